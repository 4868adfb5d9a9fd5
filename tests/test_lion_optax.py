"""pallasopt.optim.lion is a drop-in for optax.lion."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import strategies as st

from optax_contract import DropInContract, params_tree
from pallasopt.optim.lion import lion


class TestLionDropIn(DropInContract):
  ours = staticmethod(lion)
  theirs = staticmethod(optax.lion)
  hyperparams = st.fixed_dictionaries({"b1": st.floats(0.0, 0.99), "b2": st.floats(0.5, 0.999)})


def test_without_decay_every_coordinate_moves_by_the_learning_rate():
  tx = lion(0.125, weight_decay=0.0, impl="interpret")
  params = params_tree()
  grads = jax.tree.map(lambda p: jnp.where(p == 0, 1.0, p), params)
  new_params, state = tx.apply_gradients(params, grads, tx.init(params))
  for p, q, g in zip(*map(jax.tree.leaves, (params, new_params, grads))):
    np.testing.assert_array_equal(q - p, -0.125 * jnp.sign(g))
  # The momentum is the only state that moves, by (1 - b2) * g from zero.
  for m, g in zip(*map(jax.tree.leaves, (state[0].mu, grads))):
    np.testing.assert_allclose(m, 0.01 * g, rtol=1e-6)
