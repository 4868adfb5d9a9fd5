"""CircularSchedule arithmetic and the stacked-layer layout helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pallasopt.pipeline.layout import (
    check_stacked,
    layers_to_stages,
    stack_layers,
    stage_shardings,
    stage_specs,
    stages_to_layers,
    unstack_layers,
)
from pallasopt.pipeline.schedule import CircularSchedule


@st.composite
def schedules(draw, streamed=None):
  S = draw(st.integers(1, 6))
  R = draw(st.integers(1, 3))
  streamed = draw(st.booleans()) if streamed is None else streamed
  if streamed:
    M = S * draw(st.integers(1, 4))
  else:
    M = draw(st.integers(S if R > 1 else 1, 12))
  return CircularSchedule(S, M, R, draw(st.integers(1, 3)), streamed_io=streamed)


@given(schedules())
def test_every_stage_computes_every_item_exactly_once(schedule):
  table = schedule.work_table()
  S, M, R = schedule.num_stages, schedule.num_microbatches, schedule.num_repeats
  assert table.shape == (schedule.num_iterations, S, 2)
  for s in range(S):
    done = [tuple(x) for x in table[:, s] if x[0] >= 0]
    assert sorted(done) == [(m, r) for m in range(M) for r in range(R)]
    for t in range(schedule.num_iterations):
      work = schedule.work(t, s)
      assert (list(work) if work else [-1, -1]) == list(table[t, s])
      if work:
        assert schedule.iteration_of(s, *work) == t
  # No iteration is idle on every stage: the count is tight.
  assert np.all((table[..., 0] >= 0).any(axis=1))


@given(schedules())
def test_dependencies_including_the_wrap_around(schedule):
  S, M, R = schedule.num_stages, schedule.num_microbatches, schedule.num_repeats
  for m in range(M):
    for r in range(R):
      for s in range(1, S):
        # The previous stage finished the same item one iteration earlier:
        # a single ppermute hands it over.
        assert schedule.iteration_of(s, m, r) == schedule.iteration_of(s - 1, m, r) + 1
      if r:
        # Round the ring: the last stage finished the previous repeat before
        # stage 0 needs it, and stage 0 holds it exactly buffer_size iterations.
        wait = schedule.iteration_of(0, m, r) - schedule.iteration_of(S - 1, m, r - 1) - 1
        assert wait == schedule.buffer_size >= 0


@given(schedules())
def test_formulas(schedule):
  S, M, R = schedule.num_stages, schedule.num_microbatches, schedule.num_repeats
  table = schedule.work_table()
  assert schedule.num_iterations == M * R + S - 1
  assert schedule.bubble_fraction == pytest.approx(np.mean(table[..., 0] < 0))
  assert schedule.num_layers == R * S * schedule.layers_per_stage
  outputs = [t for t in range(schedule.num_iterations) if (w := schedule.work(t, S - 1)) and w[1] == R - 1]
  assert schedule.first_output_iteration == outputs[0] == (R - 1) * M + S - 1
  assert outputs == [schedule.output_iteration(m) for m in range(M)]
  assert outputs[-1] == schedule.num_iterations - 1
  assert schedule.stacked_axes == len(schedule.stacked_shape)
  layers = {schedule.layer_index(r, s, j) for r in range(R) for s in range(S)
            for j in range(schedule.layers_per_stage)}
  assert layers == set(range(schedule.num_layers))


@given(schedules(streamed=True))
def test_streamed_io_rotation_and_realignment_restore_order(schedule):
  """A model of the streamed-io buffer: stage 0 reads each input when it needs
  it, no pending input or finished output is overwritten, and the realigned
  columns hold the outputs in microbatch order on the stage their inputs came
  from."""
  S, M = schedule.num_stages, schedule.num_microbatches
  per_stage = schedule.microbatches_per_stage
  io = [[("in", s * per_stage + c) for c in range(per_stage)] for s in range(S)]
  for m in range(M):
    assert io[schedule.io_home(m)[0]][schedule.io_home(m)[1]] == ("in", m)
  outputs = {schedule.output_iteration(m): m for m in range(M)}
  for t in range(schedule.num_iterations):
    column = schedule.io_column(t)
    if t < M:
      assert io[0][column] == ("in", t)
    # What wraps from stage 0 to stage S-1 is dropped: it must be consumed.
    wrapped = io[0][column]
    assert wrapped[0] != "out", f"output {wrapped} dropped at iteration {t}"
    assert wrapped[0] != "in" or wrapped[1] <= t, f"input {wrapped} dropped at iteration {t}"
    rotated = [io[(s + 1) % S][column] for s in range(S)]
    rotated[S - 1] = ("out", outputs[t]) if t in outputs else ("done",)
    for s in range(S):
      io[s][column] = rotated[s]
  for m in range(M):
    stage, column = schedule.output_home(m)
    assert io[stage][column] == ("out", m)
  for s in range(S):
    labels = np.array([label[1] for label in io[s]])
    assert list(schedule.realign_outputs(labels)) == list(range(s * per_stage, (s + 1) * per_stage))
    assert list(schedule.realign_outputs(jnp.asarray(labels))) == list(range(s * per_stage, (s + 1) * per_stage))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_stages=4, num_microbatches=3, num_repeats=2), ValueError, "num_microbatches >= num_stages"),
        (dict(num_stages=4, num_microbatches=6, streamed_io=True), ValueError, "divisible by num_stages"),
        (dict(num_stages=0, num_microbatches=4), ValueError, "num_stages must be >= 1"),
        (dict(num_stages=2, num_microbatches=4, num_repeats=-1), ValueError, "num_repeats"),
        (dict(num_stages=2, num_microbatches=4.0), TypeError, "num_microbatches must be an int"),
        (dict(num_stages=2, num_microbatches=4, layers_per_stage=0), ValueError, "layers_per_stage"),
        (dict(num_stages=2, num_microbatches=4, streamed_io="yes"), TypeError, "streamed_io"),
    ],
)
def test_bad_schedules_raise(kwargs, error, match):
  with pytest.raises(error, match=match):
    CircularSchedule(**kwargs)


def test_for_layers():
  schedule = CircularSchedule.for_layers(12, 2, 4, 3)
  assert (schedule.layers_per_stage, schedule.stacked_shape) == (2, (3, 2, 2))
  assert CircularSchedule.for_layers(4, 4, 4).stacked_shape == (1, 4)
  with pytest.raises(ValueError, match="num_layers=10 is not divisible by num_stages \\* num_repeats"):
    CircularSchedule.for_layers(10, 2, 4, 2)
  with pytest.raises(ValueError, match="microbatches_per_stage"):
    CircularSchedule(2, 4).microbatches_per_stage


@given(schedules(), st.lists(st.integers(1, 3), max_size=2).map(tuple))
def test_layout_round_trip_and_layer_order(schedule, inner):
  L = schedule.num_layers
  layers = {"w": np.arange(L * int(np.prod(inner)), dtype=np.float32).reshape((L, *inner)),
            "b": np.arange(L, dtype=np.float32)}
  stacked = layers_to_stages(layers, schedule)
  assert stacked["w"].shape == schedule.stacked_shape + inner
  check_stacked(stacked, schedule)
  for r in range(schedule.num_repeats):
    for s in range(schedule.num_stages):
      for j in range(schedule.layers_per_stage):
        index = (r, s, j) if schedule.layers_per_stage > 1 else (r, s)
        assert stacked["b"][index] == schedule.layer_index(r, s, j)
  back = stages_to_layers(stacked, schedule)
  jax.tree.map(np.testing.assert_array_equal, back, layers)
  per_layer = unstack_layers(back)
  assert len(per_layer) == L
  jax.tree.map(np.testing.assert_array_equal, stack_layers(per_layer), layers)


def test_layout_errors_name_the_leaf():
  schedule = CircularSchedule(2, 4, 2)
  with pytest.raises(ValueError, match=r"layers\['w'\] has shape \(3, 5\); expected a leading dim of num_layers = R \* S \* lps = 4"):
    layers_to_stages({"w": jnp.zeros((3, 5))}, schedule)
  with pytest.raises(ValueError, match=r"stacked_params\['b'\] has shape \(2, 3\)"):
    check_stacked({"b": jnp.zeros((2, 3))}, schedule)
  with pytest.raises(ValueError, match=r"layers\[1\] has tree structure"):
    stack_layers([{"w": jnp.zeros(2)}, {"v": jnp.zeros(2)}])
  with pytest.raises(TypeError, match="non-empty list"):
    stack_layers([])
  with pytest.raises(ValueError, match="same leading dim"):
    unstack_layers({"a": jnp.zeros((2, 1)), "b": jnp.zeros((3,))})
  with pytest.raises(ValueError, match=r"stacked_params\['x'\] has shape \(4,\)"):
    stage_specs({"x": jnp.zeros(4)})


def test_stage_specs_and_shardings():
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("stage", "data"))
  stacked = {"w": jnp.zeros((1, 2, 3, 3)), "b": jnp.zeros((1, 2, 3))}
  assert stage_specs(stacked) == {"w": P(None, "stage"), "b": P(None, "stage")}
  assert stage_specs(stacked, stage_axis="pp")["w"] == P(None, "pp")
  shardings = stage_shardings(mesh, stacked)
  assert shardings["w"] == NamedSharding(mesh, P(None, "stage"))
  placed = jax.device_put(stacked, shardings)
  assert placed["w"].addressable_shards[0].data.shape == (1, 1, 3, 3)
  with pytest.raises(ValueError, match="stage_axis 'pp' is not an axis of the mesh"):
    stage_shardings(mesh, stacked, stage_axis="pp")
