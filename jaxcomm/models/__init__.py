"""Flax models used by experiments and tests."""

from jaxcomm.models._mlp import MLP
from jaxcomm.models._mlp import accuracy
from jaxcomm.models._mlp import classifier_loss
from jaxcomm.models._resnet import BasicBlock
from jaxcomm.models._resnet import ResNet18
from jaxcomm.models._transformer import Block
from jaxcomm.models._transformer import TransformerLM
from jaxcomm.models._transformer import causal_attention
from jaxcomm.models._transformer import lm_loss

__all__ = (
    "BasicBlock",
    "Block",
    "MLP",
    "ResNet18",
    "TransformerLM",
    "accuracy",
    "causal_attention",
    "classifier_loss",
    "lm_loss",
)
