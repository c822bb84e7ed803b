"""Helpers the test files share, and the one table of jaxcomm's public transforms (`METHODS`).

The contract checks themselves ship with the package, in `jaxcomm.testing` (re-exported here
for test files written against this module).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jaxcomm import codecs, data, local, models, parallel, sim, sync, train
from jaxcomm.testing import check_codec  # noqa: F401
from jaxcomm.testing import check_converges_on_quadratic  # noqa: F401
from jaxcomm.testing import check_jit_state_and_dtypes  # noqa: F401
from jaxcomm.testing import check_on_mesh  # noqa: F401
from jaxcomm.testing import check_transform  # noqa: F401
from jaxcomm.testing import codec_zoo  # noqa: F401
from jaxcomm.testing import example_params  # noqa: F401


def digits_task(num_batches: int):
  """(params, loss, batches): a small MLP on digits with `num_batches` global batches of 64."""
  model = models.MLP(hidden=(16,), num_classes=10)
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 64)))
  loss = lambda p, b: models.classifier_loss(model)(p, b)[0]
  ds = data.digits()
  return params, loss, [ds.batch(t, 64) for t in range(num_batches)]


def run_steps(mesh, tx, task, steps=1):
  """(trainer, state, measurements per step) after `steps` Trainer steps of `task`."""
  params, loss, batches = task
  trainer = train.Trainer(loss, tx, mesh)
  state = trainer.init(params)
  ms = []
  for t in range(steps):
    state, m = trainer.step(state, batches[t])
    ms.append(m)
  return trainer, state, ms


def flat(tree):
  """A tree as one float32 numpy vector."""
  return np.asarray(codecs.flatten(tree)[0])


# ---------------------------------------------------------------- the table of transforms
class Setting(NamedTuple):
  """Another setting of a factory the contract checks: `make()` is a complete optimiser on
  one device, held to `check_transform(make(), steps)`."""
  make: Callable[[], optax.GradientTransformation]
  steps: int = 200


class Method(NamedTuple):
  """One public transform factory (a row of `METHODS`).

  Attributes:
    build: `(inner, axis_name) -> transform`: the factory with small example arguments
      (`axis_name=None`: one device). A wrapper wraps `inner`; other factories ignore it.
    stage: the transform replaces the gradient and takes no step of its own (the contract
      chains `optax.sgd(0.5)` after it).
    plugin: the experiments method module (experiments/methods/<plugin>.py) whose settings
      mirror this factory's signature, or None.
    variants: more settings the contract checks, by name (`Setting`).
    hands_on: a wrapper that hands each worker's gradient to `inner` as it came: `inner`'s
      refusal of summed gradients is its own (tests/test_local_gradient_guard.py).
  """
  build: Callable[[Any, Any], Any]
  stage: bool = False
  plugin: str | None = None
  variants: dict = {}
  hands_on: bool = False


def _average(params, state, sync, axis_name=None):
  """Local SGD's sync rule (the skeleton's row, `local.periodic`)."""
  avg, nbytes = local.masked_average(params, sync.mine, sync.total, axis_name)
  return avg, state, nbytes


def _decoupled_schedule(axis_name) -> local.DecoupledSchedule:
  """Decoupled DiLoCo's ticks for the contract: equal learners (one without an axis, else the
  suite's W = 8), two fragments, H = 2, long enough for the quadratic's steps."""
  return sim.decoupled_schedule([1.0] * (1 if axis_name is None else 8), fragments=2,
                                sync_every=2, horizon_s=400.0)


def _zero(**kwargs) -> Setting:
  return Setting(lambda: parallel.zero(optax.sgd(0.1), axis_name=None, **kwargs))


def _compressed(memory, codec, lr) -> Setting:
  return Setting(lambda: optax.chain(sync.compressed(codec(), memory=memory, axis_name=None,
                                                     key=jax.random.key(0)), optax.sgd(lr)),
                 steps=300)


# A memory of one's own: EF that sends half of its error, and a second (bfloat16) buffer
# keeping the last message this worker sent.
DAMPED_MEMORY = sync.ErrorMemory(
    init=lambda n: {"e": jnp.zeros(n), "own": jnp.zeros(n, jnp.bfloat16)},
    send=lambda m, x: x + 0.5 * m["e"], keep=lambda m, sent, own: {"e": sent - own, "own": own})
NESTEROV = optax.sgd(0.7, momentum=0.9, nesterov=True)

# Every public transform factory of jaxcomm.sync, .local and .parallel: a function of their
# `__all__` whose return annotation is an optax `GradientTransformation...` must have a row
# (tests/test_transforms_contract.py holds the table complete and runs the contract on every
# row and variant, tests/test_local_gradient_guard.py checks that every row refuses summed
# gradients, tests/test_experiments.py reads `plugin`). A new factory is one line:
#     "sync.dion": Method(lambda inner, axis: sync.dion(0.05, rank=2, axis_name=axis)),
# (`stage=True` for a stage without a step of its own, `plugin="..."` when an experiments
# method module builds it, `variants={...}` for settings that take another code path).
METHODS = {
    "sync.mean": Method(lambda inner, axis: sync.mean(axis), stage=True, plugin="dp"),
    "sync.compressed": Method(
        lambda inner, axis: sync.compressed(codecs.top_k(0.5), memory="ef", axis_name=axis),
        stage=True, plugin="compressed", variants={
            # EF is stable for lr below about the codec's contraction: small lr.
            "no_memory": _compressed(None, lambda: codecs.qsgd(15, bucket=None), 0.3),
            "ef21": _compressed("ef21", lambda: codecs.top_k(0.25), 0.05),
            "loco": _compressed("loco", lambda: codecs.top_k(0.25), 0.05),
            "own_memory": _compressed(DAMPED_MEMORY, lambda: codecs.top_k(0.25), 0.05)}),
    "sync.powersgd": Method(
        lambda inner, axis: sync.powersgd(1, min_compression_rate=0, axis_name=axis),
        stage=True, plugin="powersgd", variants={"cold_start": Setting(lambda: optax.chain(
            sync.powersgd(1, warm_start=False, min_compression_rate=0, axis_name=None),
            optax.sgd(0.2)), steps=300)}),
    "sync.lq_sgd": Method(lambda inner, axis: sync.lq_sgd(1, min_compression_rate=0,
                                                          axis_name=axis),
                          stage=True, plugin="lq_sgd"),
    "sync.muon": Method(lambda inner, axis: sync.muon(0.05, axis_name=axis), plugin="muon"),
    "sync.muonbp": Method(lambda inner, axis: sync.muonbp(0.05, 2, axis_name=axis),
                          plugin="muonbp"),
    "sync.dion": Method(lambda inner, axis: sync.dion(0.05, rank=1, axis_name=axis),
                        plugin="dion"),
    "sync.dion2": Method(lambda inner, axis: sync.dion2(0.05, 0.5, axis_name=axis),
                         plugin="dion2"),
    "sync.onebit_adam": Method(lambda inner, axis: sync.onebit_adam(0.05, freeze_step=20,
                                                                    axis_name=axis),
                               plugin="onebit_adam"),
    "sync.demo": Method(lambda inner, axis: sync.demo(0.02, chunk=4, k=4, axis_name=axis),
                        plugin="demo"),
    "sync.dpsgd": Method(lambda inner, axis: sync.dpsgd(inner, "ring", num_workers=8,
                                                        axis_name=axis), plugin="dpsgd"),
    "sync.choco": Method(lambda inner, axis: sync.choco(inner, "ring", codecs.identity(),
                                                        num_workers=8, axis_name=axis),
                         plugin="choco"),
    "sync.gradient_coding": Method(lambda inner, axis: sync.gradient_coding(
        sync.fractional_repetition(1, 0), axis_name=axis), stage=True),
    "sync.skip_nonfinite": Method(lambda inner, axis: sync.skip_nonfinite(inner,
                                                                          axis_name=axis),
                                  hands_on=True),
    "local.acco": Method(lambda inner, axis: local.acco(inner, axis), plugin="acco",
                         variants={"micro_batches": Setting(lambda: local.acco(
                             optax.sgd(0.1, momentum=0.5), None, micro_batches=2))}),
    "local.cocodc": Method(lambda inner, axis: local.cocodc(inner, optax.sgd(1.0), 2, 2, 1,
                                                            axis_name=axis, codec=None)),
    "local.decoupled_diloco": Method(lambda inner, axis: local.decoupled_diloco(
        inner, optax.sgd(1.0), _decoupled_schedule(axis), fragments=2, axis_name=axis),
        plugin="decoupled_diloco"),
    "local.delayed": Method(lambda inner, axis: local.delayed(inner, axis), plugin="delayed",
                            variants={"momentum": Setting(lambda: local.delayed(
                                optax.sgd(0.1, momentum=0.5), None))}),
    "local.des_loc": Method(lambda inner, axis: local.des_loc(optax.chain(optax.trace(0.5), inner),
                                                              2, {"trace": 3}, axis),
                            plugin="des_loc"),
    "local.diloco": Method(
        lambda inner, axis: local.diloco(inner, optax.sgd(1.0), 2, axis), plugin="diloco",
        variants={"nesterov": Setting(lambda: local.diloco(optax.sgd(0.1), NESTEROV, 3, None)),
                  "fp8_ef": Setting(lambda: local.diloco(
                      optax.sgd(0.1), optax.sgd(1.0), 3, None,
                      codec=codecs.cast("float8_e4m3fn"), memory="ef"))}),
    "local.dreamddp": Method(lambda inner, axis: local.dreamddp(inner, 2, axis),
                             plugin="dreamddp"),
    "local.factored_gossip_diloco": Method(lambda inner, axis: local.factored_gossip_diloco(
        inner, optax.sgd(1.0), 2, "ring", num_workers=8, axis_name=axis),
        plugin="factored_gossip_diloco"),
    "local.gasloc": Method(lambda inner, axis: local.gasloc(
        inner, optax.sgd(1.0), 2, "ring", num_workers=8, momentum=0.3, axis_name=axis),
        plugin="gasloc"),
    "local.hierarchical": Method(lambda inner, axis: local.hierarchical(inner, 2, axis, None),
                                 plugin="hierarchical"),
    "local.local_sgd": Method(lambda inner, axis: local.local_sgd(inner, 2, axis),
                              plugin="local_sgd"),
    # Outer SGD(1.0): Muon's steps do not shrink near the optimum, and the default outer
    # Nesterov momentum (0.7, 0.9) keeps them oscillating on the quadratic at this lr.
    "local.muloco": Method(lambda inner, axis: local.muloco(0.05, 2, axis, outer=optax.sgd(1.0),
                                                            bits=4, block=4, memory="ef"),
                           plugin="muloco"),
    "local.noloco": Method(lambda inner, axis: local.noloco(inner, 2, axis), plugin="noloco"),
    "local.pier": Method(lambda inner, axis: local.pier(
        inner, 2, axis, outer_lr=1.0, momentum=local.pier_momentum(0.5, 2)), plugin="pier"),
    "local.periodic": Method(lambda inner, axis: local.periodic(
        inner, 2, functools.partial(_average, axis_name=axis), axis_name=axis)),
    "local.scaffold": Method(lambda inner, axis: local.scaffold(inner, 2, axis),
                             plugin="scaffold"),
    "local.sparseloco": Method(
        lambda inner, axis: local.sparseloco(inner, 2, density=0.5, bits=None, axis_name=axis),
        plugin="sparseloco", variants={"bits8": Setting(lambda: local.sparseloco(
            optax.sgd(0.1), 3, 0.5, 8, None))}),
    "local.stale": Method(lambda inner, axis: local.stale(inner, 1, axis), plugin="stale",
                          variants={"dc": Setting(lambda: local.stale(
                              optax.sgd(0.1), 2, None, compensation="dc"))}),
    "local.streaming_diloco": Method(
        lambda inner, axis: local.streaming_diloco(inner, optax.sgd(1.0), 2, fragments=2,
                                                   axis_name=axis, codec=None),
        plugin="streaming_diloco", variants={
            "fp4_overlap": Setting(lambda: local.streaming_diloco(
                optax.sgd(0.1), NESTEROV, 4, 2, 1, 0.5, None)),
            "dc": Setting(lambda: local.streaming_diloco(
                optax.sgd(0.1), optax.sgd(0.7, momentum=0.9), 4, 2, 1, 0.5, None, codec=None,
                compensation="dc", dc_lambda=2.0))}),
    "parallel.zero": Method(
        lambda inner, axis: parallel.zero(inner, 2, axis), plugin="zero", variants={
            "stage1": _zero(stage=1), "stage2_accumulate": _zero(stage=2, accumulate_steps=2),
            "stage1_int8_ef": _zero(stage=1, codec=codecs.uniform(8), memory="ef"),
            "stage3": _zero(stage=3, param_specs={"w": P(), "b": P()})}),
    # One group of leaves sharded over `tensor`, one replicated (example_params: w, b).
    "parallel.by_sharding": Method(lambda inner, axis: parallel.by_sharding(
        inner, {"w": P(None, "tensor"), "b": P()}), hands_on=True),
}


def variants() -> dict:
  """Every variant of `METHODS` as `{"factory[variant]": Setting}`."""
  return {f"{name}[{v}]": setting for name, method in METHODS.items()
          for v, setting in method.variants.items()}


def factory(name: str) -> Callable:
  """The library factory of a row of `METHODS` ("sync.mean" -> `jaxcomm.sync.mean`)."""
  package, function = name.split(".")
  return getattr({"sync": sync, "local": local, "parallel": parallel}[package], function)
