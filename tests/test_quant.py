"""The shared low-precision machinery: 8-bit maps, blockwise codes, random bits, rounding."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from hypothesis import given, strategies as st

from pallasopt.kernels import codecs, quant, rounding

_encode = jax.jit(codecs.encode, static_argnums=1)


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
  got = codecs.map_values(signed)
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
  table = codecs.map_values(signed)
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


def _e3m4_by_construction() -> np.ndarray:
  """The e3m4 map built independently, in float64: 0; 2^-6 f/16 (f = 1..15) and
  2^(e-7) (1 + f/16) (e = 1..7, f = 0..15), over T = 31/16; both signs."""
  magnitudes = [2.0**-6 * f / 16 for f in range(1, 16)]
  magnitudes += [2.0 ** (e - 7) * (1 + f / 16) for e in range(1, 8) for f in range(16)]
  positive = np.asarray(magnitudes) / (31 / 16)
  return np.concatenate([-positive[::-1], [0.0], positive])


def test_map_is_the_e3m4_map():
  got = codecs.e3m4_map_values()
  want = _e3m4_by_construction()
  assert got.shape == want.shape == (255,)
  assert np.all(np.diff(got) > 0)  # codes are ranks: strictly ascending
  # Decode builds the value's f32 bits exactly; 1/T rounds once, the product once.
  np.testing.assert_allclose(got, want, rtol=2 * 2**-24, atol=0)
  assert got[-1] == 1.0 and got[0] == -1.0 and got[127] == 0.0
  # 4 mantissa bits: normal neighbours at most 2^-4 apart relative to the smaller.
  normal = got[127 + 16:]
  assert np.max(normal[1:] / normal[:-1]) <= 1 + 2**-4 + 2**-22


def test_e3m4_encode_picks_the_nearest_map_value():
  table = codecs.e3m4_map_values().astype(np.float64)
  rng = np.random.default_rng(0)
  x = np.concatenate([
      rng.uniform(-1, 1, 255 * 200), np.logspace(-12, 0, 255 * 10) * rng.choice([-1, 1], 2550),
      np.zeros(255), np.resize(np.concatenate([table, (table[1:] + table[:-1]) / 2]), 255 * 4),
  ]).astype(np.float32)
  x = x[: x.size // 255 * 255]
  encoded = jax.jit(lambda rows: codecs.encode_rows(rows, "e3m4", saturate_outliers=False))
  codes, absmax = encoded(_rows(x))
  codes = np.asarray(codes)[:, 1:].ravel()
  assert np.all(np.asarray(absmax) == 1) and np.all(codes == np.round(codes))
  assert codes.min() >= -127 and codes.max() <= 127
  got = table[codes.astype(int) + 127]
  # The encoder rounds T |x| in f32 first (2^-24 of x): at a midpoint between
  # two values that may pick the farther one, by that much.
  np.testing.assert_array_less(np.abs(got - x), _nearest_error(x, table) + 2**-23 * np.abs(x)
                               + 1e-12)
  # Map values encode to themselves.
  codes, _ = encoded(_rows(np.resize(table.astype(np.float32), 255 * 2)))
  np.testing.assert_array_equal(np.asarray(codes)[:, 1:].ravel(),
                                np.resize(np.arange(-127, 128), 510))


def _block_absmax(x: np.ndarray) -> np.ndarray:
  """The absmax of each block of `quant.BLOCK` elements of ``x``, row-major, zero-padded."""
  flat = np.pad(x.ravel(), (0, -x.size % quant.BLOCK)).reshape(-1, quant.BLOCK)
  return np.abs(flat).max(axis=1)


@given(
    shape=st.sampled_from([(1,), (7,), (256,), (257,), (3, 300), (2, 3, 128), (5000,)]),
    seed=st.integers(0, 2**16),
    log_scale=st.floats(-8, 4),
)
def test_blockwise_error_is_within_the_map_bound(shape, seed, log_scale):
  # Each element is off by at most half the map gap around x / absmax,
  # times its block's absmax (plus f32 rounding of the product).
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32) * np.float32(10.0**log_scale)
  q = quant.quantize(jnp.asarray(x))
  assert isinstance(q, quant.Int8Blockwise)
  assert q.codes.shape == shape and q.codes.dtype == jnp.int8
  assert q.scales.shape == quant.scales_shape(shape) and q.scales.dtype == jnp.float32
  absmax = _block_absmax(x)
  # Every layout holds the scales in flat block order.
  np.testing.assert_array_equal(np.asarray(q.scales).ravel(), absmax)
  block_absmax = np.repeat(absmax, quant.BLOCK)[: x.size]
  table = codecs.e3m4_map_values()
  normalised = np.where(block_absmax > 0, x.ravel() / np.where(block_absmax > 0, block_absmax, 1), 0)
  # f32 rounding: x / absmax, T x, 1/T and the product by it, the product by absmax.
  bound = _nearest_error(normalised, table) * block_absmax + 5 * 2**-24 * block_absmax
  err = np.abs(np.asarray(quant.dequantize(q)).ravel() - x.ravel())
  np.testing.assert_array_less(err, bound + 1e-30)


def test_scales_shape_keeps_the_moments_dims_with_the_last_counted_in_blocks():
  assert quant.scales_shape((4096, 1024)) == (4096, 4)
  assert quant.scales_shape((8, 3, 1024)) == (8, 3, 4)
  assert quant.scales_shape((1024,)) == (4,)
  assert quant.scales_shape((32, 12, 64)) == (32, 3)  # 12 * 64 = 3 blocks
  assert quant.scales_shape((1024, 128)) == (512,)
  assert quant.scales_shape((50257,)) == (197,)  # ragged last block
  assert quant.scales_shape(()) == (1,)


@pytest.mark.parametrize("shape,spec,sizes,whole", [
    # MaxText's MLP output with the layer axis second, split over its columns.
    ((5632, 2, 2048), P(None, None, "fsdp"), {"fsdp": 8}, True),
    ((4096, 4096), P("fsdp", "tp"), {"fsdp": 2, "tp": 4}, True),
    ((2, 2048, 5632), P(None, "fsdp", None), {"fsdp": 8}, True),
    # Columns cut mid-block (128 per shard): the blocks axis stays whole.
    ((4096, 1024), P(None, "tp"), {"tp": 8}, False),
])
def test_scales_split_under_their_params_spec_where_shards_hold_whole_blocks(
    shape, spec, sizes, whole):
  scales = quant.scales_spec(shape, spec, sizes, exact=False)
  if whole:  # the param's own spec: the convention of trainers that reuse it works
    assert scales == spec
    assert quant.scales_spec(shape, spec, sizes, exact=True) == spec
  else:
    assert scales == P(*spec[:-1], None)
    assert quant.scales_spec(shape, spec, sizes, exact=True) is None


def test_scales_saved_in_the_transposed_layout_convert_or_fail_clearly():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 1024)), jnp.float32)
  q = quant.quantize(x)
  # From 2026-11-25 until 2026-12-07: (blocks per row, rows). Square here, so
  # only the caller can say which layout it holds.
  old = quant.Int8Blockwise(q.codes, jnp.swapaxes(q.scales, -1, -2))
  np.testing.assert_array_equal(quant.from_transposed_scales(old).scales, q.scales)
  wide = quant.Int8Blockwise(jnp.zeros((8, 1024), jnp.int8), jnp.zeros((4, 8)))
  with pytest.raises(ValueError, match=r"\(4, 8\) do not fit codes of shape \(8, 1024\).*legacy_scales=True"):
    quant.dequantize(wide)
  with pytest.raises(ValueError, match=r"expected \(4,\)"):
    quant.from_transposed_scales(quant.Int8Blockwise(jnp.zeros((1024,), jnp.int8), jnp.zeros((5,))))


def test_a_zero_block_has_scale_zero_and_decodes_to_zero():
  q = quant.quantize(jnp.zeros((512,)).at[300].set(1.5))
  np.testing.assert_array_equal(q.scales, [0.0, 1.5])
  np.testing.assert_array_equal(quant.dequantize(q)[:256], 0.0)


def test_block_scales_leave_out_non_finite_elements_and_saturate_outliers():
  row = jnp.asarray(np.linspace(0.01, 2.0, 256), jnp.float32)
  scale = lambda x, **kw: float(codecs.block_scales(x[None], **kw)[0, 0])
  for fault in (jnp.nan, jnp.inf, -jnp.inf):
    assert scale(row.at[7].set(fault)) == 2.0
  # The outlier bound is strict, on the next largest magnitude.
  assert scale(row.at[7].set(-codecs.OUTLIER_RATIO * 2.0)) == codecs.OUTLIER_RATIO * 2.0
  assert scale(row.at[7].set(np.nextafter(np.float32(codecs.OUTLIER_RATIO * 2.0), np.inf))) == 2.0
  assert scale(row.at[7].set(1e30), saturate_outliers=False) == np.float32(1e30)
  # An element with no nonzero neighbour keeps its own scale.
  assert scale(jnp.zeros(256).at[7].set(1e30)) == np.float32(1e30)
  assert scale(jnp.full(256, jnp.nan)) == 0.0


_FAULTS = {"nan": jnp.nan, "inf": jnp.inf, "-inf": -jnp.inf, "outlier": 1e30, "-outlier": -1e30}


@pytest.mark.parametrize("fmt,role,fault", [
    (fmt, role, fault) for fmt in quant.FORMATS for role in quant.ROLES for fault in _FAULTS
    # A second moment is never negative.
    if not (role == quant.ROOT and fault.startswith("-"))
])
def test_a_fault_stays_in_its_element(fmt, role, fault):
  # One non-finite or outlying element of a block: the scales stay finite,
  # the other elements of its block keep the codes and values they have
  # without it (the clean block holds 0 there), and the element itself is
  # stored apart: NaN as 0, inf and an outlier at the top code of its sign
  # (a ratio keeps an outlier as its block's scale: ratios saturate nothing).
  rng = np.random.default_rng(0)
  signs = 1.0 if role == quant.ROOT else rng.choice([-1.0, 1.0], 512)
  clean = jnp.asarray(signs * 10.0 ** rng.uniform(-2, 0, 512), jnp.float32).at[300].set(0.0)
  faulty = clean.at[300].set(_FAULTS[fault])
  root = jnp.ones(512) if role == quant.RATIO else None
  stored = lambda x: quant.quantize(x, role=role, fmt=fmt, root=root)
  q, q_clean = stored(faulty), stored(clean)
  assert np.all(np.isfinite(q.scales)), q.scales
  got, want = np.asarray(quant.stored_values(q)), np.asarray(quant.stored_values(q_clean))
  if role == quant.RATIO and "outlier" in fault:
    assert float(q.scales[1]) == np.float32(1e30)
    return
  others = np.arange(512) != 300
  np.testing.assert_array_equal(got[others], want[others])
  top = float(q.scales[1])
  if fault == "nan":
    # A root map has no 0: its least value stands for it.
    assert got[300] == want[300] and (role == quant.ROOT or got[300] == 0.0)
  else:
    # What the block's scale itself (with the fault's sign) stores: the signed
    # dynamic map's largest negative value is -0.993, not -1.
    stored_top = quant.from_stored(-top if fault.startswith("-") else top, role, 1.0)
    saturated = clean.at[300].set(stored_top)
    assert got[300] == np.asarray(quant.stored_values(stored(saturated)))[300]
    assert abs(got[300]) >= 0.99 * top


def test_random_bits_are_reproducible_and_separate_streams():
  index = jnp.arange(1 << 14)
  key = rounding.leaf_key(7, 3, 5)
  a = rounding.random_bits(key, index, 1)
  np.testing.assert_array_equal(a, rounding.random_bits(rounding.leaf_key(7, 3, 5), index, 1))
  others = [
      rounding.random_bits(key, index, 2),
      rounding.random_bits(rounding.leaf_key(8, 3, 5), index, 1),
      rounding.random_bits(rounding.leaf_key(7, 4, 5), index, 1),
      rounding.random_bits(rounding.leaf_key(7, 3, 6), index, 1),
  ]
  for b in others:
    assert np.mean(np.asarray(a) == np.asarray(b)) < 1e-3
  # Each of the low 16 bits (the ones rounding uses) is 1 half the time:
  # n = 2^14 fair bits have standard deviation 0.5 / sqrt(n); allow 6 of them.
  bits = (np.asarray(a)[:, None] >> np.arange(16)) & 1
  assert np.all(np.abs(bits.mean(axis=0) - 0.5) < 6 * 0.5 / math.sqrt(index.size))
  # And independent of the other streams' bits: each pair differs half the time.
  for b in others:
    differ = ((np.asarray(a) ^ np.asarray(b))[:, None] >> np.arange(16)) & 1
    assert np.all(np.abs(differ.mean(axis=0) - 0.5) < 6 * 0.5 / math.sqrt(index.size))


def test_split_key_round_trips():
  for key in (rounding.leaf_key(0, 0, 0), jnp.int32(-1), jnp.int32(2**31 - 1), jnp.int32(-(2**31))):
    assert int(rounding.join_key(*rounding.split_key(key))) == int(key)


@pytest.mark.parametrize("x", [1.0 + 2**-9 + 2**-12, -3.7e-5, 123.456, 1e-30])
def test_stochastic_rounding_is_unbiased(x):
  # Every rounding lands on one of the two neighbouring bf16 values, so its
  # error e has |e| < ulp and variance <= ulp^2 / 4; the mean of n = 2^16
  # roundings has standard deviation <= ulp / (2 sqrt(n)). Allow 6 of them.
  n = 1 << 16
  xs = jnp.full((n,), x, jnp.float32)
  r = np.asarray(rounding.stochastic_round_bf16(xs, rounding.random_bits(rounding.leaf_key(0, 1, 0), jnp.arange(n))))
  down = float(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16))
  lo, hi = sorted([down, float(np.nextafter(jnp.bfloat16(down), jnp.bfloat16(np.inf * np.sign(x - down or 1))))])
  ulp = hi - lo
  assert set(np.unique(r)) <= {lo, hi} | ({down} if lo == hi else set())
  assert np.all(np.asarray(jnp.asarray(r).astype(jnp.bfloat16).astype(jnp.float32)) == r)
  assert abs(r.astype(np.float64).mean() - np.float64(np.float32(x))) <= 6 * ulp / (2 * math.sqrt(n))


def test_stochastic_rounding_keeps_bf16_values_nan_and_inf():
  x = jnp.asarray([1.0, -2.5, 0.0, -0.0, jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
  bits = jnp.full(x.shape, -1, jnp.int32)  # all ones: the largest nudge
  r = np.asarray(rounding.stochastic_round_bf16(x, bits))
  np.testing.assert_array_equal(r[:6], np.asarray(x)[:6])
  assert np.signbit(r[3]) and np.isnan(r[6])


@given(
    shape=st.sampled_from([(256,), (300,), (3, 300), (5000,)]),
    seed=st.integers(0, 2**16),
    log_scale=st.floats(-8, 4),
)
def test_fp8_blockwise_error_is_within_e4m3_rounding(shape, seed, log_scale):
  # y = 448 x / absmax rounds to e4m3: within half an ulp, 2^-4 |y| for
  # normal values and 2^-10 (half the subnormal step) below 2^-6; back in x,
  # times absmax / 448, plus f32 rounding of the two products.
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32) * np.float32(10.0**log_scale)
  q = quant.quantize(jnp.asarray(x), fmt="fp8")
  assert isinstance(q, quant.Fp8Blockwise) and q.codes.dtype == jnp.float8_e4m3fn
  absmax = np.repeat(_block_absmax(x), quant.BLOCK)[: x.size]
  bound = np.maximum(2**-4 * np.abs(x.ravel()), 2**-10 * absmax / 448) + 2**-22 * absmax
  err = np.abs(np.asarray(quant.dequantize(q)).ravel() - x.ravel())
  np.testing.assert_array_less(err, bound + 1e-30)


# ---- The second moment's root, the ratio, and stochastic codes. ----

_LEAST_ROOT = 2.0**-15 / (31 / 16)  # the root map's least value


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_code_dtype_is_the_dtype_quantize_stores(fmt):
  x = jnp.linspace(0.1, 2.0, 512).reshape(2, 256)
  for role in quant.ROLES:
    root = jnp.sqrt(x) if role == quant.RATIO else None
    q = quant.quantize(x, role=role, fmt=fmt, root=root)
    assert q.codes.dtype == quant.code_dtype(role, fmt), (role, fmt)
  with pytest.raises(ValueError, match="fmt must be one of"):
    quant.code_dtype(quant.SIGNED, "int2")


def test_root_map_is_a_zero_free_unsigned_4_4_float():
  got = codecs.root_map_values()
  want = np.sort([np.float32(2.0 ** (e - 15) * (1 + f / 16)) * np.float32(16 / 31)
                  for e in range(16) for f in range(16)]).astype(np.float32)
  np.testing.assert_array_equal(got, want)
  assert np.all(np.diff(got) > 0) and got[0] > 0 and abs(got[-1] - 1.0) <= 2**-24
  # 4 mantissa bits: neighbours are at most 2^-4 apart relative to the smaller.
  assert np.max(got[1:] / got[:-1]) <= 1 + 2**-4


def test_the_4_bit_maps():
  # Signed (int4's moments and ratios): k / 7 at codes k = -7..7 (code -8 is
  # never written). Root: the 2 + 2 bit float without zero, codes -8..7.
  codes = jnp.arange(-8, 8, dtype=jnp.float32)[None]
  linear = np.asarray(codecs.decode_rows(codes, jnp.ones((1, 1)), "linear4"))[0]
  np.testing.assert_array_equal(linear[1:], (np.arange(-7, 8) * np.float32(1 / 7)).astype(np.float32))
  assert linear[0] == -1.0
  root = codecs.root_map_values("root4")
  want = np.sort([np.float32(2.0 ** (e - 3) * (1 + f / 4)) * np.float32(4 / 7)
                  for e in range(4) for f in range(4)]).astype(np.float32)
  np.testing.assert_array_equal(root, want)
  assert np.all(np.diff(root) > 0) and root[0] > 0 and abs(root[-1] - 1.0) <= 2**-24
  assert np.max(root[1:] / root[:-1]) <= 1 + 2**-2


def test_nibbles_pack_as_xla_stores_uint4():
  # Byte k holds element 2k in its low half: the Triton kernels' view of uint4 codes.
  codes = np.random.default_rng(0).integers(-8, 8, (3, 512)).astype(np.int32)
  packed = codecs.to_nibbles(jnp.asarray(codes))
  np.testing.assert_array_equal(
      np.asarray(packed), np.asarray(codecs.as_bytes(jnp.asarray(codes, jnp.int4)), np.int32))
  np.testing.assert_array_equal(np.asarray(codecs.from_nibbles(packed)), codes)
  back = codecs.as_nibbles(packed.astype(jnp.uint8))
  assert back.dtype == jnp.int4
  np.testing.assert_array_equal(np.asarray(back, np.float32), codes)


def _rows(x: np.ndarray) -> jax.Array:
  """One block per row: x's values after a leading absmax of 1 (so x / absmax is x)."""
  x = np.asarray(x, np.float32).reshape(-1, quant.BLOCK - 1)
  return jnp.asarray(np.concatenate([np.ones((x.shape[0], 1), np.float32), x], axis=1))


@pytest.mark.parametrize("name", ["root", "root4"])
def test_root_encode_picks_the_nearest_value_and_floors_at_the_least(name):
  table = codecs.root_map_values(name).astype(np.float64)
  rng = np.random.default_rng(0)
  x = np.concatenate([
      rng.uniform(0, 1, 255 * 200), np.logspace(-12, 0, 255 * 20), np.zeros(255),
      np.resize(np.concatenate([table, (table[1:] + table[:-1]) / 2]), 255 * 4),
  ]).astype(np.float32)
  x = x[: x.size // 255 * 255]
  # The map itself, under a scale of 1: no outlier saturates.
  encoded = jax.jit(lambda rows: codecs.encode_rows(rows, name, saturate_outliers=False))
  codes, absmax = encoded(_rows(x))
  codes = np.asarray(codes)[:, 1:].ravel()
  first = -8 if name == "root4" else 0
  assert np.all(np.asarray(absmax) == 1) and codes.min() >= first
  assert codes.max() < first + table.size
  got = table[codes.astype(int) - first]
  # The encoder rounds T x in f32 first (2^-24 of x): at a midpoint between
  # two values that may pick the farther one, by that much.
  np.testing.assert_array_less(np.abs(got - x), _nearest_error(np.maximum(x, table[0]), table)
                               + np.maximum(table[0] - x, 0) + 2**-23 * x + 1e-12)
  assert np.all(got[x < table[0]] == table[0])  # never below: no zero code


@pytest.mark.parametrize("codec,values", [
    ("e3m4", [0.5 + 1 / 300, -3.1e-3, 2e-4, -0.99]),
    ("e4m3", [0.5 + 1 / 300, -3.1e-3, 7e-6, 0.9]),
    ("root", [0.5 + 1 / 300, 3.1e-3, 4e-5, 0.97]),
    ("linear4", [0.5 + 1 / 300, -3.1e-2, 0.2, -0.99]),
    ("root4", [0.5 + 1 / 300, 0.09, 0.2, 0.97]),
])
def test_stochastic_codes_are_unbiased_and_land_next_to_the_value(codec, values):
  # n keys: each rounding lands on one of the two codes around x, so the
  # error has |e| < gap and variance <= gap^2 / 4; the mean of n draws has
  # standard deviation <= gap / (2 sqrt(n)). Allow 6 of them.
  n = 4096
  x = np.repeat(np.asarray(values, np.float32), 255 // len(values) + 1)[:255]
  # As stored: e4m3 codes are f32 values that storing as float8 rounds (or keeps).
  stored = lambda c: c.astype(jnp.float8_e4m3fn).astype(jnp.float32) if codec == "e4m3" else c

  @jax.jit  # one compile, not one per op
  def encode_and_decode(rows):
    keys = rounding.leaf_key(3, jnp.arange(n), 1)[:, None]
    bits = rounding.code_bits(jnp.broadcast_to(keys, rows.shape), rows, 1)
    codes, absmax = codecs.encode_rows(rows, codec, bits)
    nearest_codes, nearest_absmax = codecs.encode_rows(rows[:1], codec)
    return (codes, stored(codes), codecs.decode_rows(codes, absmax, codec),
            codecs.decode_rows(stored(nearest_codes), nearest_absmax, codec))

  codes, stored_codes, got, nearest = encode_and_decode(_rows(np.tile(x, n)))
  np.testing.assert_array_equal(stored_codes, codes)  # stochastic codes are on the grid
  got = np.asarray(got)[:, 1:].astype(np.float64)
  nearest = np.asarray(nearest)[0, 1:]
  for value in values:
    column = got[:, np.flatnonzero(x == np.float32(value))].ravel()
    neighbours = np.unique(column)
    assert len(neighbours) <= 2 and np.float32(value) >= neighbours.min() - 1e-12
    assert np.float32(value) <= neighbours.max() + 1e-12
    gap = neighbours.max() - neighbours.min()
    assert abs(column.mean() - np.float32(value)) <= 6 * gap / (2 * np.sqrt(n)) + 1e-7 * abs(value)
    assert np.isin(nearest[x == np.float32(value)], neighbours).all()


def test_the_second_moment_never_decodes_below_its_value_out_of_range_or_to_zero():
  # v spans 36 decades in a block: its root spans 18, the map 4.8 below the
  # absmax; below that the root decodes to the least value, never to zero.
  v = np.concatenate([np.logspace(0, -36, 255), [0.0]]).astype(np.float32)
  q = quant.quantize(jnp.asarray(v), role=quant.ROOT)
  assert isinstance(q, quant.RootBlockwise) and q.root_codes.dtype == jnp.uint8
  got = np.asarray(quant.dequantize(q), np.float64)
  w = np.sqrt(v.astype(np.float64))
  in_range = w >= _LEAST_ROOT
  # Nearest: within half a step (2^-5 of the root, plus f32 rounding), squared.
  error = np.abs(np.sqrt(got) - w)[in_range]
  np.testing.assert_array_less(error, (2**-5 + 1e-6) * w[in_range])
  assert np.all(got > 0)
  np.testing.assert_allclose(got[~in_range], _LEAST_ROOT**2, rtol=1e-6)


@given(
    seed=st.integers(0, 2**16), log_scale=st.floats(-20, 4), fmt=st.sampled_from(["int8", "fp8"])
)
def test_a_ratio_decodes_with_its_roots(seed, log_scale, fmt):
  # m is stored as r = m / w and decoded as r' w' (w' the decoded root): with
  # every code to nearest, r' is within the map's half gap of r (times the
  # block's absmax of r), so |r' w' - m| <= |r' - r| w' + |r| |w' - w|.
  rng = np.random.default_rng(seed)
  shape = (3, 512)
  v = (rng.standard_normal(shape) ** 2 * 10.0 ** (2 * log_scale)).astype(np.float32)
  m = (rng.uniform(-1, 1, shape) * np.sqrt(v)).astype(np.float32)
  w = jnp.sqrt(jnp.asarray(v))
  root = quant.quantize(jnp.asarray(v), role=quant.ROOT, fmt=fmt)
  ratio = quant.quantize(jnp.asarray(m), role=quant.RATIO, fmt=fmt, root=w)
  assert isinstance(ratio, quant.RatioBlockwise if fmt == "fp8" else quant.Int8RatioBlockwise)
  assert ratio.codes.dtype == (jnp.float8_e4m3fn if fmt == "fp8" else jnp.int8)
  w_dec = np.asarray(quant.stored_values(root), np.float64)
  got = np.asarray(quant.dequantize(ratio, root=jnp.asarray(w_dec, jnp.float32)), np.float64)
  r = m / np.asarray(w)
  r_dec = np.asarray(quant.stored_values(ratio), np.float64)
  r_absmax = np.abs(r).reshape(3, 2, 256).max(-1).repeat(256).reshape(shape)
  # e3m4: half a step, 2^-5 of the value (normal) or 2^-11 / T of the absmax (subnormal).
  half_gap = np.maximum(2**-5 * np.abs(r), 2**-11 * 16 / 31 * r_absmax) if fmt == "int8" else (
      np.maximum(2**-4 * np.abs(r), 2**-10 * r_absmax / 448))
  assert np.all(np.abs(r_dec - r) <= half_gap + 2**-21 * r_absmax)
  bound = np.abs(r_dec - r) * w_dec + np.abs(r) * np.abs(w_dec - np.asarray(w)) + 2**-21 * np.abs(m)
  np.testing.assert_array_less(np.abs(got - m), bound + 1e-30)
  with pytest.raises(ValueError, match="root="):
    quant.dequantize(ratio)


def test_legacy_second_moment_reads_the_old_maps():
  codes = jnp.arange(256, dtype=jnp.uint8)
  scales = jnp.asarray([2.0], jnp.float32)
  got = quant.legacy_second_moment(quant.DynamicInt8Blockwise(codes, scales))
  # (Eager and jitted decodes round the map values apart, see the map test.)
  np.testing.assert_allclose(got, codecs.map_values(False) * np.float32(2.0), rtol=60 * 2**-24)
  assert float(got[0]) == 0.0  # the zero code the root map no longer has
  fp8 = jnp.asarray(np.linspace(0, 448, 256), jnp.float8_e4m3fn)
  np.testing.assert_allclose(
      quant.legacy_second_moment(quant.Fp8Blockwise(fp8, scales)),
      np.asarray(fp8, np.float32) * (np.float32(2.0) / np.float32(448)), rtol=2**-22)


def test_code_bits_hash_the_value_not_its_position():
  values = jnp.asarray(np.random.default_rng(0).standard_normal(4096), jnp.float32)
  key = rounding.leaf_key(7, 3, 5)
  bits = np.asarray(rounding.code_bits(key, values, 2))
  order = np.random.default_rng(1).permutation(4096)
  np.testing.assert_array_equal(np.asarray(rounding.code_bits(key, values[order], 2)), bits[order])
  others = (rounding.code_bits(key, values, 3), rounding.code_bits(rounding.leaf_key(7, 4, 5), values, 2))
  for other in others:
    assert np.mean(np.asarray(other) == bits) < 1e-2
