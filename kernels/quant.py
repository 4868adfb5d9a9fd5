r"""Low-precision optimizer state: 8-bit blockwise codes and stochastic rounding.

One module for every family's kernel and reference. Its functions are plain
``jnp`` on f32 (and int32) values, so the same code runs inside a Pallas kernel
body (Mosaic TPU, Triton, the interpreter) and in the XLA reference, and both
produce the same codes, scales and rounded values.

**8-bit blockwise state** (Dettmers et al., `8-bit Optimizers via Block-wise
Quantization <https://arxiv.org/abs/2110.02861>`_, 2022). A moment is cut into
blocks of `BLOCK` consecutive elements (row-major order); each block stores
its absolute maximum ``s`` in f32 and each element the 8-bit code of the map
value nearest to ``x / s``. The map is *dynamic tree* quantization: a value
is a decade ``10^{-z}`` (``z = 0..6``) times a linear fraction in
``(0.1, 1)``, with more fraction values in the larger decades, so small
moments keep their relative precision. With ``F`` fraction bits in decade 0,
decade ``z`` holds ``2^{F-z}`` values, the midpoints of ``2^{F-z}`` equal
steps of ``[0.1, 1]``:

.. math::

  q_z(f) = 10^{-z}\left(0.1 + 0.9\,\frac{f + 1/2}{2^{F-z}}\right),
  \qquad f = 0, \dots, 2^{F-z} - 1.

* the *signed* map (first moments): ``F = 6``, the 127 values ``±q_z(f)``
  each, 0 and 1: 256 values;
* the *unsigned* map (second moments): ``F = 7``, the 254 values
  ``q_z(f)``, 0 and 1: 256 values.

Those are the value sets bitsandbytes uses for its 8-bit optimizers. A code
is the value's rank in the sorted map, so decoding and encoding are
arithmetic (the decade from a handful of compares, the fraction from an
affine map): no lookup table, no gather, nothing Mosaic or Triton cannot
lower. Encoding rounds to the nearest map value (ties towards zero).

**fp8 blockwise state** (`Fp8Blockwise`): the same blocks and absmax, each
element stored as the float8 e4m3 value nearest to ``448 x / s`` (448 is
e4m3's largest finite value): no map, 3 mantissa bits (relative error
:math:`\le 2^{-4}`) and a range down to :math:`2^{-9}/448` of the absmax.

**Stochastic rounding** to bfloat16 adds 16 random bits below the bf16
mantissa of the f32 value and truncates: the result is one of the two
neighbouring bf16 values, the farther one with probability proportional to
the distance, so it is unbiased. The bits are a counter-based hash
(murmur3's 32-bit finalizer, applied twice) of a per-leaf key and the
element's flat index: the same bits in the reference, the interpreter and
on hardware, reproducible run to run (the TPU hardware PRNG is not emulated
on CPU). The key mixes (seed, step, leaf), see `leaf_key`; the bits also mix a
stream number, so one leaf's params and moments round independently.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallasopt.kernels import _compat

__all__ = [
    "BLOCK",
    "MIN_QUANTIZED_SIZE",
    "Int8Blockwise",
    "Fp8Blockwise",
    "BLOCKWISE",
    "E4M3_MAX",
    "is_blockwise",
    "is_float8",
    "format_of",
    "scales_shape",
    "rows_hold_blocks",
    "from_row_major_scales",
    "check_scales",
    "decode",
    "encode",
    "quantize_rows",
    "dequantize_rows",
    "quantize",
    "dequantize",
    "map_values",
    "leaf_key",
    "split_key",
    "join_key",
    "element_index",
    "random_bits",
    "stochastic_round_bf16",
]

# Elements per quantization block (one f32 scale each): 8 + 32/256 bits each.
BLOCK = 256
# Leaves smaller than this keep f32 state, as bitsandbytes does: their
# scales would cost more than the codes save and they are a rounding error of
# a model's bytes.
MIN_QUANTIZED_SIZE = 4096
# Decades of the dynamic map: 10^0 .. 10^-6.
_DECADES = 7
_FRACTION_BITS = {True: 6, False: 7}


class Int8Blockwise(NamedTuple):
  """A moment stored as 8-bit codes with one f32 absmax per block.

  Attributes:
    codes: uint8, the moment's shape: the rank of each element's map value.
    scales: f32, the absmax of each block of `BLOCK` elements, shaped by
      `scales_shape`: for a matrix whose rows hold whole blocks,
      ``(..., blocks per row, rows)``, the layout a TPU stores without
      padding, so a kernel reads the scales as they are and they shard like
      the params' rows.
  """

  codes: jax.Array
  scales: jax.Array


class Fp8Blockwise(NamedTuple):
  """A moment stored as float8 e4m3 values with one f32 absmax per block.

  Attributes:
    codes: float8_e4m3fn, the moment's shape: ``448 x / absmax``, rounded to
      nearest (even).
    scales: f32 absmax per block of `BLOCK` elements, as `Int8Blockwise`'s.
  """

  codes: jax.Array
  scales: jax.Array


# The blockwise state formats, by the name `quantize` takes.
BLOCKWISE: dict[str, type] = {"int8": Int8Blockwise, "fp8": Fp8Blockwise}
# The largest finite float8_e4m3fn value: a block's absmax maps to it.
E4M3_MAX = 448.0


def is_blockwise(x: object) -> bool:
  """Whether ``x`` is a blockwise-quantized moment (8-bit codes or fp8)."""
  return isinstance(x, tuple(BLOCKWISE.values()))


def is_float8(dtype) -> bool:
  """Whether ``dtype`` is an 8-bit float (fp8 codes), any of JAX's float8 types."""
  return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 1


def format_of(q: Int8Blockwise | Fp8Blockwise) -> str:
  """``"int8"`` or ``"fp8"``: the format of a blockwise moment."""
  return "fp8" if isinstance(q, Fp8Blockwise) else "int8"


def rows_hold_blocks(shape: tuple[int, ...]) -> bool:
  """Whether a moment of ``shape`` has rows of whole blocks (2 or more dims)."""
  return len(shape) >= 2 and shape[-1] % BLOCK == 0


def scales_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
  """The shape of the per-block scales of a moment of ``shape``.

  Rows of whole blocks (`rows_hold_blocks`): ``shape[:-2] + (shape[-1] //
  BLOCK, shape[-2])``, the blocks of each row along the second-last axis and
  the rows along the last (a TPU tiles the last two dims by (8, 128): the
  other order would pad a few blocks per row to 128 lanes, and XLA would lay
  it out column-major). Otherwise ``shape[:k] + (blocks,)`` with ``k`` the
  most leading dims whose trailing product is a whole number of blocks, and
  ``(ceil(size / BLOCK),)`` when no trailing product is (the last block is
  then ragged).

  A state saved before 2026-11-25 holds such rows' scales as
  ``shape[:-1] + (shape[-1] // BLOCK,)``: ``pallasopt.optim.convert_state(...,
  legacy_scales=True)`` converts it (`from_row_major_scales`).
  """
  if rows_hold_blocks(shape):
    return tuple(shape[:-2]) + (shape[-1] // BLOCK, shape[-2])
  for k in range(len(shape), 0, -1):
    tail = math.prod(shape[k - 1 :])
    if tail % BLOCK == 0:
      return tuple(shape[: k - 1]) + (tail // BLOCK,)
  return (-(-math.prod(shape) // BLOCK),)


def _i32(value: int) -> np.int32:
  """A 32-bit pattern as an int32 constant (the hash works on int32 bits)."""
  return np.uint32(value).view(np.int32)


def _magnitude_value(j, fraction_bits: int):
  """The map magnitude of index ``j`` (f32, integral): 0, ``q_z(f)`` or 1.

  ``j`` counts the nonnegative map values from 0: below ``2^(F-6)`` it is
  0, at ``2^(F+1)`` it is 1, and ``2^(F-z) <= j < 2^(F-z+1)`` is decade
  ``z``, fraction ``f = j - 2^(F-z)``.
  """
  f_bits = fraction_bits
  # The decade's 10^-z and 1 / 2^(F-z) by compares (no log, no gather).
  first = f_bits - (_DECADES - 1)
  scale = jnp.zeros_like(j)
  inv_width = jnp.zeros_like(j)
  for b in range(first, f_bits + 1):
    at_least = j >= float(2**b)
    scale = jnp.where(at_least, np.float32(10.0 ** (b - f_bits)), scale)
    inv_width = jnp.where(at_least, np.float32(2.0**-b), inv_width)
  # 10^-z (0.1 + 0.9 (j - 2^(F-z) + 1/2) / 2^(F-z)) = 10^-z (0.9 (j + 1/2) / 2^(F-z) - 0.8)
  inner = scale * ((j + 0.5) * inv_width * np.float32(0.9) - np.float32(0.8))
  top = float(2 ** (f_bits + 1))
  return jnp.where(j >= top, 1.0, jnp.where(j < float(2**first), 0.0, inner))


def decode(codes, signed: bool):
  """Map values of ``codes`` (f32 holding 0..255), as f32 in [-1, 1]."""
  if signed:
    offset = codes - 127.0
    return jnp.where(offset < 0, -1.0, 1.0) * _magnitude_value(
        jnp.abs(offset), _FRACTION_BITS[True]
    )
  return _magnitude_value(codes + 1.0, _FRACTION_BITS[False])


def encode(x, signed: bool):
  """Codes (f32 holding 0..255) of the map values nearest to ``x``.

  ``x`` is f32, normalised to [-1, 1] ([0, 1] unsigned; negatives clip to 0).
  NaN encodes as 0's code: a NaN moment is carried by its block's scale.
  """
  f_bits = _FRACTION_BITS[signed]
  a = jnp.abs(x) if signed else jnp.maximum(x, 0.0)
  a = jnp.where(jnp.isnan(a), 0.0, jnp.minimum(a, 1.0))
  zero_index = float(2 ** (f_bits - (_DECADES - 1)) - 1)
  top = float(2 ** (f_bits + 1))
  # The floor index: the largest j whose value is <= a, from the decade of a
  # (a >= its first value) and the affine position inside it. Float rounding
  # may put it one off next to a map value; the nearest of (j, j + 1) is
  # still right then.
  scale_inv = jnp.zeros_like(a)
  width = jnp.zeros_like(a)
  in_map = jnp.zeros(a.shape, jnp.bool_)
  for z in range(_DECADES - 1, -1, -1):
    first_value = np.float32(10.0**-z * (0.1 + 0.45 / 2 ** (f_bits - z)))
    at_least = a >= first_value
    in_map = in_map | at_least
    scale_inv = jnp.where(at_least, np.float32(10.0**z), scale_inv)
    width = jnp.where(at_least, float(2 ** (f_bits - z)), width)
  position = jnp.floor((a * scale_inv + np.float32(0.8)) * width * np.float32(1 / 0.9) - 0.5)
  low = jnp.where(in_map, jnp.clip(position, width, 2.0 * width - 1.0), zero_index)
  high = low + 1.0
  nearer_low = a - _magnitude_value(low, f_bits) <= _magnitude_value(high, f_bits) - a
  j = jnp.where(a >= 1.0, top, jnp.where(nearer_low, low, high))
  if signed:
    # The map's 1 is positive only: a negative -1 takes the largest
    # negative value, as in bitsandbytes.
    j = jnp.where(x < 0, jnp.minimum(j, top - 1.0), j)
    return 127.0 + jnp.where(x < 0, -j, j)
  return j - 1.0


def quantize_rows(x, signed: bool, fmt: str = "int8"):
  """Blockwise codes of the rows of ``x`` (f32 ``(rows, BLOCK)``): ``(codes, absmax)``.

  ``absmax`` is f32 ``(rows, 1)``. ``codes`` is f32: for ``"int8"`` holding
  0..255, for ``"fp8"`` the scaled values, which storing as float8_e4m3fn
  rounds. A zero block gets scale 0 and 0's code.
  """
  absmax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
  positive = absmax > 0
  normalised = jnp.where(positive, x / jnp.where(positive, absmax, 1.0), 0.0)
  if fmt == "fp8":
    return normalised * E4M3_MAX, absmax
  return encode(normalised, signed), absmax


def dequantize_rows(codes, absmax, signed: bool, fmt: str = "int8"):
  """The f32 values of blockwise ``codes`` (loaded as f32) with their ``absmax``."""
  if fmt == "fp8":
    return codes * (absmax / E4M3_MAX)
  return decode(codes, signed) * absmax


def _reshape(x, shape, sharding):
  # Under Explicit mesh axes a reshape must name its output's sharding.
  if sharding is None:
    return jnp.reshape(x, shape)
  return jax.lax.reshape(x, shape, out_sharding=sharding)


def _sharding(x, leading: int | None = None):
  """``x``'s explicit sharding, cut to its first ``leading`` dims; None if it has none."""
  spec = _compat.explicit_spec(x)
  if spec is None:
    return None
  entries = (tuple(spec) + (None,) * x.ndim)[: x.ndim if leading is None else leading]
  return jax.sharding.NamedSharding(
      jax.typeof(x).sharding.mesh, jax.sharding.PartitionSpec(*entries)
  )


def _block_rows(x):
  """``x`` as rows of one block each, in the order of its scales (`scales_shape`) + (BLOCK,).

  Whole blocks keep the leading dims (and their sharding); a ragged last
  block is zero-padded (which changes no absmax).
  """
  if rows_hold_blocks(x.shape):
    *lead, rows, cols = x.shape
    split = _reshape(x, (*lead, rows, cols // BLOCK, BLOCK), _sharding(x, len(lead) + 1))
    return jnp.swapaxes(split, -2, -3)
  blocks = scales_shape(x.shape)
  size = math.prod(x.shape)
  if size % BLOCK:
    flat = _reshape(x, (size,), _sharding(x, 0))
    return jnp.pad(flat, (0, -size % BLOCK)).reshape(blocks + (BLOCK,))
  return _reshape(x, blocks + (BLOCK,), _sharding(x, len(blocks) - 1))


def _from_block_rows(rows, like):
  """The inverse of `_block_rows`: ``like``'s shape and sharding."""
  if rows_hold_blocks(like.shape):
    return _reshape(jnp.swapaxes(rows, -2, -3), like.shape, _sharding(like))
  size = math.prod(like.shape)
  if size % BLOCK:
    flat = _reshape(rows, (rows.size,), _sharding(rows, 0))
    return _reshape(flat[:size], like.shape, _sharding(like))
  return _reshape(rows, like.shape, _sharding(like))


_CODE_DTYPES = {"int8": jnp.uint8, "fp8": jnp.float8_e4m3fn}


def quantize(
    x: jax.Array, *, signed: bool, fmt: str = "int8"
) -> Int8Blockwise | Fp8Blockwise:
  """The blockwise moment (``fmt``: ``"int8"`` or ``"fp8"``) of an array of any shape.

  Its last block may be ragged.
  """
  codes, absmax = quantize_rows(_block_rows(x.astype(jnp.float32)), signed, fmt)
  return BLOCKWISE[fmt](
      _from_block_rows(codes.astype(_CODE_DTYPES[fmt]), x), absmax.reshape(absmax.shape[:-1])
  )


def dequantize(q: Int8Blockwise | Fp8Blockwise, *, signed: bool) -> jax.Array:
  """The f32 moment a blockwise moment stores."""
  check_scales(q)
  rows = _block_rows(q.codes.astype(jnp.float32))
  values = dequantize_rows(rows, q.scales[..., None], signed, format_of(q))
  return _from_block_rows(values, q.codes)


_LEGACY_LAYOUT = "2026-11-25"


def check_scales(q: Int8Blockwise | Fp8Blockwise) -> None:
  """Raises a ValueError unless ``q``'s scales have the shape `scales_shape` gives its codes."""
  shape, got = tuple(q.codes.shape), tuple(q.scales.shape)
  if got == scales_shape(shape):
    return
  legacy = rows_hold_blocks(shape) and got == shape[:-1] + (shape[-1] // BLOCK,)
  raise ValueError(
      f"blockwise scales of shape {got} do not fit codes of shape {shape}: expected "
      f"{scales_shape(shape)}."
      + (f" A state saved before {_LEGACY_LAYOUT} keeps them as {got}: convert it with "
         "pallasopt.optim.convert_state(opt_state, params, state_format, legacy_scales=True)."
         if legacy else "")
  )


def from_row_major_scales(q: Int8Blockwise | Fp8Blockwise) -> Int8Blockwise | Fp8Blockwise:
  """A blockwise moment saved before 2026-11-25, in the current layout.

  Until then a matrix whose rows hold whole blocks kept its scales as
  ``shape[:-1] + (blocks per row,)``; `scales_shape` now puts the rows last,
  and other scales are unchanged. (The shapes alone cannot tell the layouts
  apart when a matrix has as many rows as blocks per row, hence a function
  that is only called on a state known to be that old.) Scales that fit
  neither layout are a ValueError.
  """
  shape = tuple(q.codes.shape)
  if rows_hold_blocks(shape) and tuple(q.scales.shape) == shape[:-1] + (shape[-1] // BLOCK,):
    return type(q)(q.codes, jnp.swapaxes(q.scales, -1, -2))
  check_scales(q)
  return q


def map_values(signed: bool) -> np.ndarray:
  """The 256 map values in code order (ascending), as float32."""
  return np.asarray(jax.jit(decode, static_argnums=1)(jnp.arange(256, dtype=jnp.float32), signed))


# ---- Counter-based random bits and stochastic rounding. ----

_GOLDEN = 0x9E3779B9


def _times_golden(value: int) -> np.int32:
  return _i32((value * _GOLDEN) & 0xFFFFFFFF)


def _fmix32(h):
  """murmur3's 32-bit finalizer on int32 bits (logical shifts, wrapping products)."""
  h = h ^ jax.lax.shift_right_logical(h, np.int32(16))
  h = h * _i32(0x85EBCA6B)
  h = h ^ jax.lax.shift_right_logical(h, np.int32(13))
  h = h * _i32(0xC2B2AE35)
  return h ^ jax.lax.shift_right_logical(h, np.int32(16))


def leaf_key(seed, step, leaf: int) -> jax.Array:
  """The int32 random key of one leaf at one step.

  `random_bits` mixes in the stream (params, first moment, ...) and each
  element's index.

  Args:
    seed: the user's seed (an int or int32 value).
    step: the optimizer step (the state's count; may be traced).
    leaf: the leaf's index in the flattened params.
  """
  key = _fmix32(jnp.asarray(seed).astype(jnp.int32) ^ _times_golden(1))
  key = _fmix32(key + jnp.asarray(step).astype(jnp.int32) * _times_golden(1))
  return _fmix32(key + _times_golden(leaf))


def split_key(key) -> tuple[jax.Array, jax.Array]:
  """A key as two f32 holding its 16-bit halves (exact): kernel scalars are f32."""
  key = jnp.asarray(key, jnp.int32)
  high = jax.lax.shift_right_logical(key, np.int32(16))
  return high.astype(jnp.float32), (key & 0xFFFF).astype(jnp.float32)


def join_key(high, low) -> jax.Array:
  """The int32 key `split_key` split."""
  return (high.astype(jnp.int32) << 16) | low.astype(jnp.int32)


def element_index(shape: tuple[int, ...]) -> jax.Array:
  """The int32 row-major flat index of every element of an array of ``shape``."""
  return jnp.arange(math.prod(shape), dtype=jnp.int32).reshape(shape)


def random_bits(key, index, stream: int = 0):
  """32 random bits (int32) per element from a key and flat element indices."""
  h = _fmix32(index.astype(jnp.int32) ^ (key + _times_golden(stream)))
  return _fmix32(h + key)


def stochastic_round_bf16(x, bits):
  """``x`` (f32) rounded stochastically to a bfloat16 value (returned as f32).

  Rounds up (away from zero) with probability equal to the fraction of a
  bf16 ulp that truncation drops, using the low 16 of ``bits``; exact on
  bf16 values, NaN stays NaN, and magnitudes past bf16's largest finite
  value may round to infinity, as rounding up must.
  """
  as_int = jax.lax.bitcast_convert_type(x, jnp.int32)
  rounded = (as_int + (bits & 0xFFFF)) & _i32(0xFFFF0000)
  return jnp.where(jnp.isnan(x), x, jax.lax.bitcast_convert_type(rounded, jnp.float32))
