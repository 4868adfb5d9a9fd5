"""pallasopt.optim.muon is a drop-in for optax.contrib.muon, and its variants
follow their published formulas.

Every trajectory runs jitted (one compile per configuration) to stay in the
CI time budget.
"""

import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers as DN

import pallasopt
from helpers import assert_trees_close, random_array, step_grads
from pallasopt.kernels import newton_schulz as ns
from pallasopt.kernels import ns_coefficients
from pallasopt.optim.muon import MUON_STATIC_ARGS, muon, shape_scale


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {
      "w": random_array(rng, (16, 24), jnp.float32),
      "t": random_array(rng, (24, 8), jnp.float32),
      "k": random_array(rng, (2, 8, 16), jnp.float32),
      "b": random_array(rng, (7,), jnp.float32),
      "s": jnp.asarray(1.5, jnp.float32),
  }


def _trajectory(tx, params, steps=2, fused=False):
  """``steps`` jitted steps; returns (params, state)."""

  @jax.jit
  def step(params, state, i):
    grads = step_grads(params, i)
    if fused:
      return pallasopt.optim.apply_gradients(tx, params, grads, state)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for i in range(steps):
    params, state = step(params, state, jnp.float32(i))
  return params, state


_K_DIMS = {"w": DN(), "t": DN(0, 1), "k": DN((1,), (2,)), "b": None, "s": None}


# ns_steps=2 keeps compiles short; the default 5 steps run in the first case.
@pytest.mark.parametrize(
    "kwargs,fused",
    [
        ({}, True),
        (dict(weight_decay=0.1, nesterov=False, adam_weight_decay=0.05, ns_coeffs="dion", consistent_rms=0.2, adaptive=True, preconditioning="aol"), False),
        (dict(ns_coeffs=((4.0, -6.0, 2.5), (3.0, -4.0, 1.5)), preconditioning="schatten",
              adam_learning_rate=3e-3, weight_decay=0.1, mu_dtype=jnp.float32,
              weight_decay_mask={"w": True, "t": False, "k": True, "b": False, "s": False}), False),
        (dict(ns_steps=2, muon_weight_dimension_numbers=lambda p: _K_DIMS, preconditioning="spectral",
              learning_rate=optax.linear_schedule(1e-2, 1e-3, 4)), True),
    ],
)
def test_matches_optax_over_steps(kwargs, fused):
  kwargs = {"learning_rate": 1e-2, **kwargs}
  got = _trajectory(muon(impl="xla", **kwargs), _params(), fused=fused)
  want = _trajectory(optax.contrib.muon(**kwargs), _params())
  assert_trees_close(got, want, rtol=2e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_interpreted_kernels_match_optax(fused):
  kwargs = dict(learning_rate=1e-2, weight_decay=0.1, adam_weight_decay=0.01, ns_steps=2)
  got = _trajectory(muon(impl="interpret", **kwargs), _params(), fused=fused)
  want = _trajectory(optax.contrib.muon(**kwargs), _params())
  assert_trees_close(got, want, rtol=2e-5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"mu_dtype": jnp.bfloat16, "weight_decay": optax.constant_schedule(0.1)},
        {"ns_coeffs": "dion", "weight_decay_mask": lambda p: jax.tree.map(lambda x: x.ndim == 2, p)},
        {"muon_weight_dimension_numbers": {"w": DN(), "t": None, "k": DN(1, 2), "b": None, "s": None}},
        {"muon_weight_dimension_numbers": lambda p: jax.tree.map(lambda x: DN() if x.ndim == 2 else None, p)},
    ],
)
def test_state_tree_equals_optax(kwargs):
  ours = muon(1e-3, **kwargs).init(_params())
  theirs = optax.contrib.muon(1e-3, **kwargs).init(_params())
  assert jax.tree.structure(ours) == jax.tree.structure(theirs)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    assert a.shape == b.shape and a.dtype == b.dtype
  assert ours[0]["muon"][0][0][1]["w"].shape == (16, 24)


@pytest.mark.parametrize("first,second", [("optax", "ours"), ("ours", "optax")])
def test_checkpoint_swap_continues_the_same_trajectory(first, second):
  kwargs = dict(learning_rate=1e-2, weight_decay=0.05, ns_steps=2)
  make = {"optax": optax.contrib.muon(**kwargs), "ours": muon(impl="xla", **kwargs)}
  update = {k: jax.jit(tx.update) for k, tx in make.items()}
  params, state = _params(), make[first].init(_params())
  for i in range(3):
    updates, state = update[first if i < 1 else second](step_grads(params, i), state, params)
    params = optax.apply_updates(params, updates)
  assert_trees_close((params, state), _trajectory(make["optax"], _params(), 3), 2e-5)


def _static_args(factory):
  return tuple(a for a in MUON_STATIC_ARGS if a in inspect.signature(factory).parameters)


@pytest.mark.parametrize(
    "compose",
    [
        lambda mk: optax.chain(optax.clip_by_global_norm(1.0), mk(learning_rate=1e-2, ns_steps=2)),
        lambda mk: optax.masked(mk(learning_rate=1e-2, ns_steps=2),
                                {"w": True, "t": True, "k": False, "b": True, "s": False}),
        lambda mk: optax.inject_hyperparams(mk, static_args=_static_args(mk))(
            learning_rate=1e-2, beta=0.9, ns_steps=2),
    ],
    ids=["chain", "masked", "inject_hyperparams"],
)
def test_composes_like_optax(compose):
  got = _trajectory(compose(functools.partial(muon, impl="xla")), _params(), steps=2)
  want = _trajectory(compose(optax.contrib.muon), _params(), steps=2)
  # inject_hyperparams also records our extra numeric arguments (e.g.
  # extra_scale_factor) among its hyperparams; compare the inner state.
  inner = lambda state: getattr(state, "inner_state", state)
  assert_trees_close((got[0], inner(got[1])), (want[0], inner(want[1])), 2e-5)


def test_changing_learning_rate_does_not_retrace():
  tx = optax.inject_hyperparams(functools.partial(muon, impl="interpret"), static_args=MUON_STATIC_ARGS)(
      learning_rate=1e-2, ns_steps=1
  )
  traces = []

  @jax.jit
  def step(params, state):
    traces.append(1)
    updates, state = tx.update(step_grads(params, 0), state, params)
    return optax.apply_updates(params, updates), state

  params, state = _params(), tx.init(_params())
  for lr in (1e-2, 3e-3, 1e-4):
    state.hyperparams["learning_rate"] = jnp.asarray(lr)
    params, state = step(params, state)
  assert len(traces) == 1


# ---- Extensions, each against a reference written from its formula. ----


def _first_update(tx, params, grads):
  return jax.jit(tx.update)(grads, tx.init(params), params)


def _nesterov_hat(g, beta, style="optax"):
  """Step-1 momentum estimate from zero state."""
  m = (1 - beta) * g
  if style == "lerp":
    return (1 - beta) * g + beta * m
  return beta * m / (1 - beta**2) + (1 - beta) * g / (1 - beta)


@pytest.mark.parametrize("preset", sorted(ns_coefficients.PRESETS))
def test_every_preset_follows_its_table(preset):
  steps = {"deepseekv4": 10, "cubic5": 5}.get(preset, 3)
  w = _params()["w"]
  tx = muon(0.1, ns_coeffs=preset, ns_steps=steps, impl="xla")
  state = tx.init({"w": w})
  np.testing.assert_array_equal(state[0]["muon"][0][0].ns_coeffs, ns_coefficients.preset_table(preset, steps))
  u, _ = _first_update(tx, {"w": w}, {"w": w})
  o = ns.newton_schulz_reference(_nesterov_hat(w, 0.95), jnp.asarray(ns_coefficients.preset_table(preset, steps)))
  assert_trees_close(u["w"], -0.1 * math.sqrt(max(1, 24 / 16)) * o, 2e-5)


def test_custom_coefficients_cycle():
  w = _params()["w"]
  custom = ((3.0, -3.2, 1.2), (2.0, -1.5, 0.5))
  tx = muon(0.1, ns_coeffs="custom", custom_ns_coeffs=custom, ns_steps=5, impl="xla")
  table = tx.init({"w": w})[0]["muon"][0][0].ns_coeffs
  np.testing.assert_array_equal(table, np.asarray([custom[i % 2] for i in range(5)], np.float32))


@pytest.mark.parametrize("mode", ["shape_scaling", "spectral", "unit_rms_norm"])
@pytest.mark.parametrize("name", ["w", "t"])
def test_scale_modes(mode, name):
  g = _params()[name]
  fan_in, fan_out = g.shape
  formula = {
      "shape_scaling": math.sqrt(max(1, fan_out / fan_in)),
      "spectral": math.sqrt(max(fan_out, fan_in)),
      "unit_rms_norm": math.sqrt(fan_out / fan_in),
  }[mode]
  assert shape_scale(fan_in, fan_out, mode) == pytest.approx(formula)
  tx = muon(1.0, scale_mode=mode, extra_scale_factor=0.3, impl="xla")
  u, _ = _first_update(tx, {name: g}, {name: g})
  o = ns.newton_schulz_reference(_nesterov_hat(g, 0.95), ns_coefficients.coefficient_table(ns_coefficients.PRESETS["simple"][0], 5))
  assert_trees_close(u[name], -0.3 * formula * o, 2e-5)


def test_lerp_momentum_has_no_bias_correction():
  g = _params()["w"]
  tx = muon(1.0, momentum="lerp", beta=0.9, impl="xla")
  u, state = _first_update(tx, {"w": g}, {"w": g})
  o = ns.newton_schulz_reference(_nesterov_hat(g, 0.9, "lerp"), ns_coefficients.coefficient_table(ns_coefficients.PRESETS["simple"][0], 5))
  assert_trees_close(u["w"], -math.sqrt(24 / 16) * o, 2e-5)
  assert_trees_close(state[0]["muon"][0][0].mu["w"], 0.1 * g, 1e-6)


@pytest.mark.parametrize("method", ["adamuon", "normuon", "namo"])
@pytest.mark.parametrize("name", ["w", "t"])
def test_second_moments(method, name):
  g = _params()[name]
  beta2, eps = 0.9, 1e-8
  tx = muon(1.0, second_moment=method, beta2=beta2, second_moment_eps=eps, momentum="lerp",
            scale_mode="spectral", impl="xla")
  u, state = _first_update(tx, {name: g}, {name: g})
  hat = _nesterov_hat(g, 0.95, "lerp")
  o = ns.newton_schulz_reference(hat, ns_coefficients.coefficient_table(ns_coefficients.PRESETS["simple"][0], 5))
  fan_in, fan_out = g.shape
  if method == "adamuon":
    nu = (1 - beta2) * o * o
    want = o / (jnp.sqrt(nu) + eps)
  elif method == "normuon":
    # One entry per output neuron when fan_out >= fan_in, else per input row.
    nu = (1 - beta2) * jnp.mean(o * o, axis=0 if fan_out >= fan_in else 1, keepdims=True)
    want = o * jax.lax.rsqrt(jnp.maximum(nu, eps))
  else:
    nu = (1 - beta2) * jnp.sum(g * g)
    want = o * jnp.linalg.norm(hat) / (jnp.sqrt(nu) + eps)
  assert_trees_close(u[name], -math.sqrt(max(fan_in, fan_out)) * want, 5e-5)
  stored = state[0]["muon"][0][4].nu[name]
  assert_trees_close(stored.reshape(-1), jnp.reshape(nu, -1), 5e-5)


def test_qkv_split_orthogonalizes_parts_separately():
  rng = np.random.default_rng(5)
  groups, split, fan_in = 2, (4, 2, 2), 16
  g = random_array(rng, (fan_in, groups * sum(split)), jnp.float32)
  tx = muon(1.0, qkv_split_shapes=split, momentum="lerp", nesterov=False, beta=0.0, impl="xla")
  u, _ = _first_update(tx, {"qkv": g}, {"qkv": g})
  table = ns_coefficients.coefficient_table(ns_coefficients.PRESETS["simple"][0], 5)
  view = g.reshape(fan_in, groups, sum(split))
  bounds = np.cumsum((0,) + split)
  parts = []
  for lo, hi in zip(bounds[:-1], bounds[1:]):
    part = view[..., lo:hi].reshape(fan_in, -1)
    o = ns.newton_schulz_reference(part, table) * math.sqrt(max(1, part.shape[1] / fan_in))
    parts.append(o.reshape(fan_in, groups, hi - lo))
  want = -jnp.concatenate(parts, axis=-1).reshape(g.shape)
  assert_trees_close(u["qkv"], want, 2e-5)


def test_blockwise_orthogonalizes_blocks():
  g = _params()["w"]
  tx = muon(1.0, blockwise=(2, 2), momentum="lerp", nesterov=False, beta=0.0, impl="xla")
  u, _ = _first_update(tx, {"w": g}, {"w": g})
  table = ns_coefficients.coefficient_table(ns_coefficients.PRESETS["simple"][0], 5)
  scale = math.sqrt(max(1, 12 / 8))
  rows = [
      jnp.concatenate([ns.newton_schulz_reference(g[r:r + 8, c:c + 12], table) for c in (0, 12)], 1)
      for r in (0, 8)
  ]
  assert_trees_close(u["w"], -scale * jnp.concatenate(rows, 0), 2e-5)


def test_adamw_predicate_routes_embeddings_to_adamw():
  params = {"embed": _params()["w"], "w": _params()["t"]}
  tx = muon(1e-2, adamw_predicate=lambda path, x: "embed" in path, impl="xla")
  state = tx.init(params)
  assert isinstance(state[0]["muon"][0][0].mu["embed"], optax.MaskedNode)
  assert state[0]["adam"][0][0].mu["embed"].shape == (16, 24)


def test_stacked_axes_orthogonalize_each_matrix():
  # k: two stacked matrices; b: their stacked biases (AdamW).
  params = {"k": _params()["k"], "b": _params()["b"][None].repeat(2, axis=0)}
  got = _trajectory(muon(1e-2, stacked_axes=1, impl="xla"), params)
  dims = {"k": DN(1, 2), "b": None}
  want = _trajectory(optax.contrib.muon(1e-2, muon_weight_dimension_numbers=dims), params)
  assert_trees_close(got, want, 2e-5)


@pytest.mark.parametrize(
    "kwargs,error",
    [
        (dict(ns_coeffs="cubic7"), ValueError),
        (dict(ns_coeffs="cubic5", ns_steps=3), ValueError),
        (dict(ns_coeffs=(1.0, 2.0)), ValueError),
        (dict(ns_coeffs=((1.0, 2.0, 3.0),) * 6), ValueError),
        (dict(ns_coeffs="custom"), ValueError),
        (dict(beta=1.0), ValueError),
        (dict(scale_mode="rms"), ValueError),
        (dict(scale_mode="spectral", consistent_rms=0.2), ValueError),
        (dict(momentum="heavy"), ValueError),
        (dict(second_moment="adam"), ValueError),
        (dict(blockwise=(0, 2)), ValueError),
        (dict(stacked_axes=-1), ValueError),
        (dict(iter_dtype=jnp.float16), TypeError),
        (dict(preconditioning="polar"), ValueError),
    ],
)
def test_bad_arguments(kwargs, error):
  with pytest.raises(error):
    muon(1e-2, **kwargs)


def test_bad_trees_name_the_leaf():
  tx = muon(1e-2, impl="xla")
  params = _params()
  state = tx.init(params)
  grads = dict(params, w=jnp.ones((16, 25)))
  with pytest.raises(ValueError, match=r"\['w'\]"):
    tx.apply_gradients(params, grads, state)
  with pytest.raises(ValueError, match="qkv_split_shapes"):
    muon(1e-2, qkv_split_shapes=(5, 2, 2), impl="xla").update(params, state, params)
