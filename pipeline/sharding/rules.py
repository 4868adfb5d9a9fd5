"""Rules that give every param a `PartitionSpec`: auto, by shape, by memory, composed."""

from __future__ import annotations

import abc
import dataclasses
import itertools
import math
import warnings
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import Mesh, PartitionSpec

from pallasopt.pipeline.sharding._common import (
    KeyPath,
    PyTree,
    ShapePattern,
    _Entry,
    _as_struct,
    _nbytes,
    _make_spec,
    _is_sharded,
    _mesh_axes,
    _context_mesh,
)


class ShardingRule(abc.ABC):
  """Maps each leaf of a pytree to a `PartitionSpec`.

  Subclasses implement `leaf_spec`; `apply` maps it over a tree.
  """

  @abc.abstractmethod
  def leaf_spec(self, path: KeyPath, leaf: jax.ShapeDtypeStruct) -> PartitionSpec:
    """The spec of one leaf.

    Args:
      path: the leaf's key path in the tree (`jax.tree_util.keystr` names it).
      leaf: the leaf's shape and dtype.
    """

  def apply(self, tree: PyTree) -> PyTree:
    """A tree of `PartitionSpec`s with the structure of `tree`.

    Args:
      tree: arrays or `jax.ShapeDtypeStruct`s (``jax.eval_shape`` output), so
        no parameter has to be allocated to get its spec.
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: self.leaf_spec(path, _as_struct(path, leaf)), tree
    )


@dataclasses.dataclass(frozen=True)
class AutoShardingRule(ShardingRule):
  """Shards the largest dims of each leaf onto mesh axes that divide them.

  Dims are visited from the largest to the smallest (the earlier dim first
  among equal sizes); each takes the first unused axis, in `axis_names` order,
  whose size divides it. Each dim gets at most one axis and each axis serves at
  most one dim; axes of size 1 are skipped since they shard nothing.

  Attributes:
    mesh: the device mesh (None: the mesh in context, as eFormer's escale
      rule takes it).
    axis_names: the mesh axes to use, in order of preference (default: all, in
      mesh order).
    min_shard_size: leaves with fewer elements stay replicated (default: the
      number of devices in the mesh, below which sharding saves little and
      adds collectives).
    reverse: offer the axes in reverse order (the last axis to the largest dim).
  """

  mesh: Mesh | None = None
  axis_names: Sequence[str] | None = None
  min_shard_size: int | None = None
  reverse: bool = False

  def __post_init__(self):
    object.__setattr__(self, "mesh", _context_mesh("AutoShardingRule", self.mesh))
    object.__setattr__(self, "axis_names", _mesh_axes(self.mesh, self.axis_names))
    if self.min_shard_size is None:
      object.__setattr__(self, "min_shard_size", self.mesh.size)
    elif self.min_shard_size < 0:
      raise ValueError(f"min_shard_size must be >= 0, got {self.min_shard_size}.")

  def leaf_spec(self, path: KeyPath, leaf: jax.ShapeDtypeStruct) -> PartitionSpec:
    del path
    shape = leaf.shape
    if math.prod(shape) < self.min_shard_size:
      return PartitionSpec()
    free = [axis for axis in self.axis_names if self.mesh.shape[axis] > 1]
    if self.reverse:
      free.reverse()
    entries: list[_Entry] = [None] * len(shape)
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
      for axis in free:
        if shape[dim] % self.mesh.shape[axis] == 0:
          entries[dim] = axis
          free.remove(axis)
          break
    return _make_spec(entries)


@dataclasses.dataclass(frozen=True)
class ShapeBasedShardingRule(ShardingRule):
  """Gives each leaf the spec of the first shape pattern it matches.

  A pattern is a tuple with one item per dim: an int matches that size, `None`
  any size; a leaf matches when it has the pattern's rank and every item
  matches. Leaves that match no pattern are replicated. Specs are returned as
  given; `ShardingAnalyzer.validate` checks them against a mesh.

  Attributes:
    patterns: ``(pattern, spec)`` pairs in order of priority, or a mapping
      from pattern to spec (its insertion order is the priority).
    shape_patterns: the same, under eFormer's name; give one of the two.
  """

  patterns: (
      Sequence[tuple[ShapePattern, PartitionSpec]] | Mapping[ShapePattern, PartitionSpec] | None
  ) = None
  shape_patterns: Mapping[ShapePattern, PartitionSpec] | None = None

  def __post_init__(self):
    if (self.patterns is None) == (self.shape_patterns is None):
      raise TypeError(
          "ShapeBasedShardingRule: give exactly one of patterns and shape_patterns (eFormer's"
          " name for it)."
      )
    patterns = self.shape_patterns if self.patterns is None else self.patterns
    object.__setattr__(self, "shape_patterns", None)
    pairs = tuple(patterns.items() if isinstance(patterns, Mapping) else patterns)
    for i, (pattern, spec) in enumerate(pairs):
      if not isinstance(pattern, tuple) or not all(
          item is None or (isinstance(item, int) and item >= 0) for item in pattern
      ):
        raise TypeError(
            f"patterns[{i}]: the pattern must be a tuple of ints and None, got {pattern!r}."
        )
      if not isinstance(spec, PartitionSpec) or len(spec) > len(pattern):
        raise TypeError(
            f"patterns[{i}]: the spec must be a PartitionSpec with at most"
            f" {len(pattern)} entries for pattern {pattern}, got {spec!r}."
        )
    object.__setattr__(self, "patterns", pairs)

  def leaf_spec(self, path: KeyPath, leaf: jax.ShapeDtypeStruct) -> PartitionSpec:
    del path
    for pattern, spec in self.patterns:
      if len(pattern) == len(leaf.shape) and all(
          item is None or item == size for item, size in zip(pattern, leaf.shape)
      ):
        return _make_spec(spec)
    return PartitionSpec()


@dataclasses.dataclass(frozen=True)
class MemoryConstrainedShardingRule(ShardingRule):
  """Shards each leaf just enough to fit a per-device byte budget.

  A leaf within the budget is replicated. A larger one gets, among all valid
  specs over `axis_names` (every sharded dim divisible by the product of its
  axes), one that fits with the smallest shard count, then the fewest axes,
  then the largest axes on the largest dims. The search is exhaustive over
  axis-to-dim assignments, so the budget is met whenever any valid spec meets
  it.

  Attributes:
    mesh: the device mesh (None: the mesh in context).
    max_bytes_per_device: the budget for one leaf's shard, in bytes.
    axis_names: the mesh axes that may be used (default: all).
    strict: when no valid spec fits, raise ValueError (True) or warn and
      return the spec with the smallest shard (False).
    max_memory_per_device: eFormer's name for ``max_bytes_per_device``; give
      one of the two (eFormer's positional order, budget first, is not
      accepted: pass it by keyword).
  """

  mesh: Mesh | None = None
  max_bytes_per_device: int | None = None
  axis_names: Sequence[str] | None = None
  strict: bool = True
  max_memory_per_device: int | None = None

  def __post_init__(self):
    owner = "MemoryConstrainedShardingRule"
    if (self.max_bytes_per_device is None) == (self.max_memory_per_device is None):
      raise TypeError(
          f"{owner}: give exactly one of max_bytes_per_device and max_memory_per_device"
          " (eFormer's name for it)."
      )
    if self.max_bytes_per_device is None:
      object.__setattr__(self, "max_bytes_per_device", self.max_memory_per_device)
    object.__setattr__(self, "max_memory_per_device", None)
    object.__setattr__(self, "mesh", _context_mesh(owner, self.mesh))
    object.__setattr__(self, "axis_names", _mesh_axes(self.mesh, self.axis_names))
    if self.max_bytes_per_device < 0:
      raise ValueError(f"max_bytes_per_device must be >= 0, got {self.max_bytes_per_device}.")

  def leaf_spec(self, path: KeyPath, leaf: jax.ShapeDtypeStruct) -> PartitionSpec:
    nbytes = _nbytes(leaf)
    if nbytes <= self.max_bytes_per_device:
      return PartitionSpec()
    shape = leaf.shape
    axes = [axis for axis in self.axis_names if self.mesh.shape[axis] > 1]
    dim_rank = {dim: r for r, dim in enumerate(sorted(range(len(shape)), key=lambda d: -shape[d]))}
    by_size = sorted(range(len(axes)), key=lambda a: -self.mesh.shape[axes[a]])
    fitting, valid = [], []
    # dims[a] is the dim that axes[a] shards, or None for an unused axis.
    for dims in itertools.product([None, *range(len(shape))], repeat=len(axes)):
      factors = [1] * len(shape)
      for axis, dim in zip(axes, dims):
        if dim is not None:
          factors[dim] *= self.mesh.shape[axis]
      if any(size % factor for size, factor in zip(shape, factors)):
        continue
      shard_count = math.prod(factors)
      placement = tuple(len(shape) if dims[a] is None else dim_rank[dims[a]] for a in by_size)
      key = (shard_count, sum(dim is not None for dim in dims), placement)
      valid.append((key, dims))
      if nbytes // shard_count <= self.max_bytes_per_device:
        fitting.append((key, dims))
    if fitting:
      return self._spec(axes, min(fitting, key=lambda item: item[0])[1], len(shape))
    (shard_count, *_), dims = min(valid, key=lambda item: (-item[0][0], item[0][1:]))
    message = (
        f"{jax.tree_util.keystr(path)}: {nbytes} bytes (shape {shape}, {leaf.dtype}) cannot fit"
        f" max_bytes_per_device={self.max_bytes_per_device}; the most any valid sharding over"
        f" mesh axes {dict((a, self.mesh.shape[a]) for a in axes)} achieves is"
        f" {nbytes // shard_count} bytes per device."
    )
    if self.strict:
      raise ValueError(message)
    warnings.warn(message)
    return self._spec(axes, dims, len(shape))

  @staticmethod
  def _spec(axes: Sequence[str], dims: Sequence[int | None], ndim: int) -> PartitionSpec:
    per_dim: list[list[str]] = [[] for _ in range(ndim)]
    for axis, dim in zip(axes, dims):
      if dim is not None:
        per_dim[dim].append(axis)
    return _make_spec(
        [None if not group else group[0] if len(group) == 1 else tuple(group) for group in per_dim]
    )


class CompositeShardingRule(ShardingRule):
  """Asks its rules in order; the first spec that shards something wins.

  A leaf every rule replicates is replicated. Typical use: a
  `ShapeBasedShardingRule` for known layers, then an `AutoShardingRule` for the
  rest.
  """

  def __init__(self, *rules: ShardingRule):
    for i, rule in enumerate(rules):
      if not isinstance(rule, ShardingRule):
        raise TypeError(f"rules[{i}] must be a ShardingRule, got {type(rule).__name__}.")
    self.rules = rules

  def __repr__(self) -> str:
    return f"CompositeShardingRule{self.rules!r}"

  def leaf_spec(self, path: KeyPath, leaf: jax.ShapeDtypeStruct) -> PartitionSpec:
    for rule in self.rules:
      spec = rule.leaf_spec(path, leaf)
      if _is_sharded(spec):
        return _make_spec(spec)
    return PartitionSpec()
