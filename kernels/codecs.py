r"""The 8-bit and 4-bit maps of blockwise state: encoding to codes and decoding them.

Plain ``jnp`` on f32 and int32 values, so the same code runs inside a Pallas
kernel body (Mosaic TPU, Triton, the interpreter) and in the XLA reference.
Which moment is stored on which map, and why, is `pallasopt.kernels.quant`.

The optimizer steps round every code *stochastically* (unbiased): the update
of an exponential average with :math:`\beta_2 = 0.999` moves it by 0.1% a
step, less than half a code, so rounding to nearest freezes it (measured on
scikit-learn's digits: AdamW's final loss 12% off Optax's, Muon's momentum
4.7% off Muon's in f32; stochastic: 0.3%). The random bits hash the value
being rounded with the step's key (`code_bits`, `step_key`): no element
index, so a step sharded any way draws the same bits.

**The maps.** Codes are arithmetic (compares, affine maps, bit fields): no
lookup table, no gather, nothing Mosaic or Triton cannot lower.

* *e3m4* (signed moments and ratios of ``"int8"``): an 8-bit float of the
  value over its block's absmax, a sign and 7 bits, code :math:`\pm c`
  (int8; -128 is never written) with :math:`c = 16 e + f`:

  .. math::

    q(c) = \begin{cases}
      2^{e-7} (1 + f/16) / T & e \ge 1 \\
      2^{-6} (f/16) / T & e = 0 \text{ (subnormal, linear down to 0)}
    \end{cases}
    \qquad T = 31/16,

  so the top code is 1 and the map spans 7 binades of relative steps of
  :math:`2^{-4}` at most, then linear steps of :math:`2^{-10}/T` to 0.
  Encoding is the f32 bit pattern of :math:`T x` cut to 4 mantissa bits
  (random bits added below them round it stochastically), decoding its
  inverse: a few integer operations, no search. It replaced the dynamic
  tree map on 2026-12-07: the same largest updates and digits loss
  (`bench.low_bit`), and (with the codes kept as integers in the kernels)
  the fused int8 AdamW step compiled for a v5e went from 95.9 to 52.1
  cycles per 1024 elements (`bench.schedule`).
* *Dynamic tree* (signed moments and ratios of ``"int8"`` states saved
  before 2026-12-07, uint8 codes: read to convert them): a value is a
  decade ``10^{-z}`` (``z = 0..6``) times a linear fraction in ``(0.1, 1)``,
  with more fraction values in the larger decades. With ``F`` fraction bits in
  decade 0, decade ``z`` holds ``2^{F-z}`` values, the midpoints of
  ``2^{F-z}`` equal steps of ``[0.1, 1]``:

  .. math::

    q_z(f) = 10^{-z}\left(0.1 + 0.9\,\frac{f + 1/2}{2^{F-z}}\right),
    \qquad f = 0, \dots, 2^{F-z} - 1.

  The signed map has ``F = 6``: the 127 values ``±q_z(f)`` each, 0 and 1 (256
  values, bitsandbytes' signed map). A code is the value's rank in the sorted
  map; finding it takes a search over the decades (the cost that retired
  it). (The unsigned map, ``F = 7``, 0 and 1, held second moments before
  2026-11-26; it is kept only to read such states, `legacy_second_moment`.)
* *e4m3* (signed moments and ratios of ``"fp8"``): the float8 e4m3 value of
  ``448 x / s`` (448 is e4m3's largest finite value): 3 mantissa bits and a
  range down to :math:`2^{-9}/448` of the absmax.
* *Root map* (`ROOT`, both formats): an unsigned 8-bit float with 4 exponent
  and 4 mantissa bits and no zero, code ``16 e + f`` the value
  :math:`2^{e-15}(1 + f/16)/T` with :math:`T = 31/16`, so the top code is 1:
  16 binades (a second moment over :math:`2^{-30}` of its block's largest),
  each with 16 steps (a relative step of :math:`2^{-4}` at most).
* *Linear 4-bit map* (signed moments and ratios of ``"int4"``): the 15
  values :math:`k/7`, code :math:`k = -7, \dots, 7` (code -8 is never
  written and reads as -1). Encoding is one product and a floor.
* *Root 4-bit map* (`ROOT` of ``"int4"``): the root map with 2 exponent and
  2 mantissa bits, :math:`2^{e-3}(1 + f/4)/T` with :math:`T = 7/4`: 4
  binades (a second moment down to :math:`2^{-7.6}` of its block's largest,
  a smaller one reads as that) and relative steps of 1/4 at most, codes
  -8 (its least value) to 7. Measured
  against a linear map without zero (Li et al.'s for the second moment) on
  `bench.low_bit`'s spike test: the linear map's relative steps of up to 1
  near its least value let a root decode far below its value, and single
  AdamW updates reached 1.13x Optax's largest (this map: 1.06x).

4-bit codes are stored as ``int4`` arrays of the moment's shape, which XLA
packs two to a byte on TPU and GPU (element ``2k`` in the low half of byte
``k``) and orbax checkpoints (TensorStore has no ``uint4``): a kernel reads
them as any other dtype (Mosaic TPU), or as the bytes of `as_bytes` where it
cannot (Triton), unpacking them with `from_nibbles`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallasopt.kernels.rounding import round_off_mantissa

__all__ = [
    "E4M3_MAX",
    "OUTLIER_RATIO",
    "block_scales",
    "decode",
    "encode",
    "encode_rows",
    "decode_rows",
    "map_values",
    "e3m4_map_values",
    "root_map_values",
    "NIBBLE_CODECS",
    "INTEGER_CODECS",
    "as_bytes",
    "as_nibbles",
    "from_nibbles",
    "to_nibbles",
]

# Decades of the dynamic map: 10^0 .. 10^-6.
_DECADES = 7
_FRACTION_BITS = {True: 6, False: 7}
# The root maps: unsigned floats with no zero, (exponent bits, mantissa bits)
# for the 8-bit ("root", codes 0..255: uint8) and 4-bit ("root4", codes
# -8..7: int4) map.
_ROOT_BITS = {"root": (4, 4), "root4": (2, 2)}
_FIRST_CODE = {"root": 0, "root4": -8}
# The largest finite float8_e4m3fn value: a block's absmax maps to it.
E4M3_MAX = 448.0
# An element more than this many times the next largest magnitude of its
# block is an outlier (`block_scales`). Measured on Optax's f32 state (jax
# 0.10.2, CPU), the largest such gap of any block: AdamW's roots and Lion's
# momenta 27 on `bench.low_bit`'s sparse bursts, 1.06-3.4 on its spike,
# random-sign and vanishing sequences, 1.7-1.8 over 300 steps of digits.
OUTLIER_RATIO = 256.0
# The signed 4-bit map's steps on each side of zero.
_LINEAR4_STEPS = 7
# The maps whose codes are 4 bits (uint4).
NIBBLE_CODECS: tuple[str, ...] = ("linear4", "root4")
# The maps whose codes are integers, which the codecs take and give as int32
# (e4m3's are the scaled f32 values that storing as float8 rounds).
INTEGER_CODECS: tuple[str, ...] = ("e3m4", "root", "root4", "linear4", "dynamic")


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
  ``x`` is never NaN here: `encode_rows` stores a NaN element as 0.
  """
  f_bits = _FRACTION_BITS[signed]
  a = jnp.abs(x) if signed else jnp.maximum(x, 0.0)
  a = jnp.minimum(a, 1.0)
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


def _e4m3_grid(y, bits):
  """``y`` (f32, |y| <= 448) on the e4m3 grid, rounded stochastically with ``bits``.

  Normal e4m3 values keep 3 of f32's 23 mantissa bits: random bits fill the
  20 dropped ones before truncating. Below 2^-6 the grid is 2^-9 apart.
  """
  a = jnp.abs(y)
  normal = round_off_mantissa(a, bits, 20)
  subnormal = _floor_rounded(a * np.float32(2.0**9), bits) * np.float32(2.0**-9)
  rounded = jnp.where(a < np.float32(2.0**-6), subnormal, normal)
  return jnp.where(y < 0, -rounded, rounded)


def _rounded_off(fixed, bits, dropped_bits: int):
  """Nonnegative int32 ``fixed`` with its low ``dropped_bits`` rounded off and shifted out.

  Half their weight added rounds to nearest (ties up); random ``bits`` added
  round stochastically. The carry moves the kept bits (a float's exponent
  too, when ``fixed`` is its bit pattern), as rounding up must.
  """
  dropped = (1 << dropped_bits) - 1
  nudge = (dropped + 1) // 2 if bits is None else bits & dropped
  return jax.lax.shift_right_logical(fixed + nudge, np.int32(dropped_bits))


def _root_map(name: str) -> tuple[float, int, int, int, int]:
  """A root map's top value ``T``, code offset, dropped mantissa bits, first and last code."""
  exponent_bits, mantissa_bits = _ROOT_BITS[name]
  top = 2.0 - 2.0**-mantissa_bits
  first = _FIRST_CODE[name]
  # The first code is the exponent field 127 - (2^E - 1) of an f32 with a
  # zero mantissa, less the offset.
  offset = ((127 - (2**exponent_bits - 1)) << mantissa_bits) - first
  return top, offset, 23 - mantissa_bits, first, first + 2 ** (exponent_bits + mantissa_bits) - 1


def _encode_root(x, bits, name: str = "root"):
  """Root-map codes (int32) of ``x`` in [0, 1]; stochastic with ``bits``.

  The f32 bit pattern of ``T x`` with its mantissa cut to M bits is, past an
  offset, the code: adding half of the dropped bits' weight rounds to
  nearest, adding random bits rounds stochastically, both carrying into
  the exponent as float rounding does. Values below the least code take it.
  """
  top, offset, dropped_bits, first, last = _root_map(name)
  as_int = jax.lax.bitcast_convert_type(x * np.float32(top), jnp.int32)
  return jnp.clip(_rounded_off(as_int, bits, dropped_bits) - offset, first, last)


def _decode_root(codes, name: str = "root"):
  """The root map's values (f32 in (0, 1]) of ``codes`` (int32)."""
  top, offset, dropped_bits, _, _ = _root_map(name)
  pattern = (codes + offset) << dropped_bits
  # A product by 1/T, not a division by T: XLA turns the division by a
  # constant into that product on some backends, not on others.
  return jax.lax.bitcast_convert_type(pattern, jnp.float32) * np.float32(1 / top)


# The e3m4 map (module docstring): the top value T maps to 1; the offset is
# the f32 exponent field of 2^-7 (the binade below the least normal one) in
# code units, 16 codes a binade.
_E3M4_TOP = 31.0 / 16.0
_E3M4_DROPPED_BITS = 23 - 4
_E3M4_OFFSET = (127 - 7) << 4
_E3M4_LAST = 127
_E3M4_LEAST_NORMAL = 2.0**-6
_E3M4_SUBNORMAL_STEP = 2.0**-10


def _encode_e3m4(x, bits):
  """e3m4 codes (int32, -127..127) of ``x`` in [-1, 1]; stochastic with ``bits``.

  ``T |x|`` as a fixed-point number whose 19 low bits are dropped: normal
  values are their f32 bit pattern past the offset (the exponent field
  counts binades in the code), subnormal ones ``T |x| + 2^-6``'s mantissa
  (units of 2^-29, by the f32 add). Random (or half) bits added below the
  kept ones round it stochastically (or to nearest), carrying as float
  rounding does. ``x`` is never NaN here (`encode_rows`).
  """
  a = jnp.abs(x) * np.float32(_E3M4_TOP)
  least_normal = np.float32(_E3M4_LEAST_NORMAL)
  lifted = jax.lax.bitcast_convert_type(a + least_normal, jnp.int32) - _bits_of(least_normal)
  normal = jax.lax.bitcast_convert_type(a, jnp.int32) - (_E3M4_OFFSET << _E3M4_DROPPED_BITS)
  fixed = jnp.where(a < least_normal, lifted, normal)
  magnitude = jnp.minimum(_rounded_off(fixed, bits, _E3M4_DROPPED_BITS), _E3M4_LAST)
  return jnp.where(x < 0, -magnitude, magnitude)


def _decode_e3m4(codes):
  """The e3m4 map's values (f32 in [-1, 1]) of ``codes`` (int32, -128..127; -128 reads as -1)."""
  magnitude = jnp.minimum(jnp.abs(codes), _E3M4_LAST)
  pattern = (magnitude + _E3M4_OFFSET) << _E3M4_DROPPED_BITS
  normal = jax.lax.bitcast_convert_type(pattern, jnp.float32)
  subnormal = magnitude.astype(jnp.float32) * np.float32(_E3M4_SUBNORMAL_STEP)
  value = jnp.where(magnitude >= 16, normal, subnormal) * np.float32(1 / _E3M4_TOP)
  return jnp.where(codes < 0, -value, value)


def _bits_of(value: np.float32) -> np.int32:
  """The bit pattern of an f32 constant, as an int32 constant."""
  return np.asarray(value, np.float32).view(np.int32)


def _as_integer(t):
  """``t`` (f32 holding integers of magnitude below 2^22) as int32, exactly.

  Adding 1.5 * 2^23 puts the integer in the mantissa's low bits: an add and
  a subtract, where a conversion that truncates costs a floor, a ceil and a
  select more on a TPU.
  """
  magic = np.float32(1.5 * 2**23)
  return jax.lax.bitcast_convert_type(t + magic, jnp.int32) - _bits_of(magic)


def _floor_rounded(t, bits):
  """``t`` (f32) rounded to an integer: to nearest (ties up), or stochastically with ``bits``."""
  return jnp.floor(t + (np.float32(0.5) if bits is None else _uniform(bits)))


def _encode_linear4(x, bits):
  """Linear 4-bit codes (int32, -7..7) of ``x`` in [-1, 1]."""
  k = _floor_rounded(x * np.float32(_LINEAR4_STEPS), bits)
  return _as_integer(jnp.clip(k, -_LINEAR4_STEPS, _LINEAR4_STEPS))


def _decode_linear4(codes):
  """The linear 4-bit map's values (f32 in [-1, 1]) of ``codes`` (int32, -8..7)."""
  return jnp.maximum(codes, -_LINEAR4_STEPS).astype(jnp.float32) * np.float32(
      1 / _LINEAR4_STEPS)


def block_scales(y, *, saturate_outliers: bool = True):
  """The scale of each row of ``y`` (f32 ``(rows, BLOCK)``): f32 ``(rows, 1)``.

  A row's largest finite magnitude: inf and NaN elements never enter it, so
  one of them cannot turn a whole block into inf or NaN. With
  ``saturate_outliers``, an element over `OUTLIER_RATIO` times the next
  largest finite magnitude of its row is an outlier, and the scale is that
  next largest: the outlier saturates at the top code and its neighbours keep
  the map's range (a 1e19 gradient would otherwise push every other element
  of the block below the map's least value). A row whose other elements are
  all zero keeps its largest as the scale.
  """
  a = jnp.abs(y)
  a = jnp.where(a < np.float32(np.inf), a, 0.0)
  largest = jnp.max(a, axis=-1, keepdims=True)
  if not saturate_outliers:
    return largest
  second = jnp.max(jnp.where(a < largest, a, 0.0), axis=-1, keepdims=True)
  outlier = (second > 0) & (largest > np.float32(OUTLIER_RATIO) * second)
  return jnp.where(outlier, second, largest)


def encode_rows(y, codec_name: str, bits=None, *, saturate_outliers: bool = True):
  """Blockwise codes of the rows of ``y`` (f32 ``(rows, BLOCK)``): ``(codes, scales)``.

  ``scales`` is f32 ``(rows, 1)`` (`block_scales`), finite whatever ``y``
  holds. ``codes`` is int32 (`INTEGER_CODECS`): -127..127 for ``"e3m4"``,
  0..255 for ``"root"``, -8..7 for ``"linear4"`` and ``"root4"``; for ``"e4m3"`` f32,
  the scaled values, which storing as float8_e4m3fn rounds (or keeps, when
  ``bits`` rounded them).
  ``bits``: int32 random bits per element for stochastic rounding (`code_bits`),
  or None for nearest. A zero block gets scale 0 (and decodes to 0).

  Elements the scale leaves out are stored apart from their block: an
  infinite element or an outlier saturates at the top code of its sign (it
  decodes as the block's scale), a NaN element is stored as 0 (the root
  maps, which have no 0, store their least value).
  """
  scales = block_scales(y, saturate_outliers=saturate_outliers)
  # A zero scale leaves only zeros and non-finite elements, which decode to 0 there.
  x = y / jnp.where(scales > 0, scales, 1.0)
  normalised = jnp.clip(jnp.where(x == x, x, 0.0), -1.0, 1.0)
  if codec_name == "e4m3":
    scaled = normalised * E4M3_MAX
    return (scaled if bits is None else _e4m3_grid(scaled, bits)), scales
  if codec_name in _ROOT_BITS:
    return _encode_root(normalised, bits, codec_name), scales
  if codec_name == "linear4":
    return _encode_linear4(normalised, bits), scales
  if codec_name == "e3m4":
    return _encode_e3m4(normalised, bits), scales
  raise ValueError(f"no encoder for map {codec_name!r}: the dynamic map is read only, to convert.")


def decode_rows(codes, absmax, codec_name: str):
  """The f32 values of blockwise ``codes`` with their ``absmax``.

  ``codes`` as `encode_rows` gives them: int32 for `INTEGER_CODECS`, f32 for
  ``"e4m3"``. ``"dynamic"`` decodes states saved before 2026-12-07 (to
  convert them).
  """
  if codec_name in INTEGER_CODECS:
    codes = codes.astype(jnp.int32)
  if codec_name == "e4m3":
    return codes * (absmax / E4M3_MAX)
  if codec_name in _ROOT_BITS:
    return _decode_root(codes, codec_name) * absmax
  if codec_name == "linear4":
    return _decode_linear4(codes) * absmax
  if codec_name == "e3m4":
    return _decode_e3m4(codes) * absmax
  return decode(codes.astype(jnp.float32), True) * absmax


def map_values(signed: bool) -> np.ndarray:
  """The 256 dynamic map values in code order (ascending), as float32."""
  return np.asarray(jax.jit(decode, static_argnums=1)(jnp.arange(256, dtype=jnp.float32), signed))


def e3m4_map_values() -> np.ndarray:
  """The 255 values of the e3m4 map, codes -127..127 (ascending), as float32."""
  return np.asarray(jax.jit(_decode_e3m4)(jnp.arange(-127, 128, dtype=jnp.int32)))


def root_map_values(name: str = "root") -> np.ndarray:
  """The values of a root map (``"root"``: 256, ``"root4"``: 16) in code order (ascending), as float32."""
  _, _, _, first, last = _root_map(name)
  return np.asarray(jax.jit(_decode_root, static_argnums=1)(
      jnp.arange(first, last + 1, dtype=jnp.int32), name))


def as_bytes(codes: jax.Array) -> jax.Array:
  """int4 ``codes`` (last dim even) as the uint8 bytes holding them, two to a byte.

  Shape ``(..., n)`` becomes ``(..., n // 2)``: byte ``k`` holds element
  ``2k`` in its low half and ``2k + 1`` in its high half (two's complement
  nibbles), as XLA packs them.
  """
  *lead, n = codes.shape
  return jax.lax.bitcast_convert_type(codes.reshape(*lead, n // 2, 2), jnp.uint8)


def as_nibbles(packed: jax.Array) -> jax.Array:
  """The int4 codes `as_bytes` packed."""
  *lead, n = packed.shape
  return jax.lax.bitcast_convert_type(packed, jnp.int4).reshape(*lead, 2 * n)


def from_nibbles(packed):
  """The int32 codes (-8..7) of int32 bytes (0..255) ``(..., n)``: ``(..., 2n)``, low half first.

  Bit operations and an interleave (which Triton lowers as a join).
  """
  low = packed & 15
  high = jax.lax.shift_right_logical(packed, np.int32(4)) & 15
  signed = lambda nibble: jnp.where(nibble >= 8, nibble - 16, nibble)
  *lead, n = packed.shape
  return jnp.stack([signed(low), signed(high)], axis=-1).reshape(*lead, 2 * n)


def to_nibbles(codes):
  """int32 bytes (0..255) of int32 codes (-8..7) ``(..., 2n)``: the inverse of `from_nibbles`."""
  *lead, n = codes.shape
  low, high = jnp.unstack(codes.reshape(*lead, n // 2, 2), axis=-1)
  return (low & 15) | ((high & 15) << 4)
