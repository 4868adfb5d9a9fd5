"""Mapping any leaf onto blocks that both Pallas targets accept.

Elementwise kernels see a leaf of ``n`` elements as a 2-D *view* (a free
reshape, so in-place aliasing survives it):

* ``n % 128 == 0``: ``(n // 128, 128)``, blocks ``(block_rows, 128)``;
* otherwise: ``(1, n)``, blocks ``(1, block_lanes)``.

Every block is legal on both targets: its last two dims are multiples of
``(8, 128)`` or equal to the array's (Mosaic TPU), and its element count is a
power of two (Triton). The last block along each axis may be ragged; TPU pads
it, and the Triton kernels mask their loads and stores (see `_elementwise`).

A kernel that reduces along whole rows (8-bit state: one scale per block of
256 elements) asks for ``lanes=256``: the view is then ``(n // 256, 256)``
and ``n`` must be a multiple of 256; its TPU blocks have at least 32 rows, a
whole packed tile of 8-bit codes.

Block sizes differ per backend. TPU pays ~0.35 us per grid step, so its blocks
are large (up to 512 x 128 elements, 256 KiB per f32 operand, well inside the
default scoped VMEM even with seven double-buffered operands). Triton keeps a
block in registers, so its blocks are small (2048 elements with 4 warps).
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["BACKENDS", "LANES", "TilePlan", "check_backend", "plan_tiles", "pow2_at_least"]

# The Pallas targets every kernel is written for: Mosaic TPU and Triton.
BACKENDS = ("tpu", "triton")
LANES = 128
# Rows of a block: a multiple of 16 so bf16 operands fill whole packed tiles.
_MIN_ROWS = 16
_MAX_ROWS = {"tpu": 512, "triton": 16}
_MIN_ROWS_8BIT = 32
_MAX_FLAT_LANES = {"tpu": 8192, "triton": 2048}


@dataclasses.dataclass(frozen=True)
class TilePlan:
  """How a leaf of `size` elements is viewed and blocked.

  Attributes:
    size: number of elements of the leaf.
    view_shape: the 2-D shape the leaf is reshaped to.
    block_shape: the block each grid step reads and writes.
    grid: the number of blocks along each view axis.
  """

  size: int
  view_shape: tuple[int, int]
  block_shape: tuple[int, int]

  @property
  def grid(self) -> tuple[int, int]:
    return tuple(  # type: ignore[return-value]
        math.ceil(d / b) for d, b in zip(self.view_shape, self.block_shape)
    )

  @property
  def ragged(self) -> bool:
    return any(d % b for d, b in zip(self.view_shape, self.block_shape))


def pow2_at_least(x: int) -> int:
  """The smallest power of two >= ``x`` (1 for ``x <= 1``)."""
  return 1 << max(0, (x - 1).bit_length())


def check_backend(backend: str) -> None:
  """Raises a ValueError naming ``backend`` unless it is one of `BACKENDS`."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be 'tpu' or 'triton'; got {backend!r}.")


def plan_tiles(size: int, backend: str, *, lanes: int = LANES) -> TilePlan:
  """Plans the view and blocks of a leaf with `size` elements.

  Args:
    size: element count of the leaf (0-d leaves have size 1).
    backend: ``"tpu"`` or ``"triton"``; picks the block size.
    lanes: the view's row length, a power-of-two multiple of 128; above 128,
      ``size`` must be a multiple of it.
  """
  check_backend(backend)
  if size <= 0:
    raise ValueError(f"cannot tile an empty leaf (size={size}).")
  if lanes % LANES or lanes != pow2_at_least(lanes):
    raise ValueError(f"lanes must be a power-of-two multiple of {LANES}; got {lanes}.")
  if lanes > LANES:
    if size % lanes:
      raise ValueError(
          f"a view with {lanes} lanes needs a multiple of {lanes} elements; got {size}."
      )
    rows = size // lanes
    # The same element budget per block; 8-bit tiles on TPU are (32, 128).
    max_rows = _MAX_ROWS[backend] * LANES // lanes
    block_rows = min(max_rows, max(_MIN_ROWS_8BIT, pow2_at_least(rows)))
    return TilePlan(size, (rows, lanes), (block_rows, lanes))
  if size % LANES == 0:
    rows = size // LANES
    block_rows = min(_MAX_ROWS[backend], max(_MIN_ROWS, pow2_at_least(rows)))
    return TilePlan(size, (rows, LANES), (block_rows, LANES))
  block_lanes = min(_MAX_FLAT_LANES[backend], max(LANES, pow2_at_least(size)))
  return TilePlan(size, (1, size), (1, block_lanes))
