"""Error memories: what a compressing stage's worker remembers of what its codec dropped.

A memory is a record of three pure functions on float32 vectors (`ErrorMemory`); the
compressing stage (`sync.compressed`) owns flattening, hierarchy, the key and the collective,
and calls the memory around its exchange. EF, EF21 and LoCo are three such records, and a
memory of your own is a fourth, written the same way. Every `memory=` of jaxcomm (`compressed`,
`powersgd`, `lq_sgd`, `local.diloco`, `local.muloco`, `parallel.zero`) reads its argument with
`resolve_memory`, so the names and the records mean the same thing in each.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm import _validate as v


class ErrorMemory(NamedTuple):
  """How a compressing stage remembers, per worker, what its codec did not send.

  Per step the stage flattens this worker's gradient into one float32 vector x and calls
  `sent = send(memory, x)`; it compresses and exchanges `sent`, where `own = D(C(sent))` is
  what the other workers received from this one; then `memory = keep(memory, sent, own)`.
  Both functions see float32 vectors of this device's slots (all n of them, or its 1/F
  shard under a hierarchical axis); the stage stores what `keep` returns in the dtypes of
  `init`'s buffers, one memory per worker.

  Attributes:
    init: `n -> memory`, a pytree of float buffers of shape [n] (their dtypes are kept).
    send: `(memory, x) -> sent`, the vector the codec compresses.
    keep: `(memory, sent, own) -> memory`, the memory after the exchange.
    accumulate: when True the stage's update is the running sum of the exchanged means
      (EF21's h = mean_w h_w) instead of this step's mean.

  >>> import jax.numpy as jnp
  >>> from jaxcomm import codecs, sync
  >>> half = sync.ErrorMemory(init=jnp.zeros, send=lambda m, x: x + m,
  ...                         keep=lambda m, sent, own: 0.5 * (sent - own))
  >>> tx = sync.compressed(codecs.top_k(k=1), memory=half, axis_name=None)
  >>> _, state = tx.update({"w": jnp.array([1., -3., 2.])}, tx.init({"w": jnp.zeros(3)}))
  >>> state.memory
  Array([0.5, 0. , 1. ], dtype=float32)
  """
  init: Callable[[int], Any]
  send: Callable[[Any, jax.Array], jax.Array]
  keep: Callable[[Any, jax.Array, jax.Array], Any]
  accumulate: bool = False


def error_feedback(dtype: Any = jnp.float32, decay: float = 1.0) -> ErrorMemory:
  """Error feedback (EF): send C(x + β e), keep e <- (x + β e) - D(C(x + β e)).

  β = `decay` is 1 for classic error feedback; SparseLoCo's memory decays (β < 1).

  Args:
    dtype: the dtype of the per-worker memory e (floating).
    decay: β in [0, 1], the weight of the memory added to the next vector.

  Returns:
    An `ErrorMemory` for `sync.compressed(codec, memory=...)` (the same as memory="ef"
    with the defaults); `local.diloco`, `local.sparseloco` and `parallel.zero` keep theirs
    with it.

  References:
    Seide et al. 2014; Karimireddy et al., arXiv 1901.09847; Stich et al., arXiv 1809.07599.

  >>> import jax.numpy as jnp
  >>> from jaxcomm import codecs, sync
  >>> tx = sync.compressed(codecs.top_k(k=1), memory=sync.error_feedback(), axis_name=None)
  >>> _, state = tx.update({"w": jnp.array([1., -3., 2.])}, tx.init({"w": jnp.zeros(3)}))
  >>> state.memory
  Array([1., 0., 2.], dtype=float32)
  """
  dtype = v.dtype("dtype", dtype)
  decay = v.number("decay", decay, low=0.0, high=1.0)
  # β = 1 adds the memory itself (one operation fewer than 1.0 * e, the same values).
  send = (lambda e, x: x + e) if decay == 1.0 else (lambda e, x: x + decay * e)
  return ErrorMemory(init=lambda n: jnp.zeros((n,), dtype), send=send,
                     keep=lambda e, sent, own: sent - own)


def ef21(dtype: Any = jnp.float32) -> ErrorMemory:
  """EF21: send c = C(x - h_w), keep h_w <- h_w + D(c); the update is h <- h + mean_w D(c_w).

  The update is the running mean of the workers' states h = mean_w h_w, not this step's
  mean of the messages (`accumulate`).

  Args:
    dtype: the dtype of the per-worker state h_w (floating).

  Returns:
    An `ErrorMemory` for `sync.compressed(codec, memory=...)` (the same as memory="ef21").

  References:
    Richtarik et al., arXiv 2106.05203.

  >>> import jax.numpy as jnp
  >>> from jaxcomm import codecs, sync
  >>> tx = sync.compressed(codecs.top_k(k=1), memory=sync.ef21(), axis_name=None)
  >>> u, state = tx.update({"w": jnp.array([1., -3., 2.])}, tx.init({"w": jnp.zeros(3)}))
  >>> u["w"], state.memory
  (Array([ 0., -3.,  0.], dtype=float32), Array([ 0., -3.,  0.], dtype=float32))
  """
  dtype = v.dtype("dtype", dtype)
  return ErrorMemory(init=lambda n: jnp.zeros((n,), dtype), send=lambda h, x: x - h,
                     keep=lambda h, sent, own: h + own, accumulate=True)


def loco(beta: float = 0.9, dtype: Any = jnp.bfloat16) -> ErrorMemory:
  """LoCo: send C(x + e), keep e <- beta e + (1 - beta)((x + e) - D(C(x + e))) in `dtype`.

  *(The exact LoCo update is unverified; this is the form in docs/algorithms.md.)*

  Args:
    beta: the moving-average factor in [0, 1).
    dtype: the dtype of the per-worker memory e (floating; bfloat16 by default).

  Returns:
    An `ErrorMemory` for `sync.compressed(codec, memory=...)` (memory="loco").

  References:
    Xie et al., arXiv 2407.04480.

  >>> import jax.numpy as jnp
  >>> from jaxcomm import codecs, sync
  >>> tx = sync.compressed(codecs.top_k(k=1), memory=sync.loco(0.5, jnp.float32),
  ...                      axis_name=None)
  >>> _, state = tx.update({"w": jnp.array([1., -3., 2.])}, tx.init({"w": jnp.zeros(3)}))
  >>> state.memory
  Array([0.5, 0. , 1. ], dtype=float32)
  """
  beta = v.number("beta", beta, low=0.0, high=1.0, high_open=True)
  dtype = v.dtype("dtype", dtype)
  return ErrorMemory(init=lambda n: jnp.zeros((n,), dtype), send=lambda e, x: x + e,
                     keep=lambda e, sent, own: beta * e + (1 - beta) * (sent - own))


# The named memories every `memory=` accepts: name -> (beta, dtype) -> ErrorMemory.
NAMED = {"ef": lambda beta, dtype: error_feedback(dtype or jnp.float32),
         "ef21": lambda beta, dtype: ef21(dtype or jnp.float32),
         "loco": lambda beta, dtype: loco(beta, dtype or jnp.bfloat16)}


def _as_f32(tree):
  return jax.tree.map(lambda b: b.astype(jnp.float32), tree)


def resolve_memory(memory: str | ErrorMemory | None, *, beta: float = 0.9, dtype: Any = None,
                   accumulate: bool = True, one_buffer: bool = False,
                   stage: str | None = None) -> ErrorMemory | None:
  """The `ErrorMemory` of a stage's `memory` argument: None, a name, or an `ErrorMemory`.

  Every `memory=` of jaxcomm reads its argument here, so the same names and the same records
  mean the same thing wherever a memory is accepted: "ef" (`error_feedback`), "ef21"
  (`ef21`) and "loco" (`loco(beta)`), in `dtype` (None: each one's default), or a record of
  your own. The record returned hands `send` and `keep` float32 views of the buffers and
  casts what `keep` returns to the buffers' dtypes, so a stage may store it as it comes back.
  A stage of your own that takes `memory=` calls it too.

  Args:
    memory: None, an `ErrorMemory`, or one of the names "ef", "ef21", "loco".
    beta: LoCo's moving-average factor (memory="loco").
    dtype: the dtype of a named memory's buffers; None: its default.
    accumulate: whether the stage keeps the running mean an accumulating memory (EF21)
      needs; when False such memories are refused.
    one_buffer: whether the stage keeps one buffer per worker; when True a record whose
      `init` returns more than one array is refused.
    stage: the stage's name, for the error message.

  Returns:
    None, or the resolved `ErrorMemory`.

  Raises:
    ValueError: naming `memory` and what the stage accepts.

  >>> import jax.numpy as jnp
  >>> from jaxcomm import sync
  >>> ef = sync.resolve_memory("ef")
  >>> ef.keep(ef.init(2), jnp.array([1., 2.]), jnp.array([1., 0.]))
  Array([0., 2.], dtype=float32)
  >>> sync.resolve_memory("ef21", accumulate=False, stage="local.diloco")
  Traceback (most recent call last):
  ...
  ValueError: memory must be None, a sync.ErrorMemory (without accumulate) or one of 'ef', ...
  """
  names = tuple(n for n, make in NAMED.items() if accumulate or not make(0.9, None).accumulate)
  limits = [text for text, on in (("without accumulate", not accumulate),
                                  ("in one buffer", one_buffer)) if on]
  record = "a sync.ErrorMemory" + (f" ({', '.join(limits)})" if limits else "")
  where = f" for {stage}" if stage else ""
  stage = stage or "this stage"

  def refuse(why: str = ""):
    got = "a sync.ErrorMemory" if isinstance(memory, ErrorMemory) else repr(memory)
    raise ValueError(f"memory must be None, {record} or one of {', '.join(map(repr, names))}"
                     f"{where}; got {got}{why}.")

  if memory is None:
    return None
  if isinstance(memory, str) and memory in NAMED:
    resolved = NAMED[memory](beta, dtype)
  elif isinstance(memory, ErrorMemory):
    if not all(callable(f) for f in (memory.init, memory.send, memory.keep)):
      refuse(" (its init, send and keep must be functions)")
    resolved = memory
  else:
    refuse()
  if resolved.accumulate and not accumulate:
    refuse(f" (it accumulates a running mean, which {stage} does not keep)")
  if one_buffer and len(jax.tree.leaves(jax.eval_shape(lambda: resolved.init(1)))) != 1:
    refuse(f" (its init returns several buffers; {stage} keeps one)")
  return ErrorMemory(
      init=resolved.init, send=lambda m, x: resolved.send(_as_f32(m), x),
      keep=lambda m, sent, own: jax.tree.map(lambda new, old: new.astype(old.dtype),
                                             resolved.keep(_as_f32(m), sent, own), m),
      accumulate=resolved.accumulate)
