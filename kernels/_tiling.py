"""Mapping a leaf onto blocks that both Pallas targets accept, in its own layout.

Every kernel sees a leaf as a 3-D *view* ``(P, R, C)``: its last two dims as
they are and its leading dims merged (`leaf_view`; a 1-D leaf is
``(1, 1, n)``, a scalar ``(1, 1, 1)``). On TPU that view is free: HBM tiles
an array's last two dims (``(8, 128)`` for 32-bit values), so merging the
dims above them, or adding unit dims above a vector, is a bitcast, while any
reshape of the last two dims, such as ``(4096, 4096) -> (131072, 128)``, is a
physical relayout: a copy of every operand and result around the kernel. On a
GPU every row-major reshape is free.

A grid ``(P, ceil(R / br), ceil(C / bc))`` walks ``(br, bc)`` blocks of one
matrix (`BlockPlan`). Every block is legal on both targets: its dims are
multiples of ``(32, 128)`` or whole (Mosaic TPU; 32 rows fill a packed tile
of 8-bit values), and its element count is a power of two (Triton). The last
block along each axis may be ragged: TPU pads it (reads past the end are
garbage, writes are dropped), and the Triton kernels mask their loads and
stores.

Blocks differ per backend. TPU pays ~0.35 us per grid step, so its blocks are
large (up to 2^17 elements, 512 KiB per f32 operand, inside the default
scoped VMEM with seven double-buffered operands). Triton keeps a block in
registers, so its blocks are small.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = [
    "BACKENDS",
    "LANES",
    "BlockPlan",
    "check_backend",
    "leaf_view",
    "plan_blocks",
    "pow2_at_least",
    "tiled_in_place",
    "pow2_at_most",
]

# The Pallas targets every kernel is written for: Mosaic TPU and Triton.
BACKENDS = ("tpu", "triton")
# TPU's vector lanes: the minor dim of every HBM and VMEM tile.
LANES = 128
_TPU_BLOCK_ELEMENTS = 1 << 17
_TPU_MAX_COLS = 2048
# Rows of a packed 8-bit TPU tile: the least block height that is legal for
# every dtype a kernel stores.
_TPU_MIN_ROWS = 32
# Triton: 4096 elements over 4 warps; blocks of one row may span 4096 columns.
_TRITON_BLOCK_ELEMENTS = 4096
_TRITON_MAX_COLS = 128


@dataclasses.dataclass(frozen=True)
class BlockPlan:
  """A leaf viewed as ``shape = (P, R, C)`` and tiled by ``block = (br, bc)``."""

  shape: tuple[int, int, int]
  block: tuple[int, int]

  @property
  def grid(self) -> tuple[int, int, int]:
    p, r, c = self.shape
    return (p, math.ceil(r / self.block[0]), math.ceil(c / self.block[1]))

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def ragged(self) -> bool:
    return any(d % b for d, b in zip(self.shape[1:], self.block))


def pow2_at_least(x: int) -> int:
  """The smallest power of two >= ``x`` (1 for ``x <= 1``)."""
  return 1 << max(0, (x - 1).bit_length())


def pow2_at_most(x: int) -> int:
  """The largest power of two <= ``x`` (1 for ``x <= 1``)."""
  return 1 << max(0, x.bit_length() - 1)


def check_backend(backend: str) -> None:
  """Raises a ValueError naming ``backend`` unless it is one of `BACKENDS`."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be 'tpu' or 'triton'; got {backend!r}.")


def leaf_view(shape: tuple[int, ...]) -> tuple[int, int, int]:
  """The ``(P, R, C)`` view of a leaf of ``shape``: leading dims merged, last two kept."""
  if len(shape) == 0:
    return (1, 1, 1)
  if len(shape) == 1:
    return (1, 1, shape[0])
  return (math.prod(shape[:-2]), shape[-2], shape[-1])


def plan_blocks(
    view: tuple[int, int, int], backend: str, *, whole_rows: bool = False,
    block_elements: int | None = None,
) -> BlockPlan:
  """Blocks for ``view = (P, R, C)``.

  TPU: whole rows up to `_TPU_MAX_COLS` columns (else blocks of that many),
  and as many rows as fit ``block_elements`` (a power of two >= 32, or all
  R). Triton: power-of-two blocks of ``block_elements``, at most 128 columns
  wide unless the view has a single row; masked where ragged.

  Args:
    view: the leaf's ``(P, R, C)`` view.
    backend: ``"tpu"`` or ``"triton"``.
    whole_rows: every block spans all C columns (a kernel that reduces each
      row, or each run of a row, in one grid step).
    block_elements: the budget of elements per block; the backend's default
      when None (2^17 on TPU, 4096 on Triton).
  """
  p, r, c = view
  check_backend(backend)
  if min(view) <= 0:
    raise ValueError(f"cannot tile an empty view {view}.")
  if backend == "tpu":
    budget = block_elements or _TPU_BLOCK_ELEMENTS
    bc = c if whole_rows or c <= _TPU_MAX_COLS else _TPU_MAX_COLS
    max_rows = max(_TPU_MIN_ROWS, pow2_at_most(budget // bc))
    return BlockPlan(view, (r if r <= max_rows else max_rows, bc))
  budget = block_elements or _TRITON_BLOCK_ELEMENTS
  if whole_rows:
    bc = pow2_at_least(c)
  else:
    bc = min(pow2_at_least(c), budget if r == 1 else _TRITON_MAX_COLS)
  return BlockPlan(view, (min(pow2_at_least(r), max(1, budget // bc)), bc))


def tiled_in_place(shape: tuple[int, ...]) -> bool:
  """Whether XLA keeps a TPU leaf of ``shape`` row-major, as a kernel takes it.

  XLA lays out an array so that its ``(8, 128)`` tiles waste the least: a
  matrix whose last dim is not a multiple of 128 may get a column-major
  layout, e.g. (4096, 4097) or blockwise scales (2048, 22) and (2048, 120),
  where (2048, 121) and (2048, 125) stay row-major, and an array of three or more dims whose
  second-last dim is not a multiple of 8 may get its dims permuted, e.g.
  (4, 1001, 4096); a kernel would pay for either with a copy of every operand
  and result. Vectors are tiled by 1024 elements and reach a kernel as they
  are when they hold whole tiles. (Compiled for TPU v5e and v6e from this
  host, jax 0.10.2.)
  """
  if len(shape) <= 1:
    return math.prod(shape) % (8 * LANES) == 0
  if len(shape) == 2:
    rows, cols = shape
    padded = lambda n, tile: -(-n // tile) * tile
    return cols % LANES == 0 or (
        padded(rows, 8) * padded(cols, LANES) <= padded(cols, 8) * padded(rows, LANES)
    )
  return shape[-1] % LANES == 0 and shape[-2] % 8 == 0
