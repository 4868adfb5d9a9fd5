"""Stage-stacked parameter layout: ``[L, ...]`` <-> ``[R, S, (lps), ...]``.

An unpipelined model keeps its ``L`` repeated layers stacked ``[L, ...]`` (a
scanned stack) or as a list of per-layer trees. The circular pipeline wants
them ``[R, S, lps, ...]`` (``[R, S, ...]`` when ``lps == 1``; see
`CircularSchedule.stacked_shape`), layer ``(r S + s) lps + j`` at
``[r, s, j]``, with dim 1 sharded over the stage mesh axis. These helpers move
between the layouts (checkpoints convert both ways, bit for bit) and give the
partition specs::

  stacked = layers_to_stages(stack_layers(per_layer_params), schedule)
  stacked = jax.device_put(stacked, stage_shardings(mesh, stacked))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallasopt.pipeline.schedule import CircularSchedule

__all__ = [
    "check_stacked",
    "layers_to_stages",
    "stack_layers",
    "stage_shardings",
    "stage_specs",
    "stages_to_layers",
    "unstack_layers",
]

PyTree = Any
STAGE_AXIS = "stage"


def _leaves(tree: PyTree, name: str) -> list[tuple[str, Any]]:
  leaves = [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
  if not leaves:
    raise ValueError(f"{name} has no array leaves.")
  for path, leaf in leaves:
    if not hasattr(leaf, "shape"):
      raise TypeError(f"{name}{path} must be an array, got {type(leaf).__name__}.")
  return leaves


def stack_layers(layers: Sequence[PyTree]) -> PyTree:
  """Per-layer trees (a list of ``L`` trees of one structure) -> one tree of ``[L, ...]``."""
  if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
    raise TypeError(f"layers must be a non-empty list of per-layer trees, got {type(layers).__name__}.")
  structure = jax.tree.structure(layers[0])
  for i, layer in enumerate(layers):
    if jax.tree.structure(layer) != structure:
      raise ValueError(
          f"layers[{i}] has tree structure {jax.tree.structure(layer)}, but layers[0] has"
          f" {structure}; every layer must have the same structure."
      )
  return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def unstack_layers(layers: PyTree) -> list[PyTree]:
  """One tree of ``[L, ...]`` leaves -> a list of ``L`` per-layer trees."""
  num_layers = {leaf.shape[0] if leaf.ndim else None for _, leaf in _leaves(layers, "layers")}
  if len(num_layers) != 1 or None in num_layers:
    raise ValueError(f"every leaf of layers needs the same leading dim L, got {sorted(map(str, num_layers))}.")
  (count,) = num_layers
  return [jax.tree.map(lambda x, i=i: x[i], layers) for i in range(count)]


def layers_to_stages(layers: PyTree, schedule: CircularSchedule) -> PyTree:
  """Leaves ``[L, ...]`` -> ``[*schedule.stacked_shape, ...]``.

  Layer ``l = (r S + s) lps + j`` goes to ``[r, s, j]``: a plain reshape.

  Raises:
    ValueError: a leaf whose leading dim is not ``schedule.num_layers``.
  """
  for path, leaf in _leaves(layers, "layers"):
    if leaf.ndim == 0 or leaf.shape[0] != schedule.num_layers:
      raise ValueError(
          f"layers{path} has shape {tuple(leaf.shape)}; expected a leading dim of"
          f" num_layers = R * S * lps = {schedule.num_layers}."
      )
  return jax.tree.map(lambda x: x.reshape(schedule.stacked_shape + x.shape[1:]), layers)


def check_stacked(stacked: PyTree, schedule: CircularSchedule, name: str = "stacked_params") -> None:
  """Every leaf of `stacked` must start with ``schedule.stacked_shape``.

  Raises:
    ValueError: naming the first leaf that does not, with its shape.
  """
  prefix = schedule.stacked_shape
  for path, leaf in _leaves(stacked, name):
    if tuple(leaf.shape[: len(prefix)]) != prefix:
      raise ValueError(
          f"{name}{path} has shape {tuple(leaf.shape)}; every leaf must start with the"
          f" stacked dims (R, S{', lps' if len(prefix) == 3 else ''}) = {prefix}"
          " (see layers_to_stages)."
      )


def stages_to_layers(stacked: PyTree, schedule: CircularSchedule) -> PyTree:
  """Leaves ``[*schedule.stacked_shape, ...]`` -> ``[L, ...]``; inverse of `layers_to_stages`."""
  check_stacked(stacked, schedule)
  axes = schedule.stacked_axes
  return jax.tree.map(lambda x: x.reshape((schedule.num_layers,) + x.shape[axes:]), stacked)


def stage_specs(stacked: PyTree, *, stage_axis: str = STAGE_AXIS) -> PyTree:
  """``PartitionSpec(None, stage_axis)`` for every leaf: dim 1 (S) over the stage axis."""
  for path, leaf in _leaves(stacked, "stacked_params"):
    if leaf.ndim < 2:
      raise ValueError(
          f"stacked_params{path} has shape {tuple(leaf.shape)}; stacked leaves have at"
          " least the dims (R, S)."
      )
  return jax.tree.map(lambda _: PartitionSpec(None, stage_axis), stacked)


def stage_shardings(mesh: Mesh, stacked: PyTree, *, stage_axis: str = STAGE_AXIS) -> PyTree:
  """`stage_specs` as `NamedSharding`s on `mesh`, for `jax.device_put` or `jax.jit`."""
  if stage_axis not in mesh.shape:
    raise ValueError(f"stage_axis {stage_axis!r} is not an axis of the mesh {dict(mesh.shape)}.")
  return jax.tree.map(
      lambda spec: NamedSharding(mesh, spec), stage_specs(stacked, stage_axis=stage_axis)
  )
