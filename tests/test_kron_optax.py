"""pallasopt.optim.kron: psgd_jax's state layout and step, Optax composition, contracts.

Every step here is jitted (op-by-op dispatch of the many small ops of a Kron
step is far slower than one compile) and parameter trees stay tiny.
"""

import functools
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import assert_trees_close, step_grads
from pallasopt.optim.adamw import adamw
from pallasopt.optim.kron import KRON_STATIC_ARGS, kron, precond_update_prob_schedule, scale_by_kron

RTOL = 2e-5


def _params(seed=0, scalar=False):
  """One matrix (compiles fast); with ``scalar``, a 0-d leaf too."""
  rng = np.random.default_rng(seed)
  params = {"w": jnp.asarray(rng.standard_normal((5, 4)), jnp.float32)}
  return {**params, "s": jnp.asarray(1.5, jnp.float32)} if scalar else params


def _shapes(tree):
  return jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype).name), tree)


@functools.cache
def _update_step(tx):
  return jax.jit(lambda p, g, s: tx.update(g, s, p))


@functools.cache
def _apply_step(tx):
  return jax.jit(tx.apply_gradients)


def _run(tx, params, steps, *, fused=False, layer_index_fn=None):
  """`steps` steps; with `layer_index_fn` (implies `fused`), passed to ``apply_gradients``."""
  if layer_index_fn is not None:
    fused = True
    step = jax.jit(functools.partial(tx.apply_gradients, layer_index_fn=layer_index_fn))
  else:
    step = _apply_step(tx) if fused else _update_step(tx)
  state = tx.init(params)
  for i in range(steps):
    grads = step_grads(params, i)
    if fused:
      params, state = step(params, grads, state)
    else:
      updates, state = step(params, grads, state)
      params = optax.apply_updates(params, updates)
  return params, state


# ---- State layout: psgd_jax's dict, factors per axis. ----


def test_state_is_psgd_jax_layout():
  params = {"w": jnp.ones((5, 4)), "b": jnp.ones((3,)), "s": jnp.ones(()), "big": jnp.ones((2, 9))}
  state = scale_by_kron(max_size_triangular=8).init(params)
  assert sorted(state) == ["Qs_preconditioners", "count", "mu", "update_counter"]
  assert _shapes(state) == {
      "count": ((), "int32"),
      "update_counter": ((), "int32"),
      "mu": _shapes(params),
      "Qs_preconditioners": {
          "w": [((5, 5), "float32"), ((4, 4), "float32")],
          "b": [((3,), "float32")],  # 1-D layers: below min_ndim_triangular
          "s": [((), "float32")],
          "big": [((2, 2), "float32"), ((9,), "float32")],  # 9 > max_size_triangular
      },
  }
  qw = state["Qs_preconditioners"]["w"]
  np.testing.assert_array_equal(qw[0], np.eye(5) ** 1.0)


@pytest.mark.parametrize(
    "kwargs,shape,want",
    [
        ({"memory_save_mode": "one_diag"}, (5, 4), [(5,), (4, 4)]),
        ({"memory_save_mode": "one_diag"}, (4, 4), [(4, 4), (4,)]),  # ties: the last axis
        ({"memory_save_mode": "all_diag"}, (5, 4), [(5,), (4,)]),
        ({"min_ndim_triangular": 1}, (6,), [(6, 6)]),
        ({"stacked_axes": 1}, (3, 5, 4), [(3, 5, 5), (3, 4, 4)]),
        ({"stacked_axes": 2}, (2, 3, 5, 4), [(2, 3, 5, 5), (2, 3, 4, 4)]),
        ({"stacked_axes": 1}, (3, 1), [(3, 1)]),  # per-layer scalars, stacked as (3, 1)
        ({"scanned_layers": {"w": True}}, (3, 5, 4), [(3, 5, 5), (3, 4, 4)]),
        ({"stacked_axes": 1}, (3, 1, 7), [(3, 1), (3, 7, 7)]),  # size-1 axes are diagonal
    ],
)
def test_factor_layout(kwargs, shape, want):
  state = scale_by_kron(**kwargs).init({"w": jnp.ones(shape)})
  assert [q.shape for q in state["Qs_preconditioners"]["w"]] == want


def test_init_scale_dtypes_and_no_momentum():
  params = {"w": jnp.ones((5, 4), jnp.bfloat16), "s": jnp.ones((), jnp.bfloat16)}
  state = scale_by_kron(b1=0.0, preconditioner_init_scale=4.0, precond_dtype=jnp.bfloat16).init(params)
  assert state["mu"] is None
  w0, w1 = state["Qs_preconditioners"]["w"]
  assert w0.dtype == jnp.bfloat16 and float(w0[0, 0]) == 2.0 and float(w1[1, 1]) == 2.0
  assert float(state["Qs_preconditioners"]["s"][0]) == 4.0
  state = scale_by_kron(mu_dtype=jnp.float32).init(params)
  assert state["mu"]["w"].dtype == jnp.float32
  assert state["Qs_preconditioners"]["s"][0].dtype == jnp.bfloat16  # psgd: ones_like(scalar)


def test_kron_state_is_the_chain_of_psgd_jax():
  params = _params(scalar=True)
  assert len(kron(1e-3).init(params)) == 2
  kron_state, decay_state, lr_state = kron(optax.linear_schedule(1e-3, 0.0, 10), weight_decay=0.1).init(params)
  assert isinstance(decay_state, optax.EmptyState)
  assert isinstance(lr_state, optax.ScaleByScheduleState)
  assert sorted(kron_state) == ["Qs_preconditioners", "count", "mu", "update_counter"]


def test_default_update_probability_schedule():
  schedule = precond_update_prob_schedule()
  assert float(schedule(0)) == 1.0 and float(schedule(500)) == 1.0
  assert float(schedule(1500)) == pytest.approx(np.exp(-1.0), rel=1e-6)
  assert float(schedule(5000)) == pytest.approx(0.03)


# ---- The step: reproducible, deterministic update decisions. ----


def test_update_decisions_follow_the_counter_and_runs_reproduce():
  tx = kron(1e-2, preconditioner_update_probability=0.5, impl="xla")
  step = _update_step(tx)

  def trajectory():
    params, state = _params(), tx.init(_params())
    qs, counters = [state[0]["Qs_preconditioners"]], []
    for i in range(4):
      updates, state = step(params, step_grads(params, i), state)
      params = optax.apply_updates(params, updates)
      qs.append(state[0]["Qs_preconditioners"])
      counters.append(int(state[0]["update_counter"]))
    return params, state, qs, counters

  params, state, qs, counters = trajectory()
  assert counters == [1, 0, 1, 0]
  changed = [not np.array_equal(a["w"][0], b["w"][0]) for a, b in zip(qs, qs[1:])]
  assert changed == [False, True, False, True]
  again = trajectory()
  for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves(again[:2])):
    np.testing.assert_array_equal(a, b)


def test_preconditioner_improves_and_q_stays_upper_triangular():
  params, state = _run(kron(1e-2, impl="xla"), _params(), 3)
  for q in state[0]["Qs_preconditioners"]["w"]:
    assert np.all(np.tril(np.asarray(q), -1) == 0)
    assert not np.allclose(q, np.eye(q.shape[0]))
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves((params, state)))


def test_fused_apply_equals_update_plus_apply_updates():
  tx = kron(optax.cosine_decay_schedule(1e-2, 10), weight_decay=0.1, impl="xla")
  want = _run(tx, _params(), 2)
  got = _run(tx, _params(), 2, fused=True)
  assert_trees_close(got, want, RTOL)


def test_fused_grad_scale_and_learning_rate_override():
  tx = kron(optax.linear_schedule(1.0, 0.0, 10), weight_decay=0.1, impl="xla")
  ref = kron(3e-3, weight_decay=0.1, impl="xla")
  params = _params()
  grads = step_grads(params, 0)
  got, state = jax.jit(functools.partial(tx.apply_gradients, grad_scale=0.25, learning_rate=3e-3))(
      params, grads, tx.init(params)
  )
  updates, ref_state = _update_step(ref)(params, jax.tree.map(lambda g: 0.25 * g, grads), ref.init(params))
  assert_trees_close(got, optax.apply_updates(params, updates), RTOL)
  assert_trees_close(state[0], ref_state[0], RTOL)


def test_stacked_layers_equal_their_slices_updated_alone():
  # Layer j of a stacked leaf draws its probe from its own index j, so it
  # updates as the slice stack[j:j+1] alone when layer_index_fn gives that
  # slice index j, and layer 0 (leaf 0, layer 0) as an unstacked leaf.
  rng = np.random.default_rng(1)
  stack = jnp.asarray(rng.standard_normal((2, 5, 4)), jnp.float32)
  first = _run(kron(1e-2, impl="xla"), {"w": stack[0]}, 2)
  second = _run(kron(1e-2, impl="xla", stacked_axes=1), {"w": stack[1:]}, 2,
                layer_index_fn=lambda shape: 1 + jnp.arange(shape[0]))
  want_w = np.stack([first[0]["w"], second[0]["w"][0]])
  want_qs = [np.stack([a, b[0]]) for a, b in zip(first[1][0]["Qs_preconditioners"]["w"],
                                                  second[1][0]["Qs_preconditioners"]["w"])]
  for kwargs in ({"stacked_axes": 1}, {"scanned_layers": {"w": True}}):
    params, state = _run(kron(1e-2, impl="xla", **kwargs), {"w": stack}, 2)
    np.testing.assert_allclose(params["w"], want_w, rtol=0, atol=1e-6)
    for got, want in zip(state[0]["Qs_preconditioners"]["w"], want_qs, strict=True):
      np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_interpreted_kernels_match_the_xla_path():
  params = {"w": jnp.asarray(np.random.default_rng(2).standard_normal((2, 5, 4)), jnp.float32),
            "s": jnp.full((2, 1), 0.5, jnp.float32)}  # one scalar per layer
  make = functools.partial(kron, 1e-2, weight_decay=0.1, stacked_axes=1)
  got = _run(make(impl="interpret"), params, 2, fused=True)
  want = _run(make(impl="xla"), params, 2, fused=True)
  assert_trees_close(got, want, 1e-4)


# ---- Composition with Optax. ----


def test_chain_masked_and_multi_steps_compose():
  params = _params(scalar=True)
  grads = [step_grads(params, i) for i in range(2)]
  base = kron(1e-2, impl="xla")
  # MultiSteps over two micro-steps == one step on the mean gradient.
  multi = optax.MultiSteps(base, every_k_schedule=2)
  state, p = multi.init(params), params
  for g in grads:
    u, state = _update_step(multi)(p, g, state)
    p = optax.apply_updates(p, u)
  mean = jax.tree.map(lambda a, b: (a + b) / 2, *grads)
  u, _ = _update_step(base)(params, mean, base.init(params))
  assert_trees_close(p, optax.apply_updates(params, u), RTOL)
  # masked: kron on "w" only; the other leaf passes through.
  masked = optax.masked(base, {"w": True, "s": False})
  u_masked, _ = _update_step(masked)(params, grads[0], masked.init(params))
  sub = kron(1e-2, impl="xla")
  u_sub, _ = _update_step(sub)({"w": params["w"]}, {"w": grads[0]["w"]}, sub.init({"w": params["w"]}))
  assert_trees_close(u_masked["w"], u_sub["w"], RTOL)
  assert_trees_close(u_masked["s"], grads[0]["s"])
  # chain: clipping first == kron on clipped gradients.
  chained = optax.chain(optax.clip(0.1), base)
  u_chain, _ = _update_step(chained)(params, grads[0], chained.init(params))
  u, _ = _update_step(base)(params, jax.tree.map(lambda g: jnp.clip(g, -0.1, 0.1), grads[0]), base.init(params))
  assert_trees_close(u_chain, u, RTOL)


def test_inject_hyperparams_does_not_retrace_when_lr_changes():
  traces = []
  tx = optax.inject_hyperparams(kron, static_args=KRON_STATIC_ARGS)(learning_rate=1e-2, impl="xla")

  @functools.partial(jax.jit, donate_argnums=(0, 2))
  def step(params, grads, state):
    traces.append(1)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = _params()
  state = tx.init(params)
  first = None
  for lr in (1e-2, 3e-3):
    state.hyperparams["learning_rate"] = jnp.asarray(lr)
    params, state = step(params, step_grads(params, 0), state)
    first = first or jax.tree.map(jnp.copy, params)
  assert len(traces) == 1
  want = _run(kron(1e-2, impl="xla"), _params(), 1)[0]
  assert_trees_close(first, want, RTOL)


def test_checkpoint_round_trip_continues_the_same_trajectory():
  tx = kron(1e-2, weight_decay=0.1, impl="xla")
  step = _update_step(tx)
  params, state = _params(), tx.init(_params())
  u, state = step(params, step_grads(params, 0), state)
  params = optax.apply_updates(params, u)
  restored = jax.tree.unflatten(
      jax.tree.structure(state), [jnp.asarray(x) for x in pickle.loads(pickle.dumps(
          [np.asarray(x) for x in jax.tree.leaves(state)]))]
  )
  grads = step_grads(params, 1)
  assert_trees_close(step(params, grads, restored), step(params, grads, state), 0.0)


def test_converges_faster_than_adamw_on_an_ill_conditioned_quadratic():
  rng = np.random.default_rng(0)
  rotation = lambda n: np.linalg.qr(rng.standard_normal((n, n)))[0]
  left = jnp.asarray(rotation(8) @ np.diag(np.logspace(0, 2, 8)) @ rotation(8), jnp.float32)
  right = jnp.asarray(rotation(6) @ np.diag(np.logspace(0, 1, 6)) @ rotation(6), jnp.float32)
  target = jnp.asarray(rng.standard_normal((8, 6)), jnp.float32)
  loss = lambda w: 0.5 * jnp.sum((left @ (w - target) @ right) ** 2)
  steps = 200

  @functools.partial(jax.jit, static_argnums=0)
  def final_loss(make, lr):
    tx = make(optax.cosine_decay_schedule(lr, steps))

    def body(carry, _):
      w, state = carry
      updates, state = tx.update(jax.grad(loss)(w), state, w)
      return (optax.apply_updates(w, updates), state), None

    w0 = jnp.zeros((8, 6))
    (w, _), _ = jax.lax.scan(body, (w0, tx.init(w0)), None, length=steps)
    return loss(w)

  kron_loss = float(final_loss(functools.partial(kron, impl="xla"), 0.1))
  adamw_losses = [float(final_loss(functools.partial(adamw, weight_decay=0.0, impl="xla"), lr))
                  for lr in (0.03, 0.1, 0.3, 1.0)]
  assert kron_loss < min(adamw_losses) / 100, (kron_loss, adamw_losses)


# ---- Bad input. ----


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"learning_rate": float("nan")}, ValueError, "learning_rate must be a finite number"),
        ({"b1": 1.0}, ValueError, r"b1 must be in \[0.0, 1.0\)"),
        ({"weight_decay": float("inf")}, ValueError, "weight_decay must be a finite number"),
        ({"preconditioner_update_probability": 1.5}, ValueError, "preconditioner_update_probability"),
        ({"preconditioner_lr": float("nan")}, ValueError, "preconditioner_lr"),
        ({"memory_save_mode": "some_diag"}, ValueError, "memory_save_mode must be one of"),
        ({"precond_grads_precision": "fp8"}, ValueError, "precond_grads_precision must be one of"),
        ({"max_size_triangular": 2.5}, ValueError, "max_size_triangular must be an int"),
        ({"stacked_axes": -1}, ValueError, "stacked_axes must be an int >= 0"),
        ({"stacked_axes": 1, "scanned_layers": {"w": True}}, ValueError, "not both"),
        ({"mu_dtype": jnp.int8}, TypeError, "mu_dtype must be float32 or bfloat16"),
        ({"impl": "cuda"}, ValueError, "impl must be one of"),
        ({"weight_decay": lambda c: 0.1}, TypeError, "weight_decay must be a scalar"),
    ],
)
def test_bad_hyperparameters_are_rejected(kwargs, error, match):
  with pytest.raises(error, match=match):
    kron(**kwargs)


def test_mismatched_grads_and_dtypes_name_the_leaf():
  tx = kron(1e-3, impl="xla")
  params = _params(scalar=True)
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"missing in grads"):
    tx.update({"w": params["w"]}, state)
  with pytest.raises(ValueError, match=r"grads\['w'\] has shape \(4, 5\)"):
    tx.update({**params, "w": jnp.ones((4, 5))}, state)
  with pytest.raises(TypeError, match=r"grads\['s'\] has dtype int32"):
    tx.update({**params, "s": jnp.int32(1)}, state)
  with pytest.raises(TypeError, match=r"params\['w'\] has dtype float16"):
    tx.init({"w": jnp.ones((2, 2), jnp.float16)})
  with pytest.raises(ValueError, match="params are required to apply gradients"):
    tx.apply_gradients(None, params, state)
  no_mu = kron(1e-3, b1=0.0, impl="xla")
  with pytest.raises(ValueError, match=r"grads\['w'\] has shape \(4, 5\) but its preconditioner"):
    no_mu.update({**params, "w": jnp.ones((4, 5))}, no_mu.init(params))


def test_inject_hyperparams_without_static_structure_args_says_what_to_do():
  tx = optax.inject_hyperparams(kron)(learning_rate=1e-2, impl="xla")
  params = _params()
  state = tx.init(params)
  with pytest.raises(TypeError, match="static_args=KRON_STATIC_ARGS"):
    jax.jit(lambda p, s: tx.update(p, s, p))(params, state)
