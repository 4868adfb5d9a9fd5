"""The circular pipeline forward pass, under `jax.shard_map`.

`circular_pipeline` runs the stage-stacked layers of `CircularSchedule` on
the devices of the stage mesh axis. Every device runs the same `lax.scan`
over the schedule's ``M R + S - 1`` iterations; at each one it applies
``stage_fn`` with its own params for the current repeat to its current
activation and passes the result to the next stage with one `lax.ppermute`
round the ring. Stage 0 takes fresh microbatches for the first ``M``
iterations and, for later repeats, the activations that came back round the
ring, held in a circular buffer of ``M - S`` slots. The backward pass is
`jax.grad` through the scan (ppermutes transpose to ppermutes).

Bubble iterations (work item outside the schedule, see
`CircularSchedule.work`) compute ``stage_fn`` on zeros, and nothing they
produce is ever read: whatever sits in a bubble slot, NaN included, changes
neither the outputs nor the gradients, provided ``stage_fn`` has finite
derivatives at an all-zero input (true of matmuls, activations, norms with
an epsilon).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from pallasopt.kernels._compat import shard_map
from pallasopt.pipeline.layout import STAGE_AXIS, check_stacked, stage_specs
from pallasopt.pipeline.schedule import CircularSchedule

__all__ = ["circular_pipeline", "io_specs", "scan_layers"]

PyTree = Any
StageFn = Callable[[PyTree, PyTree], PyTree]


def scan_layers(layer_fn: StageFn) -> StageFn:
  """A ``stage_fn`` for ``layers_per_stage > 1`` from a one-layer function.

  ``layer_fn(layer_params, x) -> x`` is applied to the stage's ``lps`` layers
  in order with `lax.scan` (the stage's params have a leading ``lps`` dim).
  """

  def stage_fn(params, x):
    return lax.scan(lambda h, p: (layer_fn(p, h), None), x, params)[0]

  return stage_fn


def io_specs(schedule: CircularSchedule, *, stage_axis: str = STAGE_AXIS,
             data_axis: str | None = None) -> PartitionSpec:
  """The spec of an input or output leaf ``[M, microbatch, ...]``.

  The microbatch dim is sharded over `data_axis`; with streamed io the ``M``
  dim is sharded over the stages (contiguous blocks of ``M / S``), otherwise
  it is replicated on every stage.
  """
  entries = [stage_axis if schedule.streamed_io else None, data_axis]
  while entries and entries[-1] is None:
    entries.pop()
  return PartitionSpec(*entries)


def _check_config(mesh: Mesh, schedule: CircularSchedule, stage_axis: str,
                  data_axis: str | None) -> None:
  if not isinstance(schedule, CircularSchedule):
    raise TypeError(f"schedule must be a CircularSchedule, got {type(schedule).__name__}.")
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
  for name, axis in (("stage_axis", stage_axis), ("data_axis", data_axis)):
    if axis is not None and axis not in mesh.shape:
      raise ValueError(f"{name} {axis!r} is not an axis of the mesh {dict(mesh.shape)}.")
  if stage_axis == data_axis:
    raise ValueError(f"stage_axis and data_axis must differ, both are {stage_axis!r}.")
  if mesh.shape[stage_axis] != schedule.num_stages:
    raise ValueError(
        f"mesh axis {stage_axis!r} has {mesh.shape[stage_axis]} devices but the schedule has"
        f" num_stages={schedule.num_stages}; they must be equal."
    )


def _local_shape(path: str, leaf: Any, schedule: CircularSchedule, mesh: Mesh,
                 data_axis: str | None) -> jax.ShapeDtypeStruct:
  """One microbatch of an input leaf as a device sees it, after checking the leaf."""
  shape = tuple(leaf.shape)
  data = mesh.shape[data_axis] if data_axis else 1
  if len(shape) < 2 or shape[0] != schedule.num_microbatches:
    raise ValueError(
        f"inputs{path} has shape {shape}; expected [num_microbatches={schedule.num_microbatches},"
        " microbatch, ...]."
    )
  if shape[1] % data:
    raise ValueError(
        f"inputs{path} has microbatch size {shape[1]}, not divisible by mesh axis"
        f" {data_axis!r} of size {data}."
    )
  return jax.ShapeDtypeStruct((shape[1] // data,) + shape[2:], leaf.dtype)


def _check_stage_fn(stage_fn: StageFn, stacked_params: PyTree, microbatch: PyTree,
                    schedule: CircularSchedule) -> None:
  # stage_fn sees a stage's params for one repeat: ``[lps, ...]`` or ``[...]``.
  local_params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape[2:], p.dtype), stacked_params)
  out = jax.eval_shape(stage_fn, local_params, microbatch)
  if jax.tree.structure(out) != jax.tree.structure(microbatch) or any(
      (o.shape, o.dtype) != (i.shape, i.dtype)
      for o, i in zip(jax.tree.leaves(out), jax.tree.leaves(microbatch))
  ):
    raise TypeError(
        "stage_fn must return an activation of the same structure, shapes and dtypes as its"
        f" input (it is fed to the next stage); input {microbatch}, got {out}."
    )


def circular_pipeline(
    stage_fn: StageFn,
    stacked_params: PyTree,
    inputs: PyTree,
    *,
    mesh: Mesh,
    schedule: CircularSchedule,
    stage_axis: str = STAGE_AXIS,
    data_axis: str | None = None,
    remat: bool = True,
) -> PyTree:
  """Applies the ``L`` stacked layers to every microbatch, pipelined over stages.

  The result equals the unpipelined model: for every microbatch ``m``,
  ``x = inputs[m]`` then ``x = stage_fn(params[r, s], x)`` for ``r < R``,
  ``s < S`` in order (``params[r, s]`` being the leaves' slices at those
  stacked indices). Differentiate it with `jax.grad` like any function.

  Args:
    stage_fn: ``stage_fn(stage_params, x) -> x``: one stage (``lps`` layers;
      see `scan_layers`) on one microbatch. ``stage_params`` are the leaves of
      `stacked_params` without their stacked dims; ``x`` and the result are
      pytrees of the same structure, shapes and dtypes.
    stacked_params: leaves ``[*schedule.stacked_shape, ...]`` (see
      `layers_to_stages`), best already sharded with `stage_shardings`.
    inputs: leaves ``[M, microbatch, ...]``, laid out as `io_specs` says.
    mesh: a mesh with `stage_axis` of size ``S`` (and `data_axis`, if given).
      Mesh axes not named here replicate the computation.
    schedule: the `CircularSchedule`; ``schedule.streamed_io`` picks the io
      layout.
    stage_axis: the mesh axis of the stages.
    data_axis: a mesh axis that shards the microbatch dim (data parallelism
      inside a stage), or None.
    remat: rematerialise each iteration's stage in the backward pass, saving
      only its input activation (``M R + S - 1`` microbatch activations in
      all). Without it every intermediate of every iteration is kept, and
      with ``R > 1`` also the slice of params each iteration used.

  Returns:
    The outputs, leaves ``[M, microbatch, ...]`` with the layout of `inputs`:
    with streamed io sharded over the stages and never gathered, otherwise
    replicated on every stage.

  Raises:
    TypeError: a bad schedule, mesh or ``stage_fn`` (one whose output is not
      shaped like its input).
    ValueError: mesh axes missing or of the wrong size, leaves whose stacked
      dims or microbatch dims do not fit.
  """
  _check_config(mesh, schedule, stage_axis, data_axis)
  check_stacked(stacked_params, schedule)
  microbatch = jax.tree_util.tree_map_with_path(
      lambda p, x: _local_shape(jax.tree_util.keystr(p), x, schedule, mesh, data_axis), inputs
  )
  _check_stage_fn(stage_fn, stacked_params, microbatch, schedule)
  spec = io_specs(schedule, stage_axis=stage_axis, data_axis=data_axis)
  io_tree_specs = jax.tree.map(lambda _: spec, inputs)
  local = functools.partial(
      _local_pipeline, stage_fn, schedule, stage_axis, data_axis, remat
  )
  return shard_map(
      local,
      mesh=mesh,
      in_specs=(stage_specs(stacked_params, stage_axis=stage_axis), io_tree_specs),
      out_specs=io_tree_specs,
  )(stacked_params, inputs)


# ----------------------------------------------------------------------------
# What one device runs.
# ----------------------------------------------------------------------------


def _take(tree: PyTree, index) -> PyTree:
  return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, index, 0, keepdims=False), tree)


def _put(tree: PyTree, value: PyTree, index) -> PyTree:
  return jax.tree.map(lambda x, v: lax.dynamic_update_index_in_dim(x, v, index, 0), tree, value)


def _select(pred, on_true: PyTree, on_false: PyTree) -> PyTree:
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def _varying_zeros(shape: tuple[int, ...], dtype, axes: tuple[str, ...]) -> jax.Array:
  """Zeros typed as varying over `axes`, like the scan carries they start."""
  zeros = jnp.zeros(shape, dtype)
  if hasattr(lax, "pcast"):
    return lax.pcast(zeros, axes, to="varying")
  return lax.pvary(zeros, axes)  # jax releases before `pcast`.


def _ring(num_stages: int, step: int) -> list[tuple[int, int]]:
  return [(i, (i + step) % num_stages) for i in range(num_stages)]


def _local_pipeline(stage_fn, schedule: CircularSchedule, stage_axis: str,
                    data_axis: str | None, remat: bool, params: PyTree, inputs: PyTree):
  S, M, R = schedule.num_stages, schedule.num_microbatches, schedule.num_repeats
  streamed, delay = schedule.streamed_io, schedule.buffer_size
  stage = lax.axis_index(stage_axis)
  axes = (stage_axis,) + ((data_axis,) if data_axis else ())

  def zeros(tree, *lead):
    return jax.tree.map(lambda x: _varying_zeros(lead + x.shape[1:], x.dtype, axes), tree)

  def run_stage(params, repeat, x):
    # With remat the repeat's params are sliced inside the checkpoint, so the
    # backward pass slices them again instead of saving them per iteration.
    if R == 1:
      mine = jax.tree.map(lambda p: p[0, 0], params)
    else:
      mine = jax.tree.map(
          lambda p: lax.dynamic_index_in_dim(p[:, 0], repeat, 0, keepdims=False), params
      )
    return stage_fn(mine, x)

  if remat:
    run_stage = jax.checkpoint(run_stage, policy=jax.checkpoint_policies.nothing_saveable)

  bubble = zeros(inputs)
  io = inputs if streamed else zeros(inputs, M)
  buffer = zeros(inputs, delay) if delay else None

  def iteration(carry, t):
    incoming, buffer, io = carry
    item = t - stage
    valid = (item >= 0) & (item < M * R)
    microbatch, repeat = item % M, jnp.clip(item // M, 0, R - 1)
    fresh = _take(io, t % schedule.microbatches_per_stage) if streamed else _take(inputs, t % M)
    if R > 1:
      # Stage 0 receives item t - S from the last stage and needs item t - M.
      if delay:
        delayed = _take(buffer, t % delay)
        buffer = _put(buffer, incoming, t % delay)
      else:
        delayed = incoming
      fresh = _select(t < M, fresh, delayed)
    x = _select(valid, _select(stage == 0, fresh, incoming), bubble)
    y = run_stage(params, repeat, x)
    incoming = jax.tree.map(lambda a: lax.ppermute(a, stage_axis, _ring(S, 1)), y)
    done = valid & (stage == S - 1) & (item >= (R - 1) * M)
    if streamed:
      column = t % schedule.microbatches_per_stage
      rotated = jax.tree.map(
          lambda a: lax.ppermute(a, stage_axis, _ring(S, -1)), _take(io, column)
      )
      io = _put(io, _select(done, y, rotated), column)
    else:
      io = _put(io, _select(done, y, _take(io, microbatch)), microbatch)
    return (incoming, buffer, io), None

  carry = (bubble, buffer, io)
  (_, _, io), _ = lax.scan(iteration, carry, jnp.arange(schedule.num_iterations))
  if streamed:
    return jax.tree.map(schedule.realign_outputs, io)
  last = jax.tree.map(lambda x: jnp.where(stage == S - 1, x, jnp.zeros_like(x)), io)
  return jax.tree.map(lambda x: lax.psum(x, stage_axis), last)
