r"""The coordination service of an elastic run, in a process that does no training.

  python -m jaxcomm.elastic.coordinator --address=127.0.0.1:12345 --num_processes=3 \
      --heartbeat_timeout=5

Start it first (`experiments.launch_local --elastic` does), then every worker with
`jaxcomm.elastic.start_distributed("127.0.0.1:12345", 3, i, external_service=True)`. Every
worker, process 0 included, may then die and be replaced; only this process must live as
long as the run. It uses no devices and no JAX backend, and runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from jaxcomm.elastic import _service


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--address", required=True, help="host:port to listen on.")
  parser.add_argument("--num_processes", type=int, required=True, help="Workers of the run.")
  parser.add_argument("--heartbeat_timeout", type=int, default=10,
                      help="Seconds after which a silent worker is declared dead.")
  args = parser.parse_args(argv)
  if args.num_processes < 1 or args.heartbeat_timeout < 1:
    parser.error("--num_processes and --heartbeat_timeout must be >= 1.")
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  service = _service.serve(args.address, args.num_processes,
                           heartbeat_timeout_s=args.heartbeat_timeout)
  print(f"coordinator: serving {args.num_processes} processes on {args.address}",
        file=sys.stderr, flush=True)
  stop.wait()
  service.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
