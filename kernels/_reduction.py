"""Row, column and per-matrix reductions, and the broadcasting passes that use them.

Optimizers that are not elementwise (Adafactor's factored second moments,
block-RMS clipping, parameter scaling) need statistics of a whole leaf, or of
each of its rows and columns, before they can update any element. This module
gives them two `pallas_call` builders over a 3-D *view* ``[P, R, C]`` of a
leaf (a free reshape: P matrices of R x C elements):

* `reduce_call`: one read pass that evaluates a *body* on f32 blocks and sums
  its values over each row (``"rows"`` -> ``[P, R]``), each column
  (``"cols"`` -> ``[P, C]``) or each whole matrix (``"total"`` -> ``[P]``);
* `broadcast_call`: one read-write pass in which full blocks meet row vectors
  ``[P, R]``, column vectors ``[P, C]`` and per-matrix scalars ``[P]``
  (`_elementwise.elementwise_call` with broadcasting operands), aliasing
  operands to outputs for in-place updates.

Blocks are ``(br, bc)`` tiles of one matrix, walked by the grid
``(P, ceil(R / br), ceil(C / bc))`` (`_tiling.plan_blocks`). Row vectors travel as
``[P, R, 1]`` blocks ``(br, 1)`` and column vectors as ``[P, 1, C]`` blocks
``(1, bc)``, so every block is legal on both targets: last two dims multiples
of (8, 128) or full (Mosaic TPU), power-of-two sizes with masked loads and
stores (Triton).

Reductions never trust the padding of a ragged block (garbage, NaN in
interpret mode): every value is selected with ``jnp.where(valid, x, 0)``
before it is summed, never multiplied by a mask. How partial sums are kept
differs per backend, because of how each runs its grid:

* TPU runs the grid in order on each core. Row sums accumulate in an output
  block that stays resident in VMEM while the innermost (column-block) grid
  axis, marked ``"arbitrary"``, advances: ``[P, R]`` in all.
* Triton runs programs concurrently, so no two may add into one block: every
  program writes its own partial row sums (``[P * ceil(C / bc), R]`` in all)
  and XLA sums them afterwards.
* Column and total sums are per-program partials on both,
  ``[P * ceil(R / br), C]`` in all, summed by XLA afterwards.

The partials cost about ``1 / bc`` (rows, Triton) and ``1 / br`` (columns) of
the leaf's bytes; on TPU the (8, 128) tiling of HBM pads a ``(1, C)`` row of
partials to 8 rows and an ``(R, 1)`` column to 128 lanes, so there the
overheads are ``8 / br`` and ``128 / C``: a few percent of the pass.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from pallasopt.kernels import _compat
from pallasopt.kernels._compat import pl, pltriton
from pallasopt.kernels._elementwise import scalar_input
from pallasopt.kernels._tiling import LANES, BlockPlan, plan_blocks

__all__ = [
    "FULL",
    "ROWS",
    "COLS",
    "MATRIX",
    "REDUCTIONS",
    "plan_flat",
    "reduce_call",
    "broadcast_call",
]

# Operand kinds, with the shapes the builders take them in.
FULL = "full"  # [P, R, C]
ROWS = "rows"  # [P, R]: one value per row, broadcast along the columns
COLS = "cols"  # [P, C]: one value per column, broadcast along the rows
MATRIX = "matrix"  # [P]: one value per matrix
KINDS = (FULL, ROWS, COLS, MATRIX)
# What `reduce_call` can sum: over columns (one per row), over rows, or all.
REDUCTIONS = ("rows", "cols", "total")

Operand = tuple[str, jax.Array]
Body = Callable[..., Sequence[jax.Array]]

def _nbytes(x: jax.Array) -> int:
  return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def plan_flat(matrices: int, size: int, backend: str) -> BlockPlan:
  """Blocks for `matrices` slices of `size` elements each, read in any order.

  A slice of a multiple of 128 elements is viewed as rows of 128 (a relayout
  on TPU unless the slice already has 128 columns), else as one row.
  """
  view = (matrices, size // LANES, LANES) if size % LANES == 0 else (matrices, 1, size)
  return plan_blocks(view, backend)


def _check_operands(name: str, plan: BlockPlan, operands: Sequence[Operand]) -> None:
  p, r, c = plan.shape
  expected = {FULL: (p, r, c), ROWS: (p, r), COLS: (p, c), MATRIX: (p,)}
  for kind, x in operands:
    if kind not in KINDS:
      raise ValueError(f"{name}: operand kind must be one of {KINDS}; got {kind!r}.")
    if tuple(x.shape) != expected[kind]:
      raise ValueError(
          f"{name}: a {kind!r} operand must have shape {expected[kind]}; got {x.shape}."
      )


def _in_spec(kind: str, plan: BlockPlan) -> pl.BlockSpec:
  br, bc = plan.block
  if kind == FULL:
    return pl.BlockSpec((None, br, bc), lambda p, i, j: (p, i, j))
  if kind == ROWS:
    return pl.BlockSpec((None, br, 1), lambda p, i, j: (p, i, 0))
  if kind == COLS:
    return pl.BlockSpec((None, 1, bc), lambda p, i, j: (p, 0, j))
  return pl.BlockSpec((None, 1, 1), lambda p, i, j: (p, 0, 0))


def _kernel_view(kind: str, x: jax.Array, plan: BlockPlan) -> jax.Array:
  p, r, c = plan.shape
  return x.reshape({FULL: (p, r, c), ROWS: (p, r, 1), COLS: (p, 1, c), MATRIX: (p, 1, 1)}[kind])


class _Block:
  """Where the current grid step's block lies, and masked I/O for it."""

  def __init__(self, plan: BlockPlan, backend: str):
    br, bc = plan.block
    _, r, c = plan.shape
    self.backend = backend
    self.shape = (br, bc)
    i, j = pl.program_id(1), pl.program_id(2)
    rows_left, cols_left = r - i * br, c - j * bc
    self.valid = (jax.lax.broadcasted_iota(jnp.int32, (br, bc), 0) < rows_left) & (
        jax.lax.broadcasted_iota(jnp.int32, (br, bc), 1) < cols_left
    )
    self.masks = {
        FULL: self.valid,
        ROWS: jax.lax.broadcasted_iota(jnp.int32, (br, 1), 0) < rows_left,
        COLS: jax.lax.broadcasted_iota(jnp.int32, (1, bc), 1) < cols_left,
        MATRIX: None,
    }

  def load(self, ref, kind: str) -> jax.Array:
    mask = self.masks[kind]
    if self.backend == "triton" and mask is not None:
      return pltriton.load(ref, mask=mask, other=0).astype(jnp.float32)
    return ref[...].astype(jnp.float32)

  def store(self, ref, value: jax.Array, kind: str) -> None:
    value = value.astype(ref.dtype)
    mask = self.masks[kind]
    if self.backend == "triton" and mask is not None:
      pltriton.store(ref, value, mask=mask)
    else:
      ref[...] = value


def _reduce_kernel(
    scalar_ref, *refs, body: Body, kinds: tuple[str, ...], reductions: tuple[str, ...],
    num_scalars: int, plan: BlockPlan, backend: str,
):
  in_refs, out_refs = refs[: len(kinds)], refs[len(kinds):]
  block = _Block(plan, backend)
  scalars = tuple(scalar_ref[k] for k in range(num_scalars))
  values = body(scalars, *(block.load(r, k) for r, k in zip(in_refs, kinds)))
  for ref, value, reduction in zip(out_refs, values, reductions, strict=True):
    terms = jnp.where(block.valid, jnp.broadcast_to(value, block.shape), 0.0)
    if reduction != "rows":
      block.store(ref, jnp.sum(terms, axis=0, keepdims=True), COLS)
    elif backend == "tpu":
      # Resident across the innermost grid axis: zero it on its first step.
      @pl.when(pl.program_id(2) == 0)
      def _():
        ref[...] = jnp.zeros_like(ref)

      ref[...] += jnp.sum(terms, axis=1, keepdims=True)
    else:
      block.store(ref, jnp.sum(terms, axis=1, keepdims=True), ROWS)


def reduce_call(
    body: Body,
    operands: Sequence[Operand],
    scalars: Sequence[jax.typing.ArrayLike],
    reductions: Sequence[str],
    plan: BlockPlan,
    *,
    backend: str,
    interpret: bool,
    name: str,
    flops_per_element: int = 0,
    transcendentals_per_element: int = 0,
) -> tuple[jax.Array, ...]:
  """Sums values computed from the operands, in one read pass.

  Args:
    body: ``body(scalars, *blocks) -> values``: one f32 value per reduction,
      broadcastable to the ``(br, bc)`` block (full blocks are ``(br, bc)``,
      row blocks ``(br, 1)``, column blocks ``(1, bc)``, matrix values
      ``(1, 1)``); ``scalars`` is a tuple of f32 0-d values.
    operands: ``(kind, array)`` pairs; see the module constants for shapes.
    scalars: per-call 0-d values, passed to the kernel as data.
    reductions: for each body value, ``"rows"`` (sum over columns),
      ``"cols"`` (sum over rows) or ``"total"`` (sum of each matrix).
    plan: the view and blocks (`_tiling.plan_blocks` or `plan_flat`).
    backend: ``"tpu"`` or ``"triton"``.
    interpret: run in the Pallas interpreter.
    name: kernel name.
    flops_per_element, transcendentals_per_element: for the cost estimate.

  Returns:
    One f32 array per reduction: ``[P, R]``, ``[P, C]`` or ``[P]``.
  """
  _check_operands(name, plan, operands)
  for reduction in reductions:
    if reduction not in REDUCTIONS:
      raise ValueError(f"{name}: reductions must be in {REDUCTIONS}; got {reduction!r}.")
  p, r, c = plan.shape
  br, bc = plan.block
  _, n_row_blocks, n_col_blocks = plan.grid
  out_shapes, out_specs = [], []
  for reduction in reductions:
    if reduction != "rows":
      out_shapes.append((p * n_row_blocks, 1, c))
      out_specs.append(
          pl.BlockSpec((None, 1, bc), lambda q, i, j: (q * n_row_blocks + i, 0, j))
      )
    elif backend == "tpu":
      out_shapes.append((p, r, 1))
      out_specs.append(pl.BlockSpec((None, br, 1), lambda q, i, j: (q, i, 0)))
    else:
      out_shapes.append((p * n_col_blocks, r, 1))
      out_specs.append(
          pl.BlockSpec((None, br, 1), lambda q, i, j: (q * n_col_blocks + j, i, 0))
      )
  scalar_vec, scalar_spec = scalar_input(scalars, backend)
  kinds = tuple(k for k, _ in operands)
  accumulates = backend == "tpu" and "rows" in reductions
  semantics = ("parallel", "parallel", "arbitrary" if accumulates else "parallel")
  call = pl.pallas_call(
      functools.partial(
          _reduce_kernel, body=body, kinds=kinds, reductions=tuple(reductions),
          num_scalars=len(scalars), plan=plan, backend=backend,
      ),
      out_shape=[jax.ShapeDtypeStruct(s, jnp.float32) for s in out_shapes],
      grid=plan.grid,
      in_specs=[scalar_spec] + [_in_spec(k, plan) for k in kinds],
      out_specs=out_specs,
      compiler_params=_compat.compiler_params(backend, semantics, interpret=interpret),
      interpret=interpret,
      name=name,
      cost_estimate=pl.CostEstimate(
          flops=flops_per_element * plan.size,
          transcendentals=transcendentals_per_element * plan.size,
          bytes_accessed=sum(_nbytes(x) for _, x in operands)
          + sum(4 * math.prod(s) for s in out_shapes),
      ),
  )
  outs = call(scalar_vec, *(_kernel_view(k, x, plan) for k, x in operands))
  results = []
  for reduction, out in zip(reductions, outs):
    if reduction == "rows":
      results.append(out.reshape(p, -1, r).sum(axis=1))
    elif reduction == "cols":
      results.append(out.reshape(p, n_row_blocks, c).sum(axis=1))
    else:
      results.append(out.reshape(p, -1).sum(axis=1))
  return tuple(results)


def _broadcast_kernel(
    scalar_ref, *refs, body: Body, kinds: tuple[str, ...], num_scalars: int,
    plan: BlockPlan, backend: str,
):
  in_refs, out_refs = refs[: len(kinds)], refs[len(kinds):]
  block = _Block(plan, backend)
  scalars = tuple(scalar_ref[k] for k in range(num_scalars))
  values = body(scalars, *(block.load(r, k) for r, k in zip(in_refs, kinds)))
  for ref, value in zip(out_refs, values, strict=True):
    block.store(ref, jnp.broadcast_to(value, block.shape), FULL)


def broadcast_call(
    body: Body,
    operands: Sequence[Operand],
    scalars: Sequence[jax.typing.ArrayLike],
    out_dtypes: Sequence[jnp.dtype],
    plan: BlockPlan,
    *,
    backend: str,
    interpret: bool,
    name: str,
    aliases: dict[int, int] | None = None,
    flops_per_element: int = 0,
    transcendentals_per_element: int = 0,
) -> tuple[jax.Array, ...]:
  """Computes full ``[P, R, C]`` outputs from broadcasting operands, in one pass.

  Args:
    body: ``body(scalars, *blocks) -> outputs`` on f32 values (shapes as in
      `reduce_call`); each output broadcasts to the ``(br, bc)`` block.
    operands: ``(kind, array)`` pairs.
    scalars: per-call 0-d values, passed to the kernel as data.
    out_dtypes: dtype of each ``[P, R, C]`` output.
    plan: the view and blocks.
    backend, interpret, name: as in `reduce_call`.
    aliases: ``{operand index: output index}`` pairs (full operands of the
      output's dtype) updated in place.
    flops_per_element, transcendentals_per_element: for the cost estimate.

  Returns:
    The outputs, each ``[P, R, C]``.
  """
  _check_operands(name, plan, operands)
  for i in aliases or {}:
    if operands[i][0] != FULL:
      raise ValueError(f"{name}: only full operands can be aliased; operand {i} is not.")
  scalar_vec, scalar_spec = scalar_input(scalars, backend)
  kinds = tuple(k for k, _ in operands)
  call = pl.pallas_call(
      functools.partial(
          _broadcast_kernel, body=body, kinds=kinds, num_scalars=len(scalars),
          plan=plan, backend=backend,
      ),
      out_shape=[jax.ShapeDtypeStruct(plan.shape, d) for d in out_dtypes],
      grid=plan.grid,
      in_specs=[scalar_spec] + [_in_spec(k, plan) for k in kinds],
      out_specs=[_in_spec(FULL, plan)] * len(out_dtypes),
      # Operand i is pallas_call input i + 1: input 0 is the scalar vector.
      input_output_aliases={i + 1: o for i, o in (aliases or {}).items()},
      compiler_params=_compat.compiler_params(backend, ("parallel",) * 3, interpret=interpret),
      interpret=interpret,
      name=name,
      cost_estimate=pl.CostEstimate(
          flops=flops_per_element * plan.size,
          transcendentals=transcendentals_per_element * plan.size,
          bytes_accessed=sum(_nbytes(x) for _, x in operands)
          + sum(plan.size * jnp.dtype(d).itemsize for d in out_dtypes),
      ),
  )
  return tuple(call(scalar_vec, *(_kernel_view(k, x, plan) for k, x in operands)))
