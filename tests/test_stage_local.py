"""The stage-local layer: apply_gradients_stage_local equals the Optax path.

`OptimizerFactory.create(...)` builds ``[MultiSteps of] chain([clip,]
optimizer, [scheduled decay])``;
its ``update`` + ``optax.apply_updates`` is the reference for the fused
stage-local step, over several steps, for every registered optimizer, and
inside ``shard_map`` each stage's update of its slice equals the unsharded one.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import assert_trees_close, frozen_at, step_grads
from pallasopt.kernels import _compat
from pallasopt.optim.eformer import (
    AdafactorConfig,
    AdamWConfig,
    AdamWOptimizer,
    KronConfig,
    LionConfig,
    MuonConfig,
    OptimizerFactory,
    SchedulerConfig,
    add_scheduled_weight_decay,
)
from pallasopt.optim.eformer import factory
from pallasopt.optim._base import FusedGradientTransformation
from pallasopt.optim.adamw import adamw
from pallasopt.optim.lion import lion
from pallasopt.optim.eformer import (
    StageLocalOptimizerMetadata,
    fused_stage_local_apply,
    make_stage_local_gradient_transformation,
    make_unsupported_stage_local_gradient_transformation,
)
from pallasopt.pipeline.sharding import optimizer_state_specs

# Small shapes that still exercise factoring (Adafactor), orthogonalization
# (Muon) and triangular and diagonal preconditioner factors (Kron; "one_diag"
# also halves its compile time).
CONFIGS = {
    "adamw": AdamWConfig(b2=0.95),
    "lion": LionConfig(),
    "adafactor": AdafactorConfig(min_dim_size_to_factor=4, momentum=0.9),
    "muon": MuonConfig(),
    "kron": KronConfig(preconditioner_update_probability=1.0, memory_save_mode="one_diag"),
}
OPTIMIZERS = sorted(CONFIGS)
COSINE = SchedulerConfig("cosine", 1e-2, learning_rate_end=1e-3, warmup_steps=2, steps=8)
LINEAR = SchedulerConfig("linear", learning_rate=1e-2, learning_rate_end=1e-3, steps=8)
MATRICES = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)


def _create(name, config=None, scheduler_config=None, **kwargs):
  """`OptimizerFactory.create` with the config before the schedule, as the cases list them."""
  return OptimizerFactory.create(name, scheduler_config, config, **kwargs)


def _params(dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  leaf = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  return {"dense": {"w": leaf(8, 16), "b": leaf(16)}, "stack": leaf(2, 4, 8)}


def _small_params():
  """The tree of `_params` with one tiny leaf shape, for eager (op-by-op) calls."""
  leaf = lambda seed: jnp.asarray(np.random.default_rng(seed).standard_normal(4), jnp.float32)
  return {"dense": {"w": leaf(0), "b": leaf(1)}, "stack": leaf(2)}


def _tolerance(dtype):
  return 1e-2 if dtype == jnp.bfloat16 else 1e-5


def _without(grads, none_path):
  """`grads` with the leaf at `none_path` (a key tuple) replaced by None."""
  if not none_path:
    return grads
  return {**grads, none_path[0]: {**grads[none_path[0]], none_path[1]: None}}


def _zeros_at(grads, none_path):
  if not none_path:
    return grads
  inner = grads[none_path[0]]
  return {**grads, none_path[0]: {**inner, none_path[1]: jnp.zeros_like(inner[none_path[1]])}}


def _trajectories(tx, ref_tx, params, steps, *, learning_rate_fn=None, none_path=None):
  """(stage-local run of `tx`, Optax run of `ref_tx`) from the same grads.

  The leaf at `none_path` gets a None gradient on the stage-local path,
  which freezes it (eFormer's rule), and zeros on the Optax path, whose
  result for that leaf's params and state is then replaced by their initial
  values (a zero gradient changes no other leaf: the clip's norm is the
  same). Both runs are scans in one jit: one compilation.
  """

  def stage_local(carry, i):
    params, state = carry
    grads = _without(step_grads(params, i), none_path)
    return tx.apply_gradients_stage_local(
        params=params, grads=grads, opt_state=state, learning_rate_fn=learning_rate_fn
    ), None

  def optax_step(carry, i):
    params, state = carry
    updates, state = ref_tx.update(_zeros_at(step_grads(params, i), none_path), state, params)
    return (optax.apply_updates(params, updates), state), None

  @jax.jit
  def run(params):
    steps_ = jnp.arange(steps, dtype=jnp.float32)
    got, _ = jax.lax.scan(stage_local, (params, tx.init(params)), steps_)
    init = (params, ref_tx.init(params))
    want, _ = jax.lax.scan(optax_step, init, steps_)
    if none_path:
      want = frozen_at(want, init, none_path)
    return got, want

  return run(params)


CASES = {
    # clip (triggered), masked weight decay, a None leaf, and learning_rate_fn
    # replacing tx's constant schedule: equal to a tx built with that schedule.
    "f32_clip_decay_mask_none_grads_lr_fn": dict(
        kwargs=dict(weight_decay=0.1, weight_decay_mask=MATRICES, clip_grad=0.5),
        learning_rate_fn=COSINE, none_path=("dense", "w"), steps=3,
    ),
    # bf16 params and grads; 3 calls per step: two applied steps and one
    # pending call, with the metadata's schedule, clip and weight decay.
    "bf16_accumulation": dict(
        kwargs=dict(scheduler_config=LINEAR, weight_decay=0.05, clip_grad=1.0,
                    gradient_accumulation_steps=3),
        dtype=jnp.bfloat16, none_path=("dense", "b"), steps=7,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_stage_local_equals_optax_path(name, case):
  spec = CASES[case]
  dtype = spec.get("dtype", jnp.float32)
  tx, _ = _create(name, CONFIGS[name], impl="xla", **spec["kwargs"])
  ref_tx, learning_rate_fn = tx, None
  if "learning_rate_fn" in spec:
    ref_tx, learning_rate_fn = _create(
        name, CONFIGS[name], spec["learning_rate_fn"], impl="xla", **spec["kwargs"]
    )
  got, want = _trajectories(tx, ref_tx, _params(dtype), spec["steps"],
                            learning_rate_fn=learning_rate_fn, none_path=spec.get("none_path"))
  assert_trees_close(got, want, rtol=_tolerance(dtype))


def test_factory_equals_optax_multisteps_chain_in_result_and_state():
  tx, schedule = _create(
      "adamw", AdamWConfig(b1=0.8, b2=0.95), COSINE, weight_decay=0.1, weight_decay_mask=MATRICES,
      clip_grad=0.5, gradient_accumulation_steps=2, impl="xla",
  )
  # eFormer's chain: AdamW without decay of its own, then the scheduled decay link.
  optax_tx = optax.MultiSteps(
      optax.chain(
          optax.clip_by_global_norm(0.5),
          optax.adamw(schedule, b1=0.8, b2=0.95, weight_decay=0.0),
          add_scheduled_weight_decay(lambda t: -schedule(t) * 0.1, MATRICES),
      ),
      every_k_schedule=2,
  )
  got, want = _trajectories(tx, optax_tx, _params(), 4)
  assert_trees_close(got, want, rtol=1e-5)


def test_global_grad_norm_replaces_the_local_norm():
  tx, _ = _create("adamw", clip_grad=0.5, impl="xla")
  params = _small_params()
  grads = step_grads(params, 0)
  apply = functools.partial(tx.apply_gradients_stage_local, params=params, grads=grads,
                            opt_state=tx.init(params))
  norm = optax.tree.norm(grads)
  got = apply(global_grad_norm=norm)
  assert_trees_close(got, apply())
  # The caller's norm is the one used: ten times larger clips ten times harder.
  harder = apply(global_grad_norm=10 * norm)
  assert_trees_close(harder[1][1][0].mu, jax.tree.map(lambda m: m / 10, got[1][1][0].mu))


def test_runs_the_fused_apply_with_the_clip_factor_as_grad_scale():
  base = adamw(1e-2, impl="xla")
  calls = []

  def no_update(*args, **kwargs):
    raise AssertionError("the stage-local path must not call update")

  def recording_apply(params, grads, state, *, grad_scale=None, learning_rate=None):
    calls.append((grad_scale, learning_rate))
    return base.apply_gradients(params, grads, state, grad_scale=grad_scale,
                                learning_rate=learning_rate)

  fused = FusedGradientTransformation(base.init, no_update, recording_apply)
  metadata = StageLocalOptimizerMetadata(scheduler=optax.constant_schedule(1e-2), clip_grad=0.5)
  tx = make_stage_local_gradient_transformation(
      optax.chain(optax.clip_by_global_norm(0.5), base), metadata, fused_stage_local_apply(fused)
  )
  params = _small_params()
  grads = step_grads(params, 0)
  tx.apply_gradients_stage_local(params=params, grads=grads, opt_state=tx.init(params),
                                 learning_rate_fn=lambda count: 3e-3 * (count + 1))
  (scale, lr), = calls
  np.testing.assert_allclose(scale, 0.5 / optax.tree.norm(grads), rtol=1e-6)
  np.testing.assert_allclose(lr, 3e-3)


def test_delete_grads_frees_eager_buffers():
  tx, _ = _create("adamw", impl="xla")
  params = _small_params()
  grads = step_grads(params, 0)
  want = tx.apply_gradients_stage_local(params=params, grads=grads, opt_state=tx.init(params))
  got = tx.apply_gradients_stage_local(params=params, grads=grads, opt_state=tx.init(params),
                                       delete_grads=True)
  assert all(g.is_deleted() for g in jax.tree.leaves(grads))
  assert not any(p.is_deleted() for p in jax.tree.leaves(params))
  assert_trees_close(got, want)


# ---- Inside shard_map: each stage updates its own slice. ----

STAGES = 4


def _stage_params(seed=1):
  rng = np.random.default_rng(seed)
  leaf = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  return {"w": leaf(STAGES, 8, 16), "b": leaf(STAGES, 16)}


@pytest.mark.parametrize(
    "name,impl,accumulate",
    # The interpreted Pallas kernel also runs inside the accumulation's cond,
    # with the clip's psum there.
    [(name, "xla", 1) for name in OPTIMIZERS] + [("adamw", "interpret", 2)],
)
def test_shard_map_stage_slices_equal_the_unsharded_step(name, impl, accumulate):
  # stacked_spec gives Kron each stage's global layer index, from which it
  # draws that layer's preconditioner probe, as the unsharded step does.
  tx, _ = _create(
      name, CONFIGS[name], LINEAR, weight_decay=0.1, clip_grad=0.5, gradient_accumulation_steps=accumulate,
      stacked_axes=1, impl=impl,
  )
  mesh = Mesh(np.array(jax.devices()[:STAGES]), ("stage",))
  params = _stage_params()
  param_specs = jax.tree.map(lambda _: P("stage"), params)
  state_specs = optimizer_state_specs(jax.eval_shape(tx.init, params), params, param_specs)
  stage_step = jax.jit(
      _compat.shard_map(
          lambda p, g, s: tx.apply_gradients_stage_local(
              params=p, grads=g, opt_state=s, axis_name="stage",
              stacked_spec=("stage",),
          ),
          mesh=mesh,
          in_specs=(param_specs, param_specs, state_specs),
          out_specs=(param_specs, state_specs),
          check_vma=False,
      )
  )
  shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), (param_specs, state_specs))
  got_p, got_s = jax.device_put((params, tx.init(params)), shardings)
  compiled = stage_step.lower(got_p, step_grads(got_p, 0), got_s).compile()

  @jax.jit
  def optax_step(params, state, i):
    updates, state = tx.update(step_grads(params, i), state, params)
    return optax.apply_updates(params, updates), state

  want_p, want_s = params, tx.init(params)
  for i in range(3):
    got_p, got_s = compiled(got_p, step_grads(got_p, jnp.float32(i)), got_s)
    want_p, want_s = optax_step(want_p, want_s, jnp.float32(i))
  assert_trees_close((got_p, got_s), (want_p, want_s), rtol=1e-5)
  assert got_p["w"].sharding.spec == P("stage")

  hlo = compiled.as_text()
  assert not re.search(r"all-gather|all-to-all|collective-permute", hlo)
  reduced = re.findall(r"=\s*(\S+)\s+all-reduce(?:-start)?\(", hlo)
  assert reduced, "the clip needs one all-reduce of the squared norm"
  assert all(re.fullmatch(r"\(?(f32\[\],?\s*)+\)?", shape) for shape in reduced), reduced


# ---- Factory, registry and schedules. ----


def test_factory_records_its_metadata():
  tx, schedule = _create(
      "adamw", AdamWConfig(b1=0.8), LINEAR, weight_decay=0.1, weight_decay_mask=MATRICES,
      clip_grad=1.0, gradient_accumulation_steps=2, stacked_axes=1, impl="xla",
  )
  m = tx.metadata
  assert m.scheduler is schedule and m.weight_decay == 0.1 and m.weight_decay_mask is MATRICES
  assert (m.gradient_accumulation_steps, m.clip_grad, m.stacked_axes) == (2, 1.0, 1)
  assert (m.adamw_b1, m.adamw_b2, m.adamw_eps, m.adamw_eps_root, m.adamw_mu_dtype) == (
      0.8, 0.999, 1e-8, 0.0, None)
  assert m.optimizer_config == AdamWConfig(b1=0.8)
  assert m.extra_kwargs == {}
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  assert isinstance(tx.init(_small_params()), optax.MultiStepsState)


def test_schedules_are_eformers():
  steps = jnp.arange(12)
  # (config, schedule) pairs: configs are mutable, so not dict keys.
  expected = [
      (SchedulerConfig(learning_rate=3e-4), optax.constant_schedule(3e-4)),
      (SchedulerConfig("linear", 1e-2, 1e-3, warmup_steps=3, steps=10), optax.join_schedules(
          [optax.linear_schedule(1e-8, 1e-2, 3), optax.linear_schedule(1e-2, 1e-3, 7)], [3])),
      (SchedulerConfig("linear", 1e-2, 1e-3, steps=10), optax.linear_schedule(1e-2, 1e-3, 10)),
      (SchedulerConfig("cosine", 1e-2, 1e-3, warmup_steps=3, steps=10, exponent=2.0),
       optax.warmup_cosine_decay_schedule(1e-8, 1e-2, 3, 10, 1e-3, exponent=2.0)),
      (SchedulerConfig("cosine", 1e-2, 1e-3, steps=10), optax.cosine_decay_schedule(1e-2, 10, 0.1)),
      (SchedulerConfig("cosine", 1e-2, steps=10), optax.cosine_decay_schedule(1e-2, 10)),
  ]
  for config, schedule in expected:
    _, got = _create("adamw", scheduler_config=config)
    np.testing.assert_allclose(jax.vmap(got)(steps), jax.vmap(schedule)(steps), rtol=1e-6,
                               err_msg=str(config))


@dataclasses.dataclass
class _SGDConfig:
  momentum: float = 0.9


@pytest.fixture
def registry(monkeypatch):
  """Registrations made by a test are undone after it."""
  monkeypatch.setattr(factory, "_OPTIMIZER_BUILDERS", dict(factory._OPTIMIZER_BUILDERS))
  monkeypatch.setattr(factory, "_SCHEDULER_BUILDERS", dict(factory._SCHEDULER_BUILDERS))


def test_registered_optimizer_and_scheduler_are_used(registry):
  @factory.register_optimizer("sgd")
  @dataclasses.dataclass
  class SGDOptimizer(factory.OptimizerBuilder):
    config: _SGDConfig

    def build(self, scheduler):
      return optax.sgd(scheduler, momentum=self.config.momentum)

  @factory.register_scheduler("halving")
  @dataclasses.dataclass
  class Halving(factory.SchedulerBuilder):
    def build(self):
      return lambda count: self.config.learning_rate / 2.0**count

  tx, schedule = _create("sgd", _SGDConfig(0.5), SchedulerConfig("halving", 1.0, steps=4),
                                  clip_grad=1.0)
  assert float(schedule(3)) == 0.125
  params = _small_params()
  want_tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(schedule, momentum=0.5))
  got = tx.update(step_grads(params, 0), tx.init(params), params)
  assert_trees_close(got, want_tx.update(step_grads(params, 0), want_tx.init(params), params))
  with pytest.raises(NotImplementedError, match=r"optimizer 'sgd' has no stage-local apply.*"
                     r"FusedGradientTransformation.*Reason: SGDOptimizer.build returned a"):
    tx.apply_gradients_stage_local(params=params, grads=params, opt_state=tx.init(params))
  # Without a config, the factory's keywords fill the default one (eFormer's rule).
  tx, schedule = OptimizerFactory.create("sgd", momentum=0.25)
  want_tx = optax.sgd(schedule, momentum=0.25)
  got, want = tx.init(params), want_tx.init(params)
  for i in range(2):  # the second update depends on the momentum
    got_updates, got = tx.update(step_grads(params, i), got, params)
    want_updates, want = want_tx.update(step_grads(params, i), want, params)
  assert_trees_close(got_updates, want_updates)


def test_user_builder_returning_a_fused_transform_gets_the_stage_local_path(registry):
  @factory.register_optimizer("lion_no_decay")
  @dataclasses.dataclass
  class NoDecayLion(factory.OptimizerBuilder):
    config: LionConfig

    def build(self, scheduler):
      return lion(scheduler, b1=self.config.b1, b2=self.config.b2, weight_decay=0.0,
                  impl=self.impl)

  tx, _ = _create("lion_no_decay", LionConfig(b1=0.8), weight_decay=0.1,
                           clip_grad=0.5, impl="xla")
  got, want = _trajectories(tx, tx, _params(), 3)
  assert_trees_close(got, want, rtol=1e-5)


# ---- Errors. ----


def test_unsupported_optimizer_keeps_update_and_explains_the_fix():
  tx = make_unsupported_stage_local_gradient_transformation(
      optax.sgd(0.1), optimizer_type="sgd", reason="no fused kernel yet."
  )
  params = _small_params()
  updates, _ = tx.update(params, tx.init(params), params, loss=1.0)
  assert_trees_close(updates, jax.tree.map(lambda p: -0.1 * p, params))
  with pytest.raises(NotImplementedError, match=r"'sgd'.*register it with a builder.*"
                     r"make_stage_local_gradient_transformation.*Reason: no fused kernel yet."):
    tx.apply_gradients_stage_local(params=params, grads=params, opt_state=tx.init(params))


def test_bad_registrations_are_rejected(registry):
  with pytest.raises(ValueError, match="optimizer 'adamw' is already registered \\(by AdamWOptimizer"):
    factory.register_optimizer("adamw")(AdamWOptimizer)
  with pytest.raises(TypeError, match="must be a dataclass subclassing OptimizerBuilder"):
    factory.register_optimizer("sgd")(_SGDConfig)
  with pytest.raises(TypeError, match="name must be a non-empty str"):
    factory.register_scheduler("")

  @factory.register_optimizer("untyped")
  @dataclasses.dataclass
  class Untyped(factory.OptimizerBuilder):
    def build(self, scheduler):
      return optax.sgd(scheduler)

  with pytest.raises(ValueError, match="Untyped \\(optimizer 'untyped'\\) must annotate its config"):
    OptimizerFactory.create("untyped")


def test_eformer_style_apply_fn_gets_only_eformers_arguments():
  seen = {}

  def apply_fn(*, params, grads, opt_state, learning_rate_fn=None, delete_grads=False):
    seen.update(learning_rate_fn=learning_rate_fn, delete_grads=delete_grads)
    return params, opt_state

  tx = make_stage_local_gradient_transformation(optax.sgd(0.1), apply_fn=apply_fn)
  params = _small_params()
  assert tx.apply_gradients_stage_local(params=params, grads=params, opt_state=()) == (params, ())
  assert seen == {"learning_rate_fn": None, "delete_grads": False}


def test_apply_fn_is_required():
  with pytest.raises(ValueError, match="needs apply_fn"):
    make_stage_local_gradient_transformation(optax.sgd(0.1))
  optimizer = adamw(0.1)
  tx = make_stage_local_gradient_transformation(
      optax.chain(optimizer), apply_fn=fused_stage_local_apply(optimizer)
  )
  params = _small_params()
  with pytest.raises(ValueError, match="needs the transform's metadata"):
    tx.apply_gradients_stage_local(params=params, grads=params, opt_state=tx.init(params))
  with pytest.raises(TypeError, match="needs a pallasopt FusedGradientTransformation"):
    fused_stage_local_apply(optax.adamw(0.1))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be an int >= 1"),
        ({"gradient_accumulation_steps": 2.0}, "gradient_accumulation_steps must be an int >= 1"),
        ({"clip_grad": -1.0}, "clip_grad must be None or a finite number >= 0"),
        ({"stacked_axes": -1}, "stacked_axes must be an int >= 0"),
        ({"weight_decay": float("nan")}, "weight_decay must be a finite number"),
        ({"impl": "gpu"}, "impl must be one of"),
    ],
)
def test_bad_factory_arguments_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    _create("adamw", **kwargs)


def test_accumulation_misuse_is_reported():
  accumulating, _ = _create("adamw", clip_grad=1.0, gradient_accumulation_steps=2,
                                     impl="xla")
  plain, _ = _create("adamw", clip_grad=1.0, impl="xla")
  params = _small_params()
  with pytest.raises(ValueError, match="global_grad_norm cannot be used with "
                     "gradient_accumulation_steps=2"):
    accumulating.apply_gradients_stage_local(
        params=params, grads=params, opt_state=accumulating.init(params), global_grad_norm=1.0)
  with pytest.raises(ValueError, match="gradient_accumulation_steps is 2, so opt_state must be "
                     "an optax.MultiStepsState; got tuple"):
    accumulating.apply_gradients_stage_local(params=params, grads=params,
                                             opt_state=plain.init(params))
  with pytest.raises(ValueError, match="gradient_accumulation_steps is 1, so opt_state must not "
                     "be an optax.MultiStepsState"):
    plain.apply_gradients_stage_local(params=params, grads=params,
                                      opt_state=accumulating.init(params))


def test_state_of_another_layout_is_reported():
  clipped, _ = _create("adamw", clip_grad=1.0, impl="xla")
  params = _small_params()
  bare = adamw(1e-3).init(params)
  with pytest.raises(ValueError, match=r"opt_state must be the optax.chain state \(clip_by_global"
                     r"_norm state, optimizer state\).*got tuple of length 3"):
    clipped.apply_gradients_stage_local(params=params, grads=params, opt_state=bare)


def test_mismatched_trees_name_the_leaf():
  tx, _ = _create("adamw", impl="xla")
  params = _small_params()
  state = tx.init(params)
  apply = functools.partial(tx.apply_gradients_stage_local, params=params, opt_state=state)
  with pytest.raises(ValueError, match=r"missing in grads: \['dense'\]\['b'\]"):
    apply(grads={"dense": {"w": params["dense"]["w"]}, "stack": params["stack"]})
  with pytest.raises(ValueError, match=r"unexpected in grads: \['extra'\]"):
    apply(grads={**params, "extra": jnp.ones(3)})
  with pytest.raises(ValueError, match=r"grads\['dense'\]\['b'\] has shape \(8,\)"):
    apply(grads={**params, "dense": {**params["dense"], "b": jnp.ones(8)}})
  # A None subtree is a zero gradient for all of it.
  got = apply(grads={**params, "dense": None})
  want = apply(grads={**params, "dense": jax.tree.map(jnp.zeros_like, params["dense"])})
  assert_trees_close(got, want)


def test_unknown_and_wrong_configs_are_reported():
  with pytest.raises(ValueError, match=r"unknown optimizer_type 'adam'; registered optimizers are "
                     r"\['adafactor', 'adamw', 'kron', 'lion', 'mars', 'muon', 'quad', 'rmsprop', "
                     r"'skew'\]"):
    _create("adam")
  with pytest.raises(ValueError, match=r"unknown scheduler_type 'exponential'; registered "
                     r"schedulers are \['constant', 'cosine', 'linear'"):
    _create("adamw", scheduler_config=SchedulerConfig("exponential", steps=10))
  with pytest.raises(TypeError, match="optimizer_config for 'adamw' must be a AdamWConfig; got "
                     "LionConfig"):
    _create("adamw", LionConfig())
  with pytest.raises(TypeError, match=r"the order is create\(optimizer_type, scheduler_config, "
                     r"optimizer_config\)"):
    _create("adamw", LINEAR)
  with pytest.raises(ValueError, match="'linear' scheduler needs learning_rate_end"):
    _create("adamw", scheduler_config=SchedulerConfig("linear", steps=10))
  with pytest.raises(ValueError, match=r"AdamWConfig.mu_dtype='bfloat61' names no jax.numpy dtype"):
    _create("adamw", AdamWConfig(mu_dtype="bfloat61"))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"scheduler_type": "cosine"}, "needs steps"),
        ({"warmup_steps": 2, "steps": 10}, "warmup_steps needs a decaying scheduler_type"),
        ({"scheduler_type": "linear", "warmup_steps": 10, "steps": 10}, "must be less than steps"),
        ({"steps": -1}, "steps must be None or an int >= 0"),
        ({"learning_rate": float("nan")}, "learning_rate must be a finite number"),
    ],
)
def test_bad_scheduler_configs_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SchedulerConfig(**kwargs)


@pytest.mark.parametrize("name", ["adamw", "lion", "rmsprop", "mars", "adafactor"])
def test_factory_decay_link_folds_into_the_fused_kernels(name):
  # These optimizers scale by the factory's schedule, so the scheduled decay
  # link is added inside their kernels (decay_link) rather than by an extra
  # pass; the result is the chain's (update path) and the link's count advances.
  tx, schedule = _create(name, None, COSINE, weight_decay=0.1, weight_decay_mask=MATRICES,
                         clip_grad=0.5, impl="xla")
  base = factory._OPTIMIZER_BUILDERS[name](config=tx.metadata.optimizer_config,
                                           impl="xla").build(schedule)
  calls = []

  def recording_apply(params, grads, state, **kwargs):
    calls.append(sorted(kwargs))
    return base.apply_gradients(params, grads, state, **kwargs)

  fused = FusedGradientTransformation(base.init, base.update, recording_apply,
                                      base.scaled_update, learning_rate=schedule)
  spied = make_stage_local_gradient_transformation(tx, tx.metadata, fused_stage_local_apply(fused))
  got, want = _trajectories(spied, tx, _params(), 3)
  assert calls and all("decay_link" in c for c in calls)
  assert_trees_close(got, want, rtol=1e-5)
  assert int(got[1][-1].inner_state.count) == 3
