"""A transform run separately on each group of equally sharded leaves.

Inside `shard_map` every value carries the mesh axes it varies over. A transform that puts
all gradient leaves into one flat vector (a codec, error feedback, fragments, PowerSGD's
factor buffer) makes every leaf it unflattens vary over the union of the leaves' axes: a
norm scale replicated over `tensor` would come back typed as differing over `tensor`, and
its next gradient would miss the sum over `tensor`. `by_sharding` runs the transform once
per group of leaves sharded over the same mesh axes (an `optax.multi_transform` whose
labels are the axes), so each group's vector varies over that group's axes only. Each group
keeps its own state (sharded like its leaves) and counts its own bytes; a transform that
treats leaves one at a time computes exactly what it computes on the whole tree.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import PartitionSpec as P

from jaxcomm import _validate as v
from jaxcomm.parallel._rules import spec_axes


def sharding_label(spec: P) -> str:
  """The group name of a leaf: its mesh axes joined by '+' ('replicated' for none).

  >>> sharding_label(P("fsdp", None, "tensor")), sharding_label(P())
  ('fsdp+tensor', 'replicated')
  """
  return "+".join(sorted(spec_axes(spec))) or "replicated"


def by_sharding(tx: optax.GradientTransformation,
                param_specs: Any) -> optax.GradientTransformationExtraArgs:
  """Runs `tx` on each group of leaves that `param_specs` shard over the same mesh axes.

  Args:
    tx: any transform (a sync or local method with its optimiser).
    param_specs: the parameters' PartitionSpecs (a tree like them).

  Returns:
    An `optax.GradientTransformationExtraArgs`; its state holds one state of `tx` per
    group, under the group's `sharding_label`.

  >>> import jax.numpy as jnp, optax
  >>> tx = by_sharding(optax.sgd(1.0), {"w": P(None, "tensor"), "b": P()})
  >>> state = tx.init({"w": jnp.ones((2, 2)), "b": jnp.ones(2)})
  >>> sorted(state.inner_states)
  ['replicated', 'tensor']
  """
  tx = v.transform("tx", tx)
  v.specs("param_specs", param_specs)
  labels = jax.tree.map(sharding_label, param_specs, is_leaf=lambda s: isinstance(s, P))
  return optax.multi_transform({label: tx for label in set(jax.tree.leaves(labels))}, labels)
