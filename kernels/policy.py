"""What ``impl="auto"`` runs on each target: the measured rules, one table per platform.

Every kernel family names its row (`UPDATE`, `NEWTON_SCHULZ`, ...) when it
calls `pallasopt.kernels._dispatch.dispatch`; nothing else in the package
decides between a kernel and the XLA reference under ``"auto"``. A row of
`TPU_AUTO` or `CUDA_AUTO` is a `Measured` entry: the choice (``"pallas"``,
``"xla"``, or a rule of the call's arrays and `Target`) and where it was
measured. Every other platform (CPUs) runs the reference.

What the tables do not hold: what a chip *cannot* run (a family's
`_dispatch.CudaRequirement`, e.g. fp8 conversions below sm_89), and where a
kernel cannot be placed (an operand layout XLA partitions): `_dispatch`
applies those whatever ``impl`` asks. Measured on one chip, a row holds on
the chips of its platform the compile tier covers (TPU v4, v5e, v5p, v6e,
tpu7x; H100, A100, B200) unless its rule names a chip.

The rules are read when a call is lowered (`_by_target`), with the call's
array leaves (a shard's, where the call runs per shard): a jitted step
compiled for two chips can take a kernel on one and XLA on the other.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Literal

import jax

from pallasopt import chips
from pallasopt.kernels._elementwise import blocks_in_place, layers_inside
from pallasopt.kernels._target import Target
from pallasopt.kernels._tiling import tiled_in_place
from pallasopt.kernels.ns_tiled import choose_regime

__all__ = [
    "Choice",
    "Measured",
    "UPDATE",
    "BLOCKWISE_UPDATE",
    "NEWTON_SCHULZ",
    "NEWTON_SCHULZ_NAMED_REGIME",
    "KRON_PRECONDITION",
    "SKEW_QUAD_PRECONDITION",
    "KRON_FACTOR_UPDATE",
    "ADAFACTOR",
    "FAMILIES",
    "TPU_AUTO",
    "CUDA_AUTO",
    "TPU_MIN_KERNEL_SIZE",
    "tiled_in_place",
    "auto_choice",
]

Choice = Literal["pallas", "xla"]
Rule = Callable[[Sequence[jax.Array], Target], Choice]

# The rows: one per kernel family (and per state kind where the choice differs).
UPDATE = "elementwise update"  # AdamW/NAdamW, Lion, RMSProp, MARS with f32/bf16 moments
BLOCKWISE_UPDATE = "elementwise update, blockwise state"  # the same with int8/fp8/int4 moments
NEWTON_SCHULZ = "newton-schulz"
NEWTON_SCHULZ_NAMED_REGIME = "newton-schulz, regime named by the caller"
KRON_PRECONDITION = "kron precondition"  # PSGD Kron's kernel (a)
SKEW_QUAD_PRECONDITION = "kron precondition in skew and quad"
KRON_FACTOR_UPDATE = "kron factor update"  # PSGD Kron's kernel (b)
ADAFACTOR = "adafactor"


@dataclasses.dataclass(frozen=True)
class Measured:
  """One row of a table: what ``"auto"`` runs, and the measurement that says so.

  Attributes:
    choice: ``"pallas"`` (the kernel), ``"xla"`` (the reference), or a rule
      ``rule(arrays, target)`` returning one of them.
    provenance: what was measured, where, and with what result.
  """

  choice: Choice | Rule
  provenance: str

  def __call__(self, arrays: Sequence[jax.Array], target: Target) -> Choice:
    return self.choice(arrays, target) if callable(self.choice) else self.choice


# Below this many elements a leaf's update is too short for a TPU kernel to
# pay: at v5e's 819 GB/s the 28 B per element of fused f32 AdamW take ~2 us
# for 2^16 elements, about the fixed cost of a kernel; XLA fuses such leaves.
TPU_MIN_KERNEL_SIZE = 1 << 16


def _blockwise_update_pays(arrays: Sequence[jax.Array], target: Target) -> Choice:
  del target
  shape = tuple(max(arrays, key=lambda x: math.prod(x.shape)).shape)
  pays = math.prod(shape) >= TPU_MIN_KERNEL_SIZE and (
      (tiled_in_place(shape) and blocks_in_place(shape)) or layers_inside(shape))
  return "pallas" if pays else "xla"


def _resident_regime(arrays: Sequence[jax.Array], target: Target) -> Choice:
  del target
  rows, cols = arrays[0].shape[-2:]
  return "pallas" if choose_regime(rows, cols, "tpu") == "resident" else "xla"


def _kron_precondition_pays(arrays: Sequence[jax.Array], target: Target) -> Choice:
  layer = arrays[0].shape[1:]
  matrix = len(layer) == 2
  if chips.is_chip(target.device_kind, "v5p"):
    pays = matrix and max(layer) >= 1024 and math.prod(layer) >= 1 << 17
  else:
    pays = not matrix or math.prod(layer) < 1 << 14 or max(layer) >= 1024
  return "pallas" if pays else "xla"


_FUSES_INTO_MATMULS = (
    "Compiled for TPU v5e and v6e from a CPU host (pallasopt.whole_step, the compile tier): "
    "alone an update step moves the same bytes either way (28 B per f32 parameter for AdamW), "
    "but in a train step XLA fuses the update into the output fusion of each weight-gradient "
    "matmul, so the gradient never reaches HBM, while a kernel (a custom call) needs it written "
    "and read back: 8 B more per matrix parameter (fused f32 AdamW on GPT-2 small: 1.064x "
    "Optax's whole-step bytes with the kernel, 1.000x with XLA)."
)

TPU_AUTO: Mapping[str, Measured] = MappingProxyType({
    UPDATE: Measured("xla", _FUSES_INTO_MATMULS),
    BLOCKWISE_UPDATE: Measured(_blockwise_update_pays, (
        "The kernel on leaves of at least TPU_MIN_KERNEL_SIZE elements that reach it in place "
        "(tiled_in_place, rows of whole blocks; or layers_inside: stacks of 2 layers scanned "
        "with the layer axis second, MaxText's default, read in XLA's order). XLA cannot fuse "
        "the blockwise re-encoding (its codec reads and writes the moments several times), so "
        "there the kernel moves fewer bytes in every form of the train step (v5e, v6e: int8 "
        "AdamW fused 0.926x Optax's whole-step bytes; XLA's codec 1.284x with 2.9 GiB of "
        "relayouts; MaxText 0.2.5's train step on a v5e-8 at param_scan_axis=1, its 2-layer "
        "MLP stacks on the kernel: 0.968x Optax's bytes, no relayout beyond Optax's, where "
        "XLA's codec on them moved 1.062x and 77 MiB of relayouts more)."
    )),
    NEWTON_SCHULZ: Measured(_resident_regime, (
        "Compiled for a TPU v5e (HBM bytes of the step, from a CPU host): the resident kernel "
        "moves what XLA does (20 B per param of GPT-2 small's 768x768 and 1024x768 matrices, "
        "with no temporary memory against XLA's 0.4 MiB), the tiled regime more (28 against 20 "
        "on a 768x2304 matrix; 184 against 80 on GPT-2's 50257x768 embedding): XLA keeps those "
        "iterates in VMEM itself. The same on every generation."
    )),
    NEWTON_SCHULZ_NAMED_REGIME: Measured("pallas", (
        "A caller that names a regime asks for the kernel in it."
    )),
    KRON_PRECONDITION: Measured(_kron_precondition_pays, (
        "Compiled for a v5e (HBM bytes of a PSGD Kron step, update mode and fused alike, from a "
        "CPU host): the kernel moves 0.82-0.96x XLA's bytes on layers of fewer than 2^14 "
        "elements (32x32 to 64x128) and on layers with a side of 1024 or more (64x1024, "
        "128x1024, 1024x128), where the factors outweigh the gradient; 1.06-1.12x on the twelve "
        "layers measured in between (128x128 to 512x512, 64x256 to 256x512). Vectors take it "
        "(0.77-0.88x at 768 and 50257). v4, v6e and tpu7x alike. A v5p stages small arrays "
        "through VMEM where the kernel pads them to whole (8, 128) tiles: there the kernel moved "
        "1.15-8.0x XLA's bytes on layers under 2^17 elements and on vectors (32x32 to 100x100, "
        "1024x64, 768 to 4096), 0.54x on 128x1024 and 1024x128, so only layers with a side of "
        "1024 and 2^17 elements or more take it."
    )),
    SKEW_QUAD_PRECONDITION: Measured("xla", (
        "Compiled for TPU v5e and v6e from a CPU host, a skew step moved 1.00-1.11x the bytes of "
        "its XLA path with the kernel (eight shapes from 64x64 to 3072x768), and a quad step on "
        "v6e, counting the balancing conditional's branches, 1.05-1.07x on seven of seventeen "
        "layer shapes (64x512 to 256x1024, 896x128: XLA transposes both factors for the step's "
        "other products instead of one), 0.57-1.00x on the others; the blocks the kernel sees "
        "do not tell those layers apart."
    )),
    KRON_FACTOR_UPDATE: Measured("xla", (
        "Compiled for v5e from a CPU host (HBM bytes of the step's conditional branches, "
        "compile_check.Traffic.branch_hbm_bytes), a Kron step that updates its preconditioner "
        "moved 1.10-1.62x with this kernel what it moved with XLA's factor update, on 32x32 to "
        "512x512 layers, 64x256 and a 768 vector (the same on 128x1024, 1024x128 and a 50257 "
        "vector; v6e alike)."
    )),
    ADAFACTOR: Measured("xla", (
        "Compiled for v5e and v6e (bench.compiled --optimizer adafactor): XLA fuses the "
        "statistics into fewer passes than the kernels make (a factored matrix: 16 B/param "
        "against the kernels' 20) and the kernels' operands cost temporary memory and "
        "relayouts on a model's tree (GPT-2 small: 35-47 MB and 12-13 copies of 1 MiB or more; "
        "XLA none)."
    )),
})

_UNTIMED_TRITON = "The Triton kernel; not yet timed against XLA on a GPU."

CUDA_AUTO: Mapping[str, Measured] = MappingProxyType({
    UPDATE: Measured("xla", (
        "XLA fuses the update into one pass; timed on an H100 (bench/results/"
        "nvidia-h100-80gb-hbm3, commit 5e874f6, against jitted Optax) the Triton kernel only "
        "tied it: the in-place step 0.44x Optax's speed on a 4K leaf, 0.86x at 1M, 0.99-1.00x "
        "from 16M up."
    )),
    BLOCKWISE_UPDATE: Measured("pallas", (
        "XLA cannot fuse the blockwise re-encoding into the update: its compiled reference reads "
        "and writes 3.5x the kernel's bytes for int8 AdamW (59.0 MB against 16.8 MB per "
        "1M-element f32 leaf, XLA's cost analysis, bench/cases_adamw.py). Timed on an H100 "
        "(commit 4a61ce5) the int8 kernel ran at 0.54-0.72x Optax's f32 speed, bound by the "
        "dynamic map's encode, not bytes; with the e3m4 map (2026-12-07) its SASS predicts 0.82x "
        "Optax's step time (bench.schedule; not yet timed)."
    )),
    NEWTON_SCHULZ: Measured("xla", (
        "The Triton kernels lost to XLA at every size measured on an H100 (commit 5e874f6, f32 "
        "iterates: 1024^2 0.86 ms vs 0.26 ms, 4096^2 29.8 vs 6.1 ms) and were removed; the "
        "wgmma regime (bf16 iterates) is not yet timed."
    )),
    NEWTON_SCHULZ_NAMED_REGIME: Measured("xla", "As NEWTON_SCHULZ: no timed GPU regime."),
    KRON_PRECONDITION: Measured("pallas", (
        "Timed on an H100 (commit 5e874f6, bench/results/nvidia-h100-80gb-hbm3/kernels-full.md): "
        "a Kron update step with the Triton kernel ran at 1.48x XLA's speed on 48 64x64 layers, "
        "0.89-0.91x on 96 128x128 and 24 128x512 layers, 1.00x on GPT-2 small; no rule yet "
        "tells those layers apart."
    )),
    SKEW_QUAD_PRECONDITION: Measured("pallas", _UNTIMED_TRITON),
    KRON_FACTOR_UPDATE: Measured("pallas", _UNTIMED_TRITON),
    ADAFACTOR: Measured("pallas", (
        "Timed on an H100: 1.11x Optax's speed on GPT-2 small, 1.20x on the 1B decoder."
    )),
})

FAMILIES: tuple[str, ...] = tuple(TPU_AUTO)

_TABLES: Mapping[str, Mapping[str, Measured]] = {"tpu": TPU_AUTO, "cuda": CUDA_AUTO}


def auto_choice(family: str, arrays: Sequence[jax.Array], target: Target) -> Choice:
  """What ``impl="auto"`` runs for ``family`` on ``target``, given the call's array leaves.

  ``"xla"`` on a platform without a table (CPUs, ROCm).
  """
  if family not in TPU_AUTO:
    raise ValueError(f"no auto policy for kernel family {family!r}; known: {FAMILIES}.")
  table = _TABLES.get(target.platform)
  return "xla" if table is None else table[family](arrays, target)
