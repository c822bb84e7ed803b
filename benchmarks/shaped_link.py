r"""Real training steps over a shaped 100 Mbit/s link, beside the cost model's prediction.

  sudo python benchmarks/shaped_link.py            # root only; otherwise it says so and exits

What it builds (and removes again, also on failure or Ctrl-C):
* two network namespaces joined by a veth pair, with private test addresses
  (10.213.77.1 and .2, /24) that exist only inside those namespaces;
* `tc qdisc ... tbf rate 100mbit` on both ends (each direction shaped; netem is not needed);
* `/etc/netns/<namespace>/hosts` in each namespace so that this machine's hostname resolves
  to that namespace's veth address (gloo binds to the address of the hostname).

Then it starts one JAX process in each namespace (`jax.distributed.initialize`, gloo CPU
collectives), builds a 2-worker data mesh across the link and times real training steps of
a small transformer LM for each method. For each method it predicts the step time with
`jaxcomm.sim`: compute measured in the same process (one worker's step with no
communication) plus the communication of the compiled step (`comm.inspect` -> `comm.cost`)
on a `Link` of the shaped rate (as TCP payload) whose per-message cost is measured over the
link (the parameters' all-reduce as a tree of arrays against one flat buffer of the same
bytes), charged as gloo runs them (ring, one collective per operand of a combined
collective). It prints measured and predicted seconds per step side by side
and their ratio, and the same for a bare all-reduce of the parameters.

Methods: exact data parallelism (`sync.mean`: one all-reduce per leaf, combined by XLA
into one tuple all-reduce that gloo runs leaf by leaf), the same with the gradients in one
flat buffer (`dp_bucketed`, like DDP's buckets), the bf16 mean (two-phase all-to-all +
all-gather), periodic parameter averaging every H steps as one flat buffer (local SGD:
DiLoCo with outer SGD at lr 1), and, built by experiments/build.py from their settings
(`registry_methods`), PowerSGD rank 4 with error feedback and DiLoCo with the same H (its
outer all-reduce is one psum per parameter leaf, like `dp`'s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMESPACES = ("jxc12a", "jxc12b")
VETHS = ("jxc12a0", "jxc12b0")
ADDRESSES = ("10.213.77.1", "10.213.77.2")  # private, only inside the two namespaces
PORT = 47312
RATE_MBIT = 100
NETNS_ETC = "/etc/netns"
TCP_PAYLOAD_FRACTION = 1448 / 1514  # TCP payload per Ethernet frame at MTU 1500

# Methods built by experiments/build.py from their settings (experiments/methods/; every
# setting not named keeps its factory default): (label, method, settings, period in steps).
# DiLoCo's H is --sync_every.
def configured_methods(sync_every: int) -> tuple:
  return (
      ("powersgd_r4", "powersgd", {"rank": 4}, 1),
      (f"diloco_h{sync_every}", "diloco", {"sync_every": sync_every}, sync_every),
  )


# ------------------------------------------------------------------------------ the network
def _run(cmd: list, check: bool = True) -> subprocess.CompletedProcess:
  return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30)


class ShapedLink:
  """Two namespaces, a veth pair shaped by tbf, per-namespace hosts files; all undone on exit."""

  def __init__(self, rate_mbit: int):
    self.rate_mbit = rate_mbit
    self.made_netns_dir = False
    self.namespaces: list = []

  def __enter__(self):
    try:
      self._build()
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc):
    self.close()

  def _build(self):
    hostname = socket.gethostname()
    for ns in NAMESPACES:
      if ns in _run(["ip", "netns", "list"]).stdout.split():
        raise RuntimeError(f"network namespace {ns} exists already (a previous run?); "
                           f"remove it with `ip netns del {ns}`.")
    if not os.path.isdir(NETNS_ETC):
      os.makedirs(NETNS_ETC)
      self.made_netns_dir = True
    for ns in NAMESPACES:
      _run(["ip", "netns", "add", ns])
      self.namespaces.append(ns)
    _run(["ip", "link", "add", VETHS[0], "type", "veth", "peer", "name", VETHS[1]])
    for ns, dev, addr in zip(NAMESPACES, VETHS, ADDRESSES):
      _run(["ip", "link", "set", dev, "netns", ns])
      _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
      _run(["ip", "-n", ns, "link", "set", dev, "up"])
      _run(["ip", "-n", ns, "link", "set", "lo", "up"])
      # Token bucket: the rate, a 32 kbit bucket, at most 400 ms of queue.
      _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
            f"{self.rate_mbit}mbit", "burst", "32kbit", "latency", "400ms"])
      os.makedirs(os.path.join(NETNS_ETC, ns), exist_ok=True)
      with open(os.path.join(NETNS_ETC, ns, "hosts"), "w", encoding="utf-8") as f:
        f.write(f"127.0.0.1 localhost\n{addr} {hostname}\n")

  def qdisc(self, ns: str) -> str:
    return _run(["tc", "-n", ns, "-s", "qdisc", "show"], check=False).stdout.strip()

  def close(self):
    for ns in NAMESPACES:
      hosts_dir = os.path.join(NETNS_ETC, ns)
      if os.path.isfile(os.path.join(hosts_dir, "hosts")):
        os.remove(os.path.join(hosts_dir, "hosts"))
      if os.path.isdir(hosts_dir) and not os.listdir(hosts_dir):
        os.rmdir(hosts_dir)
    for ns in list(self.namespaces):
      _run(["ip", "netns", "del", ns], check=False)  # deletes the veth pair with it
      self.namespaces.remove(ns)
    if self.made_netns_dir and os.path.isdir(NETNS_ETC) and not os.listdir(NETNS_ETC):
      os.rmdir(NETNS_ETC)


def _missing_tools() -> list:
  return [t for t in ("ip", "tc") if shutil.which(t) is None]


def orchestrate(args) -> int:
  if os.geteuid() != 0:
    print("shaped_link: needs root (network namespaces, veth, tc); not root, so nothing "
          "was run.")
    return 0
  missing = _missing_tools()
  if missing:
    print(f"shaped_link: {', '.join(missing)} not found on this machine; nothing was run.")
    return 0
  procs = []

  def stop(signum, frame):  # make SIGTERM run the clean-up like Ctrl-C does
    del frame
    raise KeyboardInterrupt(f"signal {signum}")

  signal.signal(signal.SIGTERM, stop)
  outdir = tempfile.mkdtemp(prefix="shaped_link_")
  try:
    with ShapedLink(args.rate_mbit) as link:
      env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
      env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
      for pid, ns in enumerate(NAMESPACES):
        cmd = ["ip", "netns", "exec", ns, "nice", "-n", str(args.nice), sys.executable,
               os.path.abspath(__file__),
               "--worker", f"--process_id={pid}", f"--coordinator={ADDRESSES[0]}:{PORT}",
               f"--rate_mbit={args.rate_mbit}", f"--out={outdir}", f"--steps={args.steps}",
               f"--sync_every={args.sync_every}", f"--local_batch={args.local_batch}",
               f"--methods={args.methods}"]
        log = open(os.path.join(outdir, f"worker{pid}.log"), "w", encoding="utf-8")
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                       cwd=ROOT), log))
      deadline = time.monotonic() + args.timeout
      for proc, _ in procs:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
      for proc, log in procs:
        log.close()
      print(link.qdisc(NAMESPACES[0]))
    codes = [p.returncode for p, _ in procs]
    result_file = os.path.join(outdir, "result.json")
    if any(codes) or not os.path.isfile(result_file):
      print(f"shaped_link: a worker failed (exit codes {codes}); its log:")
      for pid in range(len(NAMESPACES)):
        with open(os.path.join(outdir, f"worker{pid}.log"), encoding="utf-8") as f:
          print(f"--- worker {pid}\n" + f.read()[-4000:])
      return 1
    with open(result_file, encoding="utf-8") as f:
      result = json.load(f)
    _print_table(result)
    if args.json:
      with open(args.json, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    return 0
  except subprocess.TimeoutExpired:
    print(f"shaped_link: workers did not finish within {args.timeout} s; stopped them.")
    return 1
  except KeyboardInterrupt as stopped:
    print(f"shaped_link: interrupted ({stopped}); stopped the workers and removed the "
          f"namespaces, veth pair and hosts files.")
    return 130
  finally:
    for proc, log in procs:
      if proc.poll() is None:
        proc.kill()  # only the workers this script started, by their own process handle
        proc.wait(timeout=30)
      log.close()
    shutil.rmtree(outdir, ignore_errors=True)


def _print_table(result: dict) -> None:
  link = result["link"]
  print(f"\nshaped link: {link['rate_mbit']} Mbit/s tbf each direction (TCP payload "
        f"{link['bandwidth_bytes_per_s'] / 1e6:.2f} MB/s), "
        f"latency per message (fitted: tree vs flat all-reduce) "
        f"{link['latency'] * 1e3:.3f} ms; 2 processes x 1 CPU device, gloo ring; "
        f"load average {result['load_average'][0]:.1f}")
  print(f"workers' niceness {result.get('nice', 0)}")
  print(f"model: {result['model']}, {result['param_bytes']:,} parameter bytes, per-worker "
        f"batch {result['local_batch']}")
  for c in result.get("calibration", []):
    print(f"{c['what']:<18} ({c['arrays']} arrays, {c['wire_bytes']:,.0f} wire bytes): measured "
          f"{c['measured_s']:.4f} s, predicted {c['predicted_s']:.4f} s")
  head = (f"{'':<26}{'median over periods':^38}{'fastest period / compute call':^38}\n"
          f"{'method':<14}{'bytes/step':>12}"
          + f"{'measured':>10}{'predicted':>10}{'ratio':>7}{'compute':>9}  " * 2
          + f"{'comm s':>8}")
  print(head + "\n" + "-" * 110)
  for r in result["methods"]:
    cells = ""
    for sfx in ("", "_min"):
      m, p = r["measured_step_s" + sfx], r["predicted_step_s" + sfx]
      cells += f"{m:>10.4f}{p:>10.4f}{p / m:>7.2f}{r['compute_s' + sfx]:>9.4f}  "
    print(f"{r['method']:<14}{r['wire_bytes_per_step']:>12,.0f}{cells}"
          f"{r['comm_s_per_step']:>8.4f}")
  by_name = {r["method"]: r for r in result["methods"]}
  for base_name in ("dp", "dp_bucketed"):
    base = by_name.get(base_name)
    for r in result["methods"] if base else ():
      if not r["method"].startswith("dp"):
        print(f"speed-up of {r['method']} over {base_name}: measured "
              f"{base['measured_step_s'] / r['measured_step_s']:.2f}x, predicted "
              f"{base['predicted_step_s'] / r['predicted_step_s']:.2f}x (medians); "
              f"{base['measured_step_s_min'] / r['measured_step_s_min']:.2f}x vs "
              f"{base['predicted_step_s_min'] / r['predicted_step_s_min']:.2f}x (fastest)")
  for note in result.get("notes", []):
    print(note)


# ------------------------------------------------------------------------------ one worker
def bucketed_mean(axis_name):
  """Exact mean of the gradients as ONE flat f32 buffer (one all-reduce, like DDP's
  gradient buckets), where `sync.mean` all-reduces each leaf (XLA combines them into one
  tuple all-reduce, which gloo runs as one collective per leaf)."""
  import jax
  import optax
  from typing import NamedTuple
  from jaxcomm import codecs, comm

  class BucketedMeanState(NamedTuple):
    wire_bytes: jax.Array  # u32[]: cumulative bytes sent

  def init_fn(params):
    del params
    return BucketedMeanState(comm.zero_bytes())

  def update_fn(updates, state, params=None):
    del params
    vec, unflatten = codecs.flatten(updates)
    vec, nbytes = comm.mean(vec, axis_name)
    return unflatten(vec), BucketedMeanState(comm.add_bytes(state.wire_bytes, nbytes))

  return optax.GradientTransformation(init_fn, update_fn)


def periodic_average(inner, sync_every: int, axis_name: str):
  """Local SGD: `inner` steps on each worker, parameters averaged every `sync_every` steps.

  Benchmark-local (DiLoCo with outer SGD at lr 1 is this, with one flat buffer on the wire
  where the library's DiLoCo, also timed, sends one psum per leaf).
  """
  import jax
  import jax.numpy as jnp
  import optax
  from jax import lax
  from typing import Any, NamedTuple
  from jaxcomm import codecs, comm

  class PeriodicAverageState(NamedTuple):
    count: jax.Array       # i32[]: steps taken
    inner_state: Any
    wire_bytes: jax.Array  # u32[]: cumulative bytes sent

  def init_fn(params):
    return PeriodicAverageState(jnp.zeros((), jnp.int32), inner.init(params),
                                comm.zero_bytes())

  def update_fn(updates, state, params):
    updates, inner_state = inner.update(updates, state.inner_state, params)
    local = optax.apply_updates(params, updates)
    # Every branch is varying over the axis: the averaged parameters are cast back.
    local = comm.varying(local, axis_name)

    def average(_):
      vec, unflatten = codecs.flatten(local)
      vec, nbytes = comm.mean(vec, axis_name)
      return (comm.varying(unflatten(vec), axis_name),
              comm.add_bytes(state.wire_bytes, nbytes))

    new, wire = lax.cond((state.count + 1) % sync_every == 0, average,
                         lambda _: (local, state.wire_bytes), None)
    updates = jax.tree.map(lambda n, p: n - p, new, params)
    return updates, PeriodicAverageState(state.count + 1, inner_state, wire)

  return optax.GradientTransformation(init_fn, update_fn)


def _cost(report, link):
  """The shaped link's model: gloo runs the ring all-reduce, and one collective per operand
  of XLA's combined (tuple) collectives."""
  from jaxcomm import comm
  return comm.cost(report, {"data": link}, "ring", split_operands=True)


def worker(args) -> None:
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(args.coordinator, num_processes=2, process_id=args.process_id,
                             initialization_timeout=120, shutdown_timeout_seconds=60)
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import PartitionSpec as P
  from experiments import build, config
  from jaxcomm import comm, sim, sync, train

  mesh = train.make_mesh({"data": jax.device_count()})
  w = jax.device_count()
  cfg = config.base_config("dp")
  cfg.model.update(d_model=128, num_layers=4, num_heads=4, d_ff=512)
  cfg.data.update(seq_len=64, batch_size=args.local_batch * w)
  cfg.optimizer.lr = 1e-3
  lr = cfg.optimizer.lr
  _, loss_fn, _, params, batch_fn = build.model_task(cfg)
  local_batches = [batch_fn(t) for t in range(args.steps + 2)]

  # tbf meters whole Ethernet frames: with MTU 1500 and TCP timestamps a 1514-byte frame
  # carries 1448 payload bytes, so the payload rate is that fraction of the shaped rate.
  goodput = args.rate_mbit * 1e6 / 8 * TCP_PAYLOAD_FRACTION

  # (label, axis -> transform, period: steps over which a method's traffic repeats)
  methods = [
      ("dp", lambda axis: optax.chain(sync.mean(axis), optax.adamw(lr)), 1),
      ("dp_bucketed", lambda axis: optax.chain(bucketed_mean(axis), optax.adamw(lr)), 1),
      ("dp_bf16", lambda axis: optax.chain(sync.mean(axis, dtype=jnp.bfloat16),
                                           optax.adamw(lr)), 1),
      (f"localsgd_h{args.sync_every}",
       lambda axis: periodic_average(optax.adamw(lr), args.sync_every, axis)
       if axis else optax.adamw(lr), args.sync_every),
  ]
  notes = []
  for label, method, settings, period in configured_methods(args.sync_every):

    def make(axis, method=method, settings=settings):
      c = cfg.copy_and_resolve_references()
      c.method = config.method_config(method, **settings)
      ctx = build.Context(config=c, inner=optax.adamw(lr), axis_name=axis,
                          num_workers=w if axis else 1, mesh_shape={"data": w},
                          key=jax.random.key(c.seed))
      return build.make_optimizer(c, ctx)

    methods.append((label, make, period))

  # Calibration: the bare all-reduce of the parameters, as a tree of leaves (what the DP
  # step compiles to) and as one flat buffer of the same bytes, measured and predicted.
  calibration = []
  flat = np.zeros(comm.tree_bytes(params) // 4, np.float32)
  bits = np.zeros(flat.size, np.uint16)  # the bf16 mean's payload, as it travels
  bare = (  # (what, argument, body, out_specs: the result varies only after all-to-all)
      ("psum params tree", params, lambda t: comm.sum(t, "data")[0], P()),
      ("psum flat buffer", flat, lambda t: comm.sum(t, "data")[0], P()),
      ("all-to-all u16", bits, lambda t: comm.all_to_all(t.reshape(w, -1), "data")[0],
       P("data")),
      ("all-gather u16", bits[:bits.size // w],
       lambda t: comm.all_gather(t, "data", tiled=True)[0], P()),
  )
  for label, tree, body, out_spec in bare:
    spec = jax.tree.map(lambda _: P(), tree)
    fn = jax.jit(jax.shard_map(lambda t, body=body: body(comm.varying(t, "data")),
                               mesh=mesh, in_specs=(spec,), out_specs=out_spec))
    arg = jax.device_put(tree, jax.sharding.NamedSharding(mesh, P()))
    calibration.append({"what": label, "arrays": len(jax.tree.leaves(tree)),
                        "measured_s": sim.measure_seconds(fn, arg, repeats=5, warmup=1),
                        "report": comm.inspect(fn, arg, mesh=mesh)})
  # The link's cost per message, measured: the parameters as a tree of K arrays and as one
  # flat buffer are the same bytes, but gloo runs K all-reduces of 2 ring messages each
  # instead of one. (Tiny all-reduces measure ~0: the cost is paid by messages of the sizes
  # that training sends, in TCP and the shaper, not by the network's round trip.) The bare
  # tree all-reduce is then matched by construction; the training steps below are not.
  tree, flat_row = calibration[0], calibration[1]
  latency = max(tree["measured_s"] - flat_row["measured_s"], 0.0) / (
      2 * max(tree["arrays"] - 1, 1))
  link = comm.Link(goodput, latency, name=f"tbf {args.rate_mbit} Mbit/s")
  for c in calibration:
    report = c.pop("report")
    c.update(wire_bytes=report.wire_bytes(), predicted_s=_cost(report, link).seconds())
    print(f"[{jax.process_index()}] {c['what']}: measured {c['measured_s']:.4f} s, predicted "
          f"{c['predicted_s']:.4f}", flush=True)

  wanted = None if args.methods == "all" else set(filter(None, args.methods.split(",")))
  rows = []
  for label, make_tx, period in methods:
    if wanted is not None and label not in wanted:
      continue
    trainer = train.Trainer(loss_fn, make_tx("data"), mesh)
    state = trainer.init(params)
    batches = [trainer.shard_batch(b) for b in local_batches]
    step_fn = trainer.step_fn(state, batches[0])
    # One worker's step without communication: the compute the prediction starts from.
    local_tx = make_tx(None)
    local_state = local_tx.init(params)

    def local_step(p, s, b, local_tx=local_tx):
      g = jax.grad(loss_fn)(p, b)
      u, s = local_tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    local_step = jax.jit(local_step)
    for t in range(2):  # compile and warm up
      state, _, _ = step_fn(state, batches[t])
      jax.block_until_ready(local_step(params, local_state, local_batches[0]))
    jax.block_until_ready(state)
    sent, step_s, compute_s = [], [], []
    for t in range(args.steps):
      start = time.perf_counter()
      state, _, nbytes = step_fn(state, batches[2 + t])
      sent.append(int(np.asarray(nbytes)))  # waits for the step
      jax.block_until_ready(state)
      step_s.append(time.perf_counter() - start)
      # Interleaved with the real steps, so that both see the same load on the machine
      # (both workers run this at the same time, as they compute at the same time).
      start = time.perf_counter()
      jax.block_until_ready(local_step(params, local_state, local_batches[2 + t]))
      compute_s.append(time.perf_counter() - start)
    # Per step, over whole periods (a period is H steps for local SGD and DiLoCo, 1
    # otherwise). Two readings of the same runs: the median, and the fastest period beside
    # the fastest compute call (the least disturbed by other programs on a shared machine).
    periods = np.reshape(step_s, (-1, period)).sum(1) / period
    # The compiled step's collectives on the shaped link, on the simulated clock.
    report = comm.inspect(step_fn, state, batches[0], mesh=mesh)
    comm_s = sim.comm_seconds_per_step(sent, _cost(report, link))
    # Every method here waits for its communication (none overlaps it with later steps).
    predict = lambda c, comm_s=comm_s: sim.simulate(c, comm_s).total / args.steps
    rows.append({"method": label, "measured_step_s": float(np.median(periods)),
                 "predicted_step_s": predict(float(np.median(compute_s))),
                 "compute_s": float(np.median(compute_s)),
                 "measured_step_s_min": float(np.min(periods)),
                 "predicted_step_s_min": predict(float(np.min(compute_s))),
                 "compute_s_min": float(np.min(compute_s)),
                 "comm_s_per_step": float(np.mean(comm_s)),
                 "wire_bytes_per_step": float(np.mean(sent)), "steps": args.steps,
                 "measured_step_s_each": step_s, "compute_s_each": compute_s,
                 "load_average": os.getloadavg(), "collectives": report.table()})
    print(f"[{jax.process_index()}] {label}: measured {rows[-1]['measured_step_s']:.4f} "
          f"s/step, predicted "
          f"{rows[-1]['predicted_step_s']:.4f}", flush=True)

  if jax.process_index() == 0:
    result = {"load_average": os.getloadavg(), "nice": os.nice(0),
              "link": {"rate_mbit": args.rate_mbit, "latency": latency,
                       "bandwidth_bytes_per_s": goodput},
              "model": f"TransformerLM d_model={cfg.model.d_model} "
                       f"layers={cfg.model.num_layers}",
              "param_bytes": comm.tree_bytes(params),
              "local_batch": cfg.data.batch_size // w,
              "methods": rows, "calibration": calibration, "notes": notes}
    with open(os.path.join(args.out, "result.json"), "w", encoding="utf-8") as f:
      json.dump(result, f, indent=2)
  jax.distributed.shutdown()


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rate_mbit", type=int, default=RATE_MBIT, help="tbf rate, Mbit/s.")
  parser.add_argument("--steps", type=int, default=16, help="timed steps per method.")
  parser.add_argument("--sync_every", type=int, default=4, help="H of local SGD and DiLoCo.")
  parser.add_argument("--local_batch", type=int, default=4, help="sequences per worker.")
  parser.add_argument("--methods", default="all",
                      help="comma-separated method labels to time, 'all', or '' (only the "
                           "bare collectives).")
  parser.add_argument("--timeout", type=float, default=900, help="seconds for all workers.")
  parser.add_argument("--json", default=None, help="also write the results here.")
  parser.add_argument("--nice", type=int, default=0,
                      help="niceness of the two workers; on a busy shared machine a negative "
                           "value (root) lets other programs disturb the timings less.")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--process_id", type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if not -20 <= args.nice <= 19:
    parser.error(f"--nice must be in [-20, 19], got {args.nice}.")
  for name in ("rate_mbit", "steps", "sync_every", "local_batch"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1, got {getattr(args, name)}.")
  if args.steps % args.sync_every:
    parser.error(f"--steps ({args.steps}) must be a multiple of --sync_every "
                 f"({args.sync_every}) so that local SGD's average is over whole periods.")
  if args.worker:
    worker(args)
    return 0
  return orchestrate(args)


if __name__ == "__main__":
  sys.exit(main())
