"""Flax models used by experiments and tests: linen (with layouts) and NNX versions.

The NNX versions load on first use (`models.NnxMLP`): importing flax.nnx costs 0.4 s of
every process's start-up, which a run of a linen model does not need.
"""

from typing import TYPE_CHECKING

from jaxcomm.models._lm_parallel import SEQUENCE_ATTENTION
from jaxcomm.models._lm_parallel import check_sequence_layout
from jaxcomm.models._lm_parallel import lm_loss_pipeline
from jaxcomm.models._lm_parallel import lm_loss_sequence
from jaxcomm.models._lm_parallel import lm_pipeline_activation_bytes
from jaxcomm.models._lm_parallel import lm_sequence_batch
from jaxcomm.models._lm_parallel import lm_shared_bytes
from jaxcomm.models._lm_parallel import lm_stage_params
from jaxcomm.models._lm_parallel import lm_stage_specs
from jaxcomm.models._lm_parallel import lm_unstage_params
from jaxcomm.models._lm_parallel import sequence_attention
from jaxcomm.models._mlp import MLP
from jaxcomm.models._mlp import accuracy
from jaxcomm.models._mlp import classifier_loss
from jaxcomm.models._resnet import BasicBlock
from jaxcomm.models._resnet import Bottleneck
from jaxcomm.models._resnet import ResNet
from jaxcomm.models._resnet import ResNet18
from jaxcomm.models._transformer import Block
from jaxcomm.models._transformer import TransformerLM
from jaxcomm.models._transformer import causal_attention
from jaxcomm.models._transformer import lm_loss

__all__ = (
    "BasicBlock",
    "Block",
    "Bottleneck",
    "MLP",
    "NnxMLP",
    "NnxTransformerLM",
    "ResNet",
    "ResNet18",
    "SEQUENCE_ATTENTION",
    "TransformerLM",
    "accuracy",
    "causal_attention",
    "check_sequence_layout",
    "classifier_loss",
    "lm_loss",
    "lm_loss_pipeline",
    "lm_loss_sequence",
    "lm_pipeline_activation_bytes",
    "lm_sequence_batch",
    "lm_shared_bytes",
    "lm_stage_params",
    "lm_stage_specs",
    "lm_unstage_params",
    "nnx_classifier_loss",
    "nnx_lm_loss",
    "sequence_attention",
)

_NNX = ("NnxMLP", "NnxTransformerLM", "nnx_classifier_loss", "nnx_lm_loss")

if TYPE_CHECKING:
  from jaxcomm.models._nnx import NnxMLP
  from jaxcomm.models._nnx import NnxTransformerLM
  from jaxcomm.models._nnx import nnx_classifier_loss
  from jaxcomm.models._nnx import nnx_lm_loss


def __getattr__(name: str):
  if name in _NNX:
    from jaxcomm.models import _nnx  # lazy: flax.nnx (see the module docstring)
    return getattr(_nnx, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
