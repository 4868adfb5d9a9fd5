"""circular_pipeline: outputs, loss and gradients equal the unpipelined model.

Runs on the 8 fake CPU devices that conftest.py requests. The configurations
form a pairwise covering array over S in {2, 4}, R in {1, 2}, M in {S, 2S},
both io layouts and remat on/off (every pair of values of any two factors
appears), with a data axis and several layers per stage on top, and every one
runs a stage that turns bubbles into NaN.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

from helpers import assert_close, assert_trees_close
from pipeline_model import layer, make_batch, make_layers, mse, sequential
from pallasopt.pipeline.circular import circular_pipeline, io_specs, scan_layers
from pallasopt.pipeline.layout import layers_to_stages, stage_shardings
from pallasopt.pipeline.schedule import CircularSchedule

RTOL = 1e-5


def stage_mesh(num_stages, data=1):
  devices = np.array(jax.devices()[: num_stages * data])
  if data == 1:
    return Mesh(devices, ("stage",))
  return Mesh(devices.reshape(num_stages, data), ("stage", "data"))


def poisoned(stage_fn):
  """`stage_fn`, except that it answers NaN to an all-zero input.

  Bubble iterations feed the stage zeros, so any bubble value that leaked into
  an output, the circular buffer or a gradient would show up as NaN.
  """
  return lambda params, x: jnp.where(jnp.all(x == 0), jnp.nan, stage_fn(params, x))


def check_against_reference(schedule, *, remat=True, data=1, microbatch=4):
  mesh = stage_mesh(schedule.num_stages, data)
  data_axis = "data" if data > 1 else None
  stage_fn = poisoned(layer if schedule.layers_per_stage == 1 else scan_layers(layer))
  layers = make_layers(schedule.num_layers)
  inputs, targets = make_batch(schedule.num_microbatches, microbatch)
  spec = io_specs(schedule, data_axis=data_axis)
  inputs, targets = (jax.device_put(x, NamedSharding(mesh, spec)) for x in (inputs, targets))
  stacked = layers_to_stages(layers, schedule)
  stacked = jax.device_put(stacked, stage_shardings(mesh, stacked))

  def pipelined_loss(stacked):
    outputs = circular_pipeline(stage_fn, stacked, inputs, mesh=mesh, schedule=schedule,
                                data_axis=data_axis, remat=remat)
    return mse(outputs, targets), outputs

  (loss, outputs), grads = jax.jit(jax.value_and_grad(pipelined_loss, has_aux=True))(stacked)
  ref_fn = lambda layers: (mse(out := sequential(layer, layers, inputs), targets), out)
  (ref_loss, ref_out), ref_grads = jax.jit(jax.value_and_grad(ref_fn, has_aux=True))(layers)
  assert outputs.sharding.is_equivalent_to(NamedSharding(mesh, spec), outputs.ndim)
  assert_close(outputs, ref_out, RTOL, "outputs")
  assert_close(loss, ref_loss, RTOL, "loss")
  assert_trees_close(grads, layers_to_stages(ref_grads, schedule), RTOL)
  assert tuple(grads["w"].sharding.spec[:2]) == (None, "stage")


# (S, R, M, streamed_io, remat) form a pairwise covering array of the 2^5 grid;
# data (devices per stage) and lps vary on top. Every case runs the NaN-poisoned
# stage, and cases 3 and 6 use the circular buffer (M > S, R > 1).
COVERING = [
    # S, R, M, streamed, remat, data, lps
    (2, 1, 2, False, False, 1, 1),
    (2, 1, 2, False, True, 2, 1),
    (2, 2, 4, True, False, 2, 1),
    (4, 1, 8, True, False, 1, 2),
    (4, 2, 4, True, True, 1, 1),
    (4, 2, 8, False, True, 2, 1),
]


@pytest.mark.parametrize("S, R, M, streamed, remat, data, lps", COVERING)
def test_loss_and_grads_equal_sequential(S, R, M, streamed, remat, data, lps):
  schedule = CircularSchedule(S, M, R, lps, streamed_io=streamed)
  check_against_reference(schedule, remat=remat, data=data)


def test_pytree_activations():
  schedule = CircularSchedule(2, 4, 2)

  def pair_layer(params, x):
    return {"h": layer(params, x["h"]), "skip": x["skip"] * 0.5 + x["h"]}

  mesh = stage_mesh(2)
  layers = make_layers(schedule.num_layers)
  inputs, targets = make_batch(4)
  pair = {"h": inputs, "skip": targets}
  out = jax.jit(lambda p, x: circular_pipeline(pair_layer, p, x, mesh=mesh, schedule=schedule))(
      layers_to_stages(layers, schedule), pair)
  assert_trees_close(out, sequential(pair_layer, layers, pair), RTOL)


def test_bad_configurations_raise():
  schedule = CircularSchedule(2, 4)
  mesh = stage_mesh(2)
  stacked = layers_to_stages(make_layers(2), schedule)
  inputs, _ = make_batch(4)
  run = functools.partial(circular_pipeline, layer, mesh=mesh, schedule=schedule)
  with pytest.raises(ValueError, match="mesh axis 'stage' has 4 devices but the schedule has num_stages=2"):
    run(stacked, inputs, mesh=stage_mesh(4))
  with pytest.raises(ValueError, match="data_axis 'data' is not an axis of the mesh"):
    run(stacked, inputs, data_axis="data")
  with pytest.raises(ValueError, match="stage_axis 'pp' is not an axis"):
    run(stacked, inputs, stage_axis="pp")
  with pytest.raises(ValueError, match=r"inputs has shape \(3, 4, 8\); expected \[num_microbatches=4"):
    run(stacked, inputs[:3])
  with pytest.raises(ValueError, match=r"microbatch size 3, not divisible by the 2 devices of the mesh axes \(.data.,\)"):
    run(stacked, inputs[:, :3], mesh=stage_mesh(2, 2), data_axis="data")
  with pytest.raises(ValueError, match=r"stacked_params\['b'\] has shape \(2, 8\)"):
    run({"w": stacked["w"], "b": make_layers(2)["b"]}, inputs)
  with pytest.raises(TypeError, match="stage_fn must return an activation of the same structure"):
    circular_pipeline(lambda p, x: x[:, :4], stacked, inputs, mesh=mesh, schedule=schedule)
  with pytest.raises(TypeError, match="schedule must be a CircularSchedule"):
    run(stacked, inputs, schedule=(2, 4))
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
    run(stacked, inputs, mesh=None)
