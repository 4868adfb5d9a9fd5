"""The AdamW Pallas kernel equals its reference (interpret mode, both flavours)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from helpers import ELEMENTWISE_KERNEL_CASES, assert_close, random_array, tolerance
from pallasopt.kernels import adamw as adamw_k
from pallasopt.kernels._elementwise import bytes_moved

hyperparams = st.fixed_dictionaries({
    "learning_rate": st.floats(1e-5, 1.0),
    "b1": st.floats(0.0, 0.99),
    "b2": st.floats(0.5, 0.9999),
    "eps": st.sampled_from([1e-8, 1e-6, 1e-3]),
    "eps_root": st.sampled_from([0.0, 1e-8, 1e-4]),
    "weight_decay": st.floats(0.0, 0.5),
})


@given(
    **ELEMENTWISE_KERNEL_CASES,
    nesterov=st.booleans(),
    hp=hyperparams,
)
def test_kernel_equals_reference_over_steps(
    shape, param_dtype, grad_dtype, mu_dtype, mode, nesterov, decay, backend, hp, seed
):
  rng = np.random.default_rng(seed)
  p = random_array(rng, shape, param_dtype)
  m = random_array(rng, shape, mu_dtype, scale=0.1)
  v = random_array(rng, shape, param_dtype, positive=True, scale=0.1)
  kernel_state = reference_state = (p, m, v)
  config = dict(mode=mode, nesterov=nesterov, decay=decay)
  # Jitted once: the step's scalars are kernel inputs, so the steps reuse it.
  kernel = jax.jit(lambda *args: adamw_k.adamw_kernel(
      *args, **config, backend=backend, interpret=True))
  for step in range(1, 4):
    g = random_array(rng, shape, grad_dtype)
    s = adamw_k.adamw_scalars(step, **hp)
    want = adamw_k.adamw_reference(reference_state[0], g, *reference_state[1:], s, **config)
    got = kernel(kernel_state[0], g, *kernel_state[1:], s)
    for name, a, b in zip(("p/u", "m", "v"), got, want):
      assert a.dtype == b.dtype, name
      assert_close(a, b, tolerance(a.dtype), err_msg=f"step {step} {name}")
    # Chain the reference's own results so each step compares the same inputs.
    reference_state = kernel_state = (
        (want[0] if mode == "apply" else reference_state[0]), want[1], want[2]
    )


@pytest.mark.parametrize("backend", ["tpu", "triton"])
def test_updates_without_decay_needs_no_params(backend):
  rng = np.random.default_rng(0)
  g, m, v = (random_array(rng, (300,), jnp.float32, positive=True) for _ in range(3))
  s = adamw_k.adamw_scalars(2, 1e-2, 0.9, 0.99, 1e-8, 0.0, 0.0)
  want = adamw_k.adamw_reference(None, g, m, v, s, mode="updates", nesterov=False, decay=False)
  got = adamw_k.adamw_kernel(
      None, g, m, v, s, mode="updates", nesterov=False, decay=False, backend=backend, interpret=True
  )
  for a, b in zip(got, want):
    assert_close(a, b, 2e-6)


def test_missing_params_are_reported():
  x = jnp.ones((8,))
  s = adamw_k.adamw_scalars(1, 1e-2, 0.9, 0.99, 1e-8, 0.0, 0.1)
  with pytest.raises(ValueError, match="p is required in 'apply' mode"):
    adamw_k.adamw_apply(None, x, x, x, s, impl="xla")
  with pytest.raises(ValueError, match="p is required in 'updates' mode with decay"):
    adamw_k.adamw_updates(None, x, x, x, s, impl="xla")


def test_empty_leaf_is_a_no_op():
  x = jnp.ones((0, 3))
  s = adamw_k.adamw_scalars(1, 1e-2, 0.9, 0.99, 1e-8, 0.0, 0.1)
  out = adamw_k.adamw_apply(x, x, x, x, s, impl="interpret")
  assert all(o.shape == (0, 3) for o in out)


@pytest.mark.parametrize(
    "mode,dtypes,decay,expected_bytes_per_element",
    [
        ("apply", (jnp.float32,) * 4, True, 28),  # read p,g,m,v; write p,m,v
        # with decay XLA adds -lr wd p outside the kernel, fused with the apply after it
        ("updates", (jnp.float32,) * 4, True, 24),  # read g,m,v; write u,m,v
        ("updates", (jnp.float32,) * 4, False, 24),  # p not read
        ("apply", (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16), True, 14),
    ],
)
def test_cost_estimate_counts_the_bytes_each_mode_moves(mode, dtypes, decay, expected_bytes_per_element):
  n = 1000
  p, g, m, v = (jnp.ones((n,), d) for d in dtypes)
  s = adamw_k.adamw_scalars(1, 1e-2, 0.9, 0.99, 1e-8, 0.0, 0.1)
  jaxpr = jax.make_jaxpr(
      lambda *a: adamw_k.adamw_kernel(*a, s, mode=mode, nesterov=False, decay=decay, backend="tpu")
  )(p, g, m, v)
  (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
  cost = eqn.params["cost_estimate"]
  assert cost.bytes_accessed == expected_bytes_per_element * n
  assert cost.flops == adamw_k.FLOPS_PER_ELEMENT * n and cost.transcendentals == n
  assert bytes_moved([p, g, m, v], [p.dtype, m.dtype, v.dtype]) == 28 * n // (4 // p.dtype.itemsize)


def test_apply_aliases_params_and_moments_in_place():
  x = jnp.ones((256,))
  s = adamw_k.adamw_scalars(1, 1e-2, 0.9, 0.99, 1e-8, 0.0, 0.1)
  jaxpr = jax.make_jaxpr(
      lambda *a: adamw_k.adamw_kernel(*a, s, mode="apply", nesterov=False, decay=True, backend="triton")
  )(x, x, x, x)
  (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
  # Inputs: scalars, g, m, v, p -> outputs p, m, v.
  assert dict(eqn.params["input_output_aliases"]) == {4: 0, 2: 1, 3: 2}
