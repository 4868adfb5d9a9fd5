"""One `pallas_call` builder for every elementwise optimizer kernel.

A family writes only its math, as a *body* over f32 values::

  def body(scalars, p, g, m, v):   # scalars: tuple of f32 0-d values
    ...
    return new_p, new_m, new_v     # f32 blocks

and `elementwise_call` does the rest, identically for every family:

* takes each operand in its own layout, as the ``(P, R, C)`` view of
  `_tiling.leaf_view` (a free reshape on every target), and walks it with
  the 3-D grid of `_tiling.plan_blocks`;
* passes the per-step scalars (learning rate, bias corrections, ...) as a
  kernel *input*, never as a Python constant, so changing them never
  recompiles: SMEM on TPU, a power-of-two f32 vector with a full block on
  Triton;
* loads every block as f32 (integer codes as int32) and stores each output
  in its own dtype;
* masks loads and stores of ragged blocks on Triton (Mosaic pads them);
* reads and writes 4-bit codes (``int4``, two to a byte) as they are on
  TPU, and on Triton, which has no 4-bit type, as their bytes
  (`codecs.as_bytes`, blocks half as wide), unpacked in the kernel;
* aliases operands to outputs (`input_output_aliases`) so that, under a jit
  that donates them, the update happens in place;
* attaches a `pl.CostEstimate` from per-element flops and the exact bytes
  moved, so XLA's scheduler and `cost_analysis()` see the kernel's traffic.

Optimizer families whose update is elementwise write their update math once
and get both Optax modes from it: `pallasopt.kernels._update`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallasopt.kernels import _compat, codecs, quant
from pallasopt.kernels._compat import pl, pltpu, pltriton
from pallasopt.kernels._tiling import (
    LANES, BlockPlan, leaf_view, plan_blocks, pow2_at_least, pow2_at_most, tiled_in_place,
)

__all__ = [
    "elementwise_call",
    "bytes_moved",
    "scalar_input",
    "blocks_in_place",
    "layers_inside",
]

Body = Callable[..., Sequence[jax.Array]]



def bytes_moved(
    operands: Sequence[jax.Array | jax.ShapeDtypeStruct],
    out_dtypes: Sequence[jnp.dtype],
    out_sizes: Sequence[int] | None = None,
) -> int:
  """HBM bytes one elementwise pass reads and writes (the roofline floor).

  Outputs have the first operand's size unless ``out_sizes`` says otherwise.
  """
  size = math.prod(operands[0].shape)
  read = sum(quant.stored_bytes(math.prod(x.shape), x.dtype) for x in operands)
  sizes = out_sizes or [size] * len(out_dtypes)
  written = sum(quant.stored_bytes(n, d) for n, d in zip(sizes, out_dtypes, strict=True))
  return read + written


def _triton_scalar_width(num_scalars: int) -> int:
  # Triton blocks must have a power-of-two element count.
  return max(8, 1 << (num_scalars - 1).bit_length())


def _scalar_vector(scalars: Sequence[jax.typing.ArrayLike], backend: str) -> jax.Array:
  vec = jnp.stack([jnp.asarray(s, jnp.float32).reshape(()) for s in scalars])
  if backend == "triton":
    vec = jnp.pad(vec, (0, _triton_scalar_width(len(scalars)) - len(scalars)))
  return vec


def scalar_input(
    scalars: Sequence[jax.typing.ArrayLike] | jax.Array, backend: str
) -> tuple[jax.Array, pl.BlockSpec]:
  """Per-step scalars as one kernel input, with its spec, for a grid of any rank.

  TPU: an f32 vector in SMEM. Triton: an f32 vector padded to a power-of-two
  length, read as one full block. The kernel reads scalar ``k`` as ``ref[k]``;
  an array (e.g. a table of coefficients) is flattened in row-major order.
  Every kernel builder (`_reduction`, `_matrix` users) passes its scalars this
  way, as `elementwise_call` does.
  """
  if isinstance(scalars, (jax.Array, np.ndarray)):
    scalars = list(jnp.ravel(jnp.asarray(scalars, jnp.float32)))
  vec = _scalar_vector(scalars, backend)
  if backend == "tpu":
    return vec, pl.BlockSpec(memory_space=pltpu.SMEM)
  return vec, pl.BlockSpec(vec.shape, lambda *_: (0,))


def _value(block):
  """A loaded block as a body sees it: integer codes as int32, everything else as f32."""
  return block.astype(jnp.int32 if jnp.issubdtype(block.dtype, jnp.integer) else jnp.float32)


def _as_column(row):
  """A ``(1, n)`` row as an ``(n, 1)`` column, inside a kernel.

  Mosaic transposes whole (8, 128) tiles: the row is broadcast to 8 rows.
  """
  return jnp.transpose(jnp.broadcast_to(row, (8, row.shape[1])))[:, :1]


def _as_row(column):
  """An ``(n, 1)`` column as a ``(1, n)`` row, inside a kernel (see `_as_column`)."""
  return jnp.transpose(jnp.broadcast_to(column, (column.shape[0], LANES)))[:1, :]


def _kernel(
    scalar_ref, *refs, body: Body, num_scalars: int, num_operands: int, plan: BlockPlan,
    backend: str, block_inputs: frozenset[int], block_outputs: frozenset[int],
    nibble_inputs: frozenset[int], nibble_outputs: frozenset[int],
    blockwise: bool, in_place: bool, whole_row_scales: bool, with_index: bool,
    stacked: bool, layer_major_inputs: frozenset[int], layer_major_outputs: frozenset[int],
):
  in_refs, out_refs = refs[:num_operands], refs[num_operands:]
  scalars = tuple(scalar_ref[k] for k in range(num_scalars))
  _, rows, cols = plan.shape
  block_rows, block_cols = plan.block
  width = quant.BLOCK if blockwise else block_cols
  shape = (block_rows, width)
  # Read outside the loop over runs below: Pallas's TPU interpreter does not
  # give a program id to code nested in a loop.
  leading, row_block, col_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  first_row = row_block * block_rows
  row = first_row + jax.lax.broadcasted_iota(jnp.int32, shape, 0)

  # The view coordinates of a run's elements: Triton masks ragged blocks with
  # them, and counter-based random bits hash their flat index.
  def col(run):
    return col_block * block_cols + run * width + jax.lax.broadcasted_iota(jnp.int32, shape, 1)

  def extra(run):
    return {"index": (leading * rows + row) * cols + col(run)} if with_index else {}

  if stacked:  # the view is (rows, layers, cols), blocked (block_rows, layers, block_cols)
    def stacked_extra(layer, run):
      if not with_index:
        return {}
      stack_row = leading * block_rows + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
      return {"index": (stack_row * rows + layer) * cols + col(run)}

    _layers_inside_kernel(
        scalars, in_refs, out_refs, body=body, extra=stacked_extra, layers=rows,
        runs=block_cols // quant.BLOCK, block_inputs=block_inputs,
        block_outputs=block_outputs, layer_major_inputs=layer_major_inputs,
        layer_major_outputs=layer_major_outputs)
    return

  if backend == "triton":
    # A Triton block is one run of `width` columns (`_plan`).
    mask = (row < rows) & (col(0) < cols)
    column_mask = first_row + jax.lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0) < rows
    # Bytes of 4-bit codes: blockwise blocks are whole blocks of columns, so
    # only rows are masked.
    byte_mask = first_row + jax.lax.broadcasted_iota(
        jnp.int32, (block_rows, width // 2), 0) < rows

    def load(i, r):
      # Triton cannot cast a fill value to float8: masked-off lanes of an fp8
      # operand stay undefined. Blocks are masked by whole rows, and a row's
      # values reach only that row's (masked-off) stores.
      other = None if quant.is_float8(r.dtype) else 0
      if i in nibble_inputs:
        return codecs.from_nibbles(pltriton.load(r, mask=byte_mask, other=0).astype(jnp.int32))
      if i not in block_inputs:
        return _value(pltriton.load(r, mask=mask, other=other))
      return pltriton.load(r, mask=column_mask, other=0).astype(jnp.float32)

    values = body(scalars, *(load(i, r) for i, r in enumerate(in_refs)), **extra(0))
    for k, (ref, value) in enumerate(zip(out_refs, values, strict=True)):
      if k in nibble_outputs:
        pltriton.store(ref, codecs.to_nibbles(value).astype(ref.dtype), mask=byte_mask)
        continue
      value = value.astype(ref.dtype)
      if k not in block_outputs:
        pltriton.store(ref, value, mask=mask)
      else:
        pltriton.store(ref, value, mask=column_mask)
    return

  runs = block_cols // width
  if runs == 1 and not in_place:
    values = body(scalars, *(_value(r[...]) for r in in_refs), **extra(0))
    for ref, value in zip(out_refs, values, strict=True):
      ref[...] = value.astype(ref.dtype)
    return

  # TPU, a matrix's blocks in place: a loop over the runs of the block's rows.
  # Per-block values are either (runs, block_rows) blocks, one row per run,
  # or (block_rows, blocks per row) blocks, the rows' whole scales, which
  # every column step of the rows reads and writes one column of.
  if whole_row_scales:
    lane = jax.lax.broadcasted_iota(jnp.int32, (block_rows, cols // quant.BLOCK), 1)

  def step(run, carry):
    cut = pl.ds(pl.multiple_of(run * width, width), width)
    if whole_row_scales:
      here = lane == col_block * runs + run

    def per_block(r):
      if whole_row_scales:
        return jnp.sum(jnp.where(here, r[...].astype(jnp.float32), 0.0), axis=1, keepdims=True)
      return _as_column(r[pl.ds(run, 1), :].astype(jnp.float32))

    blocks = [
        per_block(r) if i in block_inputs else _value(r[:, cut])
        for i, r in enumerate(in_refs)
    ]
    for k, (ref, value) in enumerate(zip(out_refs, body(scalars, *blocks, **extra(run)),
                                         strict=True)):
      if k not in block_outputs:
        ref[:, cut] = value.astype(ref.dtype)
      elif whole_row_scales:
        ref[...] = jnp.where(here, value.astype(ref.dtype), ref[...])
      else:
        ref[pl.ds(run, 1), :] = _as_row(value).astype(ref.dtype)
    return carry

  jax.lax.fori_loop(0, runs, step, 0)


def _layers_inside_kernel(
    scalars, in_refs, out_refs, *, body: Body, extra: Callable, layers: int, runs: int,
    block_inputs: frozenset[int], block_outputs: frozenset[int],
    layer_major_inputs: frozenset[int], layer_major_outputs: frozenset[int],
):
  """TPU, a stack of a few layers in its stored order (`layers_inside`).

  Each layer of the block is a (rows, runs x 256) matrix, walked in runs of
  one block: f32 and bf16 operands are (rows, layers, cols) blocks, codes
  (layers, rows, cols), per-block values (runs, layers, rows), one row of
  the rows' values per run and layer.
  """
  for layer in range(layers):
    def step(run, carry, layer=layer):
      cut = pl.ds(pl.multiple_of(run * quant.BLOCK, quant.BLOCK), quant.BLOCK)

      def load(i, r):
        if i in block_inputs:
          return _as_column(r[run, pl.ds(layer, 1), :].astype(jnp.float32))
        return _value(r[layer, :, cut] if i in layer_major_inputs else r[:, layer, cut])

      values = body(scalars, *(load(i, r) for i, r in enumerate(in_refs)), **extra(layer, run))
      for k, (ref, value) in enumerate(zip(out_refs, values, strict=True)):
        if k in block_outputs:
          ref[run, pl.ds(layer, 1), :] = _as_row(value).astype(ref.dtype)
        elif k in layer_major_outputs:
          ref[layer, :, cut] = value.astype(ref.dtype)
        else:
          ref[:, layer, cut] = value.astype(ref.dtype)
      return carry

    jax.lax.fori_loop(0, runs, step, 0)


# A TPU kernel over a stack of layers whose layer axis is second, e.g.
# MaxText's (emb, layers, mlp) with its default param_scan_axis=1: XLA tiles
# a (P, 2, C) f32 or bf16 array (2, 128) and puts the 2 outermost in 8-bit
# and 4-bit codes, (2, P, C) tiled (32, 128) or (64, 128), and (P, 2,
# blocks) scales with P innermost (compiled for v5e). The kernel reads each
# in that order, 128 rows (the scales' lanes) by 1024 columns a grid step.
_LAYERS_INSIDE = (2,)
_LAYERS_INSIDE_ROWS = LANES
_LAYERS_INSIDE_COLS = 1024


def layers_inside(shape: tuple[int, ...]) -> bool:
  """Whether a TPU kernel over blockwise state reads a stack of ``shape`` layer by layer.

  A leaf of three or more dims whose second-last, the layers of a stack
  scanned with its layer axis second, is 2, whose rows hold whole blocks
  and whose leading dims hold whole multiples of 128 rows: the kernel reads
  each operand in the order XLA stores it (`_layers_inside_kernel`).
  """
  return (len(shape) >= 3 and shape[-2] in _LAYERS_INSIDE and quant.rows_hold_blocks(shape)
          and math.prod(shape[:-2]) % _LAYERS_INSIDE_ROWS == 0)


# TPU blocks of a matrix read in place by a blockwise kernel: runs of 2048
# columns (8 blocks: the scales' second-last dim tiles by 8), the last one
# ragged where a row holds no whole number of them (5632 or 32000 columns:
# its out-of-row lanes are never stored), or the whole row where it is
# narrower; rows in multiples of 128 (the scales' last dim) up to 2^18 elements.
_TPU_BLOCKWISE_COLS = 2048
_TPU_BLOCKWISE_ELEMENTS = 1 << 18
# Triton: elements per block of an elementwise kernel (registers), and the
# warps that share a block. Quantizing holds more values per element: at 4
# warps ptxas gave a blockwise kernel 255 registers and spills (MARS int8
# 136-168 B, AdamW int8 on an A100 16 B, on the dynamic map int8 used until
# 2026-12-07); at 8 warps it needs 40-190 and spills none (the compile tier
# checks every target).
_TRITON_BLOCK_ELEMENTS = 2048
_TRITON_WARPS = 4
_TRITON_BLOCKWISE_WARPS = 8


def _tpu_blockwise_block(rows: int, cols: int) -> tuple[int, int]:
  block_cols = min(cols, _TPU_BLOCKWISE_COLS)
  max_rows = max(LANES, pow2_at_most(_TPU_BLOCKWISE_ELEMENTS // block_cols))
  return min(rows, max_rows), block_cols


def blocks_in_place(shape: tuple[int, ...]) -> bool:
  """Whether a TPU kernel over blockwise state reads a leaf of ``shape`` as it is.

  True for a matrix whose rows hold whole blocks (`quant.rows_hold_blocks`);
  otherwise the kernel views the leaf as rows of one block, ``(size //
  BLOCK, BLOCK)``, a relayout on TPU (free on a GPU).
  """
  return quant.rows_hold_blocks(shape)


def _plan(shape: tuple[int, ...], backend: str, blockwise: bool) -> tuple[BlockPlan, bool]:
  """The view and blocks of an elementwise kernel over a leaf of ``shape``.

  Returns the plan and whether blockwise state is read in place.
  """
  if not blockwise:
    return plan_blocks(
        leaf_view(shape), backend,
        block_elements=_TRITON_BLOCK_ELEMENTS if backend == "triton" else None,
    ), False
  size = math.prod(shape)
  if size % quant.BLOCK:
    raise ValueError(f"blockwise state needs whole blocks of {quant.BLOCK}; got {size} elements.")
  view = leaf_view(shape)
  if backend == "triton" and quant.rows_hold_blocks(shape):
    rows = min(pow2_at_least(view[1]), _TRITON_BLOCK_ELEMENTS // quant.BLOCK)
    return BlockPlan(view, (rows, quant.BLOCK)), True
  if backend == "tpu" and blocks_in_place(shape):
    return BlockPlan(view, _tpu_blockwise_block(*view[1:])), True
  return plan_blocks((1, size // quant.BLOCK, quant.BLOCK), backend, whole_rows=True), False


def elementwise_call(
    body: Body,
    operands: Sequence[jax.Array],
    scalars: Sequence[jax.typing.ArrayLike],
    out_dtypes: Sequence[jnp.dtype],
    *,
    backend: str,
    interpret: bool,
    name: str,
    aliases: Mapping[int, int] | None = None,
    flops_per_element: int = 0,
    transcendentals_per_element: int = 0,
    blockwise: bool = False,
    block_inputs: Sequence[int] = (),
    block_outputs: Sequence[int] = (),
    with_index: bool = False,
) -> tuple[jax.Array, ...]:
  """Runs `body` over same-shaped operands as one fused Pallas kernel.

  The operands reach the kernel in their own layout (`_tiling.leaf_view`):
  on TPU no copy, reshape or transpose of a leaf appears around the kernel.

  Args:
    body: ``body(scalars, *blocks) -> outputs``; values f32, but integer
      operands (blockwise codes) int32.
    operands: arrays of one shape (any rank, any size), f32, bf16 or 8-bit,
      except the `block_inputs`.
    scalars: per-step 0-d values, passed to the kernel as data.
    out_dtypes: dtype of each output; outputs have the operands' shape.
    backend: ``"tpu"`` (Mosaic TPU) or ``"triton"``.
    interpret: run in the Pallas interpreter instead of compiling.
    name: kernel name, shown in profiles.
    aliases: ``{operand index: output index}`` pairs updated in place.
    flops_per_element: for the cost estimate.
    transcendentals_per_element: for the cost estimate.
    blockwise: for a kernel over blockwise state (`quant`): the body sees
      ``(rows, quant.BLOCK)`` values, one block per row. The leaf's size must
      be a multiple of the block; see `blocks_in_place` for when that costs
      a relayout on TPU.
    block_inputs: operands holding one value per block, in the layout of
      `quant.scales_shape`; the body sees them as ``(rows, 1)`` values.
    block_outputs: outputs with one value per block, returned in the layout
      of `quant.scales_shape`.
    with_index: pass the body ``index=``, the int32 row-major flat index of
      every element of its block (for counter-based random bits).

  Returns:
    The outputs, shaped like the operands (block outputs as said above).
  """
  block_inputs, block_outputs = frozenset(block_inputs), frozenset(block_outputs)
  if (block_inputs or block_outputs) and not blockwise:
    raise ValueError(f"{name}: per-block inputs and outputs need blockwise=True.")
  # Triton has no 4-bit type: such codes travel as their bytes.
  as_bytes = backend == "triton" and blockwise
  nibble_inputs = frozenset(
      i for i, x in enumerate(operands) if as_bytes and jnp.dtype(x.dtype) == jnp.int4)
  nibble_outputs = frozenset(
      k for k, d in enumerate(out_dtypes) if as_bytes and jnp.dtype(d) == jnp.int4)
  full = [x for i, x in enumerate(operands) if i not in block_inputs]
  shape = full[0].shape
  for x in full:
    if x.shape != shape:
      raise ValueError(
          f"{name}: operands must share one shape; got {[o.shape for o in full]}."
      )
  size = math.prod(shape)
  if size == 0:
    return tuple(jnp.zeros(shape, d) for d in out_dtypes)

  plan, in_place = _plan(shape, backend, blockwise)
  p, r, c = plan.shape
  block_rows, block_cols = plan.block
  block = pl.BlockSpec((None, block_rows, block_cols), lambda b, i, j: (b, i, j))
  bytes_view = (p, r, c // 2)
  byte_block = pl.BlockSpec((None, block_rows, block_cols // 2), lambda b, i, j: (b, i, j))
  # Per-block values are stored in the moment's own dims, the last counted in
  # blocks (`quant.scales_shape`), and read in the order XLA stores them, so
  # that no copy appears around the kernel. A TPU kernel over a matrix in
  # place reads (P, blocks per row, R), one row per run of 256 columns, where
  # XLA stores (..., R, blocks per row) column-major (a narrow array:
  # `_tiling.tiled_in_place`), and otherwise the rows' whole scales,
  # (block_rows, blocks per row), a column per run. Every other kernel reads
  # them in the stored order, one value per row of its block: (P, R, blocks
  # per row) in place (Triton's blocks are one block wide), (P, R, 1) for
  # rows of one block.
  blocks_per_row = c // quant.BLOCK
  scales_layout = quant.scales_shape(shape)
  grid = plan.grid
  # A stack of a few layers (`layers_inside`): every operand in XLA's order.
  stacked = backend == "tpu" and in_place and layers_inside(shape)
  whole_row_scales = (in_place and backend == "tpu" and not stacked
                      and tiled_in_place((r, blocks_per_row)))
  scales_as_rows = in_place and backend == "tpu" and not stacked and not whole_row_scales
  layer_major_inputs = frozenset(
      i for i, x in enumerate(operands)
      if stacked and i not in block_inputs and jnp.dtype(x.dtype).itemsize == 1)
  layer_major_outputs = frozenset(
      k for k, d in enumerate(out_dtypes)
      if stacked and k not in block_outputs and jnp.dtype(d).itemsize == 1)
  if stacked:
    rows, cols = _LAYERS_INSIDE_ROWS, min(c, _LAYERS_INSIDE_COLS)
    plan = BlockPlan(plan.shape, (rows, cols))
    grid = (p // rows, 1, pl.cdiv(c, cols))
    block = pl.BlockSpec((rows, r, cols), lambda b, i, j: (b, 0, j))
    layer_major = pl.BlockSpec((r, rows, cols), lambda b, i, j: (0, b, j))
    per_block_view = (blocks_per_row, r, p)
    per_block = pl.BlockSpec((cols // quant.BLOCK, r, rows), lambda b, i, j: (j, 0, b))
  elif scales_as_rows:
    per_block_view = (p, blocks_per_row, r)
    per_block = pl.BlockSpec(
        (None, block_cols // quant.BLOCK, block_rows), lambda b, i, j: (b, j, i)
    )
  elif whole_row_scales:
    per_block_view = (p, r, blocks_per_row)
    per_block = pl.BlockSpec((None, block_rows, blocks_per_row), lambda b, i, j: (b, i, 0))
  elif in_place:
    per_block_view = (p, r, blocks_per_row)
    per_block = pl.BlockSpec(
        (None, block_rows, block_cols // quant.BLOCK), lambda b, i, j: (b, i, j)
    )
  else:
    per_block_view = (p, r, 1)
    per_block = pl.BlockSpec((None, block_rows, 1), lambda b, i, j: (b, i, 0))

  def to_view(x):
    if stacked:
      return jnp.transpose(x.reshape(p, r, blocks_per_row))
    if scales_as_rows:
      return jnp.swapaxes(x.reshape(p, r, blocks_per_row), -1, -2)
    return x.reshape(per_block_view)

  def from_view(x):
    if stacked:
      x = jnp.transpose(x)
    if scales_as_rows:
      x = jnp.swapaxes(x, -1, -2)
    return x.reshape(scales_layout)

  scalar_vec, scalar_spec = scalar_input(scalars, backend)
  kernel = functools.partial(
      _kernel, body=body, num_scalars=len(scalars), num_operands=len(operands),
      plan=plan, backend=backend, block_inputs=block_inputs, block_outputs=block_outputs,
      nibble_inputs=nibble_inputs, nibble_outputs=nibble_outputs,
      blockwise=blockwise, in_place=in_place, whole_row_scales=whole_row_scales,
      with_index=with_index, stacked=stacked, layer_major_inputs=layer_major_inputs,
      layer_major_outputs=layer_major_outputs,
  )

  def spec(k, per_block_set, nibble_set, layer_major_set):
    if k in per_block_set:
      return per_block
    return byte_block if k in nibble_set else layer_major if k in layer_major_set else block

  def out_struct(k, dtype):
    if k in block_outputs:
      return jax.ShapeDtypeStruct(per_block_view, dtype)
    if k in nibble_outputs:
      return jax.ShapeDtypeStruct(bytes_view, jnp.uint8)
    if k in layer_major_outputs:
      return jax.ShapeDtypeStruct((r, p, c), dtype)
    return jax.ShapeDtypeStruct(plan.shape, dtype)

  def operand_view(k, x):
    if k in block_inputs:
      return to_view(x)
    if k in nibble_inputs:
      return codecs.as_bytes(x.reshape(plan.shape))
    if k in layer_major_inputs:
      return jnp.swapaxes(x.reshape(plan.shape), 0, 1)
    return x.reshape(plan.shape)

  def output(k, o):
    if k in block_outputs:
      return from_view(o)
    if k in layer_major_outputs:
      o = jnp.swapaxes(o, 0, 1)
    return (codecs.as_nibbles(o) if k in nibble_outputs else o).reshape(shape)

  blocks = size // quant.BLOCK if blockwise else 0
  call = pl.pallas_call(
      kernel,
      out_shape=[out_struct(k, d) for k, d in enumerate(out_dtypes)],
      grid=grid,
      in_specs=[scalar_spec]
      + [spec(k, block_inputs, nibble_inputs, layer_major_inputs) for k in range(len(operands))],
      out_specs=[spec(k, block_outputs, nibble_outputs, layer_major_outputs)
                 for k in range(len(out_dtypes))],
      # Operand i is pallas_call input i + 1: input 0 is the scalar vector.
      input_output_aliases={i + 1: o for i, o in (aliases or {}).items()},
      compiler_params=_compat.compiler_params(
          # The rows' whole scales stay in VMEM while the column steps
          # write them, one column each: those steps run in order.
          backend, ("parallel", "parallel", "arbitrary" if whole_row_scales else "parallel"),
          interpret=interpret,
          num_warps=_TRITON_BLOCKWISE_WARPS if blockwise else _TRITON_WARPS,
      ),
      interpret=interpret,
      name=name,
      cost_estimate=pl.CostEstimate(
          flops=flops_per_element * size,
          transcendentals=transcendentals_per_element * size,
          bytes_accessed=bytes_moved(
              full + [x for i, x in enumerate(operands) if i in block_inputs], out_dtypes,
              [blocks if k in block_outputs else size for k in range(len(out_dtypes))],
          ),
      ),
  )
  views = [operand_view(k, x) for k, x in enumerate(operands)]
  # Compiled for TPU v5e from this host, GPT-2 small's fused AdamW moves 28.0
  # B/param in HBM either way, and cost_analysis() counts 28.0 with the
  # operands kept in HBM, 95.7 when XLA stages them through VMEM. (The
  # matrix and reduction kernels measured more HBM bytes kept there: XLA's
  # placement stays theirs.)
  outs = call(scalar_vec, *_compat.kept_in_hbm(views, backend, interpret))
  return tuple(output(k, o) for k, o in enumerate(outs))
