"""The drop-in contract every elementwise pallasopt transform is tested against.

A family's ``test_<family>_optax.py`` subclasses `DropInContract`, naming its
transform, the Optax transform it replaces and the hyperparameters the
trajectory test draws; pytest then runs every test below for it::

  class TestLionDropIn(DropInContract):
    ours = staticmethod(lion)
    theirs = staticmethod(optax.lion)
    hyperparams = st.fixed_dictionaries({"b1": ..., "b2": ...})

The transforms must take Optax's ``(learning_rate, ..., mu_dtype,
weight_decay, mask)`` plus keyword-only ``impl``, keep Optax's state tree with
the first moment at ``state[0].mu``, and accept ``b1``.
"""

import functools
import inspect
from collections.abc import Callable
from typing import Any

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

_run = functools.partial(run_steps, apply_gradients=pallasopt.optim.apply_gradients)


def assert_same_state_layout(ours, theirs):
  """Same tree, shapes and dtypes: a checkpoint of one restores into the other."""
  assert jax.tree.structure(ours) == jax.tree.structure(theirs)
  layout = lambda tree: [(jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(tree)]
  assert layout(ours) == layout(theirs)


def params_tree(seed=0):
  """A small params tree: a matrix and a ragged vector under "dense", a scalar."""
  rng = np.random.default_rng(seed)
  return {
      "dense": {"w": jnp.asarray(rng.standard_normal((37, 128)), jnp.float32),
                "b": jnp.asarray(rng.standard_normal((7,)), jnp.float32)},
      "scale": jnp.asarray(1.5, jnp.float32),
  }


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


def _matches_optax_over_steps():
  """A fresh copy of the trajectory test for each `DropInContract` subclass.

  Hypothesis refuses one ``@given`` function run from several classes (its
  ``differing_executors`` health check), so every family gets its own.
  """

  @given(
      leaf_shapes=st.lists(shapes(max_rank=3, max_side=20), min_size=1, max_size=3),
      dtype=st.sampled_from(FLOAT_DTYPES),
      mu_dtype=st.sampled_from([None, jnp.float32, jnp.bfloat16]),
      lr=st.floats(1e-4, 0.1),
      weight_decay=st.sampled_from([0.0, 1e-4, 0.1]),
      use_mask=st.booleans(),
      fused=st.booleans(),
      seed=st.integers(0, 2**16),
      data=st.data(),
  )
  def test_matches_optax_over_steps(
      self, leaf_shapes, dtype, mu_dtype, lr, weight_decay, use_mask, fused, seed, data
  ):
    rng = np.random.default_rng(seed)
    params = tree_of(rng, [(s, dtype) for s in leaf_shapes])
    mask = {k: i % 2 == 0 for i, k in enumerate(params)} if use_mask else None
    kwargs = dict(mu_dtype=mu_dtype, weight_decay=weight_decay, mask=mask,
                  **data.draw(self.hyperparams, label="hyperparams"))
    got = _run(self.xla(lr, **kwargs), params, 3, fused)
    want = run_optax_f32_math(
        self.theirs, {"learning_rate": lr, **kwargs}, params, 3, fused,
        moment_of=lambda s: s[0].mu,
    )
    assert_trees_close(got, want, rtol=tolerance(dtype, mu_dtype or dtype))

  return test_matches_optax_over_steps


class DropInContract:
  """Tests that `ours` behaves as `theirs` wherever Optax code may call it."""

  ours: Callable[..., Any]
  theirs: Callable[..., Any]
  # Family hyperparameters (besides learning_rate, mu_dtype, weight_decay and
  # mask) drawn by the trajectory test.
  hyperparams: st.SearchStrategy
  # Extra arguments for the interpreted-kernel run (e.g. nesterov=True).
  interpret_kwargs: dict = {}

  @property
  def xla(self):
    """`ours` on the XLA reference path (a partial, so its signature shows)."""
    return functools.partial(self.ours, impl="xla")

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    cls.test_matches_optax_over_steps = _matches_optax_over_steps()

  def test_signature_matches_optax(self):
    ours = inspect.signature(self.ours).parameters
    theirs = inspect.signature(self.theirs).parameters
    for name, param in theirs.items():
      assert name in ours, name
      assert (ours[name].kind, ours[name].default) == (param.kind, param.default), name
    assert ours["impl"].kind == inspect.Parameter.KEYWORD_ONLY and ours["impl"].default == "auto"

  @pytest.mark.parametrize("fused", [False, True])
  def test_interpreted_kernels_match_optax(self, fused):
    kwargs = dict(
        learning_rate=optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10),
        weight_decay=optax.linear_schedule(0.1, 0.0, 10),
        mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p),
        **self.interpret_kwargs,
    )
    with use_impl("interpret"):  # jitted whole: one compile, not one per eager op
      got = jax.jit(lambda p: _run(self.ours(**kwargs), p, 3, fused))(params_tree())
    want = _run(self.theirs(**kwargs), params_tree(), 3, False)
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
  def test_state_tree_equals_optax(self, kwargs):
    kwargs = {"learning_rate": 1e-3, **kwargs}
    ours, theirs = self.ours(**kwargs).init(params_tree()), self.theirs(**kwargs).init(params_tree())
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
      assert a.shape == b.shape and a.dtype == b.dtype

  @pytest.mark.parametrize("first,second", [("optax", "pallasopt"), ("pallasopt", "optax")])
  def test_checkpoint_swap_continues_the_same_trajectory(self, first, second):
    make = {"optax": self.theirs, "pallasopt": self.xla}
    kwargs = dict(learning_rate=optax.linear_schedule(1e-2, 1e-3, 6), weight_decay=0.05)
    params, state = params_tree(), make[first](**kwargs).init(params_tree())
    for i in range(4):
      tx = make[first if i < 2 else second](**kwargs)
      updates, state = tx.update(step_grads(params, i), state, params)
      params = optax.apply_updates(params, updates)
    assert_trees_close((params, state), _run(self.theirs(**kwargs), params_tree(), 4, False))

  @pytest.mark.parametrize("name", sorted(_compositions()))
  def test_composes_like_optax(self, name):
    build = _compositions()[name]
    ours, theirs = build(self.xla), build(self.theirs)
    step = lambda tx: jax.jit(lambda p, g, s: tx.update(g, s, p))
    ours_step, theirs_step = step(ours), step(theirs)  # compiled once each
    got_params = want_params = params_tree()
    got_state, want_state = ours.init(got_params), theirs.init(want_params)
    for i in range(4):
      grads = step_grads(got_params, i)
      if name == "apply_if_finite" and i == 1:
        grads = jax.tree.map(lambda g: g.at[()].set(jnp.nan) if g.ndim == 0 else g, grads)
      u, got_state = ours_step(got_params, grads, got_state)
      got_params = optax.apply_updates(got_params, u)
      u, want_state = theirs_step(want_params, grads, want_state)
      want_params = optax.apply_updates(want_params, u)
    assert_trees_close((got_params, got_state), (want_params, want_state))

  def test_extra_args_are_accepted_and_ignored(self):
    tx = optax.chain(self.xla(1e-2))
    params = params_tree()
    updates, _ = tx.update(step_grads(params, 0), tx.init(params), params, loss=jnp.float32(1.0))
    ref = self.theirs(1e-2)
    want, _ = ref.update(step_grads(params, 0), ref.init(params), params)
    assert_trees_close(updates, want)

  @pytest.mark.parametrize("impl", ["xla", "interpret"])
  def test_vmap_over_independent_models(self, impl):
    params = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), params_tree())
    grads = jax.tree.map(lambda x: jnp.stack([jnp.cos(x[0]), jnp.sin(x[1])]), params)
    tx, ref = self.ours(1e-2, impl=impl), self.theirs(1e-2)
    got = jax.jit(jax.vmap(lambda p, g: tx.update(g, tx.init(p), p)))(params, grads)
    want = jax.jit(jax.vmap(lambda p, g: ref.update(g, ref.init(p), p)))(params, grads)
    assert_trees_close(got, want)

  @pytest.mark.parametrize("impl", ["xla", "interpret"])
  def test_changing_the_learning_rate_does_not_retrace(self, impl):
    traces = []
    tx = optax.inject_hyperparams(self.ours)(learning_rate=1e-2, impl=impl)

    @functools.partial(jax.jit, donate_argnums=(0, 2))
    def step(params, grads, state):
      traces.append(1)
      return pallasopt.optim.apply_gradients(tx, params, grads, state)

    params = params_tree()
    state = tx.init(params)
    for lr in (1e-2, 3e-3, 1e-4):
      state.hyperparams["learning_rate"] = jnp.asarray(lr)
      params, state = step(params, step_grads(params, 0), state)
    assert len(traces) == 1

  def test_fused_apply_equals_update_plus_apply_updates_under_jit_with_donation(self):
    tx = self.xla(optax.cosine_decay_schedule(1e-2, 10), weight_decay=0.1)
    fused = jax.jit(functools.partial(pallasopt.optim.apply_gradients, tx), donate_argnums=(0, 2))
    params = params_tree()
    state = tx.init(params)
    want = _run(tx, params_tree(), 3, fused=False)
    for i in range(3):
      params, state = fused(params, step_grads(params, i), state)
    assert_trees_close((params, state), want)

  def test_fused_grad_scale_and_learning_rate_override_match_optax(self):
    tx = self.ours(optax.linear_schedule(1.0, 0.0, 10), weight_decay=0.1, impl="interpret")
    params = params_tree()
    grads = step_grads(params, 0)
    got = tx.apply_gradients(params, grads, tx.init(params), grad_scale=0.25, learning_rate=3e-3)
    ref = self.theirs(3e-3, weight_decay=0.1)
    updates, ref_state = ref.update(jax.tree.map(lambda g: 0.25 * g, grads), ref.init(params), params)
    assert_trees_close(got[0], optax.apply_updates(params, updates))
    assert_trees_close(got[1][0], ref_state[0])

  def test_empty_params_tree(self):
    tx = self.xla(1e-3)
    updates, state = tx.update({}, tx.init({}), {})
    assert updates == {} and int(state[0].count) == 1
    assert tx.apply_gradients({}, {}, tx.init({}))[0] == {}

  # ---- Bad input is reported, naming the argument and the leaf. ----

  @pytest.mark.parametrize(
      "kwargs,match",
      [
          ({"learning_rate": float("inf")}, "learning_rate must be a finite number"),
          ({"learning_rate": float("nan")}, "learning_rate"),
          ({"b1": 1.0}, r"b1 must be in \[0.0, 1.0\)"),
          ({"b2": -0.1}, "b2"),
          ({"weight_decay": float("nan")}, "weight_decay must be a finite number"),
          ({"impl": "cuda"}, "impl must be one of"),
      ],
  )
  def test_bad_hyperparameters_are_rejected(self, kwargs, match):
    with pytest.raises(ValueError, match=match):
      self.ours(**{"learning_rate": 1e-3, **kwargs})

  def test_negative_rates_ascend_like_optax(self):
    # Optax takes rates of either sign (a negative learning rate ascends).
    kwargs = dict(learning_rate=-1e-2, weight_decay=-0.05)
    with use_impl("interpret"):
      got = jax.jit(lambda p: _run(self.ours(**kwargs), p, 2, True))(params_tree())
    assert_trees_close(got, _run(self.theirs(**kwargs), params_tree(), 2, False))

  @pytest.mark.parametrize("mu_dtype", [jnp.float16, jnp.complex64])
  def test_any_mu_dtype_optax_takes_is_taken(self, mu_dtype):
    params = params_tree()
    ours, theirs = self.xla(1e-3, mu_dtype=mu_dtype), self.theirs(1e-3, mu_dtype=mu_dtype)
    assert_same_state_layout(ours.init(params), theirs.init(params))
    with pytest.raises(TypeError, match="not a dtype"):  # as Optax does
      self.ours(1e-3, mu_dtype="not a dtype")

  def test_mismatched_grads_name_the_leaf(self):
    tx = self.xla(1e-3)
    params = params_tree()
    state = tx.init(params)
    missing = {"dense": params["dense"]}
    with pytest.raises(ValueError, match=r"missing in grads: \['scale'\]\.?$"):
      tx.update(missing, state, params)
    wrong = {**params, "dense": {**params["dense"], "b": jnp.ones((8,))}}
    with pytest.raises(ValueError, match=r"grads\['dense'\]\['b'\] has shape \(8,\)"):
      tx.update(wrong, state, params)
    with pytest.raises(ValueError, match=r"params\['dense'\]\['b'\] has shape \(8,\)"):
      pallasopt.optim.apply_gradients(tx, wrong, params, state)

  @pytest.mark.parametrize("dtype", [jnp.complex64, jnp.float16])
  @pytest.mark.parametrize("impl", ["xla", "interpret"])
  def test_leaves_no_kernel_takes_follow_optax(self, dtype, impl):
    # A mixed tree: "ok" runs the kernel, "other" Optax's math in its dtype.
    params = {"ok": jnp.linspace(-1.0, 1.0, 300), "other": jnp.linspace(1, 2, 7).astype(dtype)}
    grads = jax.tree.map(lambda p: (0.5 * p + 0.25).astype(p.dtype), params)
    ours, theirs = self.ours(1e-2, impl=impl), self.theirs(1e-2)
    state_ours, state_theirs = ours.init(params), theirs.init(params)
    assert_same_state_layout(state_ours, state_theirs)
    u_ours, s_ours = jax.jit(ours.update)(grads, state_ours, params)
    u_theirs, s_theirs = theirs.update(grads, state_theirs, params)
    assert u_ours["other"].dtype == u_theirs["other"].dtype
    # The same Optax code on that leaf, up to XLA's fusion choices (ulps).
    ulps = 4 * float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(np.asarray(u_ours["other"]), np.asarray(u_theirs["other"]),
                               rtol=ulps, atol=0)
    assert_same_state_layout(s_ours, s_theirs)

  def test_params_are_required_for_weight_decay_only(self):
    tx = self.xla(1e-3, weight_decay=0.1)
    params = params_tree()
    with pytest.raises(ValueError, match="params are required for weight decay"):
      tx.update(params, tx.init(params))
    with pytest.raises(ValueError, match="params are required to apply gradients"):
      tx.apply_gradients(None, params, tx.init(params))
    no_decay = self.xla(1e-3, weight_decay=0.0)
    updates, _ = no_decay.update(params, no_decay.init(params))
    assert jax.tree.structure(updates) == jax.tree.structure(params)

  def test_non_boolean_mask_is_rejected(self):
    tx = self.xla(1e-3, mask={"dense": jnp.array(True), "scale": False})
    params = params_tree()
    with pytest.raises(TypeError, match=r"mask\['dense'\]\['b'\] must be a Python bool"):
      tx.update(params, tx.init(params), params)
