r"""Low-precision optimizer state: 8-bit blockwise codes and stochastic rounding.

One module for every family's kernel and reference. Its functions are plain
``jnp`` on f32 (and int32) values, so the same code runs inside a Pallas kernel
body (Mosaic TPU, Triton, the interpreter) and in the XLA reference, and both
produce the same codes, scales and rounded values.

**Blockwise state** (Dettmers et al., `8-bit Optimizers via Block-wise
Quantization <https://arxiv.org/abs/2110.02861>`_, 2022). A stored value is
cut into blocks of `BLOCK` consecutive elements (row-major order); each block
stores its absolute maximum ``s`` in f32 and each element an 8-bit code of
``x / s`` on a *map*.

**What is stored: the roles.** A moment is stored in one of three roles:

* `SIGNED`: the moment itself (Lion's, Muon's and Adafactor's momentum,
  RMSProp's mean and trace, MARS's previous gradient): `Int8Blockwise` on the
  signed dynamic map, or `Fp8Blockwise`;
* `ROOT`: a second moment :math:`v` as its square root :math:`w = \sqrt v`,
  on the zero-free root map (`RootBlockwise`, both formats);
* `RATIO`: a first moment :math:`m` that an update divides by the root of a
  second moment, stored as :math:`r = m / w` with :math:`w` that second
  moment's root (0 where :math:`w = 0`), on the format's signed codes
  (`RatioBlockwise`); it decodes as :math:`r\,\hat w` with :math:`\hat w` the
  decoded root.

Why (Li, Chen, Zhu, `Memory Efficient Optimizers with 4-bit States
<https://arxiv.org/abs/2309.01507>`_, 2023, name it the zero-point problem):
the second moment spans the square of the first moment's range, and on a map
with a zero code (bitsandbytes', torchao's) its small entries in a block
decode to 0 while the first moment's do not: measured single AdamW updates of
7x to :math:`10^5` x the learning rate. The root spans the first moment's
range, and its map has no zero: a value below the map's least one
(:math:`2^{-15}` of the block's absmax) decodes to that least value, larger
than the truth, which can only shrink an update. Storing the ratio makes the
update :math:`m / w` depend on the stored ratio, whose largest values (the
largest updates) sit at the top of the map, where it is finest; where the
stored root is off, the decoded first moment is off by the same factor.

The optimizer steps round every code *stochastically* (unbiased): the update
of an exponential average with :math:`\beta_2 = 0.999` moves it by 0.1% a
step, less than half a code, so rounding to nearest freezes it (measured on
scikit-learn's digits: AdamW's final loss 12% off Optax's, Muon's momentum
4.7% off Muon's in f32; stochastic: 0.3%). The random bits hash the value
being rounded with the step's key (`code_bits`, `step_key`): no element
index, so a step sharded any way draws the same bits.

**The maps.** Codes are arithmetic (compares, affine maps, bit fields): no
lookup table, no gather, nothing Mosaic or Triton cannot lower.

* *Dynamic tree* (signed moments and ratios of ``"int8"``): a value is a
  decade ``10^{-z}`` (``z = 0..6``) times a linear fraction in ``(0.1, 1)``,
  with more fraction values in the larger decades. With ``F`` fraction bits in
  decade 0, decade ``z`` holds ``2^{F-z}`` values, the midpoints of
  ``2^{F-z}`` equal steps of ``[0.1, 1]``:

  .. math::

    q_z(f) = 10^{-z}\left(0.1 + 0.9\,\frac{f + 1/2}{2^{F-z}}\right),
    \qquad f = 0, \dots, 2^{F-z} - 1.

  The signed map has ``F = 6``: the 127 values ``±q_z(f)`` each, 0 and 1 (256
  values, bitsandbytes' signed map). A code is the value's rank in the sorted
  map. (The unsigned map, ``F = 7``, 0 and 1, held second moments before
  2026-11-26; it is kept only to read such states, `legacy_second_moment`.)
* *e4m3* (signed moments and ratios of ``"fp8"``): the float8 e4m3 value of
  ``448 x / s`` (448 is e4m3's largest finite value): 3 mantissa bits and a
  range down to :math:`2^{-9}/448` of the absmax.
* *Root map* (`ROOT`, both formats): an unsigned 8-bit float with 4 exponent
  and 4 mantissa bits and no zero, code ``16 e + f`` the value
  :math:`2^{e-15}(1 + f/16)/T` with :math:`T = 31/16`, so the top code is 1:
  16 binades (a second moment over :math:`2^{-30}` of its block's largest),
  each with 16 steps (a relative step of :math:`2^{-4}` at most).

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
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallasopt.kernels import _compat

__all__ = [
    "BLOCK",
    "MIN_QUANTIZED_SIZE",
    "FORMATS",
    "SIGNED",
    "RATIO",
    "ROOT",
    "ROLES",
    "Int8Blockwise",
    "Fp8Blockwise",
    "RootBlockwise",
    "RatioBlockwise",
    "Blockwise",
    "E4M3_MAX",
    "is_blockwise",
    "is_float8",
    "role_of",
    "codec_of",
    "codec",
    "scales_shape",
    "scales_spec",
    "rows_hold_blocks",
    "from_row_major_scales",
    "check_scales",
    "decode",
    "encode",
    "to_stored",
    "from_stored",
    "encode_rows",
    "decode_rows",
    "quantize",
    "quantize_like",
    "dequantize",
    "stored_values",
    "legacy_second_moment",
    "map_values",
    "root_map_values",
    "step_key",
    "leaf_key",
    "split_key",
    "join_key",
    "element_index",
    "random_bits",
    "code_bits",
    "stochastic_round_bf16",
]

# Elements per quantization block (one f32 scale each): 8 + 32/256 bits each.
BLOCK = 256
# Leaves smaller than this keep f32 state, as bitsandbytes does: their
# scales would cost more than the codes save and they are a rounding error of
# a model's bytes.
MIN_QUANTIZED_SIZE = 4096
# The blockwise state formats (`state_format`).
FORMATS: tuple[str, ...] = ("int8", "fp8")
# The roles of a stored moment (module docstring).
SIGNED, RATIO, ROOT = "signed", "ratio", "root"
ROLES: tuple[str, ...] = (SIGNED, RATIO, ROOT)
# Decades of the dynamic map: 10^0 .. 10^-6.
_DECADES = 7
_FRACTION_BITS = {True: 6, False: 7}
# The root map: exponent and mantissa bits, and T, its largest value (the
# largest 4 + 4 bit float, 2^0 (1 + 15/16)), which the block's absmax maps to.
_ROOT_EXPONENT_BITS = 4
_ROOT_MANTISSA_BITS = 4
_ROOT_TOP = 2.0 - 2.0**-_ROOT_MANTISSA_BITS
# Code 0 is the exponent field 127 - (2^E - 1) of an f32 with a zero mantissa.
_ROOT_CODE_OFFSET = (127 - (2**_ROOT_EXPONENT_BITS - 1)) << _ROOT_MANTISSA_BITS
_ROOT_DROPPED_BITS = 23 - _ROOT_MANTISSA_BITS


class Int8Blockwise(NamedTuple):
  """A signed moment stored as 8-bit codes with one f32 absmax per block.

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
  """A signed moment stored as float8 e4m3 values with one f32 absmax per block.

  Attributes:
    codes: float8_e4m3fn, the moment's shape: ``448 x / absmax``, rounded
      stochastically (by the steps) or to nearest (even).
    scales: f32 absmax per block of `BLOCK` elements, as `Int8Blockwise`'s.
  """

  codes: jax.Array
  scales: jax.Array


def _read_as_codes_and_scales(cls: type) -> type:
  """A blockwise class whose fields are named apart, read as ``codes`` and ``scales`` too."""
  cls.codes = property(lambda self: self[0], doc="The codes (the first field).")
  cls.scales = property(lambda self: self[1], doc="The per-block absmax (the second field).")
  return cls


@_read_as_codes_and_scales
class RootBlockwise(NamedTuple):
  """A second moment stored as its square root on the zero-free root map.

  The fields' names differ from `Int8Blockwise`'s on purpose: a checkpoint
  that stored the second moment itself (before 2026-11-26) cannot restore
  into this state unnoticed.

  Attributes:
    root_codes: uint8, the moment's shape: the root map's code of each
      element's root over its block's absmax.
    root_scales: f32, the absmax of the root in each block, shaped by
      `scales_shape`.
  """

  root_codes: jax.Array
  root_scales: jax.Array


@_read_as_codes_and_scales
class RatioBlockwise(NamedTuple):
  """A first moment stored as its ratio to its second moment's root.

  Attributes:
    ratio_codes: the moment's shape: uint8 codes on the signed dynamic map
      (``"int8"``) or float8 e4m3 values (``"fp8"``) of ``m / w`` over its
      block's absmax.
    ratio_scales: f32, the absmax of the ratio in each block, shaped by
      `scales_shape`.
  """

  ratio_codes: jax.Array
  ratio_scales: jax.Array


Blockwise = Int8Blockwise | Fp8Blockwise | RootBlockwise | RatioBlockwise
_CLASSES = (Int8Blockwise, Fp8Blockwise, RootBlockwise, RatioBlockwise)
# The largest finite float8_e4m3fn value: a block's absmax maps to it.
E4M3_MAX = 448.0


def is_blockwise(x: object) -> bool:
  """Whether ``x`` is a blockwise-quantized moment (any role and format)."""
  return isinstance(x, _CLASSES)


def is_float8(dtype) -> bool:
  """Whether ``dtype`` is an 8-bit float (fp8 codes), any of JAX's float8 types."""
  return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 1


def role_of(q: Blockwise) -> str:
  """The role (`SIGNED`, `RATIO` or `ROOT`) a blockwise moment is stored in."""
  if isinstance(q, RootBlockwise):
    return ROOT
  return RATIO if isinstance(q, RatioBlockwise) else SIGNED


def codec(role: str, fmt: str) -> str:
  """The map of a role in a format: ``"dynamic"``, ``"e4m3"`` or ``"root"``."""
  if role not in ROLES:
    raise ValueError(f"role must be one of {ROLES}; got {role!r}.")
  if fmt not in FORMATS:
    raise ValueError(f"fmt must be one of {FORMATS}; got {fmt!r}.")
  if role == ROOT:
    return "root"
  return "e4m3" if fmt == "fp8" else "dynamic"


def codec_of(q: Blockwise) -> str:
  """The map a blockwise moment's codes are on (see `codec`)."""
  if isinstance(q, RootBlockwise):
    return "root"
  return "e4m3" if is_float8(q.codes.dtype) else "dynamic"


def _class(role: str, fmt: str) -> type:
  if role == ROOT:
    return RootBlockwise
  if role == RATIO:
    return RatioBlockwise
  return Fp8Blockwise if fmt == "fp8" else Int8Blockwise


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


def scales_spec(
    shape: tuple[int, ...],
    spec: jax.sharding.PartitionSpec,
    axis_sizes: Mapping[str, int] | None,
    *,
    exact: bool,
) -> jax.sharding.PartitionSpec | None:
  """How the per-block scales of a moment of ``shape`` split when it splits as ``spec``.

  The one rule for the kernels' per-shard layout and the state specs a mesh
  declares (`pallasopt.pipeline.optimizer_state_specs`): a shard holds the
  scales of the blocks its codes hold.

  Rows of whole blocks (scales ``(..., blocks per row, rows)``): the leading
  dims and the rows split like the moment's; the blocks axis splits like its
  columns where every column shard holds whole blocks, which takes the mesh's
  ``axis_sizes`` to know, and is whole otherwise. Other layouts (scales
  ``shape[:k] + (blocks,)``): the ``k`` leading dims split like the moment's
  and the blocks axis is whole.

  Args:
    shape: the moment's (its param's) shape.
    spec: the moment's `PartitionSpec`.
    axis_sizes: the mesh's axis sizes, or None where no mesh is known.
    exact: if true, None when a shard's scales would not be those of the
      blocks its codes hold (columns split mid-block, or dims merged into the
      blocks axis split): then no shard can encode on its own.
  """
  entries = [*spec, *(None,) * (len(shape) - len(spec))]
  axes_of = lambda entry: () if entry is None else (entry,) if isinstance(entry, str) else entry
  scales = scales_shape(shape)
  if rows_hold_blocks(shape):
    column_axes = axes_of(entries[-1])
    if not column_axes:
      whole = True
    elif axis_sizes is None:
      whole = False
    else:
      shards = math.prod(axis_sizes[a] for a in column_axes)
      whole = shape[-1] % (shards * BLOCK) == 0
    if exact and not whole:
      return None
    return jax.sharding.PartitionSpec(
        *entries[:-2], entries[-1] if whole else None, entries[-2])
  leading = len(scales) - 1
  if tuple(scales[:leading]) != tuple(shape[:leading]):
    leading = 0
  if exact and any(axes_of(entry) for entry in entries[leading:]):
    return None
  return jax.sharding.PartitionSpec(*entries[:leading], None)


def _i32(value: int) -> np.int32:
  """A 32-bit pattern as an int32 constant (the hash works on int32 bits)."""
  return np.uint32(value).view(np.int32)


def _uniform(bits):
  """A uniform f32 in [0, 1) from the high 24 of 32 random bits (int32)."""
  return jax.lax.shift_right_logical(bits, np.int32(8)).astype(jnp.float32) * np.float32(2.0**-24)


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
  """Map values of ``codes`` (f32 holding 0..255), as f32 in [-1, 1].

  ``signed``: the signed dynamic map; else the unsigned one, which held
  second moments before 2026-11-26.
  """
  if signed:
    offset = codes - 127.0
    return jnp.where(offset < 0, -1.0, 1.0) * _magnitude_value(
        jnp.abs(offset), _FRACTION_BITS[True]
    )
  return _magnitude_value(codes + 1.0, _FRACTION_BITS[False])


def encode(x, signed: bool, bits=None):
  """Codes (f32 holding 0..255) of the map values next to ``x``.

  ``x`` is f32, normalised to [-1, 1] ([0, 1] unsigned; negatives clip to 0).
  Without ``bits`` each value takes the nearest map value (ties towards
  zero); with ``bits`` (int32 random bits per element) one of the two map
  values around it, the farther with probability proportional to the
  distance, so the expected map value is ``x``.
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
  # still right then, and a stochastic choice takes the nearer one with
  # probability ~1.
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
  below, above = a - _magnitude_value(low, f_bits), _magnitude_value(high, f_bits) - a
  if bits is None:
    take_low = below <= above
  else:
    take_low = below <= _uniform(bits) * (below + above)
  j = jnp.where(a >= 1.0, top, jnp.where(take_low, low, high))
  if signed:
    # The map's 1 is positive only: a negative -1 takes the largest
    # negative value, as in bitsandbytes.
    j = jnp.where(x < 0, jnp.minimum(j, top - 1.0), j)
    return 127.0 + jnp.where(x < 0, -j, j)
  return j - 1.0


def _round_off_mantissa(x, bits, dropped: int):
  """``x`` (f32) cut to ``23 - dropped`` mantissa bits after adding ``dropped`` random bits.

  Stochastic rounding to that precision: the farther neighbour with
  probability proportional to the distance (a carry moves the exponent, as
  rounding up must).
  """
  low = (1 << dropped) - 1
  as_int = jax.lax.bitcast_convert_type(x, jnp.int32)
  kept = (as_int + (bits & low)) & _i32(~low & 0xFFFFFFFF)
  return jax.lax.bitcast_convert_type(kept, jnp.float32)


def _e4m3_grid(y, bits):
  """``y`` (f32, |y| <= 448) on the e4m3 grid, rounded stochastically with ``bits``.

  Normal e4m3 values keep 3 of f32's 23 mantissa bits: random bits fill the
  20 dropped ones before truncating. Below 2^-6 the grid is 2^-9 apart.
  """
  a = jnp.abs(y)
  normal = _round_off_mantissa(a, bits, 20)
  subnormal = jnp.floor(a * np.float32(2.0**9) + _uniform(bits)) * np.float32(2.0**-9)
  rounded = jnp.where(a < np.float32(2.0**-6), subnormal, normal)
  return jnp.where(y < 0, -rounded, rounded)


def _encode_root(x, bits):
  """Root-map codes (f32 holding 0..255) of ``x`` in [0, 1]; stochastic with ``bits``.

  The f32 bit pattern of ``T x`` with its mantissa cut to 4 bits is, past an
  offset, the code: adding half of the dropped bits' weight rounds to
  nearest, adding random bits rounds stochastically, both carrying into
  the exponent as float rounding does. Values below the least code take it.
  """
  as_int = jax.lax.bitcast_convert_type(x * np.float32(_ROOT_TOP), jnp.int32)
  dropped = (1 << _ROOT_DROPPED_BITS) - 1
  nudge = (dropped + 1) // 2 if bits is None else bits & dropped
  code = jax.lax.shift_right_logical(as_int + nudge, np.int32(_ROOT_DROPPED_BITS))
  return jnp.clip(code - _ROOT_CODE_OFFSET, 0, 255).astype(jnp.float32)


def _decode_root(codes):
  """The root map's values (f32 in (0, 1]) of ``codes`` (f32 holding 0..255)."""
  pattern = (codes.astype(jnp.int32) + _ROOT_CODE_OFFSET) << _ROOT_DROPPED_BITS
  # A product by 1/T, not a division by T: XLA turns the division by a
  # constant into that product on some backends, not on others.
  return jax.lax.bitcast_convert_type(pattern, jnp.float32) * np.float32(1 / _ROOT_TOP)


def to_stored(x, role: str, root=None):
  """The f32 values a moment ``x`` is stored as in ``role``.

  `ROOT`: ``sqrt(x)``; `RATIO`: ``x / root`` (0 where ``root`` is 0), with
  ``root`` the f32 root of the second moment it is divided by; `SIGNED`: ``x``.
  """
  if role == ROOT:
    return jnp.sqrt(x)
  if role == RATIO:
    positive = root > 0
    return jnp.where(positive, x / jnp.where(positive, root, 1.0), 0.0)
  return x


def from_stored(y, role: str, root=None):
  """The moment stored values ``y`` hold in ``role`` (the inverse of `to_stored`)."""
  if role == ROOT:
    return y * y
  if role == RATIO:
    return y * root
  return y


def encode_rows(y, codec_name: str, bits=None):
  """Blockwise codes of the rows of ``y`` (f32 ``(rows, BLOCK)``): ``(codes, absmax)``.

  ``absmax`` is f32 ``(rows, 1)``. ``codes`` is f32: holding 0..255 for the
  ``"dynamic"`` and ``"root"`` maps, for ``"e4m3"`` the scaled values, which
  storing as float8_e4m3fn rounds (or keeps, when ``bits`` rounded them).
  ``bits``: int32 random bits per element for stochastic rounding (`code_bits`),
  or None for nearest. A zero block gets scale 0 (and decodes to 0).
  """
  absmax = jnp.max(jnp.abs(y), axis=-1, keepdims=True)
  positive = absmax > 0
  normalised = jnp.where(positive, y / jnp.where(positive, absmax, 1.0), 0.0)
  if codec_name == "e4m3":
    scaled = normalised * E4M3_MAX
    return (scaled if bits is None else _e4m3_grid(scaled, bits)), absmax
  if codec_name == "root":
    return _encode_root(normalised, bits), absmax
  return encode(normalised, True, bits), absmax


def decode_rows(codes, absmax, codec_name: str):
  """The f32 values of blockwise ``codes`` (loaded as f32) with their ``absmax``."""
  if codec_name == "e4m3":
    return codes * (absmax / E4M3_MAX)
  if codec_name == "root":
    return _decode_root(codes) * absmax
  return decode(codes, True) * absmax


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


_CODE_DTYPES = {"dynamic": jnp.uint8, "root": jnp.uint8, "e4m3": jnp.float8_e4m3fn}


def quantize(
    x: jax.Array, *, role: str = SIGNED, fmt: str = "int8", root: jax.Array | None = None,
    key: jax.Array | None = None, stream: int = 1,
) -> Blockwise:
  """The blockwise moment of an array of any shape (its last block may be ragged).

  Args:
    x: the moment's f32 values.
    role: `SIGNED`, `RATIO` or `ROOT` (module docstring).
    fmt: ``"int8"`` or ``"fp8"``.
    root: for `RATIO`, the f32 root of the second moment ``x`` is divided by.
    key: the leaf's random key (`leaf_key`): the codes round stochastically
      with `code_bits` of ``stream``. Without it they round to nearest (a
      one-off conversion does; the optimizer steps pass the key).
    stream: the moment's random stream.
  """
  name = codec(role, fmt)
  if role == RATIO and root is None:
    raise ValueError("a first moment stored as a ratio needs root=, its second moment's root.")
  rows = _block_rows(to_stored(x.astype(jnp.float32), role, root))
  bits = None if key is None else code_bits(key, rows, stream)
  codes, absmax = encode_rows(rows, name, bits)
  return _class(role, fmt)(
      _from_block_rows(codes.astype(_CODE_DTYPES[name]), x), absmax.reshape(absmax.shape[:-1])
  )


def quantize_like(
    x: jax.Array, like: Blockwise, *, root: jax.Array | None = None,
    key: jax.Array | None = None, stream: int = 1,
) -> Blockwise:
  """`quantize` of ``x`` in the role and format of the blockwise moment ``like``."""
  fmt = "fp8" if codec_of(like) == "e4m3" else "int8"
  return quantize(x, role=role_of(like), fmt=fmt, root=root, key=key, stream=stream)


def stored_values(q: Blockwise) -> jax.Array:
  """The f32 values a blockwise moment's codes decode to: in its role (`to_stored`).

  A `RootBlockwise`'s are the roots of its second moment; a
  `RatioBlockwise`'s the ratios.
  """
  check_scales(q)
  rows = _block_rows(q.codes.astype(jnp.float32))
  return _from_block_rows(decode_rows(rows, q.scales[..., None], codec_of(q)), q.codes)


def dequantize(q: Blockwise, *, root: jax.Array | None = None) -> jax.Array:
  """The f32 moment a blockwise moment holds.

  A `RatioBlockwise` needs ``root``, the `stored_values` of its second
  moment's `RootBlockwise`.
  """
  role = role_of(q)
  if role == RATIO and root is None:
    raise ValueError("a first moment stored as a ratio needs root=, its second moment's root.")
  return from_stored(stored_values(q), role, root)


def legacy_second_moment(q: Int8Blockwise | Fp8Blockwise) -> jax.Array:
  """The f32 second moment a blockwise state saved before 2026-11-26 held.

  Until then a second moment was stored as itself: on the unsigned dynamic
  map (``"int8"``) or as e4m3 values (``"fp8"``).
  """
  if codec_of(q) == "e4m3":
    return stored_values(q)
  check_scales(q)
  rows = _block_rows(q.codes.astype(jnp.float32))
  return _from_block_rows(decode(rows, False) * q.scales[..., None], q.codes)


_LEGACY_LAYOUT = "2026-11-25"


def check_scales(q: Blockwise) -> None:
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


def from_row_major_scales(q: Blockwise) -> Blockwise:
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
  """The 256 dynamic map values in code order (ascending), as float32."""
  return np.asarray(jax.jit(decode, static_argnums=1)(jnp.arange(256, dtype=jnp.float32), signed))


def root_map_values() -> np.ndarray:
  """The 256 root map values in code order (ascending), as float32."""
  return np.asarray(jax.jit(_decode_root)(jnp.arange(256, dtype=jnp.float32)))


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


def step_key(seed, step) -> jax.Array:
  """The int32 random key of one step, for every leaf.

  Enough for blockwise codes, whose bits (`code_bits`) hash the values
  rounded: one key for all leaves lets every kernel of a step share one
  scalar operand (per-leaf operands cost XLA temporary memory on a TPU:
  9.8 MiB in GPT-2 small's int8 AdamW step compiled for a v5e).
  """
  key = _fmix32(jnp.asarray(seed).astype(jnp.int32) ^ _times_golden(1))
  return _fmix32(key + jnp.asarray(step).astype(jnp.int32) * _times_golden(1))


def leaf_key(seed, step, leaf: int) -> jax.Array:
  """The int32 random key of one leaf at one step.

  `random_bits` mixes in the stream (params, first moment, ...) and each
  element's index.

  Args:
    seed: the user's seed (an int or int32 value).
    step: the optimizer step (the state's count; may be traced).
    leaf: the leaf's index in the flattened params.
  """
  return _fmix32(step_key(seed, step) + _times_golden(leaf))


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


def code_bits(key, values, stream: int):
  """32 random bits (int32) per element for rounding blockwise codes of f32 ``values``.

  The hash of each value's bit pattern (not of its position, as
  `random_bits` for bf16 rounding): a shard of a leaf draws the bits the
  whole leaf would, however the step is sharded. Over steps the key
  changes, so each element's rounding is unbiased over time; equal values in
  one step round alike.
  """
  return random_bits(key, jax.lax.bitcast_convert_type(values, jnp.int32), stream)


def stochastic_round_bf16(x, bits):
  """``x`` (f32) rounded stochastically to a bfloat16 value (returned as f32).

  Rounds up (away from zero) with probability equal to the fraction of a
  bf16 ulp that truncation drops, using the low 16 of ``bits``; exact on
  bf16 values, NaN stays NaN, and magnitudes past bf16's largest finite
  value may round to infinity, as rounding up must.
  """
  return jnp.where(jnp.isnan(x), x, _round_off_mantissa(x, bits, 16))
