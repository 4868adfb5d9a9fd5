"""pallasopt.optim.adafactor is a drop-in for optax.adafactor."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, strategies as st

import pallasopt
from helpers import (
    FLOAT_DTYPES,
    assert_trees_close,
    run_optax_f32_math,
    run_steps,
    step_grads,
    tolerance,
    tree_of,
)
from pallasopt.kernels import use_impl
from pallasopt.optim.adafactor import ADAFACTOR_STATIC_ARGS, adafactor
from test_adafactor_kernel import MIN_DIMS, SHAPES

_run = functools.partial(run_steps, apply_gradients=pallasopt.optim.apply_gradients)


def _params(seed=0):
  """A factored matrix, a ragged vector and a stacked leaf (factored over its last two axes)."""
  rng = np.random.default_rng(seed)
  leaf = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  return {"dense": {"w": leaf(37, 20), "b": leaf(7)}, "stack": leaf(3, 9, 12)}


_xla = functools.partial(adafactor, impl="xla")


def _jitted(tx):
  """`tx` with jitted update (and apply): one compile per run instead of one per op."""
  if isinstance(tx, pallasopt.optim.FusedGradientTransformation):
    return pallasopt.optim.FusedGradientTransformation(
        tx.init, jax.jit(tx.update), jax.jit(tx.apply_gradients))
  return optax.GradientTransformation(tx.init, jax.jit(tx.update))


def _ema(state):
  return next(link for link in state if isinstance(link, optax.EmaState)).ema


@given(
    leaf_shapes=st.lists(SHAPES, min_size=1, max_size=2),
    dtype=st.sampled_from(FLOAT_DTYPES),
    learning_rate=st.one_of(st.none(), st.floats(1e-3, 0.3)),
    min_dim=MIN_DIMS,
    decay_rate=st.floats(0.3, 1.0),
    decay_offset=st.sampled_from([0, -2]),
    parameter_scale=st.booleans(),
    clipping_threshold=st.one_of(st.none(), st.floats(0.1, 2.0)),
    momentum=st.one_of(st.none(), st.floats(0.0, 0.95)),
    dtype_momentum=st.sampled_from(FLOAT_DTYPES),
    weight_decay_rate=st.one_of(st.none(), st.floats(0.0, 0.1)),
    eps=st.sampled_from([1e-30, 1e-6]),
    factored=st.booleans(),
    use_mask=st.booleans(),
    fused=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_optax_over_steps(
    leaf_shapes, dtype, learning_rate, min_dim, decay_rate, decay_offset, parameter_scale,
    clipping_threshold, momentum, dtype_momentum, weight_decay_rate, eps, factored, use_mask,
    fused, seed,
):
  rng = np.random.default_rng(seed)
  params = tree_of(rng, [(s, dtype) for s in leaf_shapes])
  mask = {k: i % 2 == 0 for i, k in enumerate(params)} if use_mask else None
  kwargs = dict(
      learning_rate=learning_rate, min_dim_size_to_factor=min_dim, decay_rate=decay_rate,
      decay_offset=decay_offset, multiply_by_parameter_scale=parameter_scale,
      clipping_threshold=clipping_threshold, momentum=momentum, dtype_momentum=dtype_momentum,
      weight_decay_rate=weight_decay_rate, eps=eps, factored=factored, weight_decay_mask=mask,
  )
  # Gradients at the initial params: fed back (sin(p (i + 1))), a one-ulp
  # difference of a bf16 param can flip the sign of a near-zero gradient, and
  # on a 0-d leaf Adafactor's first steps are sign steps (|u| = clip * |p|),
  # so the two runs would follow different but equally right paths.
  got = _run(_xla(**kwargs), params, 3, fused, feedback=False)
  want = run_optax_f32_math(
      optax.adafactor, kwargs, params, 3, fused,
      moment_of=_ema if momentum is not None else None, feedback=False,
  )
  # XLA's fused code may round x**-0.5 an ulp apart from Optax's; without a
  # learning rate the steps are O(1), so an ulp grows to a few 1e-6 in 3 steps.
  rtol = max(tolerance(dtype, dtype_momentum if momentum is not None else dtype), 1e-5)
  # Parameter scale without a learning rate makes |u| = |p| on 0-d leaves, so
  # p + u may cancel to ~0: judge params at the scale of the initial params.
  for (path, a), b, p in zip(jax.tree_util.tree_flatten_with_path(got[0])[0],
                             jax.tree.leaves(want[0]), jax.tree.leaves(params)):
    assert a.dtype == b.dtype
    a, b, p = (np.asarray(x, np.float32) for x in (a, b, p))
    scale = max(np.max(np.abs(b), initial=0.0), np.max(np.abs(p), initial=0.0))
    np.testing.assert_allclose(a, b, rtol=0, atol=rtol * scale,
                               err_msg=jax.tree_util.keystr(path))
  assert_trees_close(got[1], want[1], rtol=rtol)


def test_interpreted_kernels_match_optax():
  # The fused path; the kernel tests cover "updates" mode against the reference.
  kwargs = dict(
      learning_rate=optax.warmup_cosine_decay_schedule(0.0, 1e-1, 2, 10),
      min_dim_size_to_factor=8, momentum=0.9, weight_decay_rate=optax.linear_schedule(0.1, 0.0, 10),
      weight_decay_mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p),
  )
  params = {"w": _params()["dense"]["w"], "stack": _params()["stack"]}
  with use_impl("interpret"):
    got = _run(adafactor(**kwargs), params, 3, True)
  want = _run(optax.adafactor(**kwargs), params, 3, False)
  assert_trees_close(got, want)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"learning_rate": 1e-2, "min_dim_size_to_factor": 8},
        {"learning_rate": optax.linear_schedule(1.0, 0.1, 5), "momentum": 0.9},
        {"momentum": 0.5, "dtype_momentum": jnp.bfloat16, "weight_decay_rate": 0.1},
        {"momentum": 0.5, "dtype_momentum": None, "clipping_threshold": None},
        {"weight_decay_rate": lambda c: 0.1, "weight_decay_mask": {"dense": True, "stack": False}},
        {"multiply_by_parameter_scale": False, "factored": False},
    ],
)
def test_state_tree_equals_optax(kwargs):
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _params())
  ours, theirs = adafactor(**kwargs).init(params), optax.adafactor(**kwargs).init(params)
  assert jax.tree.structure(ours) == jax.tree.structure(theirs)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    assert a.shape == b.shape and a.dtype == b.dtype


def test_checkpoint_swap_continues_the_same_trajectory():
  kwargs = dict(learning_rate=optax.linear_schedule(1e-1, 1e-2, 6), min_dim_size_to_factor=8,
                momentum=0.8, weight_decay_rate=0.01)
  make = {"optax": _jitted(optax.adafactor(**kwargs)), "pallasopt": _jitted(_xla(**kwargs))}
  want = _run(make["optax"], _params(), 4, False)
  for first, second in [("optax", "pallasopt"), ("pallasopt", "optax")]:
    params, state = _params(), make[first].init(_params())
    for i in range(4):
      updates, state = make[first if i < 2 else second].update(step_grads(params, i), state, params)
      params = optax.apply_updates(params, updates)
    assert_trees_close((params, state), want)


def _compositions():
  static = ("min_dim_size_to_factor", "dtype_momentum")  # what Optax itself needs
  return {
      "chain": lambda mk: optax.chain(optax.clip_by_global_norm(1.0), mk(1e-1, 8)),
      "masked": lambda mk: optax.masked(mk(1e-1, 8), {"dense": True, "stack": False}),
      "multi_steps": lambda mk: optax.MultiSteps(mk(1e-1, 8), every_k_schedule=2),
      "inject_hyperparams": lambda mk: optax.inject_hyperparams(
          mk, static_args=ADAFACTOR_STATIC_ARGS if mk is not optax.adafactor else static
      )(learning_rate=1e-1, min_dim_size_to_factor=8, decay_rate=0.7, momentum=0.5),
      "apply_if_finite": lambda mk: optax.apply_if_finite(mk(1e-1, 8), max_consecutive_errors=2),
  }


@pytest.mark.parametrize("name", sorted(_compositions()))
def test_composes_like_optax(name):
  build = _compositions()[name]
  ours, theirs = build(_xla), build(optax.adafactor)
  step = lambda tx: jax.jit(lambda p, g, s: (lambda u, s: (optax.apply_updates(p, u), s))(
      *tx.update(g, s, p)))
  our_step, their_step = step(ours), step(theirs)
  got_params = want_params = _params()
  got_state, want_state = ours.init(got_params), theirs.init(want_params)
  for i in range(4):
    grads = step_grads(got_params, i)
    if name == "apply_if_finite" and i == 1:
      grads = {**grads, "stack": grads["stack"].at[0, 0, 0].set(jnp.nan)}
    got_params, got_state = our_step(got_params, grads, got_state)
    want_params, want_state = their_step(want_params, grads, want_state)
  assert_trees_close((got_params, got_state), (want_params, want_state))


def test_inject_hyperparams_with_optaxs_static_args_works_under_jit():
  # stacked_axes defaults to None, so inject_hyperparams does not trace it.
  tx = optax.inject_hyperparams(adafactor, static_args=("min_dim_size_to_factor",))(
      learning_rate=1e-1, impl="xla")
  params = {"b": _params()["dense"]["b"]}
  state = tx.init(params)
  updates, _ = jax.jit(lambda g, s, p: tx.update(g, s, p))(step_grads(params, 0), state, params)
  want, _ = optax.adafactor(1e-1).update(step_grads(params, 0), optax.adafactor(1e-1).init(params),
                                         params)
  assert_trees_close(updates, want)
  # A stacked_axes passed as a number is a hyperparameter; traced, it is explained.
  stacked = optax.inject_hyperparams(adafactor, static_args=("min_dim_size_to_factor",))(
      learning_rate=1e-1, stacked_axes=0, impl="xla")
  with pytest.raises(TypeError, match="stacked_axes must be a Python int.*ADAFACTOR_STATIC_ARGS"):
    jax.jit(lambda g, s, p: stacked.update(g, s, p))(
        step_grads(params, 0), stacked.init(params), params)


def test_extra_args_are_accepted_and_ignored():
  tx = optax.chain(_xla(learning_rate=1e-1))
  params = {"b": _params()["dense"]["b"]}
  updates, _ = tx.update(step_grads(params, 0), tx.init(params), params, loss=jnp.float32(1.0))
  ref = optax.adafactor(1e-1)
  want, _ = ref.update(step_grads(params, 0), ref.init(params), params)
  assert_trees_close(updates, want)


def test_vmap_over_independent_models():
  params = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), _params()["dense"])
  grads = jax.tree.map(lambda x: jnp.stack([jnp.cos(x[0]), jnp.sin(x[1])]), params)
  tx, ref = _xla(learning_rate=1e-1, min_dim_size_to_factor=8), optax.adafactor(1e-1, 8)
  got = jax.jit(jax.vmap(lambda p, g: tx.update(g, tx.init(p), p)))(params, grads)
  want = jax.jit(jax.vmap(lambda p, g: ref.update(g, ref.init(p), p)))(params, grads)
  assert_trees_close(got, want)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_changing_the_learning_rate_does_not_retrace(impl):
  traces = []
  tx = optax.inject_hyperparams(adafactor, static_args=ADAFACTOR_STATIC_ARGS)(
      learning_rate=1e-2, min_dim_size_to_factor=8, impl=impl)

  @functools.partial(jax.jit, donate_argnums=(0, 2))
  def step(params, grads, state):
    traces.append(1)
    return pallasopt.optim.apply_gradients(tx, params, grads, state)

  params = {"w": _params()["dense"]["w"]}
  state = tx.init(params)
  for lr in (1e-2, 3e-3, 1e-4):
    state.hyperparams["learning_rate"] = jnp.asarray(lr)
    params, state = step(params, step_grads(params, 0), state)
  assert len(traces) == 1


def test_fused_apply_equals_update_plus_apply_updates_under_jit_with_donation():
  tx = _xla(learning_rate=optax.cosine_decay_schedule(1e-1, 10), min_dim_size_to_factor=8,
            momentum=0.9, weight_decay_rate=0.01)
  fused = jax.jit(functools.partial(pallasopt.optim.apply_gradients, tx), donate_argnums=(0, 2))
  params = _params()
  state = tx.init(params)
  want = _run(tx, _params(), 3, fused=False)
  for i in range(3):
    params, state = fused(params, step_grads(params, i), state)
  assert_trees_close((params, state), want)


def test_fused_grad_scale_and_learning_rate_override_match_optax():
  tx = adafactor(optax.linear_schedule(1.0, 0.0, 10), min_dim_size_to_factor=8,
                 weight_decay_rate=0.1, momentum=0.5, impl="xla")
  params = _params()["dense"]
  grads = step_grads(params, 0)
  got = jax.jit(functools.partial(tx.apply_gradients, grad_scale=0.25, learning_rate=3e-2))(
      params, grads, tx.init(params))
  ref = optax.adafactor(3e-2, min_dim_size_to_factor=8, weight_decay_rate=0.1, momentum=0.5)
  updates, ref_state = jax.jit(ref.update)(
      jax.tree.map(lambda g: 0.25 * g, grads), ref.init(params), params)
  assert_trees_close(got[0], optax.apply_updates(params, updates))
  assert_trees_close((got[1][0], got[1][-3]), (ref_state[0], ref_state[-3]))


# ---- stacked_axes: each layer is updated as its own leaf. ----

# (The kernel tests draw stacked_axes too, comparing the kernels with this path.)
@pytest.mark.parametrize(
    "shape,stacked_axes",
    [
        ((3, 20, 37), 1),
        ((2, 2, 9, 12), 2),
        ((2, 3, 1), 2),  # per-layer scalars, stacked as (layers..., 1)
    ],
)
def test_stacked_layers_update_like_separate_leaves(shape, stacked_axes):
  kwargs = dict(learning_rate=1e-1, min_dim_size_to_factor=8, momentum=0.9)
  rng = np.random.default_rng(0)
  stacked = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  got_params, got_state = _run(
      _xla(**kwargs, stacked_axes=stacked_axes), {"w": stacked}, 3, True)
  layers = stacked.reshape(-1, *shape[stacked_axes:])
  optax_tx = optax.adafactor(**kwargs)
  for i, layer in enumerate(layers):
    want_params, want_state = _run(optax_tx, {"w": layer}, 3, False)
    index = np.unravel_index(i, shape[:stacked_axes])
    assert_trees_close(got_params["w"][index], want_params["w"])
    factored = want_state[0]
    for name in ("v_row", "v_col", "v"):
      want = getattr(factored, name)["w"]
      got = getattr(got_state[0], name)["w"]
      if want.shape != (1,) or got.shape != (1,):  # (1,) placeholders are shared
        assert_trees_close(got[index], want)


def test_stacked_axes_zero_factors_stacking_axes_like_optax():
  # [layers, d_in, d_out] with layers among the two largest: Optax factors it.
  params = {"w": jnp.ones((30, 20, 40))}
  kwargs = dict(learning_rate=1e-1, min_dim_size_to_factor=8)
  ours, theirs = adafactor(**kwargs).init(params), optax.adafactor(**kwargs).init(params)
  assert ours[0].v_row["w"].shape == theirs[0].v_row["w"].shape == (30, 20)
  assert ours[0].v_col["w"].shape == theirs[0].v_col["w"].shape == (20, 40)
  stacked = adafactor(**kwargs, stacked_axes=1).init(params)[0]
  assert stacked.v_row["w"].shape == (30, 20) and stacked.v_col["w"].shape == (30, 40)


# ---- Bad input is reported, naming the argument and the leaf. ----

@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"learning_rate": float("inf")}, ValueError, "learning_rate must be a finite number"),
        ({"decay_rate": float("nan")}, ValueError, "decay_rate"),
        ({"momentum": 1.5}, ValueError, r"momentum must be in \[0.0, 1.0\]"),
        ({"eps": -1e-8}, ValueError, "eps"),
        ({"clipping_threshold": -1.0}, ValueError, "clipping_threshold"),
        ({"weight_decay_rate": float("nan")}, ValueError, "weight_decay_rate must be a finite"),
        ({"min_dim_size_to_factor": -1}, ValueError, "min_dim_size_to_factor must be an int >= 0"),
        ({"min_dim_size_to_factor": 1.5}, ValueError, "min_dim_size_to_factor must be an int"),
        ({"stacked_axes": -1}, ValueError, "stacked_axes must be an int >= 0"),
        ({"impl": "cuda"}, ValueError, "impl must be one of"),
        ({"momentum": 0.9, "dtype_momentum": "not a dtype"}, TypeError,
         "dtype_momentum must be a dtype or None"),
        ({"momentum": 0.9, "dtype_momentum": jnp.zeros(())}, TypeError,
         "dtype_momentum must be a dtype.*ADAFACTOR_STATIC_ARGS"),
    ],
)
def test_bad_hyperparameters_are_rejected(kwargs, error, match):
  with pytest.raises(error, match=match):
    adafactor(**kwargs)


def test_params_are_required():
  tx = _xla(learning_rate=1e-1)
  params = _params()
  with pytest.raises(ValueError, match="params are required"):
    tx.update(params, tx.init(params))


def test_mismatched_grads_and_state_name_the_leaf():
  tx = _xla(learning_rate=1e-1, min_dim_size_to_factor=8)
  params = _params()
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"missing in grads: \['stack'\]"):
    tx.update({k: v for k, v in params.items() if k != "stack"}, state, params)
  wrong = {**params, "dense": {**params["dense"], "b": jnp.ones((8,))}}
  with pytest.raises(ValueError, match=r"grads\['dense'\]\['b'\] has shape \(8,\)"):
    tx.update(wrong, state, params)
  # A state built with another factoring threshold does not fit.
  other = _xla(learning_rate=1e-1, min_dim_size_to_factor=128).init(params)
  with pytest.raises(ValueError, match=r"opt_state\[0\].v_row\['dense'\]\['w'\] has shape \(1,\)"):
    tx.update(params, other, params)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.complex64])
def test_leaves_no_kernel_takes_follow_optax(dtype):
  # A mixed tree: "ok" runs the kernel, "other" Optax's own chain in its dtype.
  params = {"ok": jnp.linspace(-1.0, 1.0, 300).reshape(20, 15),
            "other": jnp.linspace(1, 2, 7).astype(dtype)}
  grads = jax.tree.map(lambda p: (0.5 * p + 0.25).astype(p.dtype), params)
  ours, theirs = _xla(learning_rate=1e-1, momentum=0.9), optax.adafactor(1e-1, momentum=0.9)
  u_ours, _ = ours.update(grads, ours.init(params), params)
  u_theirs, _ = theirs.update(grads, theirs.init(params), params)
  assert u_ours["other"].dtype == u_theirs["other"].dtype
  # Optax's own chain on that leaf, up to XLA's fusion choices (ulps).
  ulps = 4 * float(jnp.finfo(dtype).eps)
  np.testing.assert_allclose(np.asarray(u_ours["other"]), np.asarray(u_theirs["other"]),
                             rtol=ulps, atol=0)


def test_non_boolean_mask_is_rejected():
  tx = _xla(weight_decay_rate=0.1, weight_decay_mask={"dense": jnp.array(True), "stack": True})
  params = _params()
  with pytest.raises(TypeError, match=r"mask\['dense'\]\['b'\] must be a Python bool"):
    tx.update(params, tx.init(params), params)
