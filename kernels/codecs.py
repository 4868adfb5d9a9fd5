r"""The 8-bit maps of blockwise state: encoding to codes and decoding them.

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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallasopt.kernels.rounding import round_off_mantissa

__all__ = [
    "E4M3_MAX",
    "decode",
    "encode",
    "encode_rows",
    "decode_rows",
    "map_values",
    "root_map_values",
]

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
# The largest finite float8_e4m3fn value: a block's absmax maps to it.
E4M3_MAX = 448.0


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


def _e4m3_grid(y, bits):
  """``y`` (f32, |y| <= 448) on the e4m3 grid, rounded stochastically with ``bits``.

  Normal e4m3 values keep 3 of f32's 23 mantissa bits: random bits fill the
  20 dropped ones before truncating. Below 2^-6 the grid is 2^-9 apart.
  """
  a = jnp.abs(y)
  normal = round_off_mantissa(a, bits, 20)
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


def map_values(signed: bool) -> np.ndarray:
  """The 256 dynamic map values in code order (ascending), as float32."""
  return np.asarray(jax.jit(decode, static_argnums=1)(jnp.arange(256, dtype=jnp.float32), signed))


def root_map_values() -> np.ndarray:
  """The 256 root map values in code order (ascending), as float32."""
  return np.asarray(jax.jit(_decode_root)(jnp.arange(256, dtype=jnp.float32)))
