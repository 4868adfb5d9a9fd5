"""Partition specs for params and optimizer state, and per-device memory.

Four rules turn a pytree of arrays (or `jax.ShapeDtypeStruct`s) into a pytree
of `PartitionSpec`s: `AutoShardingRule`, `ShapeBasedShardingRule`,
`MemoryConstrainedShardingRule` and `CompositeShardingRule`; subclass
`ShardingRule` for more. `optimizer_state_specs` derives the specs of every
optimizer state leaf from the param specs, `ShardingAnalyzer` validates specs
against a mesh and counts bytes, and `barrier_sync` lines up the processes of a
multi-process run::

  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  param_specs = AutoShardingRule(mesh).apply(params)
  state_shapes = jax.eval_shape(tx.init, params)  # allocates nothing
  state_specs = optimizer_state_specs(state_shapes, params, param_specs, mesh=mesh)
  analyzer = ShardingAnalyzer(mesh)
  print(analyzer.estimate_memory(params, param_specs, state_shapes, state_specs))
  opt_state = jax.jit(tx.init, out_shardings=named_shardings(mesh, state_specs))(params)

Every spec a rule or `optimizer_state_specs` returns is trimmed of trailing
`None`s, so a replicated leaf always gets ``PartitionSpec()``.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import math
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallasopt.kernels import _compat, quant

__all__ = [
    "AutoShardingRule",
    "CompositeShardingRule",
    "FactorInfo",
    "FactorRule",
    "MemoryConstrainedShardingRule",
    "MemoryEstimate",
    "ShapeBasedShardingRule",
    "ShardingAnalyzer",
    "ShardingRule",
    "barrier_sync",
    "named_shardings",
    "optimizer_state_specs",
    "replicate_factors",
    "shard_factors_like_params",
]

KeyPath = tuple[Any, ...]
PyTree = Any
ShapePattern = tuple[int | None, ...]
_Entry = str | tuple[str, ...] | None


# ----------------------------------------------------------------------------
# Leaves and specs.
# ----------------------------------------------------------------------------


def _as_struct(path: KeyPath, leaf: Any, what: str = "tree") -> jax.ShapeDtypeStruct:
  if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
    return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype)
  raise TypeError(
      f"{what} leaf {jax.tree_util.keystr(path)} must be an array or a"
      f" jax.ShapeDtypeStruct, got {type(leaf).__name__}."
  )


def _nbytes(leaf: jax.ShapeDtypeStruct) -> int:
  return math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize


def _axes(entry: _Entry) -> tuple[str, ...]:
  """The mesh axes of one spec entry: None, an axis name or a tuple of them."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _make_spec(entries: Sequence[_Entry]) -> PartitionSpec:
  # Trailing Nones are trimmed so that equal shardings compare equal
  # (PartitionSpec() != PartitionSpec(None)).
  entries = list(entries)
  while entries and entries[-1] is None:
    entries.pop()
  return PartitionSpec(*entries)


def _entries(spec: PartitionSpec, ndim: int) -> list[_Entry]:
  entries = list(spec)
  return entries + [None] * (ndim - len(entries))


def _is_sharded(spec: PartitionSpec) -> bool:
  return any(_axes(entry) for entry in spec)


def _is_masked(node: Any) -> bool:
  return isinstance(node, optax.MaskedNode)


def _is_state_leaf(node: Any) -> bool:
  # A blockwise moment stands where its param's moment array would.
  return _is_masked(node) or quant.is_blockwise(node)


def _blockwise_specs(
    moment: Any, param_shape, param_spec: PartitionSpec, axis_sizes: Mapping[str, int] | None
) -> Any:
  """Codes like the param; scales by `quant.scales_spec`, the kernels' own rule."""
  scales = quant.scales_spec(tuple(param_shape), param_spec, axis_sizes, exact=False)
  codes = _make_spec(_entries(param_spec, len(param_shape)))
  return type(moment)(codes, _make_spec(list(scales)))


def _shard_factor(mesh_shape: Mapping[str, int], spec: PartitionSpec) -> int:
  return math.prod(mesh_shape[axis] for entry in spec for axis in _axes(entry))


def _mesh_axes(mesh: Mesh, axis_names: Sequence[str] | None) -> tuple[str, ...]:
  if axis_names is None:
    return tuple(mesh.axis_names)
  names = tuple(axis_names)
  unknown = [name for name in names if name not in mesh.shape]
  if unknown or len(set(names)) != len(names):
    raise ValueError(
        f"axis_names must be distinct axes of the mesh {tuple(mesh.axis_names)},"
        f" got {names}."
    )
  return names


def _context_mesh(owner: str, mesh: Mesh | None) -> Mesh:
  """``mesh``, or the mesh of the enclosing ``jax.set_mesh`` / ``with mesh:`` block.

  eFormer's rules and analyzer take ``mesh=None`` to mean the mesh in
  context; so do ours, and say so when there is none.
  """
  if mesh is not None:
    if not isinstance(mesh, Mesh):
      raise TypeError(f"{owner}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    return mesh
  current = jax.sharding.get_mesh()
  if current.empty:
    # `with mesh:` (deprecated, still what eFormer's examples use) sets only
    # the legacy thread resources.
    legacy = _compat.legacy_context_mesh()
    current = current if legacy is None else legacy
  if current.empty:
    raise ValueError(
        f"{owner}: mesh=None takes the mesh in context, and none is active; pass mesh= or "
        "call inside `with jax.set_mesh(mesh):`."
    )
  return current


def named_shardings(mesh: Mesh, specs: PyTree) -> PyTree:
  """Wraps every `PartitionSpec` of `specs` in a `NamedSharding` on `mesh`.

  The result feeds `jax.device_put` and the ``in_shardings`` /
  ``out_shardings`` of `jax.jit`. Empty nodes (``None``, ``optax.MaskedNode``)
  are kept, so it has the structure of the tree the specs were made for.
  """
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)


# ----------------------------------------------------------------------------
# Rules.
# ----------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------
# Optimizer state.
# ----------------------------------------------------------------------------


class FactorInfo(NamedTuple):
  """What a `FactorRule` knows about one preconditioner factor.

  Attributes:
    path: the factor's key path in the optimizer state.
    shape: the factor's shape.
    param_path: the key path of the param it preconditions.
    param_shape: that param's shape.
    param_spec: that param's spec.
    index: the factor's position in the param's list of factors.
    num_factors: the length of that list.
    stacked_dims: how many leading dims of the param are stacking dims (e.g.
      pipeline stages or scanned layers) that every factor also carries: the
      param's rank minus `num_factors` when every factor starts with those
      dims of the param, else 0.
  """

  path: KeyPath
  shape: tuple[int, ...]
  param_path: KeyPath
  param_shape: tuple[int, ...]
  param_spec: PartitionSpec
  index: int
  num_factors: int
  stacked_dims: int


FactorRule = Callable[[FactorInfo], PartitionSpec]


def replicate_factors(info: FactorInfo) -> PartitionSpec:
  """The default `FactorRule`: replicated, except for the stacking dims.

  A factor of a stage-stacked param keeps the param's spec on the stacking
  dims (so each stage holds only its own factors) and is replicated otherwise.
  """
  return _make_spec(_entries(info.param_spec, len(info.param_shape))[: info.stacked_dims])


def shard_factors_like_params(info: FactorInfo) -> PartitionSpec:
  """A `FactorRule` that shards each Kron factor like its param's dim.

  Factor ``index`` of a param preconditions dim ``stacked_dims + index``. A
  square ``[d, d]`` factor has its rows and a diagonal ``[d]`` factor its
  entries sharded like that dim of the param; the stacking dims keep the
  param's spec. A factor of any other shape gets only the stacking dims.
  """
  entries = _entries(info.param_spec, len(info.param_shape))
  stacked = entries[: info.stacked_dims]
  own = info.shape[info.stacked_dims :]
  dim = info.stacked_dims + info.index
  if dim >= len(info.param_shape):
    return _make_spec(stacked)
  size = info.param_shape[dim]
  if own in ((size, size), (size,)):
    return _make_spec([*stacked, entries[dim]])
  return _make_spec(stacked)


def _factored_dims(shape: tuple[int, ...]) -> tuple[int, int] | None:
  # Adafactor factors the two largest dims: (second largest, largest), ties
  # broken by position as optax's argsort does.
  if len(shape) < 2:
    return None
  order = np.argsort(shape, kind="stable")
  return int(order[-2]), int(order[-1])


# Which dim Adafactor's statistics drop: v_row reduces over the largest
# factored dim and v_col over the other one.
_FACTORED_FIELDS: dict[str, int] = {"v_row": 1, "v_col": 0}


def _derived_spec(
    shape: tuple[int, ...],
    param_shape: tuple[int, ...],
    param_spec: PartitionSpec,
    factored_field: str | None,
) -> PartitionSpec | None:
  """The spec of a state leaf shaped after a param, or None if it is not."""
  entries = _entries(param_spec, len(param_shape))
  if shape == param_shape:
    return _make_spec(entries)
  if len(shape) == len(param_shape) and all(s in (p, 1) for s, p in zip(shape, param_shape)):
    return _make_spec([e if s == p else None for e, s, p in zip(entries, shape, param_shape)])
  if len(shape) + 1 != len(param_shape):
    return None
  dropped = [
      d for d in range(len(param_shape)) if param_shape[:d] + param_shape[d + 1 :] == shape
  ]
  if not dropped:
    return None
  # Several dims qualify only when equal-sized neighbours are reduced; an
  # Adafactor statistic knows which one it reduced, anything else takes the
  # last.
  dim = dropped[-1]
  factored = _factored_dims(param_shape) if factored_field is not None else None
  if factored is not None and factored[_FACTORED_FIELDS[factored_field]] in dropped:
    dim = factored[_FACTORED_FIELDS[factored_field]]
  return _make_spec(entries[:dim] + entries[dim + 1 :])


class _Params(NamedTuple):
  treedef: jax.tree_util.PyTreeDef
  paths: list[KeyPath]
  structs: list[jax.ShapeDtypeStruct]
  specs: list[PartitionSpec]
  axis_sizes: Mapping[str, int] | None


def _children(node: Any) -> tuple[list[tuple[KeyPath, Any]], jax.tree_util.PyTreeDef]:
  # One level of flattening: everything below the root counts as a leaf.
  return jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)


def _factored_field(child_path: KeyPath) -> str | None:
  name = getattr(child_path[-1], "name", None)
  return name if name in _FACTORED_FIELDS else None


def _state_specs(
    path: KeyPath, node: Any, params: _Params, factor_rule: FactorRule, field: str | None = None
) -> PyTree:
  treedef = jax.tree_util.tree_structure(node)
  if treedef.num_leaves == 0:
    # None, optax.MaskedNode(), EmptyState(), (): nothing to place.
    return node
  treedef = jax.tree_util.tree_structure(node, is_leaf=_is_state_leaf)
  if treedef == params.treedef:
    return _matched_specs(path, node, params, field)
  factors = _factor_lists(node, params)
  if factors is not None:
    return _factor_specs(path, factors, params, factor_rule)
  if jax.tree_util.treedef_is_leaf(treedef):
    _as_struct(path, node, "opt_state")
    return PartitionSpec()
  children, node_def = _children(node)
  # Adafactor's statistics need to know which of v_row / v_col they are.
  factored = {"v_row", "v_col"} <= set(getattr(node, "_fields", ()))
  return node_def.unflatten([
      _state_specs(
          path + child_path,
          child,
          params,
          factor_rule,
          _factored_field(child_path) if factored else None,
      )
      for child_path, child in children
  ])


def _matched_specs(path: KeyPath, node: Any, params: _Params, field: str | None) -> PyTree:
  """Specs of a subtree with the params' structure, leaf by leaf."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=_is_state_leaf)
  specs = []
  for (leaf_path, leaf), param, spec in zip(leaves, params.structs, params.specs):
    if _is_masked(leaf):
      specs.append(leaf)
      continue
    if quant.is_blockwise(leaf):
      specs.append(_blockwise_specs(leaf, param.shape, spec, params.axis_sizes))
      continue
    shape = _as_struct(path + leaf_path, leaf, "opt_state").shape
    derived = _derived_spec(shape, param.shape, spec, field)
    specs.append(PartitionSpec() if derived is None else derived)
  return treedef.unflatten(specs)


def _factor_lists(node: Any, params: _Params) -> list[Any] | None:
  """Per param, its list of factors, if `node` stores lists of arrays per param.

  A param masked out by ``optax.masked`` has an ``optax.MaskedNode`` instead.
  """
  if jax.tree_util.treedef_is_leaf(params.treedef):
    # Bare-array params are a prefix of every tree; nothing is recognised.
    return None
  try:
    per_param = params.treedef.flatten_up_to(node)
  except (ValueError, TypeError):
    return None
  def is_factor_list(sub):
    return (
        type(sub) in (list, tuple)
        and len(sub) > 0
        and all(hasattr(f, "shape") and hasattr(f, "dtype") for f in sub)
    )

  if any(map(is_factor_list, per_param)) and all(
      is_factor_list(sub) or _is_masked(sub) for sub in per_param
  ):
    return per_param
  return None


def _factor_specs(path: KeyPath, per_param: list[Any], params: _Params, factor_rule: FactorRule):
  out = []
  for sub, param_path, param, spec in zip(per_param, params.paths, params.structs, params.specs):
    if _is_masked(sub):
      out.append(sub)
      continue
    shapes = [tuple(f.shape) for f in sub]
    stacked = len(param.shape) - len(sub)
    if stacked < 0 or any(s[:stacked] != param.shape[:stacked] for s in shapes):
      stacked = 0
    specs = []
    for i, shape in enumerate(shapes):
      info = FactorInfo(
          path=path + param_path + (jax.tree_util.SequenceKey(i),),
          shape=shape,
          param_path=param_path,
          param_shape=param.shape,
          param_spec=spec,
          index=i,
          num_factors=len(sub),
          stacked_dims=stacked,
      )
      factor_spec = factor_rule(info)
      if not isinstance(factor_spec, PartitionSpec):
        raise TypeError(
            f"factor_rule must return a PartitionSpec, got {type(factor_spec).__name__} for"
            f" {jax.tree_util.keystr(info.path)}."
        )
      specs.append(factor_spec)
    out.append(type(sub)(specs))
  return params.treedef.unflatten(out)


def optimizer_state_specs(
    state_shapes: PyTree,
    params: PyTree,
    param_specs: PyTree,
    *,
    factor_rule: FactorRule = replicate_factors,
    mesh: Mesh | jax.sharding.AbstractMesh | None = None,
) -> PyTree:
  """Partition specs for every leaf of an optimizer state.

  Works for any Optax-style state, including pallasopt's transforms (whose
  state trees are Optax's) and their ``optax.chain``, ``optax.masked``,
  ``optax.partition``, ``optax.inject_hyperparams`` and ``optax.MultiSteps``
  wrappings. The state tree is walked from the root; at each node:

  * A subtree with the params' structure (``optax.MaskedNode`` standing in for
    masked-out params is allowed) is matched leaf by leaf against the params:

    - a leaf of the param's shape (Adam/Lion/Muon moments, accumulated grads)
      takes the param's spec;
    - a leaf of the param's rank whose dims are the param's or 1 (statistics
      kept with ``keepdims``) takes the spec with the size-1 dims unsharded;
    - a leaf of the param's shape with one dim removed (Adafactor's
      ``v_row``/``v_col``) takes the spec with that dim dropped; when several
      equal-sized dims could have been removed, Adafactor's choice is used
      under ``v_row``/``v_col`` and the last such dim elsewhere;
    - any other leaf (Adafactor's ``(1,)`` placeholders) is replicated;
    - a blockwise moment (``state_format="int8"`` or ``"fp8"``, any
      `pallasopt.kernels.quant.Blockwise`): its codes take the param's spec,
      its per-block scales the split the kernels run them in
      (`pallasopt.kernels.quant.scales_spec`): like the param's leading dims
      and rows, and like its columns where each shard of them holds whole
      blocks of 256, which only the ``mesh`` tells (without one that axis is
      whole, and a kernel on a column-sharded param gathers its scales).

  * A subtree holding, for each param, a list or tuple of arrays
    (``psgd_jax.kron``'s ``Qs_preconditioners``: one ``[d, d]`` or ``[d]``
    factor per param dim) gets its specs from `factor_rule`, replicated by
    default except for stacking dims (see `replicate_factors`).
  * Any other leaf (``count``, injected hyperparameters, Muon's
    ``ns_coeffs``) is replicated.

  Derived specs use only the param's valid spec entries on dims of the same
  size, so they are valid whenever the param specs are, and a stage-stacked
  leaf keeps its stage axis wherever the stage dim survives in the state.

  Args:
    state_shapes: the optimizer state, or better its shapes:
      ``jax.eval_shape(tx.init, params)``.
    params: the params (arrays or `jax.ShapeDtypeStruct`s).
    param_specs: a `PartitionSpec` per param, with the structure of `params`.
    factor_rule: the spec of each preconditioner factor, from a `FactorInfo`
      (`replicate_factors` or `shard_factors_like_params`, or your own).
    mesh: the mesh the specs are for (a `Mesh` or `AbstractMesh`); by default
      the one set by ``jax.set_mesh`` or ``jax.sharding.use_abstract_mesh``,
      if any.

  Returns:
    A tree with the structure of `state_shapes` and a `PartitionSpec` at each
    leaf (empty nodes such as ``optax.MaskedNode()`` are kept).
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  try:
    spec_leaves = treedef.flatten_up_to(param_specs)
  except (ValueError, TypeError) as e:
    raise ValueError(f"param_specs must have the structure of params {treedef}: {e}") from e
  for (path, _), spec in zip(flat, spec_leaves):
    if not isinstance(spec, PartitionSpec):
      raise TypeError(
          f"param_specs{jax.tree_util.keystr(path)} must be a PartitionSpec,"
          f" got {type(spec).__name__}."
      )
  structs = [_as_struct(path, leaf, "params") for path, leaf in flat]
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
  axis_sizes = None if mesh.empty else dict(mesh.shape)
  info = _Params(treedef, [path for path, _ in flat], structs, spec_leaves, axis_sizes)
  return _state_specs((), state_shapes, info, factor_rule, None)


# ----------------------------------------------------------------------------
# Analysis.
# ----------------------------------------------------------------------------


class MemoryEstimate(NamedTuple):
  """Bytes of params and optimizer state, logical and per device.

  ``*_bytes`` count one copy of every leaf; ``*_bytes_per_device`` what each
  device of the mesh holds (valid specs shard evenly, so every device holds the
  same amount; replicated leaves count in full on each).
  """

  param_bytes: int
  state_bytes: int
  param_bytes_per_device: int
  state_bytes_per_device: int

  @property
  def total_bytes(self) -> int:
    return self.param_bytes + self.state_bytes

  @property
  def bytes_per_device(self) -> int:
    return self.param_bytes_per_device + self.state_bytes_per_device


class ShardingAnalyzer:
  """Checks partition specs against a mesh and counts bytes per device.

  ``mesh=None`` takes the mesh in context. `validate_partition_specs` and
  `estimate_memory_usage` are eFormer's (escale's) names and return types for
  `validate` and `estimate_memory`, with our checks.
  """

  def __init__(self, mesh: Mesh | None = None):
    self.mesh = _context_mesh("ShardingAnalyzer", mesh)

  def validate_partition_specs(self, pytree: PyTree, partition_specs: PyTree) -> list[str]:
    """Every problem `validate` would raise for, as a list (empty: all valid)."""
    try:
      self.validate(pytree, partition_specs)
    except ValueError as e:
      first, *problems = str(e).split("\n  ")
      return problems or [first]
    return []

  def estimate_memory_usage(self, pytree: PyTree, partition_specs: PyTree) -> dict[str, int]:
    """``{"total_size": bytes, "size_per_device": bytes}`` of ``pytree`` so sharded.

    Raises ValueError for invalid specs, as `validate` does.
    """
    total, per_device = self._bytes(self._checked(pytree, partition_specs, "tree"))
    return {"total_size": total, "size_per_device": per_device}

  def validate(self, shapes: PyTree, specs: PyTree, *, name: str = "tree") -> None:
    """Raises ValueError listing every spec that does not fit its leaf.

    A spec fits when it is a `PartitionSpec` with no more entries than the
    leaf has dims, names only axes of the mesh, uses each axis once, and every
    sharded dim is divisible by the product of its axes' sizes.

    Args:
      shapes: arrays or `jax.ShapeDtypeStruct`s.
      specs: a `PartitionSpec` per leaf of `shapes`, same structure.
      name: what the tree is, for the messages (e.g. "params").
    """
    self._checked(shapes, specs, name)

  def estimate_memory(
      self,
      params: PyTree,
      param_specs: PyTree,
      opt_state: PyTree = None,
      opt_state_specs: PyTree = None,
  ) -> MemoryEstimate:
    """Validates the specs and counts the bytes of params and state.

    Args:
      params: arrays or `jax.ShapeDtypeStruct`s.
      param_specs: their specs.
      opt_state: the optimizer state or its shapes (``jax.eval_shape``), or
        None to count params only.
      opt_state_specs: its specs (`optimizer_state_specs`).
    """
    if (opt_state is None) != (opt_state_specs is None):
      raise ValueError("opt_state and opt_state_specs must be given together.")
    param_bytes, param_per_device = self._bytes(self._checked(params, param_specs, "params"))
    state_bytes, state_per_device = self._bytes(
        self._checked(opt_state, opt_state_specs, "opt_state")
    )
    return MemoryEstimate(param_bytes, state_bytes, param_per_device, state_per_device)

  def _bytes(self, leaves: list[tuple[jax.ShapeDtypeStruct, PartitionSpec]]) -> tuple[int, int]:
    total = sum(_nbytes(leaf) for leaf, _ in leaves)
    per_device = sum(_nbytes(leaf) // _shard_factor(self.mesh.shape, spec) for leaf, spec in leaves)
    return total, per_device

  def _checked(self, shapes: PyTree, specs: PyTree, name: str):
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    try:
      spec_leaves = treedef.flatten_up_to(specs)
    except (ValueError, TypeError) as e:
      raise ValueError(f"the specs of {name} must have its structure {treedef}: {e}") from e
    errors, leaves = [], []
    for (path, leaf), spec in zip(flat, spec_leaves):
      struct = _as_struct(path, leaf, name)
      where = f"{name}{jax.tree_util.keystr(path)} (shape {struct.shape})"
      if not isinstance(spec, PartitionSpec):
        errors.append(f"{where}: expected a PartitionSpec, got {type(spec).__name__}")
        continue
      errors.extend(f"{where}: {problem}" for problem in self._spec_problems(struct.shape, spec))
      leaves.append((struct, spec))
    if errors:
      raise ValueError(
          f"{len(errors)} invalid partition spec(s) for mesh {dict(self.mesh.shape)}:\n  "
          + "\n  ".join(errors)
      )
    return leaves

  def _spec_problems(self, shape: tuple[int, ...], spec: PartitionSpec) -> list[str]:
    if len(spec) > len(shape):
      return [f"spec {spec} has {len(spec)} entries for {len(shape)} dims"]
    problems, seen = [], set()
    for dim, entry in enumerate(spec):
      if not (entry is None or isinstance(entry, str) or (
          isinstance(entry, tuple) and all(isinstance(a, str) for a in entry))):
        problems.append(f"dim {dim}: entry {entry!r} is not None, an axis name or a tuple of them")
        continue
      axes = _axes(entry)
      unknown = [a for a in axes if a not in self.mesh.shape]
      if unknown:
        problems.append(
            f"dim {dim}: mesh axis {unknown[0]!r} is not one of {tuple(self.mesh.axis_names)}"
        )
        continue
      repeated = [a for i, a in enumerate(axes) if a in seen or a in axes[:i]]
      if repeated:
        problems.append(f"dim {dim}: mesh axis {repeated[0]!r} is used twice in {spec}")
      seen.update(axes)
      factor = math.prod(self.mesh.shape[a] for a in axes)
      if shape[dim] % factor:
        problems.append(
            f"dim {dim} of size {shape[dim]} is not divisible by mesh axis"
            f" {entry!r} of size {factor}"
        )
    return problems


# ----------------------------------------------------------------------------
# Multi-process.
# ----------------------------------------------------------------------------


def barrier_sync(name: str = "pallasopt_barrier", *, timeout: float | None = None) -> None:
  """Blocks until every process of the run has reached this barrier.

  With one process it returns at once. Otherwise it calls
  `jax.experimental.multihost_utils.sync_global_devices`, which has no timeout
  of its own; with `timeout`, the sync runs in a daemon thread and TimeoutError
  is raised if it has not finished after `timeout` seconds. The pending sync
  cannot be cancelled and stays in flight, so after a TimeoutError the run is
  out of step and should be aborted rather than retried.

  Args:
    name: the barrier's name; every process must pass the same one.
    timeout: seconds to wait, or None to wait forever.
  """
  if timeout is not None and not timeout > 0:
    raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout}.")
  if jax.process_count() == 1:
    return
  if timeout is None:
    multihost_utils.sync_global_devices(name)
    return
  failure: list[BaseException] = []

  def sync():
    try:
      multihost_utils.sync_global_devices(name)
    except BaseException as e:  # re-raised in the caller's thread
      failure.append(e)

  thread = threading.Thread(target=sync, name=f"barrier_sync:{name}", daemon=True)
  thread.start()
  thread.join(timeout)
  if thread.is_alive():
    raise TimeoutError(
        f"barrier_sync({name!r}): not every one of the {jax.process_count()} processes"
        f" arrived within {timeout} s."
    )
  if failure:
    raise failure[0]
