"""eFormer's factory calls give eFormer's numbers and opt_state trees.

`OptimizerFactory.create` called as eFormer 0.0.101's is (cosine schedule with
warmup, scheduled weight decay with a mask, clipping, accumulation) is checked
against eFormer's own trajectories, recorded by
``tests/data/record_eformer_factory.py`` (eFormer is not installed in CI):
params and every opt_state leaf, by key path and dtype, after 5 applied steps,
on the ``update`` path and the jitted stage-local path.
"""

import dataclasses
import json
import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import assert_trees_close
from pallasopt import optim
from pallasopt.optim import eformer

DATA = json.loads((pathlib.Path(__file__).parent / "data" / "eformer_factory.json").read_text())
RUNS = sorted(DATA["runs"])

# float32 (u = 6e-8) trajectories whose ops are reassociated (fused kernels vs
# Optax's chain): each of the up to 10 calls differs by O(10 u) relative to the
# leaf's scale, amplified at most by Adam's normalisation, Newton-Schulz's or
# White-Kron's power iterations (~10x): <= ~1e-5. Measured: <= 2.3e-6.
RTOL = 1e-5
# White-Kron in bfloat16 (u = 2^-8): eFormer rounds each product of a
# preconditioner application to bf16, we accumulate the chain in f32 and round
# once; 5 steps of that (x 2 with accumulation) through factors the next step
# multiplies again: params within 8u of their scale, the factors and their
# Lipschitz estimates within 32u. Measured: params <= 1.8u, state <= 21u.
BF16_RTOL = {"params": 8 * 2.0**-8, "state": 32 * 2.0**-8}


def _grads(params, i):
  return jax.tree.map(lambda x: jnp.cos(x * (i + 1)) * 0.5, params)


def _create(run, **kwargs):
  name, k = DATA["runs"][run]["optimizer"], run.split("/")[1]
  config_cls = eformer.OptimizerFactory._get_config_class(name)
  return eformer.OptimizerFactory.create(
      name, eformer.SchedulerConfig(**DATA["scheduler"]), config_cls(**DATA["runs"][run]["config"]),
      weight_decay=DATA["weight_decay"], weight_decay_mask=DATA["mask"],
      clip_grad=DATA["clip_grad"], gradient_accumulation_steps=int(k[1:]), **kwargs,
  )


def _params():
  return {k: jnp.asarray(v, jnp.float32) for k, v in DATA["params"].items()}


def _calls(run):
  return DATA["steps"] * int(run.split("/")[1][1:])


def _check_against_record(run, params, state):
  record = DATA["runs"][run]
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  paths = [jax.tree_util.keystr(path) for path, _ in leaves]
  assert paths == list(record["state"]), "opt_state tree differs from eFormer's"
  assert [str(x.dtype) for _, x in leaves] == [record["state_dtypes"][p] for p in paths]
  want_params = {k: np.asarray(v) for k, v in record["params"].items()}
  want_state = [np.asarray(record["state"][p], jnp.dtype(record["state_dtypes"][p])) for p in paths]
  got_state = [x for _, x in leaves]
  if run.split("/")[0].endswith("_bf16"):
    assert_trees_close(params, want_params, rtol=BF16_RTOL["params"])
    assert_trees_close(got_state, want_state, rtol=BF16_RTOL["state"])
  else:
    assert_trees_close((params, got_state), (want_params, want_state), rtol=RTOL)


def _trajectories(tx, run, paths):
  """``{path: (params, state)}`` after the run's calls, for ``"update"`` (tx.update
  and optax.apply_updates) and ``"stage_local"`` (the stage-local step), one jit."""

  def scan(call, params):
    return jax.lax.scan(call, (params, tx.init(params)), jnp.arange(_calls(run)))[0]

  def update_call(carry, i):
    params, state = carry
    updates, state = tx.update(_grads(params, i), state, params)
    return (optax.apply_updates(params, updates), state), None

  def stage_local_call(carry, i):
    params, state = carry
    return tx.apply_gradients_stage_local(
        params=params, grads=_grads(params, i), opt_state=state), None

  calls = {"update": update_call, "stage_local": stage_local_call}
  return jax.jit(lambda params: {path: scan(calls[path], params) for path in paths})(_params())


# bf16 White-Kron runs: without accumulation (its logic is the f32 runs'); their
# stage-local path runs the same code as the f32 runs'.
@pytest.mark.parametrize("run", [run for run in RUNS if not run.endswith("_bf16/k2")])
def test_update_and_jitted_stage_local_paths_give_eformers_params_and_state(run):
  tx, _ = _create(run, impl="xla")
  paths = ("update",) if "_bf16" in run else ("update", "stage_local")
  for result in _trajectories(tx, run, paths).values():
    _check_against_record(run, *result)


@pytest.mark.parametrize("run", ["adamw/k1", "mars/k2", "quad/k1", "skew/k2"])
def test_interpreted_kernels_give_eformers_params_and_state(run):
  tx, _ = _create(run, impl="interpret")
  _check_against_record(run, *_trajectories(tx, run, ("stage_local",))["stage_local"])


@pytest.mark.parametrize("name", sorted({run.split("/")[0] for run in RUNS if "bf16" not in run}))
def test_a_none_grad_leaves_its_leaf_and_state_untouched(name):
  tx, _ = _create(f"{name}/k1", impl="xla")
  step = lambda p, g, s: tx.apply_gradients_stage_local(params=p, grads=g, opt_state=s)

  @jax.jit  # both steps in one program: one compile
  def two_steps(params):
    params, state = step(params, _grads(params, 0), tx.init(params))  # "k"'s moments nonzero
    return (params, state), step(params, {**_grads(params, 1), "k": None}, state)

  (params, state), (new_params, new_state) = two_steps(_params())
  np.testing.assert_array_equal(new_params["k"], params["k"])
  assert not np.array_equal(new_params["w"], params["w"])
  # Per-param state of "k": its entries keyed ['k']; for White-Kron, k's
  # factors (large[1], sorted leaf order b, k, w) and the dense block stack,
  # which holds only k's blocks (b is a vector, w takes the large route).
  frozen_state = lambda key: "['k']" in key or "['large'][1]" in key or "['dense']" in key
  new_leaves = dict(jax.tree_util.tree_flatten_with_path(new_state)[0])
  checked = 0
  for path, old in jax.tree_util.tree_flatten_with_path(state)[0]:
    key = jax.tree_util.keystr(path)
    if frozen_state(key) and not key.endswith(("valid_rows", "valid_cols")):
      np.testing.assert_array_equal(new_leaves[path], old, err_msg=key)
      checked += 1
  assert checked >= 1


def test_lion_keeps_optax_default_decay_as_a_config_field():
  # eFormer's Lion builder leaves optax.lion's weight_decay=1e-3 in place; the
  # recorded run used LionConfig() and matched, and 0 turns it off.
  params = _params()
  grads = _grads(params, 0)
  updates = {}
  for decay in (1e-3, 0.0):
    tx, _ = eformer.OptimizerFactory.create("lion", eformer.SchedulerConfig(learning_rate=1e-2),
                                          eformer.LionConfig(weight_decay=decay), impl="xla")
    updates[decay], _ = tx.update(grads, tx.init(params), params)
  assert eformer.LionConfig().weight_decay == 1e-3
  # The difference cancels two updates of size lr = 1e-2: a few f32 ulps of them.
  np.testing.assert_allclose(updates[1e-3]["w"] - updates[0.0]["w"], -1e-2 * 1e-3 * params["w"],
                             rtol=0, atol=4 * np.finfo(np.float32).eps * 1e-2)


def test_scheduled_decay_link_is_the_state_and_math_of_eformers():
  schedule = optax.linear_schedule(1.0, 0.5, 4)
  link = eformer.add_scheduled_weight_decay(lambda t: -schedule(t) * 0.1, {"a": True, "b": False})
  params = {"a": jnp.ones(3), "b": jnp.ones(2)}
  state = link.init(params)
  assert isinstance(state, optax.MaskedState)
  assert isinstance(state.inner_state, eformer.OptaxScheduledWeightDecayState)
  zeros = jax.tree.map(jnp.zeros_like, params)
  for t in range(3):
    updates, state = link.update(zeros, state, params)
    np.testing.assert_allclose(updates["a"], -float(schedule(t)) * 0.1 * np.ones(3), rtol=1e-6)
    np.testing.assert_array_equal(updates["b"], np.zeros(2))
  assert int(state.inner_state.count) == 3
  with pytest.raises(ValueError, match="update needs params"):
    eformer.add_scheduled_weight_decay(lambda t: 0.1).update(zeros, state.inner_state)
  with pytest.raises(TypeError, match="schedule_fn must be callable"):
    eformer.add_scheduled_weight_decay(0.1)


def test_kwargs_fill_the_default_config_and_others_warn():
  tx, _ = eformer.OptimizerFactory.create("adamw", b1=0.8, impl="xla")
  assert tx.metadata.optimizer_config == eformer.AdamWConfig(b1=0.8)
  with pytest.warns(UserWarning, match=r"ignores \['bb1'\].*did you mean 'b1' for 'bb1'"):
    eformer.OptimizerFactory.create("adamw", bb1=0.8, impl="xla")
  with pytest.warns(UserWarning, match=r"ignores \['b1'\].*or optimizer_config was given"):
    tx, _ = eformer.OptimizerFactory.create("adamw", None, eformer.AdamWConfig(), b1=0.5)
  assert tx.metadata.optimizer_config.b1 == 0.9
  # String dtypes become dtypes in place, as eFormer converts them.
  config = eformer.AdamWConfig(mu_dtype="bfloat16")
  eformer.OptimizerFactory.create("adamw", None, config, impl="xla")
  assert config.mu_dtype is jnp.bfloat16


def test_custom_scheduler_and_scheduler_factory():
  config = eformer.SchedulerConfig(learning_rate=1.0, steps=8)
  _, schedule = eformer.OptimizerFactory.create(
      "adamw", config, custom_scheduler=lambda steps: optax.linear_schedule(1.0, 0.0, steps))
  assert float(schedule(4)) == 0.5
  with pytest.raises(ValueError, match="custom_scheduler is called with config.steps"):
    eformer.SchedulerFactory.create_scheduler(eformer.SchedulerConfig(), lambda steps: None)
  with pytest.raises(TypeError, match="config must be a SchedulerConfig"):
    eformer.SchedulerFactory.create_scheduler({"learning_rate": 1.0})
  with pytest.warns(UserWarning, match="without warmup_steps ignores exponent=2.0"):
    eformer.SchedulerFactory.create_scheduler(eformer.SchedulerConfig("cosine", 1.0, steps=8,
                                                                  exponent=2.0))


def test_template_and_config_serialization_are_eformers():
  template = eformer.OptimizerFactory.generate_template("lion")
  assert template.splitlines()[:3] == ["LionConfig(", "    b1: float = 0.9", "    b2: float = 0.99"]
  config = eformer.MarsConfig(beta1=0.9, max_grad_norm=None)
  as_dict = eformer.OptimizerFactory.serialize_config(config)
  as_json = eformer.OptimizerFactory.serialize_config(config, format="json")
  assert eformer.OptimizerFactory.deserialize_config("mars", as_dict) == config
  assert eformer.OptimizerFactory.deserialize_config("mars", as_json, format="json") == config
  with pytest.raises(ValueError, match="format must be 'dict' or 'json'"):
    eformer.OptimizerFactory.serialize_config(config, format="yaml")
  with pytest.raises(TypeError, match="format='json' needs a str"):
    eformer.OptimizerFactory.deserialize_config("mars", as_dict, format="json")


def test_builder_classes_are_eformers():
  for name, cls in [("adamw", eformer.AdamWOptimizer), ("lion", eformer.LionOptimizer),
                    ("adafactor", eformer.AdafactorOptimizer), ("rmsprop", eformer.RMSPropOptimizer),
                    ("muon", eformer.MuonOptimizer), ("mars", eformer.MarsOptimizer)]:
    builder = cls(config=eformer.OptimizerFactory._get_config_class(name)(), impl="xla")
    tx = builder.build(optax.constant_schedule(1e-3))
    assert isinstance(tx, optim.FusedGradientTransformation), name
    assert [f.name for f in dataclasses.fields(cls)][0] == "config"
  schedule = eformer.CosineSchedulerBuilder(
      eformer.SchedulerConfig("cosine", 1e-2, 1e-3, warmup_steps=2, steps=10)).build()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    np.testing.assert_allclose(
        schedule(5), optax.warmup_cosine_decay_schedule(1e-8, 1e-2, 2, 10, 1e-3)(5))
