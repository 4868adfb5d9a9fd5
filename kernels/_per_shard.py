"""Kernels under a mesh whose axes are not all manual: per shard, in `shard_map`.

A ``pallas_call`` is never partitioned by XLA, so `pallasopt.kernels._dispatch`
runs an elementwise family's kernel per shard, with the layout its operands
arrive with (see its module docstring for the ways a step is sharded):
`mesh_aware` where the operands' types or the mesh in context show the
layout while tracing, `per_shard_lowering` where only the lowering does
(`_target.Target.layouts`). A shard's blockwise scales split by the one rule
`quant.scales_spec`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from pallasopt.kernels import _compat, quant
from pallasopt.kernels._target import BASELINE_DEVICE_KIND, Target, local_shape

__all__ = ["mesh_aware", "per_shard_lowering"]


def _non_manual_mesh(args) -> tuple[object | None, bool]:
  """The mesh a call runs under, if not all its axes are manual, and whether it is in context.

  The mesh in context (``jax.set_mesh``), else the mesh of the first operand
  whose type carries an Explicit sharding (arrays sharded over Explicit axes
  with no mesh in context), else None.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    return (None if mesh.are_all_axes_manual else mesh), True
  for x in jax.tree.leaves(args):
    if _compat.explicit_spec(x) is not None and _layouts_known(jax.typeof(x).sharding.mesh):
      return jax.typeof(x).sharding.mesh, False
  return None, False


def _local_aval(x, spec: PartitionSpec, mesh) -> jax.ShapeDtypeStruct:
  """The type of ``x``'s local shard when split as ``spec``."""
  return jax.ShapeDtypeStruct(local_shape(jnp.shape(x), spec, mesh), jnp.result_type(x))


class _ShardPlan(NamedTuple):
  """How an update on one leaf splits over a mesh (`_shard_plan`)."""

  leaf: PartitionSpec  # arrays of the leaf's shape
  scales: PartitionSpec | None  # a blockwise moment's scales, where shards hold whole blocks
  local_leaf: tuple[int, ...]

  def spec(self, shape: tuple[int, ...], leaf: tuple[int, ...]) -> PartitionSpec | None:
    """The split of an array of ``shape`` beside a leaf of shape ``leaf``, or None if none is exact."""
    if not shape or all(axes is None for axes in self.leaf):
      return PartitionSpec()
    if shape == leaf:
      return self.leaf
    if self.scales is not None and shape == quant.scales_shape(leaf):
      return self.scales
    return None


def _shard_plan(leaf: tuple[int, ...], layout: PartitionSpec, mesh) -> _ShardPlan:
  """The split of every array of an update whose leaf (of shape ``leaf``) splits as ``layout``.

  Arrays of the leaf's shape split like it and scalars are replicated; a
  blockwise moment's scales (`quant.scales_shape` of a leaf whose rows hold
  whole blocks) split like the rows and the blocks they scale, where every
  shard holds whole blocks. Any other array has no exact split.
  """
  padded = (*layout, *(None,) * (len(leaf) - len(layout)))
  scales = quant.scales_spec(leaf, layout, dict(mesh.shape), exact=True)
  return _ShardPlan(PartitionSpec(*padded), scales, local_shape(leaf, layout, mesh))


def _leaf_shape(arrays: Sequence[object]) -> tuple[int, ...]:
  """The shape of the leaf an update runs on: its largest operand's."""
  return max((tuple(jnp.shape(x)) for x in arrays), key=math.prod, default=())


def _exact_split(
    leaves: Sequence[object], layout: PartitionSpec, mesh
) -> tuple[_ShardPlan, tuple[PartitionSpec, ...]] | None:
  """The update's `_shard_plan` and each operand's split, when its leaf splits as ``layout``.

  None if a shard would not compute what the whole leaf does.
  """
  leaf = _leaf_shape(leaves)
  plan = _shard_plan(leaf, layout, mesh)
  specs = tuple(plan.spec(tuple(jnp.shape(x)), leaf) for x in leaves)
  return None if any(s is None for s in specs) else (plan, specs)


def _out_spec(plan: _ShardPlan, shape: tuple[int, ...]) -> PartitionSpec:
  spec = plan.spec(tuple(shape), plan.local_leaf)
  if spec is None:
    raise TypeError(
        f"an elementwise kernel returned an array of local shape {shape}, neither its "
        f"leaf's {plan.local_leaf} nor that leaf's block scales: it cannot run per shard."
    )
  return spec


def _under_shard_map(fn, mesh, args: Sequence[object], layout: PartitionSpec | None):
  """Runs ``fn(*args)`` in `shard_map` over ``mesh``'s non-manual axes.

  ``layout``: how the update's leaf is split; every operand and output is
  split to match (`_shard_plan`; the caller has checked with `_exact_split`
  that the operands can be), so that an elementwise kernel runs on the local
  shards. None: every operand is gathered and the outputs are replicated.
  """
  leaves, treedef = jax.tree.flatten(args)
  local_fn = lambda *flat: fn(*jax.tree.unflatten(treedef, flat))
  if layout is None:
    in_specs, out_specs = tuple(PartitionSpec() for _ in leaves), PartitionSpec()
  else:
    plan, in_specs = _exact_split(leaves, layout, mesh)
    local_leaves = [_local_aval(x, spec, mesh) for x, spec in zip(leaves, in_specs)]
    out_specs = jax.tree.map(
        lambda x: _out_spec(plan, x.shape), jax.eval_shape(local_fn, *local_leaves)
    )
  if _layouts_known(mesh):  # the operands' types must agree with the specs
    leaves = [
        jax.sharding.reshard(x, spec)
        if jnp.ndim(x) > 0 and (_compat.explicit_spec(x) or PartitionSpec()) != spec else x
        for x, spec in zip(leaves, in_specs)
    ]
  axes = frozenset(a for a in mesh.axis_names if a not in mesh.manual_axes)
  mapped = _compat.shard_map(
      local_fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=axes,
      check_vma=False,
  )
  return mapped(*leaves)


def _layouts_known(mesh) -> bool:
  """Whether the operands' types carry their layout over ``mesh``'s free axes."""
  return all(
      t == jax.sharding.AxisType.Explicit
      for name, t in zip(mesh.axis_names, mesh.axis_types)
      if name not in mesh.manual_axes
  )


def _typed_layout(args) -> PartitionSpec:
  """The layout of the update's leaf as the operands' types carry it (Explicit axes).

  The first operand of the leaf's shape sharded over Explicit axes;
  replicated if none is.
  """
  return _operand_layouts(args).get(_leaf_shape(jax.tree.leaves(args)), PartitionSpec())


def _operand_layouts(args) -> dict[tuple[int, ...], PartitionSpec]:
  """Per shape, the layout of the first operand of that shape sharded over Explicit axes."""
  layouts = {}
  for x in jax.tree.leaves(args):
    spec = _compat.explicit_spec(x)
    if spec is not None:
      layouts.setdefault(tuple(jnp.shape(x)), spec)
  return layouts


def _lowered_layout(target: Target, mesh, operands: Sequence[object]) -> PartitionSpec | None:
  """The layout of the update's leaf, as the lowering shows it (`Target.layouts`).

  The first split over ``mesh``'s axes, that divides the leaf, of an operand
  of the leaf's shape; replicated if every one shown is; None if the
  lowering shows none.
  """
  leaf = _leaf_shape(operands)
  shown = [
      layout.spec
      for layout, x in zip(target.layouts, operands)
      if layout is not None and tuple(jnp.shape(x)) == leaf and leaf and layout.fits(mesh, leaf)
  ]
  split = (s for s in shown if any(axes is not None for axes in s))
  return next(split, PartitionSpec() if shown else None)


def _lowering_mesh(target: Target):
  """The mesh of a partitioned lowering: the one in context, else the one its operands name."""
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    return None if mesh.are_all_axes_manual else mesh
  axes = next((layout.mesh_axes for layout in target.layouts if layout and layout.mesh_axes), None)
  if axes is None:
    return None
  names, sizes = zip(*axes)
  kind = target.device_kind or BASELINE_DEVICE_KIND.get(target.platform)
  device = None if kind is None else jax.sharding.AbstractDevice(
      device_kind=kind, num_cores=None, platform=target.platform
  )
  auto = (jax.sharding.AxisType.Auto,) * len(names)
  return jax.sharding.AbstractMesh(sizes, names, axis_types=auto, abstract_device=device)


def per_shard_lowering(target: Target, operands, call, impl: str, runs_kernel):
  """An elementwise ``call``, lowered where XLA partitions it, on local shards; or None.

  XLA, not the operands' types, lays the operands out there (Auto mesh axes,
  or shardings given to ``jax.jit`` only), so the layout is read from the
  lowering (`Target.layouts`): where the operands are the jitted function's
  arguments, ``call`` runs per shard in `shard_map` with their sharding.
  Under ``"auto"`` only where ``runs_kernel(target, local shards)`` (else
  XLA partitions the reference, as it is); where the lowering shows no
  layout but the mesh is in context, a kernel ``impl`` runs on gathered
  operands. None where neither is known.
  """
  mesh = _lowering_mesh(target)
  if mesh is None:
    return None
  layout = _lowered_layout(target, mesh, operands)
  split = None if layout is None else _exact_split(operands, layout, mesh)
  if split is None:  # no layout shown, or none that splits exactly: gathered
    if impl == "auto":
      return None
    layout = None
  elif impl == "auto":
    local = [_local_aval(x, spec, mesh) for x, spec in zip(operands, split[1])]
    if not runs_kernel(dataclasses.replace(target, partitioned=False, layouts=()), local):
      return None
  return lambda *a, **k: _under_shard_map(lambda *x: call(*x, **k), mesh, a, layout)


def mesh_aware(call, reference, impl: str, elementwise: bool):
  """``call`` made legal under a non-manual mesh (module docstring)."""

  def run(*args, **kwargs):
    mesh, in_context = _non_manual_mesh(args)
    if mesh is None:
      return call(*args, **kwargs)
    if elementwise and not _layouts_known(mesh):
      return call(*args, **kwargs)  # per shard as lowered (`_per_shard_lowering`)
    layout = _typed_layout(args) if elementwise else None
    if layout is not None and _exact_split(jax.tree.leaves(args), layout, mesh) is None:
      layout = None  # no exact split (blocks cut in two)
    if impl == "auto" and layout is None:
      return reference(*args, **kwargs)
    bound = lambda *a: call(*a, **kwargs)
    if in_context:
      out = _under_shard_map(bound, mesh, args, layout)
    else:
      with jax.sharding.use_abstract_mesh(mesh):
        out = _under_shard_map(bound, mesh, args, layout)
    return out if layout is not None else _in_operand_layout(out, args)

  return run


def _in_operand_layout(outputs, args):
  """Gathered ``outputs`` returned to the layout of the operands of their shape (Explicit axes).

  A kernel run on gathered operands returns replicated arrays; an update or
  state left so would change its type from step to step (the step compiled
  again) and hold a whole copy on every device. Each output takes the layout
  of the first sharded operand of its shape (a gradient's for the update and
  the new momentum); outputs of no operand's shape stay replicated.
  """
  layouts = _operand_layouts(args)
  return jax.tree.map(
      lambda x: jax.sharding.reshard(x, layouts[tuple(jnp.shape(x))])
      if tuple(jnp.shape(x)) in layouts else x,
      outputs,
  )
