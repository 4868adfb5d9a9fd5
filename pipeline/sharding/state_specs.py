"""The partition specs of an optimizer state, derived from its params' specs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from pallasopt.kernels import quant
from pallasopt.pipeline.sharding._common import (
    KeyPath,
    PyTree,
    _as_struct,
    _make_spec,
    _entries,
    _is_masked,
    _is_state_leaf,
    _blockwise_specs,
)


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
    - a blockwise moment (``state_format="int8"``, ``"fp8"`` or ``"int4"``,
      any `pallasopt.kernels.quant.Blockwise`): its codes take the param's
      spec, its per-block scales (the param's dims, the last counted in
      blocks) the split the kernels run them in
      (`pallasopt.kernels.quant.scales_spec`): the param's spec too where
      each shard of its columns holds whole blocks of 256, which only the
      ``mesh`` tells (without one the blocks axis is whole, and a kernel on a
      column-sharded param gathers its scales).

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
    params: the params (arrays or `jax.ShapeDtypeStruct` values).
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
