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

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallasopt.pipeline.schedule import CircularSchedule

__all__ = [
    "check_stacked",
    "fsdp_dims",
    "layers_to_stages",
    "stack_layers",
    "stage_shardings",
    "stage_specs",
    "stages_to_layers",
    "unstack_layers",
]

PyTree = Any
STAGE_AXIS = "stage"
FSDP_MIN_SIZE = 2**12
"""Per-layer elements below which `fsdp_dims` leaves a leaf whole (biases, norm scales)."""


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


def fsdp_dims(stacked: PyTree, schedule: CircularSchedule, fsdp_size: int, *,
              min_size: int = FSDP_MIN_SIZE) -> PyTree:
  """The dim of each stacked leaf that an FSDP axis of `fsdp_size` devices splits, or None.

  A layer's slice of the leaf (the dims after the stacked ones) is split along
  one dim whose size `fsdp_size` divides: the largest such dim other than the
  last (rows keep blockwise state's 256-element blocks whole in every shard),
  else the last. A leaf whose layer slice has fewer than `min_size` elements,
  or no such dim, stays whole on every device of the axis.
  """
  check_stacked(stacked, schedule)
  first = schedule.stacked_axes

  def dim_of(leaf):
    layer_shape = tuple(leaf.shape[first:])
    if fsdp_size == 1 or math.prod(layer_shape) < min_size:
      return None
    fits = [first + i for i, n in enumerate(layer_shape) if n % fsdp_size == 0]
    inner = [d for d in fits if d != leaf.ndim - 1]
    if inner:
      return max(inner, key=lambda d: (leaf.shape[d], -d))
    return fits[-1] if fits else None

  return jax.tree.map(dim_of, stacked)


def stage_specs(stacked: PyTree, *, stage_axis: str = STAGE_AXIS, fsdp_axis: str | None = None,
                fsdp: PyTree | None = None) -> PyTree:
  """``PartitionSpec(None, stage_axis)`` for every leaf: dim 1 (S) over the stage axis.

  With `fsdp_axis`, the dim `fsdp` names for the leaf (`fsdp_dims`; None: no
  dim) is split over that axis too.
  """
  for path, leaf in _leaves(stacked, "stacked_params"):
    if leaf.ndim < 2:
      raise ValueError(
          f"stacked_params{path} has shape {tuple(leaf.shape)}; stacked leaves have at"
          " least the dims (R, S)."
      )

  def spec(dim):
    if fsdp_axis is None or dim is None:
      return PartitionSpec(None, stage_axis)
    return PartitionSpec(None, stage_axis, *[None] * (dim - 2), fsdp_axis)

  leaves, treedef = jax.tree.flatten(stacked)
  dims = [None] * len(leaves) if fsdp is None else treedef.flatten_up_to(fsdp)
  return treedef.unflatten([spec(dim) for dim in dims])


def stage_shardings(mesh: Mesh, stacked: PyTree, *, stage_axis: str = STAGE_AXIS,
                    fsdp_axis: str | None = None, fsdp: PyTree | None = None) -> PyTree:
  """`stage_specs` as `NamedSharding`s on `mesh`, for `jax.device_put` or `jax.jit`."""
  for name, axis in (("stage_axis", stage_axis), ("fsdp_axis", fsdp_axis)):
    if axis is not None and axis not in mesh.shape:
      raise ValueError(f"{name} {axis!r} is not an axis of the mesh {dict(mesh.shape)}.")
  specs = stage_specs(stacked, stage_axis=stage_axis, fsdp_axis=fsdp_axis, fsdp=fsdp)
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
