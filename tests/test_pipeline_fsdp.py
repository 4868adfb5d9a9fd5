"""FSDP inside each pipeline stage: params, gradients and optimizer state split over a
second mesh axis, each repeat's weights gathered in a sliding window.

Runs on the 8 fake CPU devices that conftest.py requests: the forward and
backward equal the unpipelined model (both backward forms), two train steps
equal the unpipelined Optax steps on the issue's mesh (4 stages x 2 FSDP
devices, 8 microbatches, 2 repeats), each device holds an eighth of the
params and state, the compiled step gathers and reduce-scatters as the design
says, and the sharded state checkpoints with orbax.
"""

import re

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

from bench.pipeline_fsdp import collective_runs
from helpers import assert_close, assert_trees_close
from pipeline_model import layer, make_batch, make_layers, mse, placed, reference_step, sequential
from pallasopt.optim.eformer import AdamWConfig, MuonConfig, OptimizerFactory, SchedulerConfig
from pallasopt.pipeline.circular import circular_pipeline, io_specs, scan_layers
from pallasopt.pipeline.layout import fsdp_dims, layers_to_stages, stage_shardings, stages_to_layers
from pallasopt.pipeline.schedule import CircularSchedule
from pallasopt.pipeline.train import make_train_step

RTOL = 1e-5


def mesh_of(*axes):
  """A mesh of the first devices, ``axes`` as ``(name, size)`` pairs."""
  sizes = [n for _, n in axes]
  devices = np.array(jax.devices()[: int(np.prod(sizes))]).reshape(sizes)
  return Mesh(devices, tuple(name for name, _ in axes))


def test_fsdp_dims_split_the_largest_inner_dim_and_leave_small_leaves_whole():
  schedule = CircularSchedule(num_stages=2, num_microbatches=2, num_repeats=1, layers_per_stage=2)
  shapes = {
      "w": (1, 2, 2, 64, 256),   # rows preferred to the (larger) last dim
      "v": (1, 2, 2, 96, 30),    # 30 is not divisible: rows
      "u": (1, 2, 2, 7, 1024),   # only the last dim divides
      "b": (1, 2, 2, 256),       # too small
      "odd": (1, 2, 2, 63, 65),  # no dim divides
  }
  stacked = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
  dims = fsdp_dims(stacked, schedule, 2, min_size=1024)
  assert dims == {"w": 3, "v": 3, "u": 4, "b": None, "odd": None}
  assert fsdp_dims(stacked, schedule, 1, min_size=1) == dict.fromkeys(shapes)


# S, R, M, streamed, remat, lps, regather: both io layouts, R = 1, 2 and 3 (the
# backward scan's gathering windows), the circular buffer (M > S with R > 1), remat on and
# off, several layers per stage, both backward forms.
CASES = [
    (2, 2, 4, False, True, 1, True),
    (4, 2, 4, True, True, 1, False),
    (2, 1, 2, True, False, 2, True),
    (2, 3, 4, False, True, 1, True),
]


def check_pipeline(schedule, *, remat, regather, axes, data_axis=None, fsdp_axis="fsdp"):
  mesh = mesh_of(("stage", schedule.num_stages), *axes)
  stage_fn = layer if schedule.layers_per_stage == 1 else scan_layers(layer)
  layers = make_layers(schedule.num_layers)
  inputs, targets = make_batch(schedule.num_microbatches, microbatch=8)
  spec = io_specs(schedule, data_axis=data_axis, fsdp_axis=fsdp_axis)
  inputs, targets = (jax.device_put(x, NamedSharding(mesh, spec)) for x in (inputs, targets))
  stacked = layers_to_stages(layers, schedule)
  # The 8x8 weights are split, the 8-element biases stay whole.
  dims = fsdp_dims(stacked, schedule, mesh.shape[fsdp_axis], min_size=64)
  stacked = jax.device_put(stacked, stage_shardings(mesh, stacked, fsdp_axis=fsdp_axis, fsdp=dims))

  def pipelined_loss(stacked):
    outputs = circular_pipeline(
        stage_fn, stacked, inputs, mesh=mesh, schedule=schedule, data_axis=data_axis,
        remat=remat, fsdp_axis=fsdp_axis, fsdp_min_size=64, fsdp_regather=regather,
    )
    return mse(outputs, targets), outputs

  (loss, outputs), grads = jax.jit(jax.value_and_grad(pipelined_loss, has_aux=True))(stacked)
  ref_fn = lambda layers: (mse(out := sequential(layer, layers, inputs), targets), out)
  (ref_loss, ref_out), ref_grads = jax.jit(jax.value_and_grad(ref_fn, has_aux=True))(layers)
  assert_close(outputs, ref_out, RTOL, "outputs")
  assert_close(loss, ref_loss, RTOL, "loss")
  assert_trees_close(grads, layers_to_stages(ref_grads, schedule), RTOL)
  # Gradients leave split like their params.
  w_dim = dims["w"]
  assert grads["w"].sharding.spec[w_dim] == fsdp_axis, grads["w"].sharding
  assert tuple(grads["b"].sharding.spec[:2]) == (None, "stage")


@pytest.mark.parametrize("S,R,M,streamed,remat,lps,regather", CASES)
def test_loss_and_grads_equal_sequential(S, R, M, streamed, remat, lps, regather):
  schedule = CircularSchedule(num_stages=S, num_microbatches=M, num_repeats=R,
                              layers_per_stage=lps, streamed_io=streamed)
  check_pipeline(schedule, remat=remat, regather=regather, axes=[("fsdp", 2)])


def test_fsdp_axis_that_is_the_data_axis_zero3():
  schedule = CircularSchedule(num_stages=4, num_microbatches=4, num_repeats=2)
  check_pipeline(schedule, remat=True, regather=True, axes=[("data", 2)],
                 data_axis="data", fsdp_axis="data")


def test_fsdp_axis_beside_a_data_axis():
  schedule = CircularSchedule(num_stages=2, num_microbatches=4, num_repeats=2)
  check_pipeline(schedule, remat=True, regather=True, axes=[("data", 2), ("fsdp", 2)],
                 data_axis="data")


# ---- The train step on the mesh: 4 stages x 2 FSDP devices. ----

SCHEDULE = CircularSchedule(num_stages=4, num_microbatches=8, num_repeats=2)
SCHEDULER = SchedulerConfig("linear", learning_rate=1e-2, learning_rate_end=5e-3, steps=4)
HIDDEN = 128
# With 256 features the whole biases (and AdamW's moments of them) are under
# 1% of the params and state.
SHARE_HIDDEN = 256


def build(name, fsdp, hidden=HIDDEN, schedule=SCHEDULE, **step_args):
  config = AdamWConfig(b2=0.95) if name == "adamw" else MuonConfig()
  tx, _ = OptimizerFactory.create(name, SCHEDULER, config, weight_decay=0.01, clip_grad=0.05,
                                  stacked_axes=schedule.stacked_axes)
  if fsdp:
    mesh, axes = mesh_of(("stage", 4), ("fsdp", 2)), dict(fsdp_axis="fsdp")
  else:
    mesh, axes = mesh_of(("stage", 4), ("data", 2)), dict(data_axis="data")
  step = make_train_step(layer, mse, tx, mesh=mesh, schedule=schedule, **axes, **step_args)
  layers = make_layers(schedule.num_layers, hidden=hidden)
  inputs, targets = make_batch(schedule.num_microbatches, microbatch=4, hidden=hidden)
  return step, tx, layers, inputs, targets


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_two_steps_equal_the_unpipelined_model_with_and_without_fsdp(name):
  results = []
  for fsdp in (False, True):
    step, _, layers, inputs, targets = build(name, fsdp)
    params, opt_state, batch = placed(step, layers, inputs, targets)
    for _ in range(2):
      params, opt_state, metrics = step(params, opt_state, *batch)
    results.append((stages_to_layers(params, SCHEDULE), metrics))
  ref_tx, _ = OptimizerFactory.create(
      name, SCHEDULER, AdamWConfig(b2=0.95) if name == "adamw" else MuonConfig(),
      weight_decay=0.01, clip_grad=0.05, stacked_axes=1)

  ref_step = reference_step(ref_tx, inputs, targets)
  ref_params, ref_state = layers, ref_tx.init(layers)
  grad = jax.jit(jax.grad(lambda p: mse(sequential(layer, p, inputs), targets)))
  slack = jax.tree.map(jnp.zeros_like, layers)
  for _ in range(2):
    if name == "adamw":
      slack = jax.tree.map(jnp.add, slack, _adam_amplified(grad(ref_params)))
    ref_params, ref_state, ref_loss, _ = ref_step(ref_params, ref_state)
  for params, metrics in results:
    assert_close(metrics["loss"], ref_loss, RTOL, "loss of step 2")
    assert jax.tree.map(jnp.result_type, params) == jax.tree.map(jnp.result_type, ref_params)
    for key in params:
      scale = float(jnp.max(jnp.abs(ref_params[key])))
      np.testing.assert_array_less(jnp.abs(params[key] - ref_params[key]),
                                   RTOL * scale + slack[key], err_msg=key)


def _adam_amplified(grads):
  """How far one AdamW step may move each param apart in two runs whose gradients
  agree within ``RTOL`` of their largest (what the loss-and-grads tests assert).

  AdamW's update is scale-free, so it turns a gradient's relative error into an
  update's: an absolute error ``RTOL max|g|`` is ``RTOL max|g| / |g|`` of a
  small element's gradient (the pipeline and the unpipelined model sum a
  gradient in another order), and its update, at most about one learning rate
  (the schedule's first, the largest), moves by that much of it, at most twice.
  On jax 0.12.1 one element of 131072, a gradient of 2.4e-8 against a median of
  4e-5, moved 2.2e-5 apart, over the 1.9e-5 of the params' scale alone.
  """
  return jax.tree.map(
      lambda g: SCHEDULER.learning_rate * jnp.minimum(
          2.0, RTOL * jnp.max(jnp.abs(g)) / jnp.maximum(jnp.abs(g), 1e-30)), grads)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_a_data_axis_beside_the_fsdp_axis_trains_as_the_unpipelined_model(name):
  # Stage 2 x data 2 x fsdp 2: gradients are summed over the data axis and
  # reduce-scattered over the FSDP axis; the clip's norm counts each element once.
  schedule = CircularSchedule(num_stages=2, num_microbatches=4, num_repeats=2)
  config = AdamWConfig() if name == "adamw" else MuonConfig()
  make = lambda stacked_axes: OptimizerFactory.create(
      name, SCHEDULER, config, clip_grad=0.05, weight_decay=0.01, stacked_axes=stacked_axes)[0]
  step = make_train_step(layer, mse, make(schedule.stacked_axes), schedule=schedule,
                         mesh=mesh_of(("stage", 2), ("data", 2), ("fsdp", 2)),
                         data_axis="data", fsdp_axis="fsdp", fsdp_min_size=64)
  layers = make_layers(schedule.num_layers)
  inputs, targets = make_batch(schedule.num_microbatches, microbatch=8)
  params, opt_state, batch = placed(step, layers, inputs, targets)
  ref_tx = make(1)
  ref_step = reference_step(ref_tx, inputs, targets)
  ref_params, ref_state = layers, ref_tx.init(layers)
  for i in range(2):
    params, opt_state, metrics = step(params, opt_state, *batch)
    ref_params, ref_state, ref_loss, ref_norm = ref_step(ref_params, ref_state)
    assert_close(metrics["loss"], ref_loss, RTOL, f"loss, step {i}")
    assert_close(metrics["grad_norm"], ref_norm, RTOL, f"grad norm, step {i}")
  assert_trees_close(stages_to_layers(params, schedule), ref_params, RTOL)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_each_device_holds_an_eighth_of_params_and_state(name):
  step, tx, layers, *_ = build(name, fsdp=True, hidden=SHARE_HIDDEN)
  params = step.shard_params(layers_to_stages(layers, SCHEDULE))
  opt_state = step.init(params)
  total = sum(x.nbytes for x in jax.tree.leaves((params, opt_state)))
  whole = sum(x.nbytes for x in jax.tree.leaves((params, opt_state))
              if "fsdp" not in jax.tree.leaves(tuple(x.sharding.spec)))
  assert whole < 0.01 * total, (whole, total)
  for device in step.mesh.devices.flat:
    held = sum(s.data.nbytes for x in jax.tree.leaves((params, opt_state))
               for s in x.addressable_shards if s.device == device)
    assert held <= total / 8 + whole, (device, held, total)
  # AdamW's moments are split like their params; Muon's state by layers.
  mu = jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu"))
  w_state = [x for x in jax.tree.leaves(opt_state) if x.shape == params["w"].shape]
  assert w_state and mu
  expected = params["w"].sharding.spec if name == "adamw" else ("fsdp", "stage")
  for x in w_state:
    assert tuple(x.sharding.spec)[: len(expected)] == tuple(expected), x.sharding


@pytest.mark.parametrize("repeats,regather", [(4, True), (4, False)])
def test_each_repeat_is_gathered_once_each_way_and_reduce_scattered(repeats, regather):
  schedule = CircularSchedule(num_stages=4, num_microbatches=8, num_repeats=repeats)
  step, tx, layers, inputs, targets = build(
      "adamw", fsdp=True, schedule=schedule, fsdp_regather=regather)
  params, opt_state, batch = placed(step, layers, inputs, targets)
  jaxpr = jax.make_jaxpr(step._step)(params, opt_state, *batch).jaxpr
  runs = {(name, shape): n for (name, shape, _), n in collective_runs(jaxpr).items()}
  half, whole = (HIDDEN // 2, HIDDEN), (HIDDEN, HIDDEN)
  # Per repeat the weight's slices are gathered once forward, and its
  # gradient reduce-scattered once. Regathering, the backward gathers the
  # last two repeats, then in each of its R windows (a scan) one more under a
  # cond on ``w >= 2``: R - 2 of them, R gathers in all.
  forward = repeats
  least, most = runs.pop(("all_gather", half))
  if regather:
    assert (least, most) == (forward + min(repeats, 2), forward + 2 + repeats), (least, most)
  else:
    assert least == most == forward
  assert runs.pop(("reduce_scatter", whole)) == [repeats, repeats], runs
  # Nothing else of a weight's size crosses devices (the whole biases'
  # gradients are psummed).
  assert all(np.prod(shape) < HIDDEN * HIDDEN // 2 for _, shape in runs), runs
  # The prefetch: the windows run in a scan whose body gathers a repeat (one
  # per split leaf) that the body's own iterations do not read: it is carried
  # to the next window, so the gather overlaps this window's work.
  windows = [eqn for eqn in _scans(jaxpr)
             if any(e.primitive.name == "all_gather" for e in eqn.params["jaxpr"].jaxpr.eqns)]
  assert windows, "no scan over windows gathers weights"
  for eqn in windows:
    body = eqn.params["jaxpr"].jaxpr
    gathered = {v for e in body.eqns if e.primitive.name == "all_gather" for v in e.outvars}
    inner = [e for e in body.eqns if e.primitive.name in ("scan", "custom_lin", "pjit")]
    assert len(gathered) == 1 and inner, body  # one split leaf, the window's iterations
    assert gathered & set(body.outvars)
    assert not any(gathered & set(e.invars) for e in inner)
  # Compiled, nothing of a weight's size is all-reduced either.
  compiled = step.lower(params, opt_state, *batch).compile().as_text()
  reduced = re.findall(r"= [a-z]+\d*\[([\d,]*)\]\S* all-reduce(?:-start)?\(", compiled)
  assert all(np.prod([int(n) for n in r.split(",") if n]) < HIDDEN * HIDDEN // 2
             for r in reduced), reduced


def _scans(jaxpr):
  """Every scan equation in `jaxpr` and the jaxprs nested in it."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      yield eqn
    for sub in jax_core.jaxprs_in_params(eqn.params):
      yield from _scans(sub)


def test_sharded_state_checkpoints_with_orbax(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  step, tx, layers, inputs, targets = build("adamw", fsdp=True)
  params = step.shard_params(layers_to_stages(layers, SCHEDULE))
  opt_state = step.init(params)
  params, opt_state, _ = step(params, opt_state, *step.shard_batch(inputs, targets))
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": opt_state})
  checkpointer.wait_until_finished()
  target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      {"params": params, "opt_state": opt_state},
  )
  restored = checkpointer.restore(tmp_path / "ckpt", target)
  saved = {"params": params, "opt_state": opt_state}
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
    assert got.sharding == want.sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # The restored state trains on.
  step(restored["params"], restored["opt_state"], *step.shard_batch(inputs, targets))


def test_bad_fsdp_configurations_raise():
  schedule = CircularSchedule(num_stages=2, num_microbatches=4, num_repeats=1)
  mesh = mesh_of(("stage", 2), ("fsdp", 2))
  stacked = layers_to_stages(make_layers(2), schedule)
  inputs, _ = make_batch(4)
  with pytest.raises(ValueError, match="fsdp_axis 'shard' is not an axis of the mesh"):
    circular_pipeline(layer, stacked, inputs, mesh=mesh, schedule=schedule, fsdp_axis="shard")
  with pytest.raises(ValueError, match="stage_axis and fsdp_axis must differ"):
    circular_pipeline(layer, stacked, inputs, mesh=mesh, schedule=schedule, fsdp_axis="stage")
  with pytest.raises(ValueError, match=r"microbatch size 3, not divisible by the 2 devices"):
    circular_pipeline(layer, stacked, inputs[:, :3], mesh=mesh, schedule=schedule,
                      fsdp_axis="fsdp")
  muon, _ = OptimizerFactory.create("muon", SCHEDULER, MuonConfig(distributed_axes=("fsdp",)),
                                    stacked_axes=schedule.stacked_axes)
  with pytest.raises(ValueError, match="distributed_axes=.*names fsdp_axis 'fsdp'"):
    make_train_step(layer, mse, muon, mesh=mesh, schedule=schedule, fsdp_axis="fsdp")
  # A non-elementwise optimizer updates whole layers: R or lps must split over the axis.
  muon, _ = OptimizerFactory.create("muon", SCHEDULER, MuonConfig(),
                                    stacked_axes=schedule.stacked_axes)
  step = make_train_step(layer, mse, muon, mesh=mesh, schedule=schedule, fsdp_axis="fsdp",
                         fsdp_min_size=64)
  with pytest.raises(ValueError, match="needs num_repeats=1 or layers_per_stage=1 divisible by 2"):
    step.state_specs(stacked)
