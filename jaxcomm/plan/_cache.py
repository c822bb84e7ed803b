"""Plans kept on disk: a step compiled once is read back instead of compiled again.

A plan depends on the model, the mesh, the method's settings, the planned steps, the
compiler (JAX and jaxlib's versions) and jaxcomm's own code; `plan_key` hashes all of these
(the caller's parts, the versions, and a digest of jaxcomm's source files), so a cached plan
is only ever read back for the same program. Entries are JSON files named by the key,
written atomically (another process planning the same step at the same time writes the same
bytes).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import tempfile
from typing import Any, Callable

import jax
import jaxlib
import numpy as np

from jaxcomm import comm
from jaxcomm.plan._compile import Memory
from jaxcomm.plan._compile import StepPlan


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
  """A digest of every Python file of jaxcomm (a changed method or collective changes it)."""
  root = pathlib.Path(__file__).resolve().parents[1]
  h = hashlib.sha256()
  for path in sorted(root.rglob("*.py")):
    h.update(str(path.relative_to(root)).encode())
    h.update(path.read_bytes())
  return h.hexdigest()[:16]


def plan_key(**parts: Any) -> str:
  """A key for a plan: `parts` (model, mesh, method settings, steps: anything JSON can write,
  e.g. a config's `to_dict()`), JAX's and jaxlib's versions and `source_digest()`.

  >>> plan_key(model={"d_model": 64}, mesh="replica=2,fsdp=4") == plan_key(
  ...     mesh="replica=2,fsdp=4", model={"d_model": 64})
  True
  """
  text = json.dumps({"parts": parts, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
                     "jaxcomm": source_digest()}, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:32]


def _tuples(x):
  return tuple(_tuples(y) for y in x) if isinstance(x, list) else x


def to_json(step: StepPlan) -> dict:
  """A StepPlan as JSON-writable values (`from_json` reads it back)."""
  return {"report": [dataclasses.asdict(c) for c in step.report],
          "memory": dataclasses.asdict(step.memory), "flops": step.flops,
          "bytes_accessed": step.bytes_accessed, "state_bytes": dict(step.state_bytes),
          "counted": None if step.counted is None else step.counted.tolist(),
          "why_not_counted": step.why_not_counted, "mesh_shape": dict(step.mesh_shape),
          "steps": step.steps}


def from_json(d: dict) -> StepPlan:
  """The StepPlan `to_json` wrote."""
  cols = tuple(comm.Collective(**{**c, "shape": _tuples(c["shape"]), "axes": _tuples(c["axes"])})
               for c in d["report"])
  return StepPlan(report=comm.CollectiveReport(cols), memory=Memory(**d["memory"]),
                  flops=d["flops"], bytes_accessed=d["bytes_accessed"],
                  state_bytes=d["state_bytes"],
                  counted=None if d["counted"] is None else np.asarray(d["counted"], np.float64),
                  why_not_counted=d["why_not_counted"], mesh_shape=d["mesh_shape"],
                  steps=d["steps"])


class PlanCache:
  """Plans on disk under `directory`, by `plan_key`.

  >>> import tempfile
  >>> from jaxcomm import comm
  >>> step = StepPlan(comm.CollectiveReport(()), Memory(1, 2, 0, 3), 5.0, 0.0, {}, None, "",
  ...                 {"data": 8}, 4)
  >>> cache = PlanCache(tempfile.mkdtemp())
  >>> key = plan_key(model="mine", mesh="data=8")
  >>> cache.get(key) is None, cache.plan(key, lambda: step) == step, cache.get(key).flops
  (True, True, 5.0)
  """

  def __init__(self, directory: str | os.PathLike):
    self.directory = pathlib.Path(directory)

  def _path(self, key: str) -> pathlib.Path:
    return self.directory / f"{key}.json"

  def get(self, key: str) -> StepPlan | None:
    """The plan stored under `key`, or None."""
    try:
      with open(self._path(key), encoding="utf-8") as f:
        return from_json(json.load(f))
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
      return None

  def put(self, key: str, step: StepPlan) -> None:
    """Stores `step` under `key` (atomically: a reader sees the old file or the whole new one)."""
    self.directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      json.dump(to_json(step), f)
    os.replace(tmp, self._path(key))

  def plan(self, key: str, make: Callable[[], StepPlan]) -> StepPlan:
    """The plan under `key`, or `make()` stored under it."""
    found = self.get(key)
    if found is None:
      found = make()
      self.put(key, found)
    return found
