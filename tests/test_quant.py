"""The shared low-precision machinery: 8-bit maps, blockwise codes, random bits, rounding."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from pallasopt.kernels import quant

_encode = jax.jit(quant.encode, static_argnums=1)


def _tree_map_by_construction(signed: bool) -> np.ndarray:
  """The dynamic tree map built independently, in float64, as the paper describes it.

  Decade 10^-z (z = 0..6) holds the midpoints of 2^(F-z) equal steps of
  [0.1, 1] (F = 6 signed, 7 unsigned), with both signs when signed; add 0 and 1.
  """
  f_bits = 6 if signed else 7
  values = [0.0, 1.0]
  for z in range(7):
    edges = np.linspace(0.1, 1.0, 2 ** (f_bits - z) + 1)
    mids = 10.0**-z * (edges[:-1] + edges[1:]) / 2
    values += list(mids) + ([*(-mids)] if signed else [])
  return np.sort(np.asarray(values))


@pytest.mark.parametrize("signed", [True, False])
def test_map_is_the_dynamic_tree_map(signed):
  got = quant.map_values(signed)
  want = _tree_map_by_construction(signed)
  assert got.shape == want.shape == (256,)
  assert np.all(np.diff(got) > 0)  # codes are ranks: strictly ascending
  # decode evaluates 10^-z (0.9 (j + 1/2) / 2^(F-z) - 0.8) in f32: the bracket
  # (>= 0.1) carries <= ~5.4 * 2^-24 absolute error from rounding 0.9, 0.8,
  # the product and the difference, so <= 54 * 2^-24 relative, and 10^-z
  # and the last product add 2 * 2^-24.
  np.testing.assert_allclose(got, want, rtol=60 * 2**-24, atol=0)
  assert got[-1] == 1.0 and 0.0 in got
  if not signed:
    assert got[0] == 0.0


def _nearest_error(x: np.ndarray, table: np.ndarray) -> np.ndarray:
  x = np.asarray(x, np.float64)
  idx = np.clip(np.searchsorted(table, x), 1, len(table) - 1)
  lo, hi = table[idx - 1].astype(np.float64), table[idx].astype(np.float64)
  return np.minimum(np.abs(x - lo), np.abs(x - hi))


@pytest.mark.parametrize("signed", [True, False])
def test_encode_picks_the_nearest_map_value(signed):
  table = quant.map_values(signed)
  rng = np.random.default_rng(0)
  low = -1.0 if signed else 0.0
  x = np.concatenate([
      rng.uniform(low, 1.0, 100_000),
      table, (table[1:] + table[:-1]) / 2,           # map values and midpoints
      np.nextafter(table, 2.0), np.nextafter(table, -2.0),
      np.logspace(-10, 0, 5_000) * (rng.choice([-1, 1], 5_000) if signed else 1),
  ]).astype(np.float32)
  x = np.clip(x, low, 1.0)
  codes = np.asarray(_encode(jnp.asarray(x), signed))
  assert codes.min() >= 0 and codes.max() <= 255 and np.all(codes == np.round(codes))
  err = np.abs(table[codes.astype(int)].astype(np.float64) - x)
  np.testing.assert_array_less(err, _nearest_error(x, table) + 1e-12)
  # Map values encode to themselves.
  np.testing.assert_array_equal(np.asarray(_encode(jnp.asarray(table), signed)), np.arange(256))


def _block_absmax(x: np.ndarray) -> np.ndarray:
  """The absmax of each block of `quant.BLOCK` elements of ``x``, row-major, zero-padded."""
  flat = np.pad(x.ravel(), (0, -x.size % quant.BLOCK)).reshape(-1, quant.BLOCK)
  return np.abs(flat).max(axis=1)


@given(
    shape=st.sampled_from([(1,), (7,), (256,), (257,), (3, 300), (2, 3, 128), (5000,)]),
    signed=st.booleans(),
    seed=st.integers(0, 2**16),
    log_scale=st.floats(-8, 4),
)
def test_blockwise_error_is_within_the_map_bound(shape, signed, seed, log_scale):
  # Each element is off by at most half the map gap around x / absmax,
  # times its block's absmax (plus f32 rounding of the product).
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32) * np.float32(10.0**log_scale)
  if not signed:
    x = np.abs(x)
  q = quant.quantize(jnp.asarray(x), signed=signed)
  assert q.codes.shape == shape and q.codes.dtype == jnp.uint8
  assert q.scales.shape == quant.scales_shape(shape) and q.scales.dtype == jnp.float32
  absmax = _block_absmax(x)
  scales = np.asarray(q.scales)
  if quant.rows_hold_blocks(shape):  # (..., blocks per row, rows): back to flat block order
    scales = np.swapaxes(scales, -1, -2)
  np.testing.assert_array_equal(scales.ravel(), absmax)
  block_absmax = np.repeat(absmax, quant.BLOCK)[: x.size]
  table = quant.map_values(signed)
  normalised = np.where(block_absmax > 0, x.ravel() / np.where(block_absmax > 0, block_absmax, 1), 0)
  bound = _nearest_error(normalised, table) * block_absmax + 2**-23 * block_absmax
  err = np.abs(np.asarray(quant.dequantize(q, signed=signed)).ravel() - x.ravel())
  np.testing.assert_array_less(err, bound + 1e-30)


def test_scales_shape_puts_rows_of_whole_blocks_last_and_keeps_the_leading_dims():
  assert quant.scales_shape((4096, 1024)) == (4, 4096)
  assert quant.scales_shape((8, 3, 1024)) == (8, 4, 3)
  assert quant.scales_shape((1024,)) == (4,)
  assert quant.scales_shape((32, 12, 64)) == (32, 3)  # 12 * 64 = 3 blocks
  assert quant.scales_shape((1024, 128)) == (512,)
  assert quant.scales_shape((50257,)) == (197,)  # ragged last block
  assert quant.scales_shape(()) == (1,)


def test_scales_saved_in_the_old_layout_convert_or_fail_clearly():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 1024)), jnp.float32)
  q = quant.quantize(x, signed=True)
  # Before 2026-11-25: (rows, blocks per row). Square here, so only the
  # caller can say which layout it holds.
  old = quant.Int8Blockwise(q.codes, jnp.swapaxes(q.scales, -1, -2))
  np.testing.assert_array_equal(quant.from_row_major_scales(old).scales, q.scales)
  wide = quant.Int8Blockwise(jnp.zeros((8, 1024), jnp.uint8), jnp.zeros((8, 4)))
  with pytest.raises(ValueError, match=r"\(8, 4\) do not fit codes of shape \(8, 1024\).*legacy_scales=True"):
    quant.dequantize(wide, signed=True)
  with pytest.raises(ValueError, match=r"expected \(4,\)"):
    quant.from_row_major_scales(quant.Int8Blockwise(jnp.zeros((1024,), jnp.uint8), jnp.zeros((5,))))


def test_zero_and_nan_blocks():
  x = jnp.zeros((512,)).at[300].set(jnp.nan)
  q = quant.quantize(x, signed=True)
  assert float(q.scales[0]) == 0.0 and np.isnan(float(q.scales[1]))
  back = quant.dequantize(q, signed=True)
  assert np.all(np.asarray(back[:256]) == 0) and np.all(np.isnan(np.asarray(back[256:])))


def test_random_bits_are_reproducible_and_separate_streams():
  index = jnp.arange(1 << 14)
  key = quant.leaf_key(7, 3, 5)
  a = quant.random_bits(key, index, 1)
  np.testing.assert_array_equal(a, quant.random_bits(quant.leaf_key(7, 3, 5), index, 1))
  others = [
      quant.random_bits(key, index, 2),
      quant.random_bits(quant.leaf_key(8, 3, 5), index, 1),
      quant.random_bits(quant.leaf_key(7, 4, 5), index, 1),
      quant.random_bits(quant.leaf_key(7, 3, 6), index, 1),
  ]
  for b in others:
    assert np.mean(np.asarray(a) == np.asarray(b)) < 1e-3
  # Each of the low 16 bits (the ones rounding uses) is 1 half the time:
  # n = 2^14 fair bits have standard deviation 0.5 / sqrt(n); allow 6 of them.
  bits = (np.asarray(a)[:, None] >> np.arange(16)) & 1
  assert np.all(np.abs(bits.mean(axis=0) - 0.5) < 6 * 0.5 / math.sqrt(index.size))


def test_split_key_round_trips():
  for key in (quant.leaf_key(0, 0, 0), jnp.int32(-1), jnp.int32(2**31 - 1), jnp.int32(-(2**31))):
    assert int(quant.join_key(*quant.split_key(key))) == int(key)


@pytest.mark.parametrize("x", [1.0 + 2**-9 + 2**-12, -3.7e-5, 123.456, 1e-30])
def test_stochastic_rounding_is_unbiased(x):
  # Every rounding lands on one of the two neighbouring bf16 values, so its
  # error e has |e| < ulp and variance <= ulp^2 / 4; the mean of n = 2^16
  # roundings has standard deviation <= ulp / (2 sqrt(n)). Allow 6 of them.
  n = 1 << 16
  xs = jnp.full((n,), x, jnp.float32)
  r = np.asarray(quant.stochastic_round_bf16(xs, quant.random_bits(quant.leaf_key(0, 1, 0), jnp.arange(n))))
  down = float(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16))
  lo, hi = sorted([down, float(np.nextafter(jnp.bfloat16(down), jnp.bfloat16(np.inf * np.sign(x - down or 1))))])
  ulp = hi - lo
  assert set(np.unique(r)) <= {lo, hi} | ({down} if lo == hi else set())
  assert np.all(np.asarray(jnp.asarray(r).astype(jnp.bfloat16).astype(jnp.float32)) == r)
  assert abs(r.astype(np.float64).mean() - np.float64(np.float32(x))) <= 6 * ulp / (2 * math.sqrt(n))


def test_stochastic_rounding_keeps_bf16_values_nan_and_inf():
  x = jnp.asarray([1.0, -2.5, 0.0, -0.0, jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
  bits = jnp.full(x.shape, -1, jnp.int32)  # all ones: the largest nudge
  r = np.asarray(quant.stochastic_round_bf16(x, bits))
  np.testing.assert_array_equal(r[:6], np.asarray(x)[:6])
  assert np.signbit(r[3]) and np.isnan(r[6])


@given(
    shape=st.sampled_from([(256,), (300,), (3, 300), (5000,)]),
    signed=st.booleans(),
    seed=st.integers(0, 2**16),
    log_scale=st.floats(-8, 4),
)
def test_fp8_blockwise_error_is_within_e4m3_rounding(shape, signed, seed, log_scale):
  # y = 448 x / absmax rounds to e4m3: within half an ulp, 2^-4 |y| for
  # normal values and 2^-10 (half the subnormal step) below 2^-6; back in x,
  # times absmax / 448, plus f32 rounding of the two products.
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32) * np.float32(10.0**log_scale)
  if not signed:
    x = np.abs(x)
  q = quant.quantize(jnp.asarray(x), signed=signed, fmt="fp8")
  assert isinstance(q, quant.Fp8Blockwise) and q.codes.dtype == jnp.float8_e4m3fn
  absmax = np.repeat(_block_absmax(x), quant.BLOCK)[: x.size]
  bound = np.maximum(2**-4 * np.abs(x.ravel()), 2**-10 * absmax / 448) + 2**-22 * absmax
  err = np.abs(np.asarray(quant.dequantize(q, signed=signed)).ravel() - x.ravel())
  np.testing.assert_array_less(err, bound + 1e-30)
