"""The checks behind the sync transforms' public factories (built on `jaxcomm._validate`)."""

from __future__ import annotations

from typing import Any

from jaxcomm import _validate as v


def axis_name(value: Any) -> Any:
  """The axis (or tuple of axes) a transform communicates over; None for one device."""
  return v.axis_name("axis_name", value)


def wire_dtype(value: Any) -> Any:
  """None (send the gradients' own dtype) or a floating dtype to send them in."""
  return None if value is None else v.dtype("dtype", value)


def inner(value: Any) -> Any:
  """The transform a wrapper wraps."""
  return v.transform("inner", value)
