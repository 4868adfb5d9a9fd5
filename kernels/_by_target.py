"""One function call whose implementation is chosen when it is lowered.

`by_target(default, choose)` returns a function that traces ``default`` (the
XLA reference) for its types and binds one primitive, ``pallasopt_by_target``.
Nothing else is decided while tracing. When JAX lowers the computation, it
runs the primitive's lowering rule once per platform of the module (one for a
plain ``jax.jit``, one per branch of a multi-platform ``jax.export``), with
the `Target` of that lowering: the platform, the device kind of the devices
being compiled for (a GPU, a TPU, a `jax.experimental.topologies` target), and
whether XLA's partitioner will split the computation. ``choose(target)`` then
returns the function to lower in ``default``'s place (a Pallas kernel), or
None to lower ``default`` itself.

So ``jax.export(..., platforms=["tpu"])`` from a CPU host carries the TPU
kernel, AOT compilation for an H100 carries the H100's kernels, and the same
function jitted on CPU devices runs the reference, with no context to set.

The primitive also:

* runs eagerly with the choice for the operands' device (so an eager call
  on a TPU runs the kernel, and on a CPU the reference, op by op as before);
* batches under `jax.vmap` by vmapping ``default`` and every choice;
* differentiates through ``default`` (a kernel and its reference compute the
  same function; the tangents are the reference's);
* caches ``default``'s jaxpr per call signature, so a tree of thousands of
  same-shaped leaves traces it once per shape;
* hands a chosen function the bfloat16 array an f32 operand was converted
  from in the same function, for the arguments it names (``narrowable_args``:
  a bf16 matmul's weight gradient), since a custom call cannot fuse the
  conversion;
* is lowered in place, not in a private function shared by equal calls, so
  that where XLA partitions the computation the rule sees which operands are
  arguments of the jitted function, and their shardings (`Target.layouts`).

The chip seen by a Pallas lowering is the target's: while a choice is
lowered, the abstract mesh in context names the target's device (its own
device kind, or `_target.BASELINE_DEVICE_KIND` when the lowering has none).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

from pallasopt.kernels import _compat
from pallasopt.kernels._target import BASELINE_DEVICE_KIND, Target, lowering_target

__all__ = ["by_target", "by_target_operands", "callable_name", "Choose"]

Choose = Callable[[Target], "Callable[..., Any] | None"]

# Platforms with a lowering rule of their own; any other platform lowers the
# default function.
_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
# Jaxprs of default functions kept for reuse (one per distinct call signature).
_JAXPR_CACHE_SIZE = 4096


@dataclasses.dataclass(frozen=True, eq=False)
class _Flat:
  """``fn`` called on flat array operands, returning its flat outputs.

  The call's pytree structure and its non-array leaves (static
  configuration: Python scalars, strings, None) are bound here, so every
  choice of one call takes the same operands.
  """

  fn: Callable[..., Any]
  treedef: Any
  static: tuple[Any, ...]
  positions: tuple[int, ...]
  out_tree: Any = None

  def arguments(self, operands) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's ``(args, kwargs)`` with these operands."""
    leaves = list(self.static)
    for position, x in zip(self.positions, operands, strict=True):
      leaves[position] = x
    return jax.tree.unflatten(self.treedef, leaves)

  def __call__(self, *operands):
    args, kwargs = self.arguments(operands)
    out, out_tree = jax.tree.flatten(self.fn(*args, **kwargs))
    if self.out_tree is not None and out_tree != self.out_tree:
      raise TypeError(
          f"{callable_name(self.fn)} returned {out_tree}, but the function it replaces returns "
          f"{self.out_tree}: a kernel and its reference must return the same structure."
      )
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class _Choice:
  """What the primitive lowers for a target: ``choose``'s function, wrapped.

  ``wrap`` makes a chosen function take the primitive's operands: `_Flat`
  for a call, `jax.vmap` of the inner choice under a batching rule.
  """

  choose: Callable[[Target], Callable[..., Any] | None]
  wrap: Callable[[Callable[..., Any]], Callable[..., Any]]

  def __call__(self, target: Target):
    fn = self.choose(target)
    return None if fn is None else self.wrap(fn)


def callable_name(fn) -> str:
  """The name of ``fn``, or of the function a `functools.partial` applies."""
  while isinstance(fn, functools.partial):
    fn = fn.func
  return getattr(fn, "__name__", repr(fn))


def _callable_key(fn) -> Hashable:
  """A key equal for equal partial applications of one function."""
  if isinstance(fn, functools.partial):
    return (
        _callable_key(fn.func), fn.args, tuple(sorted(fn.keywords.items()))
    )
  return fn


def _is_operand(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray))


def by_target_operands(args, kwargs) -> list[Any]:
  """The operands of a `by_target` call on ``(*args, **kwargs)``, in order (`Target.layouts`)."""
  return [x for x in jax.tree.leaves((args, kwargs)) if _is_operand(x)]


_jaxprs: collections.OrderedDict = collections.OrderedDict()


def _default_jaxpr(flat: _Flat, avals) -> tuple[jex_core.ClosedJaxpr, Any]:
  """The jaxpr of ``flat``'s function on these operand types, and its output tree (cached)."""
  try:
    key = (
        _callable_key(flat.fn), flat.treedef, flat.static, tuple(avals),
        _compat.trace_context(),
    )
    hash(key)
  except TypeError:  # unhashable static configuration: trace every time.
    key = None
  if key is not None and key in _jaxprs:
    _jaxprs.move_to_end(key)
    return _jaxprs[key]
  out_tree = []

  def traced(*operands):
    args, kwargs = flat.arguments(operands)
    out, tree = jax.tree.flatten(flat.fn(*args, **kwargs))
    out_tree.append(tree)
    return out

  jaxpr = _compat.trace_to_closed_jaxpr(traced, avals)
  if any(isinstance(c, jax.core.Tracer) for c in jaxpr.consts):
    raise TypeError(
        f"{callable_name(flat.fn)} closes over a traced value (e.g. a functools.partial "
        "keyword): pass every array to by_target's function as an argument."
    )
  entry = (jaxpr, out_tree[0])
  if key is not None:
    _jaxprs[key] = entry
    if len(_jaxprs) > _JAXPR_CACHE_SIZE:
      _jaxprs.popitem(last=False)
  return entry


def by_target(
    default: Callable[..., Any], choose: Choose, *, narrowable_args: Sequence[int] = ()
) -> Callable[..., Any]:
  """``default``, with the implementation ``choose(target)`` picks when lowered.

  Args:
    default: the function traced for the call's types, lowered where
      ``choose`` returns None, and used to differentiate.
    choose: ``Target -> function or None``; a function takes ``default``'s
      arguments and returns its result structure, shapes and dtypes. It is
      called once per lowering and platform; it may raise a ValueError to
      refuse a target (the lowering then fails with that error).
    narrowable_args: positional arguments whose f32 arrays a chosen function
      also takes in bfloat16 with the same results (a kernel that reads a
      gradient either way). Where the lowering shows such an array converted
      from bfloat16 in the same function (the weight gradient of a bf16
      matmul), the chosen function reads the bfloat16 array: a Pallas call
      cannot fuse the conversion, which would write the f32 array to HBM
      and read it back (4 + 4 bytes per element, against 2).

  Returns:
    A function with ``default``'s signature. Array leaves of its arguments
    (anywhere in their pytrees) are the primitive's operands; every other
    leaf is static configuration.
  """

  def call(*args, **kwargs):
    leaves, treedef = jax.tree.flatten((args, kwargs))
    positions = tuple(i for i, x in enumerate(leaves) if _is_operand(x))
    operands = [leaves[i] for i in positions]
    static = tuple(None if i in positions else x for i, x in enumerate(leaves))
    avals = [jax.typeof(x) for x in operands]
    jaxpr, out_tree = _default_jaxpr(_Flat(default, treedef, static, positions), avals)
    flat = lambda fn: _Flat(fn, treedef, static, positions, out_tree)
    narrowable = _operands_of(args, narrowable_args, positions)
    outs = by_target_p.bind(
        *operands, jaxpr=jaxpr, choice=_Choice(choose, flat), narrowable=narrowable
    )
    return jax.tree.unflatten(out_tree, outs)

  return call


def _operands_of(args, which: Sequence[int], positions: tuple[int, ...]) -> tuple[int, ...]:
  """The indices, among a call's operands, of the array leaves of positional ``args[which]``."""
  ranges = []
  for k in which:
    if k < len(args):
      start = len(jax.tree.leaves(args[:k]))
      ranges.append(range(start, start + len(jax.tree.leaves(args[k]))))
  return tuple(j for j, leaf in enumerate(positions) if any(leaf in r for r in ranges))


# ---- The primitive. ----

by_target_p = jex_core.Primitive("pallasopt_by_target")
by_target_p.multiple_results = True


@by_target_p.def_impl
def _impl(*operands, jaxpr, choice, narrowable):
  del narrowable
  # An eager call: the chip is the operands' device.
  devices = {d for x in operands if hasattr(x, "devices") for d in x.devices()}
  device = next(iter(devices)) if devices else jax.devices()[0]
  target = Target.of_device(device, partitioned=len(devices) > 1)
  fn = choice(target)
  if fn is None:
    return jex_core.jaxpr_as_fun(jaxpr)(*operands)
  with _device_of(target):
    return fn(*operands)


@by_target_p.def_abstract_eval
def _abstract_eval(*avals, jaxpr, choice, narrowable):
  del avals, choice, narrowable
  return jaxpr.out_avals


@contextlib.contextmanager
def _device_of(target: Target) -> Iterator[None]:
  """The abstract mesh in context names ``target``'s device, as Pallas reads it."""
  mesh = jax.sharding.get_abstract_mesh()
  current = getattr(mesh, "abstract_device", None)
  kind = target.device_kind or BASELINE_DEVICE_KIND.get(target.platform)
  if kind is None or (current is not None and current.device_kind == kind):
    yield
    return
  device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform=target.platform)
  with _compat.use_abstract_device(mesh, device):
    yield


def _default_lowering(ctx, *operands, jaxpr, choice, narrowable):
  del choice, narrowable
  return _compat.lower_in_place(jex_core.jaxpr_as_fun(jaxpr), ctx, *operands)


def _narrowed(ctx, operands, narrowable: tuple[int, ...], fn):
  """``ctx`` and ``operands`` with each narrowable f32 operand read as the bf16 it was converted from.

  Unchanged where no such operand is shown, or where ``fn`` would return
  other types on the bf16 operands.
  """
  narrowed, avals = list(operands), list(ctx.avals_in)
  for i in narrowable:
    source = _compat.widened_from_bfloat16(operands[i])
    if source is not None:
      narrowed[i], avals[i] = source, avals[i].update(dtype=np.dtype(jax.numpy.bfloat16))
  if avals == list(ctx.avals_in):
    return ctx, operands
  out = jax.eval_shape(fn, *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals))
  if [(o.shape, o.dtype) for o in out] != [(a.shape, a.dtype) for a in ctx.avals_out]:
    return ctx, operands
  return ctx.replace(avals_in=avals), narrowed


def _lowering(ctx, *operands, jaxpr, choice, narrowable, platform):
  target = lowering_target(ctx, platform, operands)
  fn = choice(target)
  if fn is None:
    return _default_lowering(ctx, *operands, jaxpr=jaxpr, choice=choice, narrowable=narrowable)
  with _device_of(target):
    ctx, operands = _narrowed(ctx, operands, narrowable, fn)
    return _compat.lower_in_place(fn, ctx, *operands)


# In place, not in a shared private function: the rule reads the shardings
# of operands that are the jitted function's arguments (`Target.layouts`).
_compat.register_inline_lowering(
    by_target_p,
    {platform: functools.partial(_lowering, platform=platform) for platform in _PLATFORMS},
    _default_lowering,
)


def _batching(operands, dims, *, jaxpr, choice, narrowable):
  in_axes = tuple(d if isinstance(d, int) else None for d in dims)  # None: not mapped
  batched = jax.vmap(jex_core.jaxpr_as_fun(jaxpr), in_axes=in_axes)
  new_jaxpr = _compat.trace_to_closed_jaxpr(batched, [jax.typeof(x) for x in operands])
  outs = by_target_p.bind(
      *operands, jaxpr=new_jaxpr, narrowable=narrowable,
      choice=_Choice(choice, functools.partial(jax.vmap, in_axes=in_axes)),
  )
  return outs, [0] * len(outs)


def _jvp(primals, tangents, *, jaxpr, choice, narrowable):
  del choice, narrowable
  tangents = [_compat.instantiate_zeros(t) for t in tangents]
  return jax.jvp(jex_core.jaxpr_as_fun(jaxpr), list(primals), tangents)


_compat.register_batching_and_jvp(by_target_p, _batching, _jvp)
