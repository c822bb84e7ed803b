"""An image ResNet (`jaxcomm.models.ResNet`) on a synthetic image dataset, data-parallel:
the ImageNet stem for images of 64 pixels and more, the CIFAR stem below."""

import jax.numpy as jnp

from ..toolkit import Task
from jaxcomm import data, models


def build(name: str, ctx, **blocks) -> Task:
  ctx.data_parallel_only(also=("fsdp",))
  c = ctx.config
  dataset = None if c.data.name.startswith("folder:") else ctx.dataset()
  if not isinstance(dataset, data.SyntheticImages):
    raise ValueError(f"config.model.name {name!r} needs an image dataset "
                     f"({', '.join(data.SYNTHETIC_IMAGES)}), got config.data.name "
                     f"{c.data.name!r}.")
  model = models.ResNet(num_classes=dataset.num_classes, **blocks,
                        stem="imagenet" if min(dataset.shape[:2]) >= 64 else "cifar")
  params = ctx.init(model.init)(ctx.key, jnp.zeros((1, *dataset.shape)))
  return Task(model=model, loss_fn=models.classifier_loss(model), has_aux=True,
              params=params, batches=ctx.batches)
