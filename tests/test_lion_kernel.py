"""The Lion Pallas kernel equals its reference (interpret mode, both flavours)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from helpers import ELEMENTWISE_KERNEL_CASES, assert_close, random_array, tolerance
from pallasopt.kernels import lion as lion_k

hyperparams = st.fixed_dictionaries({
    "learning_rate": st.floats(1e-5, 1.0),
    "b1": st.floats(0.0, 0.99),
    "b2": st.floats(0.5, 0.9999),
    "weight_decay": st.floats(0.0, 1.0),
    "grad_scale": st.sampled_from([1.0, 0.25, 3.0]),
})


@given(
    **ELEMENTWISE_KERNEL_CASES,
    hp=hyperparams,
)
def test_kernel_equals_reference_over_steps(
    shape, param_dtype, grad_dtype, mu_dtype, mode, decay, backend, hp, seed
):
  rng = np.random.default_rng(seed)
  p = random_array(rng, shape, param_dtype)
  m = random_array(rng, shape, mu_dtype, scale=0.1)
  grads = [random_array(rng, shape, grad_dtype) for _ in range(3)]
  s = lion_k.lion_scalars(**hp)

  @jax.jit  # one compile for the three steps, not one per eager kernel call
  def trajectory(p, m, grads):
    steps = []
    for g in grads:
      want = lion_k.lion_reference(p, g, m, s, mode=mode, decay=decay)
      got = lion_k.lion_kernel(p, g, m, s, mode=mode, decay=decay, backend=backend, interpret=True)
      steps.append((got, want))
      # Chain the reference's own results so each step compares the same inputs.
      p, m = (want[0] if mode == "apply" else p), want[1]
    return steps

  for step, (got, want) in enumerate(trajectory(p, m, grads)):
    for name, a, b in zip(("p/u", "m"), got, want):
      assert a.dtype == b.dtype, name
      assert_close(a, b, tolerance(a.dtype), err_msg=f"step {step} {name}")


@pytest.mark.parametrize("backend", ["tpu", "triton"])
def test_updates_without_decay_need_no_params(backend):
  rng = np.random.default_rng(0)
  g, m = (random_array(rng, (300,), jnp.float32) for _ in range(2))
  s = lion_k.lion_scalars(1e-2, 0.9, 0.99, 0.0)
  want = lion_k.lion_reference(None, g, m, s, mode="updates", decay=False)
  got = lion_k.lion_kernel(None, g, m, s, mode="updates", decay=False, backend=backend, interpret=True)
  for a, b in zip(got, want):
    assert_close(a, b, 2e-6)


def test_update_is_the_sign_of_the_interpolation_plus_decay():
  # c = 0.5*m + 0.5*g picks the sign per element; sign(0) = 0.
  p = jnp.array([2.0, 2.0, 2.0, -4.0])
  g = jnp.array([1.0, -3.0, 1.0, 0.0])
  m = jnp.array([1.0, 1.0, -1.0, 0.0])
  s = lion_k.lion_scalars(0.1, 0.5, 0.75, 0.5)
  for impl in ("xla", "interpret"):
    u, m_new = lion_k.lion_updates(p, g, m, s, impl=impl)
    np.testing.assert_allclose(u, [-0.2, 0.0, -0.1, 0.2], rtol=1e-6)
    np.testing.assert_allclose(m_new, [1.0, 0.0, -0.5, 0.0], rtol=1e-6)


@pytest.mark.parametrize("backend", ["tpu", "triton"])
def test_sign_matches_jnp_sign_on_special_values(backend):
  g = jnp.array([0.0, -0.0, jnp.nan, jnp.inf, -jnp.inf, 1e-45, -1e-45, 3.0, -2.0])
  s = lion_k.lion_scalars(1.0, 0.0, 0.5, 0.0)  # c = g, u = -sign(g)
  u, _ = lion_k.lion_kernel(None, g, jnp.zeros_like(g), s, mode="updates", decay=False,
                            backend=backend, interpret=True)
  np.testing.assert_array_equal(u, -jnp.sign(g))


def test_missing_params_are_reported():
  x = jnp.ones((8,))
  s = lion_k.lion_scalars(1e-2, 0.9, 0.99, 0.1)
  with pytest.raises(ValueError, match="p is required in 'apply' mode"):
    lion_k.lion_apply(None, x, x, s, impl="xla")
  with pytest.raises(ValueError, match="p is required in 'updates' mode with decay"):
    lion_k.lion_updates(None, x, x, s, impl="interpret")


def test_empty_leaf_is_a_no_op():
  x = jnp.ones((0, 3))
  out = lion_k.lion_apply(x, x, x, lion_k.lion_scalars(1e-2, 0.9, 0.99, 0.1), impl="interpret")
  assert all(o.shape == (0, 3) for o in out)


def _pallas_call(fn, *args):
  (eqn,) = [e for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "pallas_call"]
  return eqn


@pytest.mark.parametrize(
    "mode,dtypes,decay,expected_bytes_per_element",
    [
        ("apply", (jnp.float32,) * 3, True, 20),  # read p,g,m; write p,m
        # with decay XLA adds -lr wd p outside the kernel, fused with the apply after it
        ("updates", (jnp.float32,) * 3, True, 16),  # read g,m; write u,m
        ("updates", (jnp.float32,) * 3, False, 16),  # p not read
        ("apply", (jnp.bfloat16,) * 3, True, 10),
        ("apply", (jnp.bfloat16, jnp.bfloat16, jnp.float32), False, 14),  # f32 m
    ],
)
def test_cost_estimate_counts_the_bytes_each_mode_moves(mode, dtypes, decay, expected_bytes_per_element):
  n = 1000
  p, g, m = (jnp.ones((n,), d) for d in dtypes)
  s = lion_k.lion_scalars(1e-2, 0.9, 0.99, 0.1)
  eqn = _pallas_call(
      lambda *a: lion_k.lion_kernel(*a, s, mode=mode, decay=decay, backend="tpu"), p, g, m
  )
  cost = eqn.params["cost_estimate"]
  assert cost.bytes_accessed == expected_bytes_per_element * n
  assert cost.flops == lion_k.FLOPS_PER_ELEMENT * n and cost.transcendentals == 0


@pytest.mark.parametrize(
    "mode,decay,aliases",
    # Inputs: scalars, g, m[, p] -> outputs p/u, m.
    [("apply", True, {3: 0, 2: 1}), ("apply", False, {3: 0, 2: 1}), ("updates", True, {2: 1})],
)
def test_params_and_momentum_are_aliased_in_place(mode, decay, aliases):
  x = jnp.ones((256,))
  s = lion_k.lion_scalars(1e-2, 0.9, 0.99, 0.1)
  eqn = _pallas_call(
      lambda *a: lion_k.lion_kernel(*a, s, mode=mode, decay=decay, backend="triton"), x, x, x
  )
  assert dict(eqn.params["input_output_aliases"]) == aliases
