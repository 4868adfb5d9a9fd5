"""make_train_step: 3 pipelined steps with a stage-local optimizer equal the
unpipelined model trained with the same optimizer's Optax path.

Runs on the 8 fake CPU devices that conftest.py requests. Every optimizer
type whose module exists is tested (AdamW and Muon also with global-norm
clipping), on pipeline configurations that differ per optimizer (both io
layouts, R = 1 and 2, the circular buffer, three stacked axes).
"""

import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import pallasopt

from helpers import assert_close
from pipeline_model import layer, make_batch, make_layers, mse, placed, reference_step
from pallasopt.optim.eformer import (
    AdafactorConfig,
    AdamWConfig,
    KronConfig,
    LionConfig,
    MuonConfig,
    OptimizerFactory,
    SchedulerConfig,
)
from pallasopt.pipeline.circular import scan_layers
from pallasopt.pipeline.layout import layers_to_stages, stages_to_layers
from pallasopt.pipeline.schedule import CircularSchedule
from pallasopt.pipeline.train import make_train_step

RTOL = 1e-5
STEPS = 3
SCHEDULER = SchedulerConfig("linear", learning_rate=1e-2, learning_rate_end=5e-3, steps=4)

# name -> (config, (S, M, R, lps, streamed_io)). Small shapes that still factor
# (Adafactor), orthogonalize (Muon) and precondition (Kron) the 8x8 weights.
CASES = {
    "adamw": (AdamWConfig(b2=0.95), (2, 4, 2, 1, True)),
    "lion": (LionConfig(), (2, 2, 2, 1, False)),
    "adafactor": (AdafactorConfig(min_dim_size_to_factor=4, momentum=0.9), (2, 2, 1, 2, True)),
    "muon": (MuonConfig(), (2, 4, 2, 1, False)),
    "kron": (KronConfig(preconditioner_update_probability=1.0), (2, 2, 2, 1, True)),
}
# Only the optimizer modules that exist in this checkout.
OPTIMIZERS = [name for name in CASES if importlib.util.find_spec(f"pallasopt.optim.{name}")]


def stage_mesh(num_stages, data=1, second_axis="data"):
  devices = np.array(jax.devices()[: num_stages * data])
  if data == 1:
    return Mesh(devices, ("stage",))
  return Mesh(devices.reshape(num_stages, data), ("stage", second_axis))


def _factory(name, clip, impl, accumulation):
  """``build(stacked_axes) -> tx``: the factory's stage-local transform."""
  kwargs = dict(weight_decay=0.01, impl=impl, gradient_accumulation_steps=accumulation)
  return lambda stacked_axes: OptimizerFactory.create(
      name, SCHEDULER, CASES[name][0], stacked_axes=stacked_axes, clip_grad=clip, **kwargs)[0]


def run_and_compare(name, clip, schedule, *, data=1, impl="xla", accumulation=1, fsdp=1,
                    build=None):
  """STEPS pipelined steps against STEPS unpipelined Optax steps; returns the step.

  ``build(stacked_axes) -> tx`` replaces the factory's transform of ``name``.
  """
  build = build or _factory(name, clip, impl, accumulation)
  tx = build(schedule.stacked_axes)
  mesh = stage_mesh(schedule.num_stages, max(data, fsdp), "fsdp" if fsdp > 1 else "data")
  stage_fn = layer if schedule.layers_per_stage == 1 else scan_layers(layer)
  # The 8x8 weights are split over the FSDP axis, the 8-element biases stay whole.
  fsdp_args = dict(fsdp_axis="fsdp", fsdp_min_size=64) if fsdp > 1 else {}
  step = make_train_step(stage_fn, mse, tx, mesh=mesh, schedule=schedule,
                         data_axis="data" if data > 1 else None, **fsdp_args)
  layers = make_layers(schedule.num_layers)
  inputs, targets = make_batch(schedule.num_microbatches)
  ref_tx = build(1)
  ref_step, ref_state = reference_step(ref_tx, inputs, targets), ref_tx.init(layers)
  params, opt_state, (sharded_inputs, sharded_targets) = placed(step, layers, inputs, targets)
  ref_params, clipped = layers, False
  for i in range(STEPS):
    old = jax.tree.leaves(params)[0]
    params, opt_state, metrics = step(params, opt_state, sharded_inputs, sharded_targets)
    assert old.is_deleted(), "params were not donated"
    ref_params, ref_state, ref_loss, ref_norm = ref_step(ref_params, ref_state)
    assert_close(metrics["loss"], ref_loss, RTOL, f"loss, step {i}")
    assert_close(metrics["grad_norm"], ref_norm, RTOL, f"grad norm, step {i}")
    got = stages_to_layers(params, schedule)
    for key in ref_params:
      assert_close(got[key], ref_params[key], RTOL, f"params[{key!r}], step {i}")
    clipped |= clip is not None and float(ref_norm) > clip
  assert clip is None or clipped, "the clip never engaged; lower it"
  return step, (params, opt_state, sharded_inputs, sharded_targets)


# The clip (a psum of the stages' squared norms, then one scale) is the
# factory's, ahead of every family alike: clipped here for one elementwise
# and one matrix family.
@pytest.mark.parametrize("name,clip", [(name, None) for name in OPTIMIZERS] + [
    (name, 0.05) for name in ("adamw", "muon") if name in OPTIMIZERS])
def test_three_steps_equal_the_unpipelined_model(name, clip):
  S, M, R, lps, streamed = CASES[name][1]
  run_and_compare(name, clip, CircularSchedule(S, M, R, lps, streamed_io=streamed))


# (AdamW and Muon: tests/test_pipeline_fsdp.py.)
@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n not in ("adamw", "muon")])
def test_fsdp_three_steps_equal_the_unpipelined_model(name):
  # Lion updates its slices in place; Adafactor (split over its layers per
  # stage) and Kron (over the repeats, with each layer's own probe) update
  # whole layers.
  S, M, R, lps, streamed = CASES[name][1]
  run_and_compare(name, 0.05, CircularSchedule(S, M, R, lps, streamed_io=streamed), fsdp=2)


def test_fsdp_with_gradient_accumulation_and_interpret_mode_kernels():
  # With accumulation and a clip even AdamW updates whole layers: the
  # stage-local step takes the averaged gradient's norm over (stage, fsdp).
  run_and_compare("adamw", 0.05, CircularSchedule(2, 2, 2), accumulation=2, fsdp=2,
                  impl="interpret")


def test_kron_with_several_layers_per_stage_draws_each_layers_own_probe():
  # Kron's probes are drawn per global layer; with 2 layers per stage and 2
  # repeats the stage-local layer index must map back through both.
  run_and_compare("kron", None, CircularSchedule(2, 2, 2, 2))


def test_gradient_accumulation():
  # The clip then applies to the averaged gradient, whose norm the stage-local
  # step takes with its own scalar psum over the stage axis.
  run_and_compare("adamw", 0.05, CircularSchedule(2, 2, 2), accumulation=2)


def test_interpret_mode_kernels_in_the_stage_shard_map():
  run_and_compare("adamw", 0.05, CircularSchedule(2, 2), impl="interpret")


COLLECTIVE = re.compile(
    r"^\s*\S+ = (\([^)]*\)|\S+) (all-reduce|all-gather|collective-permute|reduce-scatter|"
    r"all-to-all|collective-broadcast)(-start)?\(",
    re.M,
)


def collectives(step, args):
  hlo = step.lower(*args).compile().as_text()
  return [(m.group(2), m.group(1)) for m in COLLECTIVE.finditer(hlo)]


def test_streamed_step_has_only_permutes_and_scalar_all_reduces():
  step, args = run_and_compare("adamw", 0.05, CircularSchedule(4, 4, 2, streamed_io=True))
  found = collectives(step, args)
  kinds = {kind for kind, _ in found}
  assert "collective-permute" in kinds
  assert kinds <= {"collective-permute", "all-reduce"}, found
  for kind, shape in found:
    if kind == "all-reduce":
      # One scalar, or a tuple of scalars when XLA combines the loss and norm.
      assert re.fullmatch(r"\(?f32\[\](, f32\[\])*\)?", shape), shape


def test_data_axis():
  """2 stages x 2 data shards: grads are summed over the data axis (the only
  non-scalar all-reduces), each shard updates its stage locally, and no
  weight is ever gathered."""
  step, args = run_and_compare("adamw", 0.05, CircularSchedule(2, 4, 2), data=2)
  kinds = {kind for kind, _ in collectives(step, args)}
  assert "all-gather" not in kinds and "collective-permute" in kinds


_PLAIN = {
    "adamw": lambda stacked_axes: pallasopt.optim.adamw(1e-2, b2=0.95, weight_decay=0.01),
    "muon": lambda stacked_axes: pallasopt.optim.muon(1e-2, stacked_axes=stacked_axes),
    "adafactor": lambda stacked_axes: pallasopt.optim.adafactor(
        1e-2, min_dim_size_to_factor=4, momentum=0.9, stacked_axes=stacked_axes),
}


@pytest.mark.parametrize("name,fsdp", [("adamw", 2), ("muon", 2), ("adafactor", 1)])
def test_a_plain_pallasopt_transform_trains_as_its_optax_path(name, fsdp):
  # No factory: the transform itself, its state optax.chain(tx)'s. AdamW
  # updates its FSDP slices in place (it is elementwise); Muon and Adafactor
  # update whole layers, each treating the stacked dims as batch dims.
  step, _ = run_and_compare(name, None, CircularSchedule(2, 4, 2), fsdp=fsdp, build=_PLAIN[name])
  assert (step._layer_layout() is None) == (fsdp == 1 or name == "adamw")


def test_bad_configurations_raise():
  schedule = CircularSchedule(2, 2, 2)
  mesh = stage_mesh(2)
  tx, _ = OptimizerFactory.create("adamw", stacked_axes=2, impl="xla")
  with pytest.raises(TypeError, match="tx must be a pallasopt transform .* got GradientTrans"):
    make_train_step(layer, mse, optax.adam(1e-3), mesh=mesh, schedule=schedule)
  chained = optax.chain(optax.clip_by_global_norm(1.0), pallasopt.optim.adamw(1e-3))
  with pytest.raises(TypeError, match="An optax.chain is neither"):
    make_train_step(layer, mse, chained, mesh=mesh, schedule=schedule)
  with pytest.raises(ValueError, match=r"tx was built with stacked_axes=0.*build it with stacked_axes=2 "):
    make_train_step(layer, mse, pallasopt.optim.muon(1e-3), mesh=mesh, schedule=schedule)
  fsdp_mesh = stage_mesh(2, 2, "fsdp")
  distributed = pallasopt.optim.muon(1e-3, stacked_axes=2, distributed_axes=("fsdp",))
  with pytest.raises(ValueError, match="distributed_axes=\\('fsdp',\\) names fsdp_axis"):
    make_train_step(layer, mse, distributed, mesh=fsdp_mesh, schedule=schedule, fsdp_axis="fsdp")
  wrong, _ = OptimizerFactory.create("adamw", stacked_axes=1, impl="xla")
  with pytest.raises(ValueError, match=r"tx was built with stacked_axes=1.*stacked_axes=2\)"):
    make_train_step(layer, mse, wrong, mesh=mesh, schedule=schedule)
  with pytest.raises(ValueError, match="mesh axis 'stage' has 4 devices"):
    make_train_step(layer, mse, tx, mesh=stage_mesh(4), schedule=schedule)
  step = make_train_step(layer, lambda out, tgt: jnp.mean(out - tgt, axis=0), tx, mesh=mesh,
                         schedule=schedule)
  params = step.shard_params(layers_to_stages(make_layers(4), schedule))
  with pytest.raises(ValueError, match=r"params\['b'\] has shape \(4, 8\)"):
    step.shard_params(make_layers(4))
  with pytest.raises(ValueError, match="loss_fn must return a scalar"):
    step(params, step.init(params), *make_batch(2))
