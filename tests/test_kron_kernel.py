"""The Kron kernels equal their references (interpret mode), and the math holds."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from helpers import assert_close
from pallasopt.kernels import kron as kk
from pallasopt.kernels import kron_factor as kf

RTOL = 2e-5


def _jit(fn, **static):
  """``fn`` jitted with its keyword arguments bound: one compile, not op-by-op dispatch."""
  return jax.jit(functools.partial(fn, **static))


def _factor(rng, batch, d, kind, dtype=jnp.float32):
  """A well-conditioned upper-triangular (dense) or positive (diag) factor."""
  if kind == "dense":
    q = np.triu(rng.standard_normal((batch, d, d))) * 0.2 + np.eye(d)
  elif kind == "diag":
    q = 1.0 + 0.3 * np.abs(rng.standard_normal((batch, d)))
  else:  # a 0-d layer's factor
    q = 1.0 + 0.3 * np.abs(rng.standard_normal((batch,)))
  return jnp.asarray(q, dtype)


def _layer(rng, batch, shape, kinds, dtype=jnp.float32):
  g, mu, p = (jnp.asarray(rng.standard_normal((batch, *shape)), dtype) for _ in range(3))
  sizes = shape or (1,)
  qs = [_factor(rng, batch, d, k) for d, k in zip(sizes, kinds)]
  return g, mu, p, qs


# (layer shape, factor kinds, backend): scalars, 1-D, 2-D, 3-D and 1-D with a
# dense factor (min_ndim_triangular=1); both Kronecker merges (all-diag and
# mixed trailing factors); TPU padding on two cases (128-wide blocks are slow
# to interpret).
APPLY, UPDATES, PRECOND = ("apply", True, True), ("updates", False, True), ("precond", True, False)
PRECOND_CASES = [
    ((), ("scalar",), "triton", APPLY),
    ((5,), ("diag",), "triton", UPDATES),
    ((9,), ("dense",), "triton", PRECOND),
    ((6, 7), ("dense", "dense"), "triton", APPLY),
    ((6, 7), ("dense", "dense"), "triton", UPDATES),
    ((6, 7), ("diag", "dense"), "triton", PRECOND),
    ((3, 4, 5), ("dense", "diag", "dense"), "triton", APPLY),
    ((3, 4, 5), ("dense", "diag", "diag"), "triton", UPDATES),
    ((6, 7), ("dense", "diag"), "tpu", APPLY),
    ((5,), ("diag",), "tpu", PRECOND),
]


@pytest.mark.parametrize("shape,kinds,backend,flavour", PRECOND_CASES, ids=str)
def test_precondition_kernel_equals_reference(shape, kinds, backend, flavour):
  mode, momentum, decay = flavour
  rng = np.random.default_rng(len(shape) + len(kinds))
  g, mu, p, qs = _layer(rng, 2, shape, kinds)
  mu = mu if momentum else None
  s = kk.kron_scalars(3, 3e-2, 0.9, 0.1, grad_scale=0.5)
  config = dict(mode=mode, decay=decay)
  want = _jit(kk.kron_precondition_reference, **config)(g, mu, p, qs, s)
  got = _jit(kk.kron_precondition_kernel, **config, backend=backend, interpret=True)(g, mu, p, qs, s)
  for a, b in zip(got, want):
    if b is None:
      assert a is None
      continue
    assert a.dtype == b.dtype and a.shape == b.shape
    assert_close(a, b, RTOL)


def test_precondition_kernel_keeps_bf16_params_and_mu_dtypes():
  rng = np.random.default_rng(3)
  g, mu, p, qs = _layer(rng, 2, (6, 7), ("dense", "dense"), jnp.bfloat16)
  s = kk.kron_scalars(2, 1e-2, 0.9, 0.0)
  want = _jit(kk.kron_precondition_reference, mode="apply")(g, mu, p, qs, s)
  got = _jit(kk.kron_precondition_kernel, mode="apply", backend="triton", interpret=True)(g, mu, p, qs, s)
  for a, b in zip(got, want):
    assert a.dtype == jnp.bfloat16
    assert_close(a, b, 1e-2)


FACTOR_CASES = [
    ("dense", 6, 7, "triton"),
    ("dense", 5, 100, "triton"),  # two column chunks of 64
    ("diag", 7, 30, "triton"),
    ("diag", 1, 1, "triton"),  # a 0-d layer's factor
    ("dense", 6, 7, "tpu"),
]


@pytest.mark.parametrize("kind,d,r,backend", FACTOR_CASES, ids=str)
def test_factor_update_kernel_equals_reference(kind, d, r, backend):
  rng = np.random.default_rng(d * r)
  q = _factor(rng, 2, d, kind)
  x, y = (jnp.asarray(rng.standard_normal((2, d, r)), jnp.float32) for _ in range(2))
  want = jax.jit(kf.kron_factor_update_reference)(q, x, y, 0.1)
  got = _jit(kf.kron_factor_update_kernel, backend=backend, interpret=True)(q, x, y, 0.1)
  assert got.shape == q.shape and got.dtype == q.dtype
  assert_close(got, want, RTOL)


def test_factor_update_keeps_q_upper_triangular():
  rng = np.random.default_rng(0)
  q = _factor(rng, 3, 6, "dense")
  x, y = (jnp.asarray(rng.standard_normal((3, 6, 11)), jnp.float32) for _ in range(2))
  for new in (
      jax.jit(kf.kron_factor_update_reference)(q, x, y, 0.1),
      _jit(kf.kron_factor_update_kernel, backend="triton", interpret=True)(q, x, y, 0.1),
  ):
    new = np.asarray(new)
    assert np.all(np.tril(new, -1) == 0)
    assert not np.allclose(new, np.asarray(q))


def test_preconditioned_gradient_equals_explicit_kronecker_product():
  rng = np.random.default_rng(1)
  shape, kinds = (3, 4, 5), ("dense", "diag", "dense")
  g, _, _, qs = _layer(rng, 1, shape, kinds)
  g = g * 1e-3  # RMS well below the clip
  mats = [np.asarray(q[0]) if q.ndim == 3 else np.diag(np.asarray(q[0])) for q in qs]
  precond = functools.reduce(np.kron, [m.T @ m for m in mats])
  want = (precond @ np.asarray(g[0]).reshape(-1)).reshape(shape)
  s = kk.kron_scalars(1, b1=0.0)
  for got, _ in (
      _jit(kk.kron_precondition_reference, mode="precond")(g, None, None, qs, s),
      _jit(kk.kron_precondition_kernel, mode="precond", backend="triton", interpret=True)(g, None, None, qs, s),
  ):
    assert_close(got[0], want, 1e-5)


def test_rms_clip_caps_each_layer_at_1_1():
  rng = np.random.default_rng(2)
  g, _, _, qs = _layer(rng, 3, (4, 6), ("dense", "dense"))
  g = g * jnp.asarray([[[1e-3]], [[1.0]], [[1e3]]])
  out, _ = _jit(kk.kron_precondition_reference, mode="precond")(g, None, None, qs, kk.kron_scalars(1, b1=0.0))
  rms = np.sqrt(np.mean(np.square(np.asarray(out)), axis=(1, 2)))
  assert rms[0] < 0.1 and rms[2] == pytest.approx(kk.RMS_CLIP, rel=1e-5)


def _psd(rng, d, rank):
  a = rng.standard_normal((d, rank)) * np.exp(rng.uniform(-3, 3, size=(1, rank)))
  b = rng.standard_normal((d, rank))
  return a @ a.T + b @ b.T


_NORM_BOUND = jax.jit(kk.norm_lower_bound)


def _padded_bound(a, size=24):
  """The bound of ``a`` zero-padded to ``size`` (one compile for every size)."""
  padded = np.zeros((size, size), np.float32)
  padded[: a.shape[0], : a.shape[1]] = a
  return float(_NORM_BOUND(jnp.asarray(padded))[0, 0])


@given(d=st.integers(1, 24), rank=st.integers(1, 24), seed=st.integers(0, 2**16))
def test_norm_lower_bound_brackets_the_spectral_norm(d, rank, seed):
  a = _psd(np.random.default_rng(seed), d, rank)
  bound = _padded_bound(a)
  norm = float(np.linalg.norm(a, 2))
  assert bound <= norm * (1 + 1e-5)
  assert bound >= norm / np.sqrt(2) * (1 - 1e-5)


def test_norm_lower_bound_of_zero_is_zero():
  assert _padded_bound(np.zeros((4, 4))) == 0.0


def test_norm_lower_bound_ignores_zero_padding():
  a = _psd(np.random.default_rng(5), 5, 3)
  exact = float(_NORM_BOUND(jnp.asarray(a, jnp.float32))[0, 0])
  assert _padded_bound(a) == pytest.approx(exact, rel=1e-6)


def test_conj_probe_inverts_the_factors():
  rng = np.random.default_rng(4)
  _, _, _, qs = _layer(rng, 1, (4, 5), ("dense", "diag"))
  qs = [q[0] for q in qs]
  v = jnp.asarray(rng.standard_normal((4, 5)), jnp.float32)
  b = kk.conj_probe(v, qs)
  q1, q2 = np.asarray(qs[0]), np.diag(np.asarray(qs[1]))
  assert_close(np.linalg.inv(q1).T @ np.asarray(v) @ np.linalg.inv(q2), b, 1e-5)
  assert_close(kk.apply_factors(v, qs), q1 @ np.asarray(v) @ q2.T, 1e-6)


def _pallas_eqn(fn, *args):
  (eqn,) = [e for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "pallas_call"]
  return eqn


def test_kernels_carry_cost_estimates_and_alias_in_place():
  rng = np.random.default_rng(0)
  g, mu, p, qs = _layer(rng, 2, (16, 16), ("dense", "dense"))
  s = kk.kron_scalars(1, 1e-2)
  eqn = _pallas_eqn(
      lambda g, mu, p: kk.kron_precondition_kernel(g, mu, p, qs, s, mode="apply", decay=True, backend="triton"),
      g, mu, p,
  )
  cost = eqn.params["cost_estimate"]
  assert cost.flops >= 2 * 8 * 16**3 and cost.bytes_accessed >= 5 * 2 * 16 * 16 * 4
  # Inputs: scalars, g, mu, p, ql, qr -> outputs p, mu.
  assert dict(eqn.params["input_output_aliases"]) == {2: 1, 3: 0}
  x = jnp.ones((2, 16, 32))
  eqn = _pallas_eqn(lambda q, x: kf.kron_factor_update_kernel(q, x, x, 0.1, backend="triton"), qs[0], x)
  assert eqn.params["cost_estimate"].flops >= 2 * 4 * 16 * 16 * 32
  assert dict(eqn.params["input_output_aliases"]) == {1: 0}


def test_large_layers_run_the_reference():
  x = jax.ShapeDtypeStruct((1, 300, 300), jnp.float32)
  q = jax.ShapeDtypeStruct((1, 300, 300), jnp.float32)
  jaxpr = jax.make_jaxpr(lambda q, x: kf.kron_factor_update_kernel(q, x, x, 0.1, backend="triton"))(q, x)
  assert "pallas_call" not in str(jaxpr)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda x: kk.kron_precondition_reference(x, None, None, [x[0]], kk.kron_scalars(1), mode="fused"), "mode must be one of"),
        (lambda x: kk.kron_precondition_reference(x, None, None, [x[0]], kk.kron_scalars(1), mode="apply"), "p is required"),
        (lambda x: kf.kron_factor_update_reference(x, x, x, 0.1), "expected q"),
        (lambda x: kk.kron_precondition_reference(x, x, x, [x[0]], kk.kron_scalars(1), mode="apply", precision="fp8"), "precision must be one of"),
    ],
)
def test_bad_kernel_arguments_are_reported(call, match):
  with pytest.raises(ValueError, match=match):
    call(jnp.ones((2, 3)))
