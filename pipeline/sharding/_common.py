"""Leaves and specs: the helpers the sharding rules, state specs and analysis share."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallasopt.kernels import _compat, quant

__all__ = ["named_shardings"]

KeyPath = tuple[Any, ...]
PyTree = Any
ShapePattern = tuple[int | None, ...]
_Entry = str | tuple[str, ...] | None


def _as_struct(path: KeyPath, leaf: Any, what: str = "tree") -> jax.ShapeDtypeStruct:
  if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
    return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype)
  raise TypeError(
      f"{what} leaf {jax.tree_util.keystr(path)} must be an array or a"
      f" jax.ShapeDtypeStruct, got {type(leaf).__name__}."
  )


def _nbytes(leaf: jax.ShapeDtypeStruct) -> int:
  return quant.stored_bytes(math.prod(leaf.shape), leaf.dtype)


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
