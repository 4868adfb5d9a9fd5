"""pallasopt.optim.adamw is a drop-in for optax.adamw."""

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
    shapes,
    step_grads,
    tolerance,
    tree_of,
)
from pallasopt.kernels import use_impl

adamw = pallasopt.optim.adamw
_run = functools.partial(run_steps, apply_gradients=pallasopt.optim.apply_gradients)


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {
      "dense": {"w": jnp.asarray(rng.standard_normal((37, 128)), jnp.float32),
                "b": jnp.asarray(rng.standard_normal((7,)), jnp.float32)},
      "scale": jnp.asarray(1.5, jnp.float32),
  }


@given(
    leaf_shapes=st.lists(shapes(max_rank=3, max_side=20), min_size=1, max_size=4),
    dtype=st.sampled_from(FLOAT_DTYPES),
    mu_dtype=st.sampled_from([None, jnp.float32, jnp.bfloat16]),
    lr=st.floats(1e-4, 0.1),
    b1=st.floats(0.0, 0.95),
    b2=st.floats(0.8, 0.999),
    eps_root=st.sampled_from([0.0, 1e-8]),
    weight_decay=st.sampled_from([0.0, 1e-4, 0.1]),
    nesterov=st.booleans(),
    use_mask=st.booleans(),
    fused=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_optax_over_steps(
    leaf_shapes, dtype, mu_dtype, lr, b1, b2, eps_root, weight_decay, nesterov, use_mask, fused, seed
):
  rng = np.random.default_rng(seed)
  params = tree_of(rng, [(s, dtype) for s in leaf_shapes])
  mask = {k: i % 2 == 0 for i, k in enumerate(params)} if use_mask else None
  kwargs = dict(b1=b1, b2=b2, eps_root=eps_root, mu_dtype=mu_dtype,
                weight_decay=weight_decay, mask=mask, nesterov=nesterov)
  got = _run(adamw(lr, impl="xla", **kwargs), params, 3, fused)
  want = run_optax_f32_math(
      optax.adamw, {"learning_rate": lr, **kwargs}, params, 3, fused, moment_of=lambda s: s[0].mu
  )
  assert_trees_close(got, want, rtol=tolerance(dtype, mu_dtype or dtype))


@pytest.mark.parametrize("fused", [False, True])
def test_interpreted_kernels_match_optax(fused):
  lr = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
  wd = optax.linear_schedule(0.1, 0.0, 10)
  mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
  with use_impl("interpret"):
    got = _run(adamw(lr, weight_decay=wd, mask=mask, nesterov=True), _params(), 3, fused)
  want = _run(optax.adamw(lr, weight_decay=wd, mask=mask, nesterov=True), _params(), 3, False)
  assert_trees_close(got, want)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"mu_dtype": jnp.bfloat16},
        {"weight_decay": optax.constant_schedule(0.1)},
        {"learning_rate": optax.linear_schedule(1.0, 0.1, 5)},
        {"mask": {"dense": True, "scale": False}},
        {"mask": lambda p: jax.tree.map(lambda x: x.ndim > 0, p), "weight_decay": lambda c: 0.1},
    ],
)
def test_state_tree_equals_optax(kwargs):
  kwargs = {"learning_rate": 1e-3, **kwargs}
  ours, theirs = adamw(**kwargs).init(_params()), optax.adamw(**kwargs).init(_params())
  assert jax.tree.structure(ours) == jax.tree.structure(theirs)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    assert a.shape == b.shape and a.dtype == b.dtype


@pytest.mark.parametrize("first,second", [("optax", "pallasopt"), ("pallasopt", "optax")])
def test_checkpoint_swap_continues_the_same_trajectory(first, second):
  make = {"optax": optax.adamw, "pallasopt": functools.partial(adamw, impl="xla")}
  kwargs = dict(learning_rate=optax.linear_schedule(1e-2, 1e-3, 6), weight_decay=0.05)
  params, state = _params(), make[first](**kwargs).init(_params())
  for i in range(4):
    tx = make[first if i < 2 else second](**kwargs)
    updates, state = tx.update(step_grads(params, i), state, params)
    params = optax.apply_updates(params, updates)
  assert_trees_close((params, state), _run(optax.adamw(**kwargs), _params(), 4, False))


def _compositions():
  wd_mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
  return {
      "chain": lambda mk: optax.chain(optax.clip_by_global_norm(1.0), mk(1e-2)),
      "masked": lambda mk: optax.masked(mk(1e-2), {"dense": True, "scale": False}),
      "multi_steps": lambda mk: optax.MultiSteps(mk(1e-2), every_k_schedule=2),
      "inject_hyperparams": lambda mk: optax.inject_hyperparams(mk)(learning_rate=1e-2, b1=0.8),
      "apply_if_finite": lambda mk: optax.apply_if_finite(mk(1e-2), max_consecutive_errors=2),
      "weight_decay_mask": lambda mk: mk(1e-2, weight_decay=0.1, mask=wd_mask),
  }


@pytest.mark.parametrize("name", sorted(_compositions()))
def test_composes_like_optax(name):
  build = _compositions()[name]
  ours = build(functools.partial(adamw, impl="xla"))
  theirs = build(optax.adamw)
  step = lambda tx: jax.jit(lambda p, g, s: tx.update(g, s, p))
  got_params = want_params = _params()
  got_state, want_state = ours.init(got_params), theirs.init(want_params)
  for i in range(4):
    grads = step_grads(got_params, i)
    if name == "apply_if_finite" and i == 1:
      grads = jax.tree.map(lambda g: g.at[()].set(jnp.nan) if g.ndim == 0 else g, grads)
    u, got_state = step(ours)(got_params, grads, got_state)
    got_params = optax.apply_updates(got_params, u)
    u, want_state = step(theirs)(want_params, grads, want_state)
    want_params = optax.apply_updates(want_params, u)
  assert_trees_close((got_params, got_state), (want_params, want_state))


def test_extra_args_are_accepted_and_ignored():
  tx = optax.chain(adamw(1e-2, impl="xla"))
  params = _params()
  state = tx.init(params)
  updates, _ = tx.update(step_grads(params, 0), state, params, loss=jnp.float32(1.0))
  want, _ = optax.adamw(1e-2).update(step_grads(params, 0), optax.adamw(1e-2).init(params), params)
  assert_trees_close(updates, want)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_vmap_over_independent_models(impl):
  params = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), _params())
  grads = jax.tree.map(lambda x: jnp.stack([jnp.cos(x[0]), jnp.sin(x[1])]), params)
  tx, ref = adamw(1e-2, impl=impl), optax.adamw(1e-2)
  got = jax.vmap(lambda p, g: tx.update(g, tx.init(p), p))(params, grads)
  want = jax.vmap(lambda p, g: ref.update(g, ref.init(p), p))(params, grads)
  assert_trees_close(got, want)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_changing_the_learning_rate_does_not_retrace(impl):
  traces = []
  tx = optax.inject_hyperparams(adamw)(learning_rate=1e-2, impl=impl)

  @functools.partial(jax.jit, donate_argnums=(0, 2))
  def step(params, grads, state):
    traces.append(1)
    return pallasopt.optim.apply_gradients(tx, params, grads, state)

  params = _params()
  state = tx.init(params)
  for lr in (1e-2, 3e-3, 1e-4):
    state.hyperparams["learning_rate"] = jnp.asarray(lr)
    params, state = step(params, step_grads(params, 0), state)
  assert len(traces) == 1


def test_fused_apply_equals_update_plus_apply_updates_under_jit_with_donation():
  tx = adamw(optax.cosine_decay_schedule(1e-2, 10), weight_decay=0.1, impl="xla")
  fused = jax.jit(functools.partial(pallasopt.optim.apply_gradients, tx), donate_argnums=(0, 2))
  params = _params()
  state = tx.init(params)
  want = _run(tx, _params(), 3, fused=False)
  for i in range(3):
    params, state = fused(params, step_grads(params, i), state)
  assert_trees_close((params, state), want)


def test_apply_gradients_falls_back_for_foreign_transforms():
  tx = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1))
  params = _params()
  got, _ = pallasopt.optim.apply_gradients(tx, params, step_grads(params, 0), tx.init(params))
  updates, _ = tx.update(step_grads(params, 0), tx.init(params), params)
  assert_trees_close(got, optax.apply_updates(params, updates))


# ---- Bad input is reported, naming the argument and the leaf. ----

@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"learning_rate": -1.0}, r"learning_rate must be in \[0.0, inf\]"),
        ({"learning_rate": float("nan")}, "learning_rate"),
        ({"b1": 1.0}, r"b1 must be in \[0.0, 1.0\)"),
        ({"b2": -0.1}, "b2"),
        ({"eps": -1e-8}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"impl": "cuda"}, "impl must be one of"),
    ],
)
def test_bad_hyperparameters_are_rejected(kwargs, match):
  with pytest.raises(ValueError, match=match):
    adamw(**{"learning_rate": 1e-3, **kwargs})


def test_bad_mu_dtype_is_rejected():
  with pytest.raises(TypeError, match="mu_dtype must be float32 or bfloat16"):
    adamw(1e-3, mu_dtype=jnp.int8)


def test_mismatched_grads_name_the_leaf():
  tx = adamw(1e-3, impl="xla")
  params = _params()
  state = tx.init(params)
  missing = {"dense": params["dense"]}
  with pytest.raises(ValueError, match=r"missing in grads: \[\"\['scale'\]\"\]"):
    tx.update(missing, state, params)
  wrong = {**params, "dense": {**params["dense"], "b": jnp.ones((8,))}}
  with pytest.raises(ValueError, match=r"grads\['dense'\]\['b'\] has shape \(8,\)"):
    tx.update(wrong, state, params)
  with pytest.raises(ValueError, match=r"params\['dense'\]\['b'\] has shape \(8,\)"):
    pallasopt.optim.apply_gradients(tx, wrong, params, state)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.complex64, jnp.float16])
def test_unsupported_dtypes_name_the_leaf(dtype):
  params = {"ok": jnp.ones((3,)), "bad": jnp.ones((3,), dtype)}
  with pytest.raises(TypeError, match=r"params\['bad'\] has dtype .*supported dtypes are float32, bfloat16"):
    adamw(1e-3).init(params)
  tx = adamw(1e-3, impl="xla")
  state = tx.init({"ok": jnp.ones((3,)), "bad": jnp.ones((3,))})
  with pytest.raises(TypeError, match=r"grads\['bad'\] has dtype"):
    tx.update(params, state, {"ok": jnp.ones((3,)), "bad": jnp.ones((3,))})


def test_params_are_required_for_weight_decay_only():
  tx = adamw(1e-3, weight_decay=0.1, impl="xla")
  params = _params()
  with pytest.raises(ValueError, match="params are required for weight decay"):
    tx.update(params, tx.init(params))
  no_decay = adamw(1e-3, weight_decay=0.0, impl="xla")
  updates, _ = no_decay.update(params, no_decay.init(params))
  assert jax.tree.structure(updates) == jax.tree.structure(params)


def test_non_boolean_mask_is_rejected():
  tx = adamw(1e-3, mask={"dense": jnp.array(True), "scale": False}, impl="xla")
  params = _params()
  with pytest.raises(TypeError, match=r"mask\['dense'\]\['b'\] must be a Python bool"):
    tx.update(params, tx.init(params), params)


def test_fused_grad_scale_and_learning_rate_override_match_optax():
  tx = adamw(optax.linear_schedule(1.0, 0.0, 10), weight_decay=0.1, impl="interpret")
  params = _params()
  grads = step_grads(params, 0)
  got = tx.apply_gradients(params, grads, tx.init(params), grad_scale=0.25, learning_rate=3e-3)
  ref = optax.adamw(3e-3, weight_decay=0.1)
  updates, ref_state = ref.update(jax.tree.map(lambda g: 0.25 * g, grads), ref.init(params), params)
  assert_trees_close(got[0], optax.apply_updates(params, updates))
  assert_trees_close(got[1][0], ref_state[0])
