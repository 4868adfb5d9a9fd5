"""pallasopt.optim.adamw is a drop-in for optax.adamw."""

import jax
import optax
import pytest
from hypothesis import strategies as st

import pallasopt
from helpers import assert_trees_close, step_grads
from optax_contract import DropInContract, params_tree


class TestAdamWDropIn(DropInContract):
  ours = staticmethod(pallasopt.optim.adamw)
  theirs = staticmethod(optax.adamw)
  hyperparams = st.fixed_dictionaries({
      "b1": st.floats(0.0, 0.95),
      "b2": st.floats(0.8, 0.999),
      "eps_root": st.sampled_from([0.0, 1e-8]),
      "nesterov": st.booleans(),
  })
  interpret_kwargs = {"nesterov": True}


@pytest.mark.parametrize("name", ["eps", "eps_root"])
def test_negative_epsilons_are_rejected(name):
  with pytest.raises(ValueError, match=rf"{name} must be in \[0.0, inf\]"):
    pallasopt.optim.adamw(1e-3, **{name: -1e-8})


def test_apply_gradients_falls_back_for_foreign_transforms():
  tx = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1))
  params = params_tree()
  got, _ = pallasopt.optim.apply_gradients(tx, params, step_grads(params, 0), tx.init(params))
  updates, _ = tx.update(step_grads(params, 0), tx.init(params), params)
  assert_trees_close(got, optax.apply_updates(params, updates))


def test_nadamw_is_adamw_with_nesterov():
  params = params_tree()
  grads = step_grads(params, 0)
  tx, ref = pallasopt.optim.nadamw(1e-2, impl="xla"), optax.nadamw(1e-2)
  got, _ = tx.update(grads, tx.init(params), params)
  want, _ = ref.update(grads, ref.init(params), params)
  assert_trees_close(got, want)
  assert jax.tree.structure(tx.init(params)) == jax.tree.structure(ref.init(params))
