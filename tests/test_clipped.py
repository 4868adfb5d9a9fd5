"""`pallasopt.optim.clipped`: Optax's clip chain, its factor inside the kernels.

Each case runs the kernels interpreted against ``optax.chain(
optax.clip_by_global_norm(c), tx)`` on the XLA path, on gradients whose
global norm is above the limit (clipped) and below it (let through), in the
``update`` form and through `apply_gradients`. The factor is rounded once
(``c / |g|``) where Optax divides and multiplies: the results agree to
`assert_trees_close`'s f32 tolerance, the states' structure exactly.
"""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import pallasopt
from helpers import assert_trees_close, optax_step, step_grads

_CASES = {
    "adamw-f32": lambda impl: pallasopt.optim.adamw(1e-2, weight_decay=0.1, impl=impl),
    "adamw-int8": lambda impl: pallasopt.optim.adamw(1e-2, state_format="int8", impl=impl),
    "lion-int8": lambda impl: pallasopt.optim.lion(1e-3, state_format="int8", impl=impl),
    # Its scaling runs inside an Optax chain (chained_transformation).
    "adafactor": lambda impl: pallasopt.optim.adafactor(1e-2, impl=impl),
    # The factor in the momentum kernel (int8) or Muon's XLA step (f32).
    "muon-int8": lambda impl: pallasopt.optim.muon(1e-2, state_format="int8", impl=impl),
    "muon-f32": lambda impl: pallasopt.optim.muon(1e-2, impl=impl),
}


def _params():
  params = {"w": jnp.zeros((64, 256)), "b": jnp.zeros((256,))}
  return jax.tree.map(lambda p, q: p + q, params, step_grads(params, 7))


def _grads_of_norm(params, step, norm):
  grads = step_grads(params, step)
  return jax.tree.map(lambda g: g * norm / optax.tree.norm(grads), grads)


def _updating_step(tx):
  @jax.jit
  def step(params, grads, state):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


@pytest.mark.parametrize("form", ["update", "apply_gradients"])
@pytest.mark.parametrize("case", sorted(_CASES))
def test_clipped_steps_as_the_optax_chain_does(case, form):
  ours = pallasopt.optim.clipped(_CASES[case]("interpret"), 1.0)
  chain = optax.chain(optax.clip_by_global_norm(1.0), _CASES[case]("xla"))
  assert isinstance(ours, pallasopt.optim.FusedGradientTransformation)
  params = _params()
  got, want = (params, ours.init(params)), (params, chain.init(params))
  assert jax.tree.structure(got[1]) == jax.tree.structure(want[1])
  step = (jax.jit(functools.partial(pallasopt.optim.apply_gradients, ours))
          if form == "apply_gradients" else _updating_step(ours))
  chain_step = optax_step(chain)
  for i, norm in enumerate([30.0, 0.5]):
    grads = _grads_of_norm(params, i, norm)
    got = step(got[0], grads, got[1])
    want = chain_step(want[0], grads, want[1])
    assert_trees_close(got, want)


def test_an_outer_clip_composes_with_the_inner_one():
  # apply_gradients(clipped(tx, 1), max_grad_norm=4) is chain(clip 4, clip 1, tx).
  ours = pallasopt.optim.clipped(_CASES["adamw-int8"]("interpret"), 1.0)
  chain = optax.chain(optax.clip_by_global_norm(4.0), optax.clip_by_global_norm(1.0),
                      _CASES["adamw-int8"]("xla"))
  params = _params()
  state = ours.init(params)
  want_state = chain.init(params)
  fused = jax.jit(functools.partial(pallasopt.optim.apply_gradients, ours, max_grad_norm=4.0))
  for i, norm in enumerate([30.0, 2.0]):
    grads = _grads_of_norm(params, i, norm)
    got, state = fused(params, grads, state)
    want, want_state = optax_step(chain)(params, grads, want_state)
    assert_trees_close(got, want)
    assert_trees_close(state[1], want_state[2])


@pytest.mark.parametrize("order", ["clip each call", "clip the mean"])
@pytest.mark.parametrize("form", ["update", "apply_gradients"])
def test_accumulating_with_the_clip_keeps_the_kernels_gated(order, form):
  # clipped(multi_steps(tx, k)) is chain(clip, MultiSteps(tx, k)): each
  # call's gradients clipped before they are accumulated; multi_steps(
  # clipped(tx), k) is MultiSteps(chain(clip, tx), k): the k-th call's mean
  # clipped, clipped(tx) gated as tx is. Both are fused, the kernels holding
  # the state on the calls that only accumulate.
  make = _CASES["adamw-int8"]
  clip = lambda tx: pallasopt.optim.clipped(tx, 1.0)
  if order == "clip each call":
    ours = clip(pallasopt.optim.multi_steps(make("interpret"), 2))
    want_tx = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.MultiSteps(make("xla"), 2).gradient_transformation())
  else:
    ours = pallasopt.optim.multi_steps(clip(make("interpret")), 2)
    want_tx = optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(1.0), make("xla")), 2).gradient_transformation()
  assert isinstance(ours, pallasopt.optim.FusedGradientTransformation)
  if order == "clip the mean":
    assert pallasopt.optim.fused_update(clip(make("xla"))).gated
  params = _params()
  got, want = (params, ours.init(params)), (params, want_tx.init(params))
  step = (jax.jit(functools.partial(pallasopt.optim.apply_gradients, ours))
          if form == "apply_gradients" else _updating_step(ours))
  chain_step = optax_step(want_tx)
  # Means above and below the limit on the applying calls.
  for i, norm in enumerate([30.0, 0.5, 0.3, 0.2]):
    grads = _grads_of_norm(params, i, norm)
    got, want = step(got[0], grads, got[1]), chain_step(want[0], grads, want[1])
    assert_trees_close(got, want)


def test_a_transform_without_kernels_gets_optax_s_chain():
  tx = pallasopt.optim.clipped(optax.sgd(0.1), 1.0)
  assert not isinstance(tx, pallasopt.optim.FusedGradientTransformation)
  params = _params()
  grads = _grads_of_norm(params, 0, 30.0)
  updates, _ = tx.update(grads, tx.init(params), params)
  chain = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
  want, _ = chain.update(grads, chain.init(params), params)
  assert_trees_close(updates, want)


def test_an_infinite_max_norm_never_clips():
  # Optax's clip takes it (its norm is always below): no NaN factor here.
  ours = pallasopt.optim.clipped(_CASES["adamw-int8"]("interpret"), float("inf"))
  plain = _CASES["adamw-int8"]("xla")
  params = _params()
  grads = _grads_of_norm(params, 0, 30.0)
  got = _updating_step(ours)(params, grads, ours.init(params))
  want = optax_step(plain)(params, grads, plain.init(params))
  assert_trees_close(got[0], want[0])
  assert_trees_close(got[1][1], want[1])


@pytest.mark.parametrize("max_norm", [0.0, -1.0, float("nan")])
def test_a_bad_max_norm_is_named(max_norm):
  with pytest.raises(ValueError, match="max_norm"):
    pallasopt.optim.clipped(pallasopt.optim.adamw(1e-3), max_norm)
