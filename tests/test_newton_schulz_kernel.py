"""Newton–Schulz: reference = Optax, kernels (interpret) = reference, spectra.

Interpret mode compiles slowly on CPU, so kernel cases are few, small and
jitted; each covers several properties (shape kind, dtype, table, steps).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import assert_close, promised_band, random_array, spread_spectrum
from pallasopt.kernels import newton_schulz as ns
from pallasopt.kernels import ns_coefficients

_SIMPLE = (3.4445, -4.7750, 2.0315)


@functools.partial(jax.jit, static_argnames=("preconditioning", "impl", "regime", "tile", "iter_dtype"))
def _ns(x, table, preconditioning="frobenius", impl="xla", regime="auto", tile=None, iter_dtype=None):
  return ns.newton_schulz(
      x, table, preconditioning=preconditioning, impl=impl, regime=regime, tile=tile,
      iter_dtype=iter_dtype,
  )


@pytest.mark.parametrize(
    "preconditioning,shape,table",
    [("frobenius", (24, 40), "triple"), ("spectral", (40, 24), "dion"),
     ("aol", (2, 3, 8, 12), "triple"), ("schatten", (24, 40), "dion")],
    ids=str,
)
def test_reference_equals_optax(preconditioning, shape, table):
  x = random_array(np.random.default_rng(0), shape, jnp.float32)
  coeffs = jnp.asarray(_SIMPLE if table == "triple" else optax.contrib._muon._DION_NS_COEFFS)
  dims = optax.contrib.MuonDimensionNumbers(-2, -1) if len(shape) > 2 else None
  want = jax.jit(
      lambda x: optax.contrib._muon.orthogonalize_via_newton_schulz(
          x, coeffs, 5, preconditioning, 1e-8, dims
      )
  )(x)
  got = _ns(x, ns_coefficients.coefficient_table(coeffs, 5 if coeffs.ndim == 1 else None), preconditioning)
  assert_close(got, want, 1e-5)


# (shape, preconditioning, table, iter dtype): tall, wide, square, stacked,
# non-multiples of every block, both dtypes, triples and tables, 1-8 steps.
KERNEL_CASES = [
    ((40, 24), "frobenius", ("simple", 5), jnp.float32),
    ((3, 17, 33), "aol", ("aol", 4), jnp.float32),
    ((2, 2, 20, 20), "schatten", ("polar_express", 8), jnp.float32),
    ((24, 40), "spectral", ("quintic", 3), jnp.float32),
    ((5, 24, 64), "frobenius", ("cans", 1), jnp.bfloat16),
    # f32 input iterated in bf16 (f32 accumulation), result stored as f32.
    ((16, 48), "frobenius", ("simple", 5), (jnp.float32, jnp.bfloat16)),
]


def _table(name, steps):
  return jnp.asarray(ns_coefficients.preset_table(name, steps))


def _tolerance(dtype):
  # bf16 iterates are rounded every step; the polynomial amplifies early
  # rounding of small singular values, so bf16 is judged at ~5e-2.
  return 5e-2 if dtype == jnp.bfloat16 else 2e-5


@pytest.mark.parametrize("shape,preconditioning,table,dtype", KERNEL_CASES, ids=str)
def test_resident_kernel_equals_reference(shape, preconditioning, table, dtype):
  dtype, iter_dtype = dtype if isinstance(dtype, tuple) else (dtype, None)
  x = random_array(np.random.default_rng(1), shape, dtype)
  t = _table(*table)
  got = _ns(x, t, preconditioning, impl="interpret", regime="resident", iter_dtype=iter_dtype)
  want = _ns(x, t, preconditioning, iter_dtype=iter_dtype)
  assert got.dtype == x.dtype
  assert_close(got, want, _tolerance(iter_dtype or dtype))


@pytest.mark.parametrize(
    "shape,preconditioning,dtype",
    [((3, 24, 40), "frobenius", jnp.float32), ((40, 33), "aol", jnp.bfloat16)],
    ids=str,
)
def test_tiled_kernel_equals_reference(shape, preconditioning, dtype):
  x = random_array(np.random.default_rng(2), shape, dtype)
  t = _table("quintic", 2)
  got = _ns(x, t, preconditioning, impl="interpret", regime="tiled", tile=16)
  want = _ns(x, t, preconditioning)
  assert_close(got, want, _tolerance(dtype))


@pytest.mark.parametrize(
    "preset,steps,kernel",
    [("simple", 5, True), ("polar_express", 8, False), ("cans", 5, False), ("cubic5", 5, True)],
)
def test_singular_values_lie_in_the_promised_band(preset, steps, kernel):
  g, scaled = spread_spectrum(np.random.default_rng(4), 32, 48)
  table = _table(preset, steps)
  band = promised_band(table, scaled.min(), scaled.max())
  outs = [_ns(g, table)] + ([_ns(g, table, impl="interpret", regime="resident")] if kernel else [])
  for out in outs:
    sv = np.linalg.svd(np.asarray(out, np.float64), compute_uv=False)
    assert band[0] - 1e-3 <= sv.min() and sv.max() <= band[1] + 1e-3, (preset, band, sv)


def test_coefficient_table_rules():
  table = np.arange(6, dtype=np.float32).reshape(2, 3)
  assert np.array_equal(ns_coefficients.coefficient_table(table, 5, "cycle"), table[[0, 1, 0, 1, 0]])
  assert np.array_equal(ns_coefficients.coefficient_table(table, 3, "repeat_last"), table[[0, 1, 1]])
  assert np.array_equal(ns_coefficients.coefficient_table(table), table)
  assert np.array_equal(ns_coefficients.coefficient_table(_SIMPLE, 2), np.asarray([_SIMPLE] * 2, np.float32))
  pe = ns_coefficients.preset_table("polar_express", 10)
  assert np.array_equal(pe[8:], np.asarray([ns_coefficients.PRESETS["polar_express"][-1]] * 2, np.float32))
  assert np.array_equal(ns_coefficients.preset_table("quintic", 10)[5:], ns_coefficients.preset_table("quintic"))
  assert len(ns_coefficients.preset_table("deepseekv4")) == 10


def test_flop_model():
  m, n = 256, 1024
  assert ns.ns_flops(m, n, 5) == 20 * m * m * n + 10 * m**3
  assert ns.ns_flops(n, m, 5, symmetric=True) == 15 * m * m * n + 5 * m**3


def test_regime_choice():
  assert ns.choose_regime(256, 1024, "tpu") == "resident"
  assert ns.choose_regime(4096, 4096, "tpu") == "tiled"
  assert ns.choose_regime(64, 128, "triton") == ns.choose_regime(4096, 4096, "triton") == "wgmma"


@pytest.mark.parametrize(
    "call,error",
    [
        (lambda x, t: ns.newton_schulz(x[0, 0], t), ValueError),
        (lambda x, t: ns.newton_schulz(x, t[:, :2]), ValueError),
        (lambda x, t: ns.newton_schulz(x, t, preconditioning="polar"), ValueError),
        (lambda x, t: ns.newton_schulz(x, t, iter_dtype=jnp.int32), TypeError),
        (lambda x, t: ns.newton_schulz(x, t, impl="interpret", regime="fast"), ValueError),
        (lambda x, t: ns.newton_schulz(x, t, impl="interpret", regime="tiled", tile=24), ValueError),
        # CUDA: no Triton regimes, and wgmma takes bf16 iterates only.
        (lambda x, t: ns.newton_schulz_kernel(x, t, backend="triton", regime="resident"), ValueError),
        (lambda x, t: ns.newton_schulz_kernel(x, t, backend="triton"), TypeError),
        (lambda x, t: ns_coefficients.coefficient_table(_SIMPLE), ValueError),
        (lambda x, t: ns_coefficients.coefficient_table(t, 3, "bounce"), ValueError),
        (lambda x, t: ns_coefficients.preset_table("cubic7"), ValueError),
        (lambda x, t: ns_coefficients.preset_table("cubic5", 6), ValueError),
    ],
)
def test_bad_input(call, error):
  x, t = jnp.ones((4, 8)), jnp.ones((2, 3))
  with pytest.raises(error):
    call(x, t)
