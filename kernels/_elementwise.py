"""One `pallas_call` builder for every elementwise optimizer kernel.

A family writes only its math, as a *body* over f32 values::

  def body(scalars, p, g, m, v):   # scalars: tuple of f32 0-d values
    ...
    return new_p, new_m, new_v     # f32 blocks

and `elementwise_call` does the rest, identically for every family:

* views each operand as the 2-D slab `_tiling.plan_tiles` picks (a free
  reshape) and walks it with a 2-D grid;
* passes the per-step scalars (learning rate, bias corrections, ...) as a
  kernel *input*, never as a Python constant, so changing them never
  recompiles: SMEM on TPU, a power-of-two f32 vector with a full block on
  Triton;
* loads every block as f32 and stores each output in its own dtype;
* masks loads and stores of ragged blocks on Triton (Mosaic pads them);
* aliases operands to outputs (`input_output_aliases`) so that, under a jit
  that donates them, the update happens in place;
* attaches a `pl.CostEstimate` from per-element flops and the exact bytes
  moved, so XLA's scheduler and `cost_analysis()` see the kernel's traffic.

Optimizer families whose update is elementwise (AdamW, Lion) share one more
layer, `reference_update` and `kernel_update`: a family writes its *update
math* once, ``math(scalars, p, g, *moments, decay=...) -> (u, *moments)``,
and gets both of its modes from it, with the same dtypes and aliasing:

* ``"apply"``: returns ``(p + u, *moments)``, p and the moments in place;
* ``"updates"``: returns ``(u, *moments)`` (the Optax contract), the moments
  in place, reading p only where weight decay needs it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallasopt.kernels import _compat, quant
from pallasopt.kernels._compat import pl, pltpu, pltriton
from pallasopt.kernels._tiling import LANES, TilePlan, plan_tiles

__all__ = [
    "elementwise_call",
    "bytes_moved",
    "scalar_input",
    "UpdateMath",
    "check_update_mode",
    "check_rounding",
    "ROUNDINGS",
    "Moment",
    "per_element",
    "cuda_auto",
    "store_moment",
    "updates_dtype",
    "reference_update",
    "kernel_update",
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
  read = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in operands)
  sizes = out_sizes or [size] * len(out_dtypes)
  written = sum(n * jnp.dtype(d).itemsize for n, d in zip(sizes, out_dtypes, strict=True))
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


def _kernel(
    scalar_ref, *refs, body: Body, num_scalars: int, num_operands: int,
    plan: TilePlan, backend: str, row_inputs: frozenset[int], row_outputs: frozenset[int],
    with_index: bool,
):
  in_refs, out_refs = refs[:num_operands], refs[num_operands:]
  scalars = tuple(scalar_ref[k] for k in range(num_scalars))
  block = plan.block_shape
  # The view coordinates of the block's elements: Triton masks ragged blocks
  # with them, and counter-based random bits hash them.
  row = lambda: pl.program_id(0) * block[0] + jax.lax.broadcasted_iota(jnp.int32, block, 0)
  col = lambda: pl.program_id(1) * block[1] + jax.lax.broadcasted_iota(jnp.int32, block, 1)
  if backend == "triton":
    mask = (row() < plan.view_shape[0]) & (col() < plan.view_shape[1])
    row_ids = jax.lax.broadcasted_iota(jnp.int32, (block[0], 1), 0)
    row_mask = pl.program_id(0) * block[0] + row_ids < plan.view_shape[0]

    def load(r, by_row):
      # Triton cannot cast a fill value to float8: masked-off lanes of an fp8
      # operand stay undefined. Blockwise views mask whole rows only, and a
      # row's values reach only that row's (masked-off) stores.
      other = None if quant.is_float8(r.dtype) else 0
      return pltriton.load(r, mask=row_mask if by_row else mask, other=other).astype(jnp.float32)

    def store(r, x, by_row):
      pltriton.store(r, x.astype(r.dtype), mask=row_mask if by_row else mask)
  else:
    load = lambda r, by_row: r[...].astype(jnp.float32)

    def store(r, x, by_row):
      r[...] = x.astype(r.dtype)

  blocks = (load(r, i in row_inputs) for i, r in enumerate(in_refs))
  extra = {"index": row() * plan.view_shape[1] + col()} if with_index else {}
  results = body(scalars, *blocks, **extra)
  for k, (ref, value) in enumerate(zip(out_refs, results, strict=True)):
    store(ref, value, k in row_outputs)


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
    lanes: int = LANES,
    row_inputs: Sequence[int] = (),
    row_outputs: Sequence[int] = (),
    with_index: bool = False,
) -> tuple[jax.Array, ...]:
  """Runs `body` over same-shaped operands as one fused Pallas kernel.

  Args:
    body: ``body(scalars, *blocks) -> outputs``; all values f32.
    operands: arrays of one shape (any rank, any size), f32, bf16 or uint8,
      except the `row_inputs`.
    scalars: per-step 0-d values, passed to the kernel as data.
    out_dtypes: dtype of each output; outputs have the operands' shape.
    backend: ``"tpu"`` (Mosaic TPU) or ``"triton"``.
    interpret: run in the Pallas interpreter instead of compiling.
    name: kernel name, shown in profiles.
    aliases: ``{operand index: output index}`` pairs updated in place.
    flops_per_element: for the cost estimate.
    transcendentals_per_element: for the cost estimate.
    lanes: the view's row length (see `plan_tiles`); 256 for a kernel that
      reduces each row of 256 elements.
    row_inputs: operands holding one value per view row (``size // lanes``
      elements, any shape); the body sees them as ``(rows, 1)`` blocks.
    row_outputs: outputs with one value per view row, returned flat.
    with_index: pass the body ``index=``, the int32 row-major flat index of
      every element of its block (for counter-based random bits).

  Returns:
    The outputs, shaped like the operands (row outputs flat).
  """
  row_inputs, row_outputs = frozenset(row_inputs), frozenset(row_outputs)
  full = [x for i, x in enumerate(operands) if i not in row_inputs]
  shape = full[0].shape
  for x in full:
    if x.shape != shape:
      raise ValueError(
          f"{name}: operands must share one shape; got {[o.shape for o in full]}."
      )
  size = math.prod(shape)
  if size == 0:
    return tuple(jnp.zeros(shape, d) for d in out_dtypes)

  plan = plan_tiles(size, backend, lanes=lanes)
  rows = plan.view_shape[0]
  block = pl.BlockSpec(plan.block_shape, lambda i, j: (i, j))
  row_block = pl.BlockSpec((plan.block_shape[0], 1), lambda i, j: (i, 0))
  if backend == "tpu":
    scalar_spec = pl.BlockSpec(memory_space=pltpu.SMEM)
  else:
    scalar_spec = pl.BlockSpec((_triton_scalar_width(len(scalars)),), lambda i, j: (0,))

  kernel = functools.partial(
      _kernel, body=body, num_scalars=len(scalars), num_operands=len(operands),
      plan=plan, backend=backend, row_inputs=row_inputs, row_outputs=row_outputs,
      with_index=with_index,
  )
  call = pl.pallas_call(
      kernel,
      out_shape=[
          jax.ShapeDtypeStruct((rows, 1) if k in row_outputs else plan.view_shape, d)
          for k, d in enumerate(out_dtypes)
      ],
      grid=plan.grid,
      in_specs=[scalar_spec]
      + [row_block if k in row_inputs else block for k in range(len(operands))],
      out_specs=[row_block if k in row_outputs else block for k in range(len(out_dtypes))],
      # Operand i is pallas_call input i + 1: input 0 is the scalar vector.
      input_output_aliases={i + 1: o for i, o in (aliases or {}).items()},
      compiler_params=_compat.compiler_params(
          backend, ("parallel", "parallel"), interpret=interpret
      ),
      interpret=interpret,
      name=name,
      cost_estimate=pl.CostEstimate(
          flops=flops_per_element * size,
          transcendentals=transcendentals_per_element * size,
          bytes_accessed=bytes_moved(
              full + [x for i, x in enumerate(operands) if i in row_inputs], out_dtypes,
              [rows if k in row_outputs else size for k in range(len(out_dtypes))],
          ),
      ),
  )
  views = [
      x.reshape((rows, 1) if k in row_inputs else plan.view_shape)
      for k, x in enumerate(operands)
  ]
  outs = call(_scalar_vector(scalars, backend), *views)
  return tuple(
      o.reshape(-1) if k in row_outputs else o.reshape(shape) for k, o in enumerate(outs)
  )


# ---- Elementwise optimizer updates: "apply" and "updates" modes. ----

UpdateMath = Callable[..., Sequence[jax.Array]]
# One optimizer state leaf: an array (f32 or bf16) or a blockwise (8-bit or fp8) moment.
Moment = jax.Array | quant.Int8Blockwise | quant.Fp8Blockwise


def check_update_mode(mode: str, p: jax.Array | None, decay: bool) -> None:
  """``mode`` is ``"apply"`` or ``"updates"`` and ``p`` is there if it is read."""
  if mode not in ("apply", "updates"):
    raise ValueError(f"mode must be 'apply' or 'updates'; got {mode!r}.")
  if p is None and (mode == "apply" or decay):
    raise ValueError(f"p is required in {mode!r} mode{' with decay' if decay else ''}.")


def updates_dtype(p: jax.Array | None, g: jax.Array, *moments: Moment) -> jnp.dtype:
  """The dtype of Optax's updates: its inputs' promoted dtype (blockwise moments count as f32)."""
  return jnp.result_type(
      *(_moment_dtype(x) for x in (p, g, *moments) if x is not None)
  )


# How a result is rounded into a bfloat16 leaf.
ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic")
# Per element, the cost-estimate flops of decoding and encoding one blockwise
# moment, and of one stochastic rounding (hash and add).
_QUANTIZED_FLOPS = 110
_ROUNDING_FLOPS = 20


def check_rounding(name: str, value: object) -> str:
  """``value`` is one of `ROUNDINGS`, else a ValueError naming ``name``."""
  if value not in ROUNDINGS:
    raise ValueError(f"{name} must be 'nearest' or 'stochastic'; got {value!r}.")
  return value  # type: ignore[return-value]


def _moment_dtype(m: Moment) -> jnp.dtype:
  return jnp.dtype(jnp.float32) if quant.is_blockwise(m) else jnp.dtype(m.dtype)


def _rounded_streams(
    p, moments, *, mode: str, state_rounding: str, param_rounding: str, key
) -> frozenset[int]:
  """The random streams a step draws: 0 for bf16 params, ``1 + i`` for bf16 moment ``i``."""
  check_rounding("state_rounding", state_rounding)
  check_rounding("param_rounding", param_rounding)
  bf16 = jnp.dtype(jnp.bfloat16)
  streams = set()
  if mode == "apply" and param_rounding == "stochastic" and p.dtype == bf16:
    streams.add(0)
  if state_rounding == "stochastic":
    streams.update(1 + i for i, m in enumerate(moments) if _moment_dtype(m) == bf16)
  if streams and key is None:
    raise ValueError("stochastic rounding needs a key (see quant.leaf_key); got key=None.")
  return frozenset(streams)


def _check_signed(moments, signed: Sequence[bool]) -> None:
  if any(map(quant.is_blockwise, moments)) and len(signed) != len(moments):
    raise ValueError(
        f"blockwise moments need one signed flag per moment; got {len(signed)} for {len(moments)}."
    )


def per_element(moments: Sequence[Moment], *roundings: str) -> bool:
  """Whether an update with these moments and roundings may run per shard.

  Plain moments rounded to nearest: every output element depends only on
  the same input element. A blockwise moment's block scales, or random bits
  drawn from an element's index in the whole leaf, are not per element.
  """
  return not any(map(quant.is_blockwise, moments)) and all(
      r == "nearest" for r in roundings
  )


def cuda_auto(moments: Sequence[Moment]) -> str:
  """What ``impl="auto"`` runs on a CUDA GPU for an update with these moments.

  f32 and bf16 moments: the XLA reference, which fuses the update into one
  pass (measured on an H100: the Triton kernel only tied it). Blockwise
  (int8 or fp8) moments: the Triton kernel, because XLA cannot fuse the
  blockwise re-encoding into the update: its compiled reference reads and
  writes 3.5x the kernel's bytes for int8 AdamW (59.0 MB against 16.8 MB per
  1M-element f32 leaf, XLA's cost analysis on a CPU host,
  bench/cases_adamw.py). Neither path has been timed on a GPU yet.
  """
  return "pallas" if any(map(quant.is_blockwise, moments)) else "xla"


def store_moment(
    x: jax.Array, like: Moment, *, signed: bool, bits: jax.Array | None = None
) -> Moment:
  """An f32 result ``x`` stored in ``like``'s format: a moment's or the params' (XLA path).

  A blockwise ``like`` (`quant.Int8Blockwise`, `quant.Fp8Blockwise`) gets
  ``x``'s blockwise codes in its format (on the signed or unsigned map for
  8-bit codes); an array ``like`` gets ``x`` in its dtype, rounded
  stochastically with ``bits`` (`quant.random_bits`) when given and the
  dtype is bfloat16, else to nearest.
  """
  if quant.is_blockwise(like):
    return quant.quantize(x, signed=signed, fmt=quant.format_of(like))
  if bits is not None and like.dtype == jnp.bfloat16:
    x = quant.stochastic_round_bf16(x, bits)
  return x.astype(like.dtype)


def reference_update(
    math: UpdateMath,
    p: jax.Array | None,
    g: jax.Array,
    moments: Sequence[Moment],
    scalars: tuple,
    *,
    mode: str,
    decay: bool,
    signed: Sequence[bool] = (),
    state_rounding: str = "nearest",
    param_rounding: str = "nearest",
    key: jax.Array | None = None,
) -> tuple[Moment, ...]:
  """Runs an update ``math`` as plain jnp: the XLA path of a family.

  Args:
    math: ``math(scalars, p, g, *moments, decay=decay) -> (u, *moments)`` on
      f32 values (``p`` is None when it is not read).
    p: params, or None in ``"updates"`` mode without decay.
    g: gradient.
    moments: the optimizer state leaves, each kept in its own format: an
      array in its own dtype, or a blockwise moment (`quant.Int8Blockwise`,
      `quant.Fp8Blockwise`).
    scalars: the family's NamedTuple of per-step scalars.
    mode: ``"apply"`` returns ``(p + u, *moments)``; ``"updates"`` returns
      ``(u, *moments)``, ``u`` in `updates_dtype`.
    decay: whether the leaf gets weight decay.
    signed: per moment, whether its 8-bit map is the signed one (needed
      when a moment is a `quant.Int8Blockwise`).
    state_rounding: how bf16 moments are stored: ``"nearest"`` or
      ``"stochastic"`` (`quant.stochastic_round_bf16`).
    param_rounding: the same for bf16 params in ``"apply"`` mode.
    key: the leaf's int32 random key (`quant.leaf_key`), needed when
      anything is rounded stochastically.
  """
  check_update_mode(mode, p, decay)
  _check_signed(moments, signed)
  streams = _rounded_streams(
      p, moments, mode=mode, state_rounding=state_rounding, param_rounding=param_rounding,
      key=key,
  )
  s = type(scalars)(*(jnp.asarray(x, jnp.float32) for x in scalars))
  f32 = lambda x: None if x is None else x.astype(jnp.float32)
  values = [
      quant.dequantize(m, signed=signed[i]) if quant.is_blockwise(m) else f32(m)
      for i, m in enumerate(moments)
  ]
  u, *new = math(s, f32(p), f32(g), *values, decay=decay)
  index = quant.element_index(g.shape) if streams else None
  bits = lambda stream: quant.random_bits(key, index, stream) if stream in streams else None
  if mode == "apply":
    first = store_moment(f32(p) + u, p, signed=True, bits=bits(0))
  else:
    first = u.astype(updates_dtype(p, g, *moments))
  stored = [
      store_moment(x, m, signed=signed[i] if signed else True, bits=bits(1 + i))
      for i, (x, m) in enumerate(zip(new, moments, strict=True))
  ]
  return (first, *stored)


def kernel_update(
    math: UpdateMath,
    p: jax.Array | None,
    g: jax.Array,
    moments: Sequence[Moment],
    scalars: tuple,
    *,
    mode: str,
    decay: bool,
    backend: str,
    interpret: bool,
    name: str,
    flops_per_element: int,
    transcendentals_per_element: int = 0,
    signed: Sequence[bool] = (),
    state_rounding: str = "nearest",
    param_rounding: str = "nearest",
    key: jax.Array | None = None,
) -> tuple[Moment, ...]:
  """`reference_update` as one fused Pallas kernel (`elementwise_call`).

  The moments are aliased to their outputs (a blockwise moment's codes and
  scales both), and in ``"apply"`` mode p too; donate them in the enclosing
  jit to update in place. p is read only in ``"apply"`` mode or with decay.
  The kernel is named ``{name}_{mode}``.

  Blockwise moments are decoded, updated in f32 and re-encoded with their new
  per-block absmax in the same pass: the view has rows of one block
  (`quant.BLOCK` elements), each row's absmax a row reduction. A leaf whose
  size is not a multiple of the block (a ragged last block) runs
  `reference_update` instead, which computes the same codes and scales.
  Stochastic rounding draws its bits from the key and each element's flat
  index, exactly as the reference does.
  """
  check_update_mode(mode, p, decay)
  _check_signed(moments, signed)
  streams = _rounded_streams(
      p, moments, mode=mode, state_rounding=state_rounding, param_rounding=param_rounding,
      key=key,
  )
  quantized = [quant.is_blockwise(m) for m in moments]
  if any(quantized) and g.size % quant.BLOCK:
    return reference_update(
        math, p, g, moments, scalars, mode=mode, decay=decay, signed=signed,
        state_rounding=state_rounding, param_rounding=param_rounding, key=key,
    )
  with_p = p is not None and (mode == "apply" or decay)
  # Operands: g, each moment (an 8-bit one as codes and scales), then p if read.
  operands, row_inputs = [g], []
  out_dtypes, row_outputs = [p.dtype if mode == "apply" else updates_dtype(p, g, *moments)], []
  aliases = {}
  for m, q in zip(moments, quantized, strict=True):
    parts = (m.codes, m.scales) if q else (m,)
    for part in parts:
      aliases[len(operands)] = len(out_dtypes)
      operands.append(part)
      out_dtypes.append(part.dtype)
    if q:
      row_inputs.append(len(operands) - 1)
      row_outputs.append(len(out_dtypes) - 1)
  if with_p:
    operands.append(p)
    if mode == "apply":
      aliases[len(operands) - 1] = 0
  num_scalars = len(scalars)
  extra_scalars = quant.split_key(key) if streams else ()

  def body(values, g, *rest, index=None):
    key_in = quant.join_key(*values[num_scalars:]) if streams else None

    def rounded(x, stream):
      if stream not in streams:
        return x
      return quant.stochastic_round_bf16(x, quant.random_bits(key_in, index, stream))

    rest = iter(rest)
    loaded = []
    for i, q in enumerate(quantized):
      if q:
        codes, scales = next(rest), next(rest)
        loaded.append(quant.dequantize_rows(codes, scales, signed[i], quant.format_of(moments[i])))
      else:
        loaded.append(next(rest))
    p = next(rest) if with_p else None
    u, *new = math(type(scalars)(*values[:num_scalars]), p, g, *loaded, decay=decay)
    outputs = [rounded(p + u, 0) if mode == "apply" else u]
    for i, (x, q) in enumerate(zip(new, quantized, strict=True)):
      if q:
        outputs.extend(quant.quantize_rows(x, signed[i], quant.format_of(moments[i])))
      else:
        outputs.append(rounded(x, 1 + i))
    return outputs

  flops = (
      flops_per_element + _QUANTIZED_FLOPS * sum(quantized) + _ROUNDING_FLOPS * len(streams)
  )
  outs = iter(elementwise_call(
      body, operands, (*scalars, *extra_scalars), out_dtypes,
      backend=backend, interpret=interpret, name=f"{name}_{mode}", aliases=aliases,
      flops_per_element=flops, transcendentals_per_element=transcendentals_per_element,
      lanes=quant.BLOCK if any(quantized) else LANES, row_inputs=row_inputs,
      row_outputs=row_outputs, with_index=bool(streams),
  ))
  first = next(outs)
  stored = [
      type(m)(next(outs), next(outs).reshape(m.scales.shape)) if q else next(outs)
      for m, q in zip(moments, quantized, strict=True)
  ]
  return (first, *stored)
