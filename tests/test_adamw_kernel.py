"""The AdamW Pallas kernel against its reference: the kernel-family contract."""

import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from helpers import random_array
from kernel_contract import KernelContract
from pallasopt.kernels import adamw as adamw_k
from pallasopt.kernels._elementwise import bytes_moved

_HYPERPARAMETERS = ("learning_rate", "b1", "b2", "eps", "eps_root", "weight_decay")


class TestAdamWKernel(KernelContract):
  kernel = staticmethod(adamw_k.adamw_kernel)
  reference = staticmethod(adamw_k.adamw_reference)
  apply = staticmethod(adamw_k.adamw_apply)
  updates = staticmethod(adamw_k.adamw_updates)
  flops_per_element, transcendentals_per_element = adamw_k.FLOPS_PER_ELEMENT, 1
  options = st.fixed_dictionaries({
      "learning_rate": st.floats(1e-5, 1.0),
      "b1": st.floats(0.0, 0.99),
      "b2": st.floats(0.5, 0.9999),
      "eps": st.sampled_from([1e-8, 1e-6, 1e-3]),
      "eps_root": st.sampled_from([0.0, 1e-8, 1e-4]),
      "weight_decay": st.floats(0.0, 0.5),
      "nesterov": st.booleans(),
  })
  simple_options = dict(learning_rate=1e-2, b1=0.9, b2=0.99, eps=1e-8, eps_root=0.0,
                        weight_decay=0.1, nesterov=False)
  kernel_keywords = ("nesterov",)

  def moments(self, rng, shape, dtype, moment_dtype, options):
    return (random_array(rng, shape, moment_dtype, scale=0.1),
            random_array(rng, shape, dtype, positive=True, scale=0.1))

  def scalars(self, step, options):
    return adamw_k.adamw_scalars(step, *(options[k] for k in _HYPERPARAMETERS))


def test_bf16_leaves_move_half_the_bytes():
  n = 1000
  p = jnp.ones((n,), jnp.bfloat16)
  assert bytes_moved([p, p, p, p], [p.dtype] * 3) == 14 * n
  f32 = jnp.ones((n,), np.float32)
  assert bytes_moved([f32] * 4, [f32.dtype] * 3) == 28 * n
