"""A training step compiled for abstract inputs: its collectives, memory and FLOPs per device.

`compile_step(program, params, batch)` takes the parameters and the batch as
`jax.ShapeDtypeStruct`s, derives the train state `program.init` would give (shapes and
shardings only: `jax.eval_shape`), lowers and compiles the step for them, and reads the
compiled program: its collectives (`comm.parse_hlo`: bytes per mesh axis), XLA's memory
analysis (bytes per device) and cost analysis (FLOPs per device), and the per-device bytes
of every argument from the shardings the compiled program takes. When the program has
conditional collectives (a sync every H steps), which steps send them comes from the
transform's own byte counters, run at the real size without the model (`_schedule`).
Nothing is allocated or run at the model's size.

The numbers are XLA:CPU's, for the program that runs on the emulated devices: the
collectives and the argument bytes are those of any backend (they follow from the program
and its shardings), while the temporary bytes (activations) and the bytes accessed depend
on the compiler's fusion, which on GPU and TPU is more aggressive (fused attention, for
one): read them as an upper estimate for those backends.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxcomm import _validate as v
from jaxcomm import comm
from jaxcomm import train
from jaxcomm.plan import _schedule

# The program is compiled, never run: LLVM's optimisation of its machine code is skipped. It
# changes no HLO, so neither the collectives nor XLA's memory and cost analyses (the tests
# hold them equal to a real step's, compiled at the default level); it halves the compile.
# Optimisation barriers are kept as GPU and TPU compilers keep them: XLA:CPU expands them
# first, and its CSE then merges a rematerialised forward pass (`jax.checkpoint`, an FSDP
# layer's re-gather) back into the first one, so its memory analysis would show no saving.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0,
                    "xla_disable_hlo_passes": "cse_barrier_expander"}


@dataclasses.dataclass(frozen=True)
class Memory:
  """Bytes per device of a compiled step (XLA's memory analysis)."""
  arguments: int   # the train state's and the batch's shards
  outputs: int     # the new state and the measurements
  aliased: int     # outputs written into argument buffers (not held twice)
  temp: int        # everything else the step holds at once (activations, gradients)

  @property
  def peak(self) -> int:
    """Arguments, outputs not aliased to them, and temporaries, held at once."""
    return self.arguments + self.outputs - self.aliased + self.temp


@dataclasses.dataclass(frozen=True)
class StepPlan:
  """One method's step at a model's real size, compiled but never run.

  Attributes:
    report: the compiled step's collectives (bytes per device, mesh axes, branches).
    memory: XLA's memory analysis, bytes per device.
    flops: FLOPs per device of one step (XLA's cost analysis).
    bytes_accessed: bytes per device the step reads and writes (XLA's cost analysis).
    state_bytes: bytes per device of the arguments the compiled step takes, by part:
      `params`, `opt_state`, `model_state`, `step` and `batch`.
    counted: f64[steps]: the bytes the transform's counters count at each step from
      `init` (see `_schedule`); None when the step has no conditional collective (every
      step sends the same) or when which steps sync depends on values (`why_not_counted`).
    why_not_counted: "" or why `counted` is None.
    mesh_shape: {axis: size} of the mesh.
    steps: the steps `counted` covers.
  """
  report: comm.CollectiveReport
  memory: Memory
  flops: float
  bytes_accessed: float
  state_bytes: dict
  counted: np.ndarray | None
  why_not_counted: str
  mesh_shape: dict
  steps: int

  @property
  def schedule(self) -> np.ndarray:
    """f64[steps] bytes per device at each step: the counted ones; without conditional
    collectives the compiled every-step bytes; else (the counters could not be run) every
    conditional branch at every step, an upper bound."""
    if self.counted is not None:
      return self.counted
    return np.full(self.steps, self.report.wire_bytes())

  def sync_fraction(self) -> float:
    """The mean fraction of the conditional collectives' bytes sent per step."""
    branch = self.report.wire_bytes(conditional=True)
    if not branch:
      return 0.0
    # What a step sends outside the branches, as the counters count it: activation traffic
    # (tensor-parallel all-reduces, pipeline sends) is in the compiled every-step bytes but
    # in no counter, so a step that syncs nothing counts less than those; its count is then
    # the base (else a DiLoCo sync on a tensor-parallel mesh would be charged too little).
    base = min(self.report.wire_bytes(conditional=False), float(np.min(self.schedule)))
    extra = np.clip(self.schedule - base, 0.0, None)
    return float(np.mean(extra) / branch)

  def bytes_per_step(self) -> float:
    """Mean bytes per device per step (the schedule's mean)."""
    return float(np.mean(self.schedule))

  def bytes_per_axis(self) -> dict:
    """{mesh axes: mean bytes per device per step over them}: every-step collectives in
    full, conditional ones times `sync_fraction`."""
    out: dict = {}
    fraction = self.sync_fraction()
    for c in self.report:
      share = fraction if c.in_conditional else 1.0
      out[c.axes] = out.get(c.axes, 0.0) + c.total_bytes * share
    return out


def _struct(x: Any, name: str) -> jax.ShapeDtypeStruct:
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  raise ValueError(f"{name} must hold arrays or jax.ShapeDtypeStructs, got {type(x).__name__}.")


def abstract_state(program: train.Program, params: Any) -> train.TrainState:
  """The train state `program.init(params)` gives, as ShapeDtypeStructs with its shardings.

  Nothing is allocated: `params` may be (and at real sizes should be) ShapeDtypeStructs.

  >>> import jax, jax.numpy as jnp, optax
  >>> from jaxcomm import parallel, sync, train
  >>> params = {"w": jax.ShapeDtypeStruct((1000,), jnp.float32)}
  >>> program = train.make_program(lambda p, b: jnp.sum(p["w"] * b["x"]),
  ...                              optax.chain(sync.mean("data"), optax.adam(1e-3)),
  ...                              parallel.make_mesh({"data": 8}), params)
  >>> state = abstract_state(program, params)
  >>> state.opt_state[1][0].mu["w"].shape, state.params["w"].sharding.spec
  ((1000,), P())
  """
  params = jax.tree.map(lambda x: _struct(x, "params"), params)
  state = jax.eval_shape(program.init, params)
  shardings = program.state_shardings()
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      state, shardings)


def abstract_batch(program: train.Program, batch: Any) -> Any:
  """The global batch as ShapeDtypeStructs sharded as the program splits it.

  `batch` may hold arrays or ShapeDtypeStructs; nothing is allocated.

  >>> import jax, jax.numpy as jnp, optax
  >>> from jaxcomm import parallel, sync, train
  >>> program = train.make_program(lambda p, b: jnp.sum(p["w"] * b["x"]),
  ...                              optax.chain(sync.mean("data"), optax.sgd(0.1)),
  ...                              parallel.make_mesh({"data": 8}),
  ...                              {"w": jax.ShapeDtypeStruct((1000,), jnp.float32)})
  >>> x = abstract_batch(program, {"x": jax.ShapeDtypeStruct((64, 1000), jnp.float32)})["x"]
  >>> x.shape, x.sharding.spec
  ((64, 1000), P('data',))
  """
  batch = jax.tree.map(lambda x: _struct(x, "batch"), batch)
  specs = program.batch_specs(batch)
  mesh = program.config.mesh
  return jax.tree.map(lambda x, spec: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, spec)), batch, specs,
                      is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def _shard_bytes(struct: jax.ShapeDtypeStruct, sharding) -> int:
  shape = sharding.shard_shape(struct.shape)
  # A PRNG key's dtype (an extended dtype, not numpy's) knows its bytes too: key<fry> is 8.
  itemsize = struct.dtype.itemsize
  return math.prod(shape) * itemsize if shape else itemsize


def _argument_bytes(compiled, state, batch) -> dict:
  """Bytes per device of each part of the arguments, as the compiled program takes them
  (arguments it does not read are not held and count 0)."""
  (state_sh, batch_sh), _ = compiled.input_shardings
  out = {}
  parts = dict(params=(state.params, state_sh.params),
               opt_state=(state.opt_state, state_sh.opt_state),
               model_state=(state.model_state, state_sh.model_state),
               step=(state.step, state_sh.step), batch=(batch, batch_sh))
  for part, (structs, shardings) in parts.items():
    treedef = jax.tree.structure(structs)
    flat, flat_sh = treedef.flatten_up_to(structs), treedef.flatten_up_to(shardings)
    out[part] = sum(_shard_bytes(x, sh) for x, sh in zip(flat, flat_sh) if sh is not None)
  return out


def compile_step(program: train.Program | train.Trainer, params: Any, batch: Any, *,
                 steps: int = 1000) -> StepPlan:
  """Compiles `program`'s step for abstract parameters and batch and reads it (never runs it).

  Args:
    program: a `train.Program` (loss, transform, mesh, specs, layout), or a `train.Trainer`
      (its program for `params` is built).
    params: the parameters, as ShapeDtypeStructs (or arrays; only shapes are read).
    batch: the global batch, as ShapeDtypeStructs (or arrays).
    steps: the steps from `init` whose counted bytes `StepPlan.counted` holds.

  Returns:
    A `StepPlan`.

  >>> import jax, jax.numpy as jnp, optax
  >>> from jaxcomm import parallel, sync, train
  >>> f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  >>> program = train.make_program(lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2),
  ...                              optax.chain(sync.mean("data"), optax.sgd(0.1)),
  ...                              parallel.make_mesh({"data": 8}), {"w": f32(1000, 10)})
  >>> step = compile_step(program, {"w": f32(1000, 10)}, {"x": f32(64, 1000)})
  >>> step.bytes_per_step(), 2 * 7 / 8 * 4 * 10_000  # a ring all-reduce of the gradient
  (70000.0, 70000.0)
  >>> step.state_bytes["params"], step.state_bytes["batch"]  # per device: 8 rows of x
  (40000, 32000)
  """
  params = jax.tree.map(lambda x: _struct(x, "params"), params)
  if isinstance(program, train.Trainer):
    program = program.build(params)
  v.instance("program", program, train.Program, "jaxcomm.train.Program (or Trainer)")
  steps = v.integer("steps", steps, low=1)
  mesh = program.config.mesh
  state = abstract_state(program, params)
  batch = abstract_batch(program, batch)
  compiled = program.step.lower(state, batch).compile(compiler_options=COMPILER_OPTIONS)
  report = comm.parse_hlo(compiled.as_text(), mesh=mesh)
  m = compiled.memory_analysis()
  memory = Memory(arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes,
                  aliased=m.alias_size_in_bytes, temp=m.temp_size_in_bytes)
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):  # older JAX: one dict per program
    analysis = analysis[0] if analysis else {}
  counted, why = None, ""
  if report.wire_bytes(conditional=True):
    counted, why = _schedule.counted_bytes(program, params, state, batch, steps, report,
                                           compiler_options=COMPILER_OPTIONS)
  return StepPlan(report=report, memory=memory, flops=float(analysis.get("flops", 0.0)),
                  bytes_accessed=float(analysis.get("bytes accessed", 0.0)),
                  state_bytes=_argument_bytes(compiled, state, batch), counted=counted,
                  why_not_counted=why, mesh_shape=dict(mesh.shape), steps=steps)
