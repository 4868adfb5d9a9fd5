"""What someone switching from Optax meets first: rates of either sign, readable
signatures, error messages, and stochastic rounding that happens or fails loudly."""

import copy
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pallasopt
from helpers import assert_trees_close, optax_step, step_grads

_DROP_INS = ["adamw", "nadamw", "lion", "rmsprop", "adafactor", "muon", "mars", "kron",
             "quad", "skew"]
# (ours, Optax's) for the drop-ins whose reference Optax ships.
_OPTAX_PAIRS = {
    "adamw": optax.adamw,
    "nadamw": optax.nadamw,
    "lion": optax.lion,
    "rmsprop": optax.rmsprop,
    "adafactor": optax.adafactor,
    "muon": optax.contrib.muon,
}


def _params():
  rng = np.random.default_rng(0)
  return {"w": jnp.asarray(rng.standard_normal((16, 32)), jnp.float32),
          "b": jnp.asarray(rng.standard_normal((32,)), jnp.float32)}


@pytest.mark.parametrize("name", sorted(_OPTAX_PAIRS))
def test_negative_rates_step_like_optax(name):
  # Optax takes a learning rate (and a decay rate) of either sign: a negative
  # rate ascends. Ours must too, with Optax's numbers.
  decay = {"rmsprop": {}, "adafactor": {"weight_decay_rate": -0.05}}.get(
      name, {"weight_decay": -0.05})
  ours = getattr(pallasopt.optim, name)(-1e-2, impl="xla", **decay)
  theirs = _OPTAX_PAIRS[name](-1e-2, **decay)
  params = _params()
  grads = step_grads(params, 0)
  got = jax.jit(ours.update)(grads, ours.init(params), params)
  want = theirs.update(grads, theirs.init(params), params)
  assert_trees_close(got[0], want[0])


@pytest.mark.parametrize("name", ["mars", "kron", "quad", "skew"])
def test_negative_learning_rate_negates_the_update(name):
  # No Optax reference here: the update is -lr times a preconditioned
  # direction that does not depend on lr, so lr -> -lr negates it exactly.
  make = getattr(pallasopt.optim, name)
  params = _params()
  grads = step_grads(params, 0)

  def update(lr):
    tx = make(lr, impl="xla")
    return tx.update(grads, tx.init(params), params)[0]

  up, down = jax.jit(lambda: (update(1e-2), update(-1e-2)))()
  for k in params:
    np.testing.assert_array_equal(np.asarray(down[k]), -np.asarray(up[k]), err_msg=k)


@pytest.mark.parametrize("name", _DROP_INS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_learning_rate_is_named(name, bad):
  with pytest.raises(ValueError, match="learning_rate must be a finite number"):
    getattr(pallasopt.optim, name)(bad)


@pytest.mark.parametrize("name", _DROP_INS)
def test_signature_names_its_types_as_optax_does(name):
  # help() and IDEs show the aliases' names, not their expanded unions.
  signature = inspect.signature(getattr(pallasopt.optim, name))
  assert "Union[" not in str(signature)
  assert "ScalarOrSchedule" in str(signature.parameters["learning_rate"])


def test_type_aliases_stand_for_optax_types():
  assert pallasopt.optim.ScalarOrSchedule.__value__ == optax.ScalarOrSchedule
  assert pallasopt.optim.Numeric.__value__ == jax.typing.ArrayLike


def test_tree_mismatch_prints_paths_as_keystr():
  tx = pallasopt.optim.adamw(1e-3, impl="xla")
  params = _params()
  with pytest.raises(ValueError) as info:
    tx.update({"w": params["w"]}, tx.init(params), params)
  assert "missing in grads: ['b']" in str(info.value)
  assert '"' not in str(info.value)


@pytest.mark.parametrize("name", ["adamw", "lion", "rmsprop", "mars"])
def test_stochastic_param_rounding_on_the_update_path_is_an_error(name):
  # update returns updates; optax.apply_updates would round bf16 params to
  # nearest, so the rounding asked for cannot happen there: it must say so.
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), _params())
  grads = step_grads(params, 0)
  tx = getattr(pallasopt.optim, name)(1e-2, param_rounding="stochastic", impl="xla")
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"param_rounding='stochastic'.*apply_gradients"):
    tx.update(grads, state, params)
  with pytest.raises(ValueError, match=r"leaf\['b'\] is bfloat16"):
    pallasopt.optim.apply_gradients(optax.chain(tx), params, grads, (state,))
  # The fused apply rounds stochastically: some params land on the farther
  # neighbour, so they differ from round-to-nearest's.
  sr, _ = jax.jit(tx.apply_gradients)(params, grads, state)
  nearest = getattr(pallasopt.optim, name)(1e-2, impl="xla")
  rn, _ = jax.jit(nearest.apply_gradients)(params, grads, nearest.init(params))
  assert not np.array_equal(np.asarray(sr["w"], np.float32), np.asarray(rn["w"], np.float32))
  # f32 params: the option changes nothing, and update works.
  f32 = _params()
  u, _ = tx.update(step_grads(f32, 0), tx.init(f32), f32)
  assert u["w"].dtype == jnp.float32


@pytest.mark.parametrize("state_format", [None, "int8"], ids=str)
@pytest.mark.parametrize("name", sorted(_OPTAX_PAIRS))
def test_apply_gradients_clips_by_global_norm_as_the_optax_chain_does(name, state_format):
  # The clip factor is applied inside the kernels (interpret mode here): the
  # step equals optax.chain(clip_by_global_norm, tx) on gradients whose norm
  # is above the limit (clipped) and below it (untouched).
  if state_format is not None and name not in ("adamw", "lion"):
    pytest.skip("int8 state: the elementwise families (AdamW, Lion) suffice here")
  kwargs = {} if state_format is None else {"state_format": state_format}
  make = lambda impl: getattr(pallasopt.optim, name)(1e-2, impl=impl, **kwargs)
  params = {"w": jnp.zeros((64, 256)), "b": jnp.zeros((256,))}
  params = jax.tree.map(lambda p, q: p + q, params, step_grads(params, 7))
  ours, chain = make("interpret"), optax.chain(optax.clip_by_global_norm(1.0), make("xla"))
  # Jitted: one compile per path for both steps, not one per op.
  fused = jax.jit(functools.partial(pallasopt.optim.apply_gradients, ours, max_grad_norm=1.0))
  chain_step = optax_step(chain)
  got, want = (params, ours.init(params)), (params, chain.init(params))
  for i, size in enumerate([30.0, 0.5]):
    grads = step_grads(params, i)
    grads = jax.tree.map(lambda g: g * size / optax.tree.norm(grads), grads)
    got = fused(got[0], grads, got[1])
    want = chain_step(want[0], grads, want[1])
    assert_trees_close(got[0], want[0])
    assert_trees_close(got[1], want[1][1])


def test_apply_gradients_with_an_infinite_max_grad_norm_never_clips():
  # As Optax's clip_by_global_norm(inf): the factor is 1, not inf / inf.
  tx = pallasopt.optim.adamw(1e-3)
  params = _params()
  grads = step_grads(params, 0)
  got = pallasopt.optim.apply_gradients(tx, params, grads, tx.init(params), max_grad_norm=np.inf)
  want = pallasopt.optim.apply_gradients(tx, params, grads, tx.init(params))
  assert_trees_close(got, want)


def test_apply_gradients_names_a_bad_max_grad_norm():
  tx = pallasopt.optim.adamw(1e-3)
  params = _params()
  with pytest.raises(ValueError, match="max_grad_norm must be > 0"):
    pallasopt.optim.apply_gradients(tx, params, params, tx.init(params), max_grad_norm=0.0)


_COPIES = {
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
    "tree_map": lambda tx: jax.tree.map(lambda f: f, tx),
    "replace": lambda tx: tx._replace(),
    "plain_optax_type": lambda tx: optax.GradientTransformationExtraArgs(tx.init, tx.update),
}


@pytest.mark.parametrize("name", _DROP_INS)
def test_copies_keep_the_fused_path(name):
  # What Optax, Flax and checkpointing code do to a transform must keep its
  # fused entry points, and each copy's fused step must be the original's.
  tx = getattr(pallasopt.optim, name)(1e-2)
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  clones = {how: copy_fn(tx) for how, copy_fn in _COPIES.items()}
  for how, clone in clones.items():
    assert isinstance(clone, optax.GradientTransformationExtraArgs), how
    assert pallasopt.optim.fused_update(clone) is not None, how
  params = _params()
  grads = step_grads(params, 0)
  state = tx.init(params)
  # Each copy's step traces to the original fused step's program, op for op
  # (where a fused form exists, the update + apply_updates path traces to
  # another), and one copy's step, run, gives the original's numbers.
  fused = str(jax.make_jaxpr(tx.apply_gradients)(params, grads, state))
  for how, clone in clones.items():
    traced = jax.make_jaxpr(
        lambda p, g, s, clone=clone: pallasopt.optim.apply_gradients(clone, p, g, s))
    assert str(traced(params, grads, state)) == fused, how

  @jax.jit
  def steps(params, grads, state):
    return (tx.apply_gradients(params, grads, state),
            pallasopt.optim.apply_gradients(clones["deepcopy"], params, grads, state))

  want, got = steps(params, grads, state)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_replaced_update_drops_the_fused_path_loudly():
  tx = pallasopt.optim.adamw(1e-2)
  plain = tx._replace(update=optax.adamw(1e-2).update)
  assert pallasopt.optim.fused_update(plain) is None
  with pytest.raises(TypeError, match="not the FusedUpdate it was built with"):
    plain.apply_gradients  # noqa: B018
  params = _params()
  grads = step_grads(params, 0)
  got = pallasopt.optim.apply_gradients(plain, params, grads, plain.init(params))
  updates, _ = optax.adamw(1e-2).update(grads, plain.init(params), params)
  assert_trees_close(got[0], optax.apply_updates(params, updates))
