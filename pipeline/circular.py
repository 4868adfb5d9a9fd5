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

With an FSDP axis (``fsdp_axis``) each device of a stage holds ``1/F`` of
the stage's weights. The scan is cut into windows of ``M`` iterations, in
which every stage runs at most two repeats (it finishes one and starts the
next), and each repeat's weights are all-gathered once, one window before
the first that needs them; the backward pass walks the windows back and
gathers each repeat once more, so at most two repeats' weights are ever
whole, and reduce-scatters the weight gradients as each repeat completes.

Bubble iterations (work item outside the schedule, see
`CircularSchedule.work`) compute ``stage_fn`` on zeros, and nothing they
produce is ever read: whatever sits in a bubble slot, NaN included, changes
neither the outputs nor the gradients, provided ``stage_fn`` has finite
derivatives at an all-zero input (true of matmuls, activations, norms with
an epsilon).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from pallasopt.kernels._compat import shard_map
from pallasopt.pipeline.layout import (
    FSDP_MIN_SIZE,
    STAGE_AXIS,
    check_stacked,
    fsdp_dims,
    stage_specs,
)
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


def _batch_axes(data_axis: str | None, fsdp_axis: str | None) -> tuple[str, ...]:
  """The mesh axes that split a microbatch: the data axis and the FSDP axis, once each."""
  return tuple(dict.fromkeys(a for a in (data_axis, fsdp_axis) if a is not None))


def io_specs(schedule: CircularSchedule, *, stage_axis: str = STAGE_AXIS,
             data_axis: str | None = None, fsdp_axis: str | None = None) -> PartitionSpec:
  """The spec of an input or output leaf ``[M, microbatch, ...]``.

  The microbatch dim is sharded over `data_axis` and `fsdp_axis` (each FSDP
  device runs its own part of the batch, as in ZeRO); with streamed io the
  ``M`` dim is sharded over the stages (contiguous blocks of ``M / S``),
  otherwise it is replicated on every stage.
  """
  batch = _batch_axes(data_axis, fsdp_axis)
  entries = [stage_axis if schedule.streamed_io else None,
             (batch[0] if len(batch) == 1 else batch) if batch else None]
  while entries and entries[-1] is None:
    entries.pop()
  return PartitionSpec(*entries)


def _check_config(mesh: Mesh, schedule: CircularSchedule, stage_axis: str,
                  data_axis: str | None, fsdp_axis: str | None = None) -> None:
  if not isinstance(schedule, CircularSchedule):
    raise TypeError(f"schedule must be a CircularSchedule, got {type(schedule).__name__}.")
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
  named = (("stage_axis", stage_axis), ("data_axis", data_axis), ("fsdp_axis", fsdp_axis))
  for name, axis in named:
    if axis is not None and axis not in mesh.shape:
      raise ValueError(f"{name} {axis!r} is not an axis of the mesh {dict(mesh.shape)}.")
  for name, axis in named[1:]:
    if axis == stage_axis:
      raise ValueError(f"stage_axis and {name} must differ, both are {stage_axis!r}.")
  if mesh.shape[stage_axis] != schedule.num_stages:
    raise ValueError(
        f"mesh axis {stage_axis!r} has {mesh.shape[stage_axis]} devices but the schedule has"
        f" num_stages={schedule.num_stages}; they must be equal."
    )


def _local_shape(path: str, leaf: Any, schedule: CircularSchedule, mesh: Mesh,
                 batch_axes: tuple[str, ...]) -> jax.ShapeDtypeStruct:
  """One microbatch of an input leaf as a device sees it, after checking the leaf."""
  shape = tuple(leaf.shape)
  data = math.prod(mesh.shape[a] for a in batch_axes)
  if len(shape) < 2 or shape[0] != schedule.num_microbatches:
    raise ValueError(
        f"inputs{path} has shape {shape}; expected [num_microbatches={schedule.num_microbatches},"
        " microbatch, ...]."
    )
  if shape[1] % data:
    raise ValueError(
        f"inputs{path} has microbatch size {shape[1]}, not divisible by the {data} devices of"
        f" the mesh axes {batch_axes} that split it."
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
    fsdp_axis: str | None = None,
    fsdp_min_size: int = FSDP_MIN_SIZE,
    fsdp_regather: bool = True,
) -> PyTree:
  """Applies the ``L`` stacked layers to every microbatch, pipelined over stages.

  The result equals the unpipelined model: for every microbatch ``m``,
  ``x = inputs[m]`` then ``x = stage_fn(params[r, s], x)`` for ``r < R``,
  ``s < S`` in order (``params[r, s]`` being the leaves' slices at those
  stacked indices). Differentiate it with `jax.grad` like any function.

  With `fsdp_axis` (fully sharded data parallelism inside each stage) every
  leaf that `fsdp_dims` splits is held in ``1/F`` slices by the ``F``
  devices of that axis, which also split the microbatches. A repeat's
  weights are all-gathered once, in a sliding window of two repeats: the
  gather of repeat ``r + 1`` is issued before the ``M`` iterations in which
  stages finish repeat ``r`` (the window that needs both), so it can run
  while they compute, and a repeat's weights are freed after the window that
  last uses them. Their gradients leave reduce-scattered to the same slices.

  Args:
    stage_fn: ``stage_fn(stage_params, x) -> x``: one stage (``lps`` layers;
      see `scan_layers`) on one microbatch. ``stage_params`` are the leaves of
      `stacked_params` without their stacked dims; ``x`` and the result are
      pytrees of the same structure, shapes and dtypes.
    stacked_params: leaves ``[*schedule.stacked_shape, ...]`` (see
      `layers_to_stages`), best already sharded with `stage_shardings`.
    inputs: leaves ``[M, microbatch, ...]``, laid out as `io_specs` says.
    mesh: a mesh with `stage_axis` of size ``S`` (and `data_axis`,
      `fsdp_axis`, if given). Mesh axes not named here replicate the
      computation.
    schedule: the `CircularSchedule`; ``schedule.streamed_io`` picks the io
      layout.
    stage_axis: the mesh axis of the stages.
    data_axis: a mesh axis that shards the microbatch dim (data parallelism
      inside a stage), or None.
    remat: rematerialise each iteration's stage in the backward pass, saving
      only its input activation (``M R + S - 1`` microbatch activations in
      all). Without it every intermediate of every iteration is kept, and
      with ``R > 1`` also the slice of params each iteration used.
    fsdp_axis: a mesh axis that shards each stage's weights (and the
      microbatch dim, like `data_axis`; it may be the same axis), or None.
    fsdp_min_size: layer slices of fewer elements stay whole (`fsdp_dims`).
    fsdp_regather: the backward pass gathers each repeat's weights again, in
      the same sliding window backwards (a second forward of each window of
      ``M`` iterations, from the activations saved at its start, finds the
      cotangents), so at most two repeats' weights are ever whole on a
      device. False keeps every gathered repeat for the backward pass: no
      second gather and no second forward, but a stage's whole weights live
      through the backward pass.

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
  _check_config(mesh, schedule, stage_axis, data_axis, fsdp_axis)
  check_stacked(stacked_params, schedule)
  batch_axes = _batch_axes(data_axis, fsdp_axis)
  microbatch = jax.tree_util.tree_map_with_path(
      lambda p, x: _local_shape(jax.tree_util.keystr(p), x, schedule, mesh, batch_axes), inputs
  )
  _check_stage_fn(stage_fn, stacked_params, microbatch, schedule)
  spec = io_specs(schedule, stage_axis=stage_axis, data_axis=data_axis, fsdp_axis=fsdp_axis)
  io_tree_specs = jax.tree.map(lambda _: spec, inputs)
  fsdp = None
  if fsdp_axis is not None:
    dims = fsdp_dims(stacked_params, schedule, mesh.shape[fsdp_axis], min_size=fsdp_min_size)
    fsdp = _Fsdp(fsdp_axis, dims, fsdp_regather)
  param_specs = stage_specs(
      stacked_params, stage_axis=stage_axis, fsdp_axis=fsdp_axis, fsdp=fsdp and fsdp.dims
  )
  local = functools.partial(
      _local_pipeline, stage_fn, schedule, stage_axis, batch_axes, remat, fsdp
  )
  return shard_map(
      local,
      mesh=mesh,
      in_specs=(param_specs, io_tree_specs),
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


class _Fsdp(NamedTuple):
  """How a pipeline's weights shard over an FSDP axis."""

  axis: str
  dims: PyTree  # per leaf: the stacked leaf's dim split over `axis`, or None
  regather: bool


def _gather_repeat(fsdp: _Fsdp, params: PyTree, repeat) -> PyTree:
  """This stage's weights of one repeat (an int or a traced index), the FSDP slices all-gathered."""
  def gather(p, dim):
    x = lax.dynamic_index_in_dim(p[:, 0], repeat, 0, keepdims=False)
    return x if dim is None else lax.all_gather(x, fsdp.axis, axis=dim - 2, tiled=True)

  return jax.tree.map(gather, params, fsdp.dims)


def _scatter_repeat(fsdp: _Fsdp, cotangents: PyTree) -> PyTree:
  """One repeat's weight cotangents reduce-scattered to this device's FSDP slices."""
  def scatter(ct, dim):
    return ct if dim is None else lax.psum_scatter(
        ct, fsdp.axis, scatter_dimension=dim - 2, tiled=True
    )

  return jax.tree.map(scatter, cotangents, fsdp.dims)


def _local_pipeline(stage_fn, schedule: CircularSchedule, stage_axis: str,
                    batch_axes: tuple[str, ...], remat: bool, fsdp: _Fsdp | None,
                    params: PyTree, inputs: PyTree):
  S, M, R = schedule.num_stages, schedule.num_microbatches, schedule.num_repeats
  streamed, delay = schedule.streamed_io, schedule.buffer_size
  axes = (stage_axis,) + batch_axes

  def zeros(tree, *lead):
    return jax.tree.map(lambda x: _varying_zeros(lead + x.shape[1:], x.dtype, axes), tree)

  def run_stage(weights, index, x):
    # `weights`: a tree of leaves [n, ...] (the n repeats from the first
    # one), or a tuple of one or two repeats' trees (FSDP's window). With
    # remat the repeat's weights are picked inside the checkpoint, so the
    # backward pass picks them again instead of saving them per iteration.
    if isinstance(weights, tuple):
      mine = weights[0] if len(weights) == 1 else jax.tree.map(
          lambda lo, hi: jnp.where(index > 0, hi, lo), *weights
      )
    elif R == 1:
      mine = jax.tree.map(lambda p: p[0], weights)
    else:
      mine = _take(weights, index)
    return stage_fn(mine, x)

  if remat:
    run_stage = jax.checkpoint(run_stage, policy=jax.checkpoint_policies.nothing_saveable)

  def start(inputs):
    bubble = zeros(inputs)
    io = inputs if streamed else zeros(inputs, M)
    return (bubble, zeros(inputs, delay) if delay else None, io)

  def run(carry, weights, first_repeat, iterations, inputs):
    """The schedule's `iterations` from `carry`, with `weights` from `first_repeat` on."""
    stage, bubble = lax.axis_index(stage_axis), zeros(inputs)

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
      y = run_stage(weights, repeat - first_repeat, x)
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

    return lax.scan(iteration, carry, jnp.asarray(iterations))[0]

  if fsdp is None:
    weights = jax.tree.map(lambda p: p[:, 0], params)
    io = run(start(inputs), weights, 0, np.arange(schedule.num_iterations), inputs)[2]
  elif fsdp.regather:
    io = _windowed_regathering(run, start, axes, fsdp, schedule)(params, inputs)
  else:
    io = _windowed(run, start, fsdp, schedule, params, inputs)[0][2]
  if streamed:
    return jax.tree.map(schedule.realign_outputs, io)
  stage = lax.axis_index(stage_axis)
  last = jax.tree.map(lambda x: jnp.where(stage == S - 1, x, jnp.zeros_like(x)), io)
  return jax.tree.map(lambda x: lax.psum(x, stage_axis), last)


def _window_iterations(schedule: CircularSchedule, window):
  """The iterations of window ``w`` (an int or a traced index): ``[w M, (w + 1) M)``."""
  M = schedule.num_microbatches
  return window * M + (jnp.arange(M) if isinstance(window, jax.Array) else np.arange(M))


def _windowed(run, start, fsdp: _Fsdp, schedule: CircularSchedule, params, inputs):
  """The schedule window by window, each repeat's weights gathered one window early.

  Window ``w`` is iterations ``[w M, (w + 1) M)``, in which stage ``s`` finishes
  repeat ``w - 1`` (its first ``s`` iterations) and starts repeat ``w``:
  windows ``0 .. R - 2`` run in a `lax.scan` whose carry holds the two
  repeats' gathered weights, each iteration gathering repeat ``w + 1`` while
  the window computes (at most three repeats whole at a time); window
  ``R - 1`` and the last ``S - 1`` iterations (repeat ``R - 1`` alone)
  follow. Returns the final carry and the carries the windows start from
  (those of the scan stacked, then the last two).
  """
  M, R = schedule.num_microbatches, schedule.num_repeats
  first = _gather_repeat(fsdp, params, 0)

  def window(state, w):
    carry, lo, hi = state
    following = _gather_repeat(fsdp, params, w + 1)
    done = run(carry, (lo, hi), w - 1, _window_iterations(schedule, w), inputs)
    return (done, hi, following), carry

  (carry, lo, hi), scanned = lax.scan(window, (start(inputs), first, first), jnp.arange(R - 1))
  starts = [carry]
  carry = run(carry, (lo, hi), R - 2, _window_iterations(schedule, R - 1), inputs)
  if schedule.num_iterations > R * M:
    starts.append(carry)
    carry = run(carry, (hi,), R - 1, np.arange(R * M, schedule.num_iterations), inputs)
  return carry, (scanned, starts)


def _windowed_regathering(run, start, axes, fsdp: _Fsdp, schedule: CircularSchedule):
  """`_windowed`'s outputs, with a backward pass that regathers in a sliding window.

  The forward pass keeps only the carry each window starts from. The
  backward pass walks the windows last to first (a reverse `lax.scan`): it
  gathers the repeat the next window back needs while this one runs again
  from its saved carry (`jax.vjp`) and pulls the cotangents back. A repeat's
  weight cotangents are complete once the first window that uses it is done;
  they are reduce-scattered then, and its gathered weights dropped. Each
  repeat is gathered once each way.
  """
  M, R = schedule.num_microbatches, schedule.num_repeats
  tail = np.arange(R * M, schedule.num_iterations)

  @jax.custom_vjp
  def pipeline(params, inputs):
    return _windowed(run, start, fsdp, schedule, params, inputs)[0][2]

  def forward(params, inputs):
    carry, starts = _windowed(run, start, fsdp, schedule, params, inputs)
    return carry[2], (params, inputs, starts)

  def pull(carry, weights, first_repeat, iterations, inputs, carry_ct):
    _, pullback = jax.vjp(
        lambda c, w, x: run(c, w, first_repeat, iterations, x), carry, weights, inputs
    )
    return pullback(carry_ct)

  def backward(residuals, io_cotangent):
    params, inputs, (scanned, starts) = residuals
    zeros = lambda tree: jax.tree.map(lambda x: _varying_zeros(x.shape, x.dtype, axes), tree)
    incoming, buffer, _ = starts[-1]
    carry_ct = (zeros(incoming), zeros(buffer), io_cotangent)
    hi = _gather_repeat(fsdp, params, R - 1)
    lo = hi if R == 1 else _gather_repeat(fsdp, params, R - 2)
    if tail.size:  # repeat R - 1 alone
      carry_ct, (later_ct,), inputs_ct = pull(starts[1], (hi,), R - 1, tail, inputs, carry_ct)
    else:
      later_ct = jax.tree.map(_typed_zeros, hi)
      inputs_ct = jax.tree.map(_typed_zeros, inputs)

    def window(state, xs):
      carry_ct, lo, hi, hi_ct, inputs_ct = state  # weights of repeats w - 1 and w
      w, carry = xs
      # The next window back needs repeat w - 2 (windows 1 and 0: repeat 0, `lo`).
      following = lax.cond(w >= 2, lambda: _gather_repeat(fsdp, params, w - 2), lambda: lo)
      carry_ct, (lo_ct, window_hi_ct), window_inputs_ct = pull(
          carry, (lo, hi), w - 1, _window_iterations(schedule, w), inputs, carry_ct
      )
      # Repeat w is complete; in window 0 `lo` is repeat 0 as well.
      first_ct = jax.tree.map(lambda c: jnp.where(w == 0, c, jnp.zeros_like(c)), lo_ct)
      done = jax.tree.map(lambda *cts: sum(cts), hi_ct, window_hi_ct, first_ct)
      state = (carry_ct, following, lo, lo_ct, _accumulate(inputs_ct, window_inputs_ct))
      return state, _scatter_repeat(fsdp, done)

    carries = jax.tree.map(lambda s, last: jnp.concatenate([s, last[None]]), scanned, starts[0])
    (carry_ct, *_, inputs_ct), repeats_ct = lax.scan(
        window, (carry_ct, lo, hi, later_ct, inputs_ct), (jnp.arange(R), carries), reverse=True
    )
    _, start_pullback = jax.vjp(start, inputs)
    inputs_ct = _accumulate(inputs_ct, start_pullback(carry_ct)[0])
    return jax.tree.map(lambda ct: ct[:, None], repeats_ct), inputs_ct

  pipeline.defvjp(forward, backward)
  return pipeline


def _typed_zeros(x: jax.Array) -> jax.Array:
  """Zeros of `x`'s shape and dtype, varying over the mesh axes `x` varies over."""
  vma = tuple(getattr(jax.typeof(x), "vma", ()))
  return _varying_zeros(x.shape, x.dtype, vma) if vma else jnp.zeros_like(x)


def _accumulate(total: PyTree | None, more: PyTree) -> PyTree:
  return more if total is None else jax.tree.map(jnp.add, total, more)
