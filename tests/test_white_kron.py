"""White-Kron (quad, skew): the block math, the kernels it runs, and the transforms.

eFormer's numbers are checked in tests/test_factory.py (recorded trajectories);
here: the pieces against their definitions, the preconditioner kernel
(interpreted) against its reference, lowering for TPU and CUDA, and the
transform's contracts (state layout, errors, stacked layers).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import CUSTOM_CALL, assert_trees_close, lowered_text
from pallasopt.kernels import white_kron as wk
from pallasopt.optim import white_kron

F32_EPS = float(np.finfo(np.float32).eps)


def _random(seed, *shape):
  # NumPy's generator: jax.random compiles a program per shape when run eagerly.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def test_power_norm_bound_is_a_lower_bound_close_to_the_norm():
  for seed in range(5):
    a = _random(seed, 12, 12)
    a = a @ a.T  # PSD, as the Gram terms are
    bound = float(wk.power_norm_bound(jax.random.key(seed), a))
    norm = float(jnp.linalg.norm(a, 2))
    # Power iterations from the largest row: a lower bound, within 5% here.
    assert 0.95 * norm <= bound <= norm * (1 + 16 * F32_EPS)


def test_procrustes_step_rotates_towards_symmetry_and_keeps_symmetric_q():
  q = jnp.eye(8) + 0.1 * _random(0, 8, 8)
  rotated = wk.procrustes_step(jax.random.key(1), q)
  asym = lambda x: float(jnp.linalg.norm(x - x.T))
  assert asym(rotated) < asym(q)
  symmetric = (q + q.T) / 2
  np.testing.assert_array_equal(wk.procrustes_step(jax.random.key(1), symmetric), symmetric)


@pytest.mark.parametrize("style", wk.STYLES)
def test_factor_steps_follow_their_formulas(style):
  q = jnp.eye(6) + 0.05 * _random(0, 6, 6)
  q = (q + q.T) / 2
  p = _random(1, 6, 9)
  term1, term2, L, lr = p @ p.T, 1.5, jnp.float32(2.0), 0.7
  new_q, new_L = wk.dense_factor_step(jax.random.key(2), term1, term2, L, q, lr, style)
  ell = float(jnp.linalg.norm(term1, 2)) + term2
  assert float(new_L) == pytest.approx(max(0.95 * 2.0 + 0.05 * ell, ell), rel=1e-2)
  step = term1 - term2 * jnp.eye(6)
  if style == "QUAD":
    z = lr / (2 * new_L)
    want = (jnp.eye(6) - z * step) @ q @ (jnp.eye(6) - z * step)
    np.testing.assert_allclose(new_q, (want + want.T) / 2, rtol=0, atol=64 * F32_EPS)
  else:  # then one rotation towards symmetric, which q - z step q is not
    assert float(jnp.linalg.norm(new_q - new_q.T)) <= float(
        jnp.linalg.norm((q - (lr / new_L) * step @ q) - (q - (lr / new_L) * step @ q).T))
  d = jnp.abs(_random(3, 6)) + 0.5
  t1 = jnp.abs(_random(4, 6))
  new_d, _ = wk.diag_factor_step(t1, 1.0, jnp.float32(0.0), d, lr, style)
  z = lr / ((2 if style == "QUAD" else 1) * (float(jnp.max(t1)) + 1.0))
  gain = 1 - z * (t1 - 1.0)
  np.testing.assert_allclose(new_d, d * (gain**2 if style == "QUAD" else gain), rtol=8 * F32_EPS)


def test_balance_keeps_each_kronecker_product():
  ql, qr = jnp.abs(_random(0, 3, 5)) * 4, jnp.abs(_random(1, 3, 7)) / 4
  bl, br = wk.balance(ql, qr)
  np.testing.assert_allclose(jnp.max(jnp.abs(bl), axis=1), jnp.max(jnp.abs(br), axis=1), rtol=1e-6)
  np.testing.assert_allclose(bl[:, :, None] * br[:, None, :], ql[:, :, None] * qr[:, None, :],
                             rtol=4 * F32_EPS)


@pytest.mark.parametrize("left,right", [("dense", "dense"), ("diag", "dense"), ("dense", "diag"),
                                        ("diag", "diag")])
def test_precondition_kernel_equals_the_products(left, right):
  batch, m, n = 3, 8, 16
  g = _random(0, batch, m, n)
  factor = lambda key, d, kind: (_random(key, batch, d, d) if kind == "dense"
                                 else jnp.abs(_random(key, batch, d)))
  ql, qr = factor(1, m, left), factor(2, n, right)
  gram = lambda q: jnp.swapaxes(q, 1, 2) @ q if q.ndim == 3 else jax.vmap(jnp.diag)(q * q)
  want = gram(ql) @ g @ gram(qr)
  for impl in ("xla", "interpret"):
    got = wk.precondition(g, ql, qr, impl=impl)
    # Four f32 products of length <= 16, O(16 u) relative to the result's scale.
    np.testing.assert_allclose(got, want, rtol=0, atol=64 * F32_EPS * float(jnp.max(jnp.abs(want))))


PARAMS = {"w": jnp.ones((6, 10)), "big": jnp.ones((3, 40)), "v": jnp.ones(5), "s": jnp.ones(()),
          "t": jnp.ones((2, 3, 4))}


@pytest.mark.parametrize("optimizer", [white_kron.quad, white_kron.skew])
def test_state_layout_routes_each_leaf(optimizer):
  tx = optimizer(1e-3, block_size=4, max_size_dense=16, dtype=jnp.float32, impl="xla")
  state, decay, lr = tx.init(PARAMS)
  kinds = {name: st.kind for name, st in zip(sorted(PARAMS), state["large"])}
  assert kinds == {"big": 1, "s": 2, "t": 0, "v": 2, "w": 0}
  # In leaf order: t merges to (6, 4): 2 x 1 blocks of 4; w: 2 x 3 blocks;
  # the partial blocks have padded identities.
  assert state["dense"].Ql.shape == (8, 4, 4) and state["dense"].valid_count == 8
  np.testing.assert_array_equal(state["dense"].valid_rows, [4, 2, 4, 4, 4, 2, 2, 2])
  np.testing.assert_array_equal(state["dense"].valid_cols, [4, 4, 4, 4, 2, 4, 4, 2])
  np.testing.assert_array_equal(state["dense"].Ql[1], jnp.diag(jnp.array([1.0, 1, 0, 0])))
  big = state["large"][0]
  assert (big.diag_left, big.diag_right, big.nr, big.stack) == (False, True, 1, 1)
  assert isinstance(decay, optax.EmptyState | optax.MaskedState | tuple) and lr == optax.EmptyState()


def test_pipeline_axis_size_pads_block_stacks_with_identities():
  tx = white_kron.skew(1e-3, block_size=4, pipeline_axis_size=4, dtype=jnp.float32, impl="xla")
  dense = tx.init({"w": jnp.ones((6, 10))})[0]["dense"]
  assert dense.Ql.shape[0] == 8 and dense.valid_count == 6
  np.testing.assert_array_equal(dense.Ql[6:], jnp.broadcast_to(jnp.eye(4), (2, 4, 4)))


def test_stacked_axes_equal_scanned_layers():
  params = {"w": _random(0, 3, 6, 8), "b": _random(1, 3, 8)}
  grads = jax.tree.map(lambda p: jnp.cos(p), params)
  kw = dict(block_size=4, dtype=jnp.float32, impl="xla")
  stacked = white_kron.quad(1e-2, **kw, stacked_axes=1)
  scanned = white_kron.quad(1e-2, **kw, scanned_layers={"w": True, "b": True})
  got = jax.jit(stacked.update)(grads, stacked.init(params), params)
  want = jax.jit(scanned.update)(grads, scanned.init(params), params)
  assert_trees_close(got, want, rtol=0)


def test_fused_entry_points_equal_the_chain():
  params = {"w": _random(0, 6, 10), "b": _random(1, 10)}
  grads = jax.tree.map(jnp.sin, params)
  tx = white_kron.skew(optax.linear_schedule(1e-2, 1e-3, 10), block_size=4, dtype=jnp.float32,
                       impl="xla")
  constant = white_kron.skew(2e-2, block_size=4, dtype=jnp.float32, impl="xla")

  @jax.jit  # one compilation for the four paths
  def paths(params, grads, state):
    half = jax.tree.map(lambda g: 0.5 * g, grads)
    return (
        tx.update(half, state, params),
        tx.apply_gradients(params, grads, state, grad_scale=0.5),
        tx.scaled_update(grads, state, params, learning_rate=2e-2)[0],
        constant.update(grads, state[:1] + (state[1], optax.EmptyState()), params)[0],
    )

  (updates, want_state), (got, got_state), scaled, unscaled = paths(params, grads, tx.init(params))
  assert_trees_close((got, got_state), (optax.apply_updates(params, updates), want_state), rtol=0)
  assert_trees_close(scaled, unscaled, rtol=0)


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match=r"scale_by_quad: dtype must be bfloat16 or float32"):
    white_kron.quad(dtype=jnp.float16)
  with pytest.warns(UserWarning, match="lr_style='sgd' is neither 'adam' nor None"):
    white_kron.skew(lr_style="sgd")
  with pytest.raises(ValueError, match="set scanned_layers or stacked_axes, not both"):
    white_kron.skew(scanned_layers={"w": True}, stacked_axes=1)
  with pytest.raises(ValueError, match="block_size"):
    white_kron.quad(block_size=0)
  with pytest.raises(ValueError, match=r"style must be one of \('QUAD', 'skew'\)"):
    wk.precondition_blocks(None, None, None, None, None, jnp.ones((1, 2, 2)), None,
                           diag_left=False, diag_right=False, lr=0.1, noise_scale=0.0,
                           style="quad", impl="xla")


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_transform_lowers_with_the_preconditioner_kernel(platform):
  sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  params = {"w": sds(64, 96), "b": sds(96)}
  # The dense blocks (one batch): preconditioning with the old and the new
  # factors. Under "auto" a TPU runs XLA (kernels/white_kron.py `precondition`).
  for impl in ("pallas", "auto"):
    tx = white_kron.quad(1e-3, block_size=32, dtype=jnp.float32, impl=impl)
    state = jax.eval_shape(tx.init, params)
    step = lambda p, g, s: tx.apply_gradients(p, g, s)
    text = lowered_text(step, platform, params, params, state)
    assert text.count(CUSTOM_CALL[platform]) == (2 if impl == "pallas" or platform == "cuda" else 0)


def test_state_of_other_layer_counts_is_rejected_not_misread():
  # A pipeline stage's slice of a stacked leaf has fewer layers than the state
  # was built for; the block stack spans all of them, so this is an error.
  tx = white_kron.skew(1e-3, block_size=4, dtype=jnp.float32, stacked_axes=1, impl="xla")
  state = tx.init({"w": jnp.ones((4, 8, 8))})
  with pytest.raises(ValueError, match=r"grads\['w'\] has shape \(1, 8, 8\), but opt_state was "
                     r"built for 4 layer\(s\) of \(8, 8\).*cannot be split over a pipeline"):
    tx.update({"w": jnp.ones((1, 8, 8))}, state, {"w": jnp.ones((1, 8, 8))})
