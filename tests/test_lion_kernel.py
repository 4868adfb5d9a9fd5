"""The Lion Pallas kernel against its reference: the kernel-family contract, and Lion's sign."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

from helpers import random_array
from kernel_contract import KernelContract
from pallasopt.kernels import lion as lion_k

_HYPERPARAMETERS = ("learning_rate", "b1", "b2", "weight_decay", "grad_scale")


class TestLionKernel(KernelContract):
  kernel = staticmethod(lion_k.lion_kernel)
  reference = staticmethod(lion_k.lion_reference)
  apply = staticmethod(lion_k.lion_apply)
  updates = staticmethod(lion_k.lion_updates)
  flops_per_element, transcendentals_per_element = lion_k.FLOPS_PER_ELEMENT, 0
  options = st.fixed_dictionaries({
      "learning_rate": st.floats(1e-5, 1.0),
      "b1": st.floats(0.0, 0.99),
      "b2": st.floats(0.5, 0.9999),
      "weight_decay": st.floats(0.0, 1.0),
      "grad_scale": st.sampled_from([1.0, 0.25, 3.0]),
  })
  simple_options = dict(learning_rate=1e-2, b1=0.9, b2=0.99, weight_decay=0.1, grad_scale=1.0)

  def moments(self, rng, shape, dtype, moment_dtype, options):
    return (random_array(rng, shape, moment_dtype, scale=0.1),)

  def scalars(self, step, options):
    return lion_k.lion_scalars(*(options[k] for k in _HYPERPARAMETERS))


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
