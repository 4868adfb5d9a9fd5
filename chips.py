"""The chips pallasopt knows: one table that kernels, compile_check, bench and tests read.

No JAX here (`pallasopt.compile_check` reads it before JAX starts).

* `CHIPS`: the compile tier's targets, by short name (``"v5e"``, ``"h100"``):
  the device kind the chip reports, its platform, its libtpu topology (TPUs)
  or compute capability and the device facts XLA needs to compile for it
  without one (GPUs, NVIDIA's published figures for the SXM parts).
* `CUDA_CAPABILITIES`: the compute capability of NVIDIA chips by the device
  kind they report, for devices that carry none (abstract devices).
* `DATASHEET`: published memory bandwidth and dense bf16 matmul peaks, by
  device kind (the benches' roofline).
"""

from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple

__all__ = [
    "GpuFacts",
    "Chip",
    "CHIPS",
    "TPU_CHIPS",
    "BASELINE",
    "CUDA_CAPABILITIES",
    "cuda_capability",
    "is_chip",
    "Peaks",
    "DATASHEET",
    "datasheet_peaks",
]


class GpuFacts(NamedTuple):
  """The device facts of an NVIDIA chip that XLA needs to compile for it."""

  shared_memory_per_block_optin: int
  shared_memory_per_core: int
  core_count: int
  fpus_per_core: int
  memory_bandwidth: int
  l2_cache_size: int
  clock_rate_ghz: float
  device_memory_size: int
  dnn_version: tuple[int, int, int]


class Chip(NamedTuple):
  """One chip of the compile tier.

  Attributes:
    device_kind: ``jax.Device.device_kind`` as the chip reports it.
    platform: ``"tpu"`` or ``"cuda"``.
    kinds: every device kind the chip has reported (releases differ).
    topology: a TPU's smallest libtpu topology of 4 chips (``"v5e:2x2"``).
    compute_capability: a GPU's ``(major, minor)``.
    gpu: a GPU's device facts (`GpuFacts`).
  """

  device_kind: str
  platform: str
  kinds: tuple[str, ...]
  topology: str | None = None
  compute_capability: tuple[int, int] | None = None
  gpu: GpuFacts | None = None


def _tpu(kind: str, topology: str, *others: str) -> Chip:
  return Chip(kind, "tpu", (kind, *others), topology=topology)


def _gpu(kind: str, capability: tuple[int, int], facts: GpuFacts) -> Chip:
  return Chip(kind, "cuda", (kind,), compute_capability=capability, gpu=facts)


CHIPS: dict[str, Chip] = {
    "h100": _gpu("NVIDIA H100 80GB HBM3", (9, 0), GpuFacts(
        232448, 233472, 132, 128, 3_352_320_000_000, 52_428_800, 1.98, 84_942_979_072,
        (9, 3, 0))),
    "a100": _gpu("NVIDIA A100-SXM4-80GB", (8, 0), GpuFacts(
        166912, 167936, 108, 64, 2_039_000_000_000, 41_943_040, 1.41, 85_095_874_560,
        (9, 3, 0))),
    "b200": _gpu("NVIDIA B200", (10, 0), GpuFacts(
        232448, 233472, 148, 128, 8_000_000_000_000, 132_120_576, 1.965, 191_514_492_928,
        (9, 8, 0))),
    "v4": _tpu("TPU v4", "v4:2x2x1"),
    "v5e": _tpu("TPU v5 lite", "v5e:2x2"),
    "v5p": _tpu("TPU v5", "v5p:2x2x1", "TPU v5p"),
    "v6e": _tpu("TPU v6 lite", "v6e:2x2"),
    "tpu7x": _tpu("TPU7x", "tpu7x:2x2x1"),
}
TPU_CHIPS: tuple[str, ...] = tuple(name for name, chip in CHIPS.items() if chip.platform == "tpu")

# The chip assumed where a lowering has no device of its platform: the oldest
# of each platform the compile tier covers, so that an export carries only
# kernels every supported chip compiles (no fp8 Triton conversions, no Hopper
# `wgmma`).
BASELINE: dict[str, str] = {"tpu": "v4", "cuda": "a100"}

# Compute capabilities by reported device kind, most specific names first
# ("A100" must not match "A10").
CUDA_CAPABILITIES: tuple[tuple[str, tuple[int, int]], ...] = (
    ("GB300", (10, 3)), ("B300", (10, 3)),
    ("GB200", (10, 0)), ("B200", (10, 0)), ("B100", (10, 0)),
    ("GH200", (9, 0)), ("H200", (9, 0)), ("H100", (9, 0)), ("H800", (9, 0)),
    ("L40", (8, 9)), ("L4", (8, 9)), ("RTX 40", (8, 9)),
    ("A100", (8, 0)), ("A800", (8, 0)), ("A30", (8, 0)),
    ("A40", (8, 6)), ("A10", (8, 6)), ("RTX 30", (8, 6)),
    ("T4", (7, 5)), ("V100", (7, 0)),
)


def cuda_capability(device_kind: str | None) -> tuple[int, int] | None:
  """The compute capability of an NVIDIA device kind, or None if unknown."""
  for name, capability in CUDA_CAPABILITIES:
    if device_kind and name in device_kind:
      return capability
  return None


def is_chip(device_kind: str | None, name: str) -> bool:
  """Whether ``device_kind`` is one that chip ``name`` of `CHIPS` reports."""
  return device_kind in CHIPS[name].kinds


@dataclasses.dataclass(frozen=True)
class Peaks:
  """Datasheet peaks of one device: memory bandwidth and dense bf16 matmul."""

  name: str
  gbps: float
  bf16_tflops: float
  source: str


# Published datasheet numbers (dense bf16, no sparsity), matched against
# `jax.Device.device_kind` in order (first match wins):
# - NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): SXM 4.8 TB/s,
#   989 TFLOP/s; NVL 4.8 TB/s, 835 TFLOP/s.
# - NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): SXM 3.35 TB/s,
#   989 TFLOP/s; PCIe 2.0 TB/s, 756 TFLOP/s; NVL 3.9 TB/s, 835 TFLOP/s.
# - NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100): 312 TFLOP/s;
#   80GB SXM 2039 GB/s, 80GB PCIe 1935 GB/s, 40GB 1555 GB/s.
# - Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v4, v5e,
#   v5p, v6e): v4 1200 GB/s, 275 TFLOP/s; v5e 819 GB/s, 197 TFLOP/s;
#   v5p 2765 GB/s, 459 TFLOP/s; v6e 1638 GB/s, 918 TFLOP/s.
DATASHEET: tuple[tuple[str, Peaks], ...] = (
    (r"h200.*nvl", Peaks("NVIDIA H200 NVL", 4800, 835, "NVIDIA H200 datasheet")),
    (r"h200", Peaks("NVIDIA H200 SXM", 4800, 989, "NVIDIA H200 datasheet")),
    (r"h100.*pcie", Peaks("NVIDIA H100 PCIe", 2000, 756, "NVIDIA H100 datasheet")),
    (r"h100.*nvl", Peaks("NVIDIA H100 NVL", 3900, 835, "NVIDIA H100 datasheet")),
    (r"h100", Peaks("NVIDIA H100 SXM", 3350, 989, "NVIDIA H100 datasheet")),
    (r"a100.*80gb.*pcie|a100.*pcie.*80gb",
     Peaks("NVIDIA A100 80GB PCIe", 1935, 312, "NVIDIA A100 datasheet")),
    (r"a100.*80gb", Peaks("NVIDIA A100 80GB SXM", 2039, 312, "NVIDIA A100 datasheet")),
    (r"a100", Peaks("NVIDIA A100 40GB", 1555, 312, "NVIDIA A100 datasheet")),
    (r"v6 ?lite|v6e", Peaks("TPU v6e", 1638, 918, "cloud.google.com/tpu/docs/v6e")),
    (r"v5 ?lite|v5e", Peaks("TPU v5e", 819, 197, "cloud.google.com/tpu/docs/v5e")),
    (r"v5p|tpu v5$", Peaks("TPU v5p", 2765, 459, "cloud.google.com/tpu/docs/v5p")),
    (r"tpu v4", Peaks("TPU v4", 1200, 275, "cloud.google.com/tpu/docs/v4")),
)


def datasheet_peaks(device_kind: str) -> Peaks | None:
  """The datasheet peaks for a `device_kind` string, or None if unknown."""
  kind = device_kind.lower().strip()
  for pattern, peaks in DATASHEET:
    if re.search(pattern, kind):
      return peaks
  return None
