"""Plans of the comparison's steps at a scenario's size: a method config compiled for its
mesh but never run (`jaxcomm.plan`), a stack of blocks from 1 and 2 blocks, kept in a plan
cache keyed by everything the program depends on, and planned in a subprocess that emulates
the mesh's devices (the comparison's own process trains the proxy on 8).

`python -m experiments.compare.plans REQUEST.json` is that subprocess (`Plans` starts it).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile

import jax
import ml_collections

from jaxcomm import plan

from .. import build

# XLA:CPU's flags for the planning process: the loop emitters and one LLVM module compile
# in about half the CPU time (benchmarks/xla_compile_flags.py) and change no collective.
PLAN_XLA_FLAGS = "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"


def default_cache() -> str:
  """Where plans are kept unless config.compare.scenario.plan_cache says otherwise."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "jaxcomm", "plans")


def _digest(*paths) -> str:
  h = hashlib.sha256()
  for p in paths:
    if p and os.path.isfile(p):
      with open(p, "rb") as f:
        h.update(f.read())
  return h.hexdigest()[:16]


def key_of(c) -> str:
  """The plan cache's key of a method config at scale: model, mesh, method settings, the
  optimizer but its learning rate (which changes no program), the planned steps, the data's
  shapes, and the sources of the method and model modules and of the builder."""
  method = build.load_method(c.method.name)
  model = build.load_model(c.model.name)
  optimizer = {k: v for k, v in c.optimizer.to_dict().items() if k != "lr"}
  return plan.plan_key(model=c.model.to_dict(), mesh=c.mesh, method=c.method.to_dict(),
                       optimizer=optimizer, steps=c.steps, seq_len=c.data.seq_len,
                       batch=c.data.batch_size, skip_nonfinite=c.skip_nonfinite,
                       xla_flags=PLAN_XLA_FLAGS,
                       sources=_digest(method.__file__, model.__file__, build.__file__))


def plan_one(c, devices=None) -> plan.StepPlan:
  """The plan of a method config at scale (this process must have its mesh's devices): a
  stack of blocks from 1 and 2 blocks, or in full when the model has no `num_layers` or the
  two do not extrapolate."""

  def plan_at(blocks):
    cb = c.copy_and_resolve_references()
    if blocks is not None:
      cb.model.num_layers = blocks
    run = build.build(cb, devices, abstract=True)
    return plan.compile_step(run.program(), run.params, run.batches(0), steps=cb.steps)

  blocks = c.model.get("num_layers")
  if not isinstance(blocks, int):
    return plan_at(None)
  try:
    return plan.plan_stack(plan_at, blocks)
  except plan.NotAffine:
    return plan_at(blocks)


# ---------------------------------------------------------------- planning in a subprocess
class Plans:
  """The plans of method configs at a scenario's size: read from the cache, the missing ones
  planned in one subprocess that emulates the scenario's devices (started at once, so that
  it compiles while the proxy trains; `get` waits for it).

  Args:
    configs: {name: method config at scale (`scale.plan_config`)}.
    cache: the plan cache's folder.
    devices: the devices the subprocess emulates (the configs' mesh's).
    log: a callable for progress lines (or None).
  """

  def __init__(self, configs: dict, cache: str, devices: int, log=None):
    self.cache = plan.PlanCache(cache)
    self.keys = {name: key_of(c) for name, c in configs.items()}
    self.errors: dict = {}
    missing = {k: configs[n] for n, k in self.keys.items() if self.cache.get(k) is None}
    self.planned = len(missing)
    self._proc = self._out = None
    if missing:
      folder = tempfile.mkdtemp(prefix="compare_plans_")
      self._out = os.path.join(folder, "out.json")
      request = os.path.join(folder, "request.json")
      with open(request, "w", encoding="utf-8") as f:
        json.dump({"configs": {k: c.to_json_best_effort() for k, c in missing.items()},
                   "cache": cache, "devices": devices, "out": self._out}, f)
      env = {**os.environ, "XLA_FLAGS": PLAN_XLA_FLAGS, "JAX_PLATFORMS": "cpu"}
      root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
      env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
      if log:
        mesh = next(iter(missing.values())).mesh
        log(f"planning {len(missing)} step(s) on {mesh} in the background "
            f"({len(self.keys) - len(missing)} from the plan cache {cache})")
      self._proc = subprocess.Popen([sys.executable, "-m", __name__, request], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True)

  def wait(self) -> None:
    """Waits for the planning subprocess (if any); a crash of it is an error."""
    if self._proc is None:
      return
    _, err = self._proc.communicate()
    if self._proc.returncode or not os.path.isfile(self._out):
      raise RuntimeError(f"planning at scale failed (exit {self._proc.returncode}):\n"
                         f"{err[-3000:]}")
    with open(self._out, encoding="utf-8") as f:
      self.errors = json.load(f)["errors"]
    self._proc = None

  def get(self, name: str) -> plan.StepPlan | str:
    """The plan of config `name`, or why it could not be planned."""
    self.wait()
    key = self.keys[name]
    if key in self.errors:
      return self.errors[key]
    found = self.cache.get(key)
    return found if found is not None else "not in the plan cache after planning"


def _plan_request(path: str) -> None:
  """The subprocess: plans each requested config, stores it in the cache, records failures."""
  with open(path, encoding="utf-8") as f:
    request = json.load(f)
  jax.config.update("jax_num_cpu_devices", request["devices"])
  cache = plan.PlanCache(request["cache"])
  errors = {}
  for key, text in request["configs"].items():
    c = ml_collections.ConfigDict(json.loads(text))
    try:
      cache.put(key, plan_one(c))
    except Exception as e:  # a method the library cannot plan at this size: reported
      errors[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
  with open(request["out"], "w", encoding="utf-8") as f:
    json.dump({"errors": errors}, f)


if __name__ == "__main__":
  _plan_request(sys.argv[1])
