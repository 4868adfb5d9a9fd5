"""`pallasopt.optim.multi_steps` and the gate it passes into the kernels.

The gate's contract (`FusedUpdate.gated`): a closed gate holds the step, the
params and every stored code as they were read (zero updates), and an open
one is the ungated step, in the kernels (interpreted) and the XLA path,
every state format. `multi_steps` is then the step of ``optax.MultiSteps``
around the same transform, with Optax's state, in the update form and
(params to the fused apply of the accumulated gradients) the fused one.
What a closed gate holds is compared bit for bit; computed steps as two
programs computing the same math (`_assert_same_step`), call by call from
the same state.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pallasopt
from helpers import assert_close, assert_nearly_same_codes, tolerance
from pallasopt.kernels import quant, use_impl
from pallasopt.optim import multi_steps

# A matrix large enough for blockwise state (`quant.MIN_QUANTIZED_SIZE`), a
# vector whose state stays f32, and a float16 leaf no kernel takes (Optax's
# math, held after it).
_PARAMS = {
    "w": jnp.linspace(-1.0, 1.0, 64 * 256, dtype=jnp.float32).reshape(64, 256),
    "b": jnp.full((256,), 0.5, jnp.float32),
    "h": jnp.full((8,), 0.25, jnp.float16),
}


def _grads(i: int):
  # float16 gradients of order 1: Optax's AdamW in float16 divides by the root
  # of a second moment that underflows to zero below ~1e-4.
  keys = jax.random.split(jax.random.key(i), 3)
  return {name: (jax.random.normal(k, p.shape) * (1.0 if name == "h" else 0.1)).astype(p.dtype)
          for k, (name, p) in zip(keys, _PARAMS.items())}


# Every gated family, each low-bit format its codec runs (NAdamW is AdamW's
# kernel with nesterov=True; fp8 and bf16 share the others' gating code).
_CASES = {
    "adamw-f32": (pallasopt.optim.adamw, {"weight_decay": 0.1}),
    "adamw-int8": (pallasopt.optim.adamw, {"weight_decay": 0.1, "state_format": "int8"}),
    "adamw-int4": (pallasopt.optim.adamw, {"weight_decay": 0.1, "state_format": "int4"}),
    "adamw-bf16": (pallasopt.optim.adamw, {"state_format": "bf16"}),
    "lion-fp8": (pallasopt.optim.lion, {"weight_decay": 0.1, "state_format": "fp8"}),
    "rmsprop-int8": (pallasopt.optim.rmsprop,
                     {"centered": True, "momentum": 0.9, "state_format": "int8"}),
    "mars-int8": (pallasopt.optim.mars, {"state_format": "int8"}),
    # Muon: "w" takes the momentum kernel, the vectors the AdamW partition;
    # NAMO's second moment reads the (accumulated) gradient, and AOL's
    # preconditioning of a zero momentum is not zero.
    "muon-int8": (pallasopt.optim.muon, {"weight_decay": 0.1, "state_format": "int8"}),
    "muon-f32": (pallasopt.optim.muon, {"weight_decay": 0.1, "second_moment": "namo",
                                        "preconditioning": "aol"}),
}


def _tx(case: str):
  make, kwargs = _CASES[case]
  return make(optax.linear_schedule(1e-2, 1e-3, 10), **kwargs)


def _assert_same(got, want, what):
  """Bit for bit: what a closed gate holds (selected, never computed)."""
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                  err_msg=what)


def _assert_same_step(got, want, what):
  """The same step compiled into two programs: XLA may contract a multiply-add
  into an FMA in one and not the other, an ulp of the stored dtype
  (`helpers.tolerance`; float16 leaves run Optax's math in float16), and a
  blockwise code next to a rounding boundary one code apart
  (`helpers.assert_nearly_same_codes`). Counters are exact."""
  is_leaf = quant.is_blockwise
  assert jax.tree.structure(got, is_leaf=is_leaf) == jax.tree.structure(want, is_leaf=is_leaf)
  for a, b in zip(jax.tree.leaves(got, is_leaf=is_leaf), jax.tree.leaves(want, is_leaf=is_leaf),
                  strict=True):
    if quant.is_blockwise(a):
      assert_nearly_same_codes(a, b)
    elif jnp.issubdtype(a.dtype, jnp.integer):
      np.testing.assert_array_equal(a, b, err_msg=what)
    else:
      assert a.dtype == b.dtype, what
      rtol = 4 * float(jnp.finfo(a.dtype).eps) if a.dtype == jnp.float16 else tolerance(a.dtype)
      assert_close(a, b, rtol, what)


# The kernels of every case; the XLA path's gate is one select in
# `_update.reference_update` for every family, run on blockwise and counted
# state.
@pytest.mark.parametrize("case,impl", [
    *((case, "interpret") for case in _CASES if case not in ("adamw-f32", "muon-f32")),
    ("adamw-int8", "xla"), ("rmsprop-int8", "xla"), ("muon-f32", "xla"),
])
def test_a_closed_gate_holds_the_step_and_an_open_one_is_the_step(case, impl):
  tx = _tx(case)
  assert tx.update.gated
  with use_impl(impl):
    state = tx.init(_PARAMS)
    # One real step first, so that the held state is not all zeros.
    params, state = jax.jit(tx.apply_gradients)(_PARAMS, _grads(0), state)
    grads = _grads(1)
    for gate in (False, True):
      gate = jnp.asarray(gate)
      updates, updated = jax.jit(
          lambda g, s, p, gate: tx.scaled_update(g, s, p, gate=gate))(grads, state, params, gate)
      applied, applied_state = jax.jit(
          lambda p, g, s, gate: tx.apply_gradients(p, g, s, gate=gate))(params, grads, state, gate)
      if gate:
        want_updates, want_state = jax.jit(tx.update)(grads, state, params)
        want_params, want_applied = jax.jit(tx.apply_gradients)(params, grads, state)
      else:
        want_updates, want_state = jax.tree.map(jnp.zeros_like, grads), state
        want_params, want_applied = params, state
      check = _assert_same_step if gate else _assert_same
      check(updates, want_updates, f"updates, gate {gate}")
      check(updated, want_state, f"update's state, gate {gate}")
      check(applied, want_params, f"params, gate {gate}")
      check(applied_state, want_applied, f"apply's state, gate {gate}")


def _step(tx, fused: bool):
  """One jitted call of ``tx``: ``(params, grads, state) -> (params, state)``."""
  if fused:
    return jax.jit(functools.partial(pallasopt.optim.apply_gradients, tx))

  def step(params, grads, state):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step)


def _agree_call_by_call(got_tx, want_tx, *, fused: bool, grads=_grads, calls: int = 7):
  """From the same params and state on every call (``want_tx``'s, in the update
  form), ``got_tx`` computes ``want_tx``'s call. A stochastic rounding a code
  apart (`_assert_same_step`) is not carried into the next call."""
  got_step, want_step = _step(got_tx, fused), _step(want_tx, False)
  params, state = _PARAMS, want_tx.init(_PARAMS)
  for call in range(calls):
    want = want_step(params, grads(call), state)
    _assert_same_step(got_step(params, grads(call), state), want, f"call {call}")
    params, state = want
  return state


# The update form for every gated family; the fused form (the kernels write
# the params, one rounding of p + u where the update form has two) for two.
@pytest.mark.parametrize("case,impl,fused", [
    *((case, "interpret", False) for case in ("adamw-int8", "adamw-int4", "lion-fp8",
                                              "rmsprop-int8", "mars-int8", "muon-int8")),
    ("adamw-f32", "xla", False), ("adamw-int8", "xla", False), ("muon-f32", "xla", False),
    ("adamw-int8", "interpret", True), ("rmsprop-int8", "interpret", True),
    ("muon-int8", "interpret", True),
])
def test_multi_steps_is_optaxs_multisteps(case, impl, fused):
  with use_impl(impl):
    state = _agree_call_by_call(
        multi_steps(_tx(case), 3), optax.MultiSteps(_tx(case), 3).gradient_transformation(),
        fused=fused)
  assert int(state.gradient_step) == 2 and int(state.mini_step) == 1  # 7 calls, k = 3


def test_a_bfloat16_accumulator_accumulates_in_bfloat16_as_optaxs():
  # The kernels accumulate in float32; a narrower accumulator keeps Optax's
  # arithmetic in its own dtype, in XLA, before the gated kernels.
  with use_impl("interpret"):
    _agree_call_by_call(
        multi_steps(_tx("adamw-int8"), 3, accumulator_dtype=jnp.bfloat16),
        optax.MultiSteps(_tx("adamw-int8"), 3, accumulator_dtype=jnp.bfloat16)
        .gradient_transformation(),
        fused=False)


def test_a_schedule_of_k_a_sum_and_skipped_calls_are_optaxs():
  every_k = lambda step: jnp.where(step < 1, 2, 3)
  options = dict(use_grad_mean=False, should_skip_update_fn=optax.skip_not_finite)
  poisoned = lambda i: jax.tree.map(lambda g: g.at[0].set(jnp.nan), _grads(i))
  grads = lambda i: poisoned(i) if i == 3 else _grads(i)
  state = _agree_call_by_call(
      multi_steps(_tx("adamw-int8"), every_k, **options),
      optax.MultiSteps(_tx("adamw-int8"), every_k, **options).gradient_transformation(),
      fused=False, grads=grads)
  # 7 calls, one skipped: k = 2, then 3 calls of k = 3 and one of the next.
  assert int(state.gradient_step) == 2 and int(state.mini_step) == 1
  assert int(state.skip_state["num_not_finite"]) == 0  # the last call's


def test_an_ungated_transform_gets_optaxs_multisteps():
  for inner in (optax.adamw(1e-3), pallasopt.optim.adafactor(1e-3)):
    tx = multi_steps(inner, 2)
    assert pallasopt.optim.fused_update(tx) is None
    assert tx.update.__self__.__class__ is optax.MultiSteps
  assert not pallasopt.optim.adafactor(1e-3).update.gated


def test_a_skip_function_must_return_a_boolean_scalar():
  tx = multi_steps(_tx("adamw-int8"), 2,
                   should_skip_update_fn=lambda g, step, p: (jnp.zeros(2, bool), ()))
  with pytest.raises(ValueError, match="should_skip_update_fn must return a boolean scalar"):
    tx.update(_grads(0), tx.init(_PARAMS), _PARAMS)
