"""Accelerators a plan is timed on: peak FLOP/s, HBM bandwidth and capacity, with sources.

A step's compute time is its FLOPs (XLA's cost analysis of the compiled step) over the
device's achievable FLOP/s: the peak times the model FLOPs utilisation (MFU) one assumes.
The peaks are the dense (no structured sparsity) bf16 matrix-unit figures of the vendors'
datasheets, which is what MFU is quoted against (PaLM, arXiv 2204.02311, Appendix B).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxcomm import _validate as v
from jaxcomm import sim

_GB = 1e9
_GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Device:
  """An accelerator: what one chip computes and holds.

  Args:
    peak_flops: dense bf16 FLOP/s of one chip.
    hbm_bandwidth: bytes/s between one chip and its HBM.
    hbm_bytes: bytes of HBM on one chip.
    name: a label for tables.
    source: where the numbers come from.

  >>> Device(989e12, 3.35e12, 80e9).peak_flops
  989000000000000.0
  """
  peak_flops: float
  hbm_bandwidth: float
  hbm_bytes: float
  name: str = dataclasses.field(default="", compare=False)
  source: str = dataclasses.field(default="", compare=False)

  def __post_init__(self):
    for field in ("peak_flops", "hbm_bandwidth", "hbm_bytes"):
      object.__setattr__(self, field, v.number(field, getattr(self, field), low=0,
                                                low_open=True))


#: Accelerators by name (`device`): dense bf16 peak, HBM bandwidth and capacity, each with
#: its datasheet.
DEVICES: dict[str, Device] = {
    "a100": Device(
        312e12, 2039 * _GB, 80 * _GB, name="a100",
        source="NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): BF16 Tensor Core 312 "
               "TFLOPS dense (624 with sparsity), HBM2e 2,039 GB/s, 80 GB."),
    "h100": Device(
        989.5e12, 3.35e12, 80 * _GB, name="h100",
        source="NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): BF16 Tensor Core 1,979 "
               "TFLOPS with sparsity = 989.5 dense, HBM3 3.35 TB/s, 80 GB."),
    "h200": Device(
        989.5e12, 4.8e12, 141 * _GB, name="h200",
        source="NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): BF16 Tensor Core 1,979 "
               "TFLOPS with sparsity = 989.5 dense, HBM3e 4.8 TB/s, 141 GB."),
    "mi300x": Device(
        1307.4e12, 5.3e12, 192 * _GB, name="mi300x",
        source="AMD Instinct MI300X data sheet: peak BF16 1,307.4 TFLOPS dense (2,614.9 with "
               "sparsity), HBM3 5.3 TB/s, 192 GB."),
    "tpu_v4": Device(
        275e12, 1200 * _GB, 32 * _GIB, name="tpu_v4",
        source="Cloud TPU v4 documentation (system architecture): 275 TFLOPS bf16 per chip, "
               "HBM2 1,200 GBps, 32 GiB."),
    "tpu_v5e": Device(
        197e12, 819 * _GB, 16 * _GIB, name="tpu_v5e",
        source="Cloud TPU v5e documentation: 197 TFLOPS bf16 per chip, HBM2 819 GBps, 16 GiB."),
    "tpu_v5p": Device(
        459e12, 2765 * _GB, 95 * _GIB, name="tpu_v5p",
        source="Cloud TPU v5p documentation: 459 TFLOPS bf16 per chip, HBM2e 2,765 GBps, "
               "95 GiB."),
}


def device(name: str) -> Device:
  """The preset accelerator called `name` (see `DEVICES` for the numbers and sources).

  >>> device("tpu_v5e").peak_flops
  197000000000000.0
  """
  return DEVICES[v.one_of("device", name, DEVICES)]


def check_mfu(mfu: Any) -> float:
  """The model FLOPs utilisation: a number in (0, 1], else a ValueError naming `mfu`.

  >>> check_mfu(0.4)
  0.4
  >>> check_mfu(-0.1)
  Traceback (most recent call last):
  ...
  ValueError: mfu must be a number in (0, 1] (the fraction of the device's peak ...), got -0.1.
  """
  if isinstance(mfu, bool) or not isinstance(mfu, (int, float)) or not 0 < mfu <= 1:
    raise ValueError(f"mfu must be a number in (0, 1] (the fraction of the device's peak "
                     f"FLOP/s a step achieves), got {mfu!r}.")
  return float(mfu)


def compute_seconds(flops: float, dev: Device, mfu: float) -> float:
  """Seconds of `flops` on `dev` at utilisation `mfu`: flops / (peak_flops * mfu).

  >>> round(compute_seconds(6e12, device("h100"), 0.5), 6)
  0.012127
  """
  v.instance("device", dev, Device, "plan.Device (see plan.device)")
  return sim.seconds_from_flops(flops, dev.peak_flops, check_mfu(mfu))
