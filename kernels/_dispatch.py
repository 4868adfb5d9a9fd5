"""Choosing between the Pallas kernels and the XLA reference.

Every kernel family exposes a pure-jnp reference and a Pallas kernel with the
same signature. `dispatch` turns the pair into the one function to call, from
an ``impl`` string:

* ``"auto"``: the best measured path of the *chip the call is compiled for*:
  on TPU the Mosaic kernel, or the reference for operands on which a
  family's kernel moves more bytes than XLA (``auto_on_tpu``); on CUDA GPUs
  the Triton kernel, or the reference for a family whose Triton kernel was
  measured slower than XLA there
  (``auto_on_cuda="xla"``, said in that family's docstring) or that the chip
  cannot run (``cuda_requirement``, e.g. fp8 conversions below sm_89); the
  reference on CPUs and anything else.
* ``"pallas"``: the Mosaic TPU kernel on TPU, the GPU kernel on GPUs (Triton,
  or Mosaic GPU for Newton–Schulz; kernels receive ``backend="triton"`` for
  either); a clear ValueError, raised when the call is lowered, on a platform
  or chip the kernel cannot compile for (a CPU: use ``"interpret"``).
* ``"interpret"``: the Pallas kernel run by the Pallas interpreter, on any
  backend (slow; for tests and debugging), placed when lowered as
  ``"pallas"`` places the compiled kernel.
* ``"xla"``: the reference only.

When the choice is made. Under ``"auto"`` and ``"pallas"`` nothing is decided
while tracing: the call traces the reference for its types and binds one
primitive (`_by_target`) whose lowering rule picks, per platform of the
lowering and for the device kind being compiled for (`_target.Target`), the
kernel or the reference. So plain JAX does the right thing with no context:
``jax.jit`` on CPU runs the reference; ``jax.export(..., platforms=["tpu"])``
from a CPU host carries the TPU kernel; ``platforms=["cpu", "tpu", "cuda"]``
carries each platform's choice in its branch; AOT compilation for a
`jax.experimental.topologies` target chooses by that target's chip. An export
for a platform with no device of it in the lowering assumes the oldest chip
of the platform the kernels support (`_target.BASELINE_DEVICE_KIND`); name
the chip with ``jax.sharding.use_abstract_mesh`` (see the README).

Sharded operands. A ``pallas_call`` is never partitioned by XLA, so a
family marked ``elementwise`` (every element updated on its own) runs per
shard inside `shard_map`, with the layout its operands arrive with, in every
way a step is sharded:

* Explicit mesh axes (``jax.set_mesh``, or arrays whose types carry an
  Explicit sharding with no mesh in context): the operands' types say the
  layout while tracing.
* Auto mesh axes (``jax.set_mesh``), and shardings given to ``jax.jit`` only
  or the legacy ``with mesh:``: XLA lays the operands out, so the layout is
  read when the call is lowered (`_target.Target.layouts`): the sharding of
  the operands that are the jitted function's arguments (the params and
  state of an optimizer step), over the mesh in context or the one that
  sharding names. ``"auto"`` runs the kernel per shard where it would on the
  local shards, else the reference, which XLA partitions.

Where the lowering shows no layout (operands computed inside the step, a
nested jit), ``"auto"`` runs the reference; a kernel ``impl`` runs on
gathered operands if a mesh is in context, else it is a ValueError that says
to use ``jax.set_mesh``. Families whose math crosses elements run the
reference under ``"auto"`` wherever XLA partitions them, and their kernel on
gathered operands under a kernel ``impl``. Inside `shard_map` (all axes
manual) kernels run on the local shards as they are.

The global default is ``"auto"``. `use_impl` overrides it for a block of code,
the ``PALLASOPT_IMPL`` environment variable for a process (read when a kernel
is traced: set it before the process starts); an explicit ``impl`` other than
``"auto"`` always wins. `use_impl` is part of ``jax.jit``'s cache key
(`jax.make_user_context`), so a function traced under one choice is traced
again under another: a jitted function never silently keeps a stale
implementation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Literal, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from pallasopt.kernels import _compat, quant
from pallasopt.kernels._by_target import by_target, by_target_operands, callable_name
from pallasopt.kernels._target import BASELINE_DEVICE_KIND, Target, local_shape

__all__ = [
    "Impl",
    "IMPLS",
    "use_impl",
    "resolve_impl",
    "lowering_platforms",
    "CudaRequirement",
    "FP8_REQUIREMENT",
    "kernel_backend",
    "dispatch",
]

Impl = Literal["auto", "pallas", "interpret", "xla"]
IMPLS: tuple[str, ...] = ("auto", "pallas", "interpret", "xla")
ENV_VAR = "PALLASOPT_IMPL"

# In jax.jit's cache key: changing it retraces.
_impl_override = jax.make_user_context(None)


class KernelFn(Protocol):

  def __call__(self, *args, backend: str, interpret: bool, **kwargs): ...


def _check_impl(impl: object, source: str) -> str:
  if impl not in IMPLS:
    raise ValueError(
        f"{source} must be one of {', '.join(map(repr, IMPLS))}; got {impl!r}."
    )
  return impl  # type: ignore[return-value]


@contextlib.contextmanager
def use_impl(impl: Impl) -> Iterator[None]:
  """Makes ``impl`` the default for every kernel traced inside the block.

  Example::

    with pallasopt.kernels.use_impl("interpret"):
      params, state = step(params, grads, state)  # Pallas interpreter on CPU

  A jitted function called inside and outside the block is traced once for
  each choice.

  Args:
    impl: one of ``"auto"``, ``"pallas"``, ``"interpret"``, ``"xla"``.
  """
  with _impl_override(_check_impl(impl, "use_impl(impl)")):
    yield


def resolve_impl(impl: str = "auto") -> str:
  """Returns the implementation a kernel call with ``impl`` will use.

  An explicit ``impl`` other than ``"auto"`` wins; otherwise the innermost
  `use_impl` block, then ``$PALLASOPT_IMPL``, then ``"auto"``.
  """
  _check_impl(impl, "impl")
  if impl != "auto":
    return impl
  scoped = _impl_override.value
  if scoped is not None:
    return scoped
  from_env = os.environ.get(ENV_VAR)
  if from_env:
    return _check_impl(from_env, f"${ENV_VAR}")
  return "auto"


def lowering_platforms(*platforms: str):
  """Removed: the kernel is now chosen when the call is lowered.

  ``jax.export(..., platforms=[...])`` and AOT compilation carry each
  target's kernels with no context; this raises a ValueError saying so.
  """
  raise ValueError(
      "pallasopt.kernels.lowering_platforms was removed: kernels are chosen when a call is "
      "lowered, for the platform and chip it is lowered for. Export with plain JAX, e.g. "
      "jax.export.export(jax.jit(step), platforms=['tpu', 'cuda'])(*args); to name the chip "
      "of an export, use jax.sharding.use_abstract_mesh with an AbstractDevice (BUILD.md, "
      f"'Export and AOT compilation with plain JAX'). Got lowering_platforms{platforms!r}."
  )


@dataclasses.dataclass(frozen=True)
class CudaRequirement:
  """What a family's GPU kernel needs of an NVIDIA chip.

  Attributes:
    supported: ``(major, minor) -> bool`` over compute capabilities.
    needs: what is needed, for messages (``"compute capability >= 8.9 (fp8
      conversions in Triton)"``).
  """

  supported: Callable[[tuple[int, int]], bool]
  needs: str

  def why_not(self, target: Target) -> str | None:
    """None if ``target`` can run the kernel, else why not."""
    if self.supported(target.cuda_capability):
      return None
    major, minor = target.cuda_capability
    return f"it needs {self.needs}, and compute capability {major}.{minor} lacks it"


# Triton converts to and from float8 only from compute capability 8.9 (Ada,
# Hopper); on an A100 its compiler aborts the process.
FP8_REQUIREMENT = CudaRequirement(
    lambda capability: capability >= (8, 9),
    "compute capability >= 8.9 (fp8 conversions in Triton)",
)


def kernel_backend(
    target: Target,
    impl: str,
    family: str,
    *,
    auto_on_cuda: Literal["pallas", "xla"] = "pallas",
    auto_on_tpu: Literal["pallas", "xla"] = "pallas",
    cuda_requirement: CudaRequirement | None = None,
) -> str | None:
  """The Pallas backend a family's kernel runs with on ``target``, or None for the reference.

  The dispatch policy in one place (module docstring); raises the ValueError
  for an ``impl="pallas"`` that ``target`` cannot take.

  Args:
    target: the lowering's platform and chip.
    impl: ``"auto"`` or ``"pallas"``.
    family: the kernel's name, for messages.
    auto_on_cuda: see `dispatch`.
    auto_on_tpu: what ``"auto"`` runs on this call's operands on a TPU (see
      `dispatch`).
    cuda_requirement: see `dispatch`.
  """
  if target.partitioned:
    if impl == "auto":
      return None
    raise ValueError(
        f"impl='pallas': the {family} kernel cannot run where XLA's partitioner splits the "
        "computation over several devices and neither a mesh in context nor the operands "
        "show how to split it (a Pallas call cannot be partitioned; an elementwise kernel runs "
        "per shard where its operands are arguments of the jitted function or a mesh is set). "
        "Put the mesh in context with jax.set_mesh(mesh), or call the step inside "
        "jax.shard_map; impl='auto' runs the XLA reference there."
    )
  if target.platform == "tpu":
    return "tpu" if impl == "pallas" or auto_on_tpu == "pallas" else None
  if target.platform in ("cuda", "rocm"):
    why_not = (
        cuda_requirement.why_not(target)
        if cuda_requirement is not None and target.platform == "cuda" else None
    )
    if impl == "pallas":
      if why_not is not None:
        raise ValueError(
            f"impl='pallas': the {family} GPU kernel cannot run on {target.chip}: {why_not}. "
            "Use impl='auto' (the XLA reference on this chip) or impl='xla'."
        )
      return "triton"
    if target.platform == "cuda" and auto_on_cuda == "pallas" and why_not is None:
      return "triton"
    return None
  if impl == "auto":
    return None
  raise ValueError(
      f"impl='pallas' cannot run the {family} kernel on platform {target.platform!r}: Pallas "
      "compiles for TPU and GPU only. Use impl='interpret' to run the kernel in the Pallas "
      "interpreter, or 'xla'."
  )


# ---- Kernels under a mesh whose axes are not all manual. ----


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
  leaves = jax.tree.leaves(args)
  leaf = _leaf_shape(leaves)
  specs = (_compat.explicit_spec(x) for x in leaves if tuple(jnp.shape(x)) == leaf)
  return next((s for s in specs if s is not None), PartitionSpec())


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


def _per_shard_lowering(target: Target, operands, call, impl: str, runs_kernel):
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


def _mesh_aware(call, reference, impl: str, elementwise: bool):
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
      return _under_shard_map(bound, mesh, args, layout)
    with jax.sharding.use_abstract_mesh(mesh):
      return _under_shard_map(bound, mesh, args, layout)

  return run


def dispatch(
    reference: Callable[..., object],
    kernel: KernelFn,
    impl: str = "auto",
    *,
    auto_on_cuda: Literal["pallas", "xla"] = "pallas",
    auto_on_tpu: (
        Literal["pallas", "xla"]
        | Callable[[Sequence[jax.Array], Target], Literal["pallas", "xla"]]
    ) = "pallas",
    cuda_requirement: CudaRequirement | None = None,
    elementwise: bool = False,
    narrowable_args: Sequence[int] = (),
) -> Callable[..., object]:
  """Returns the function that runs a kernel family as ``impl`` asks.

  Args:
    reference: the pure-jnp implementation.
    kernel: the Pallas implementation; takes the reference's arguments plus
      keyword-only ``backend`` (``"tpu"`` or ``"triton"``) and ``interpret``.
    impl: see the module docstring.
    auto_on_cuda: what ``"auto"`` runs on a CUDA GPU: the Triton kernel
      (``"pallas"``) or the reference (``"xla"``), for a family whose Triton
      kernel is slower than XLA there. ``impl="pallas"`` still runs Triton.
    auto_on_tpu: what ``"auto"`` runs on a TPU, ``"pallas"`` or ``"xla"``
      (for a family whose kernel moves more bytes than XLA there), or a
      function of the call's array leaves (their local shards when the call
      runs per shard) and the `Target` that says which (for a family whose
      kernel pays only on some shapes, modes or TPU generations).
    cuda_requirement: what the GPU kernel needs of the chip; on a chip
      without it ``"auto"`` runs the reference and ``"pallas"`` raises.
    elementwise: every output element depends only on the same element of
      the array operands, so the kernel may run per shard.
    narrowable_args: positional arguments the kernel reads in bfloat16 as
      well as f32, with the same results (`_by_target.by_target`): where the
      step converts them from bfloat16 (a bf16 matmul's weight gradient),
      the kernel reads the bfloat16 array.
  """
  if auto_on_cuda not in ("pallas", "xla"):
    raise ValueError(f"auto_on_cuda must be 'pallas' or 'xla'; got {auto_on_cuda!r}.")
  if not callable(auto_on_tpu) and auto_on_tpu not in ("pallas", "xla"):
    raise ValueError(f"auto_on_tpu must be 'pallas', 'xla' or a function; got {auto_on_tpu!r}.")
  impl = resolve_impl(impl)
  if impl == "xla":
    return reference
  family = callable_name(kernel).removesuffix("_kernel")
  interpreted = functools.partial(kernel, backend="tpu", interpret=True)

  def call(*args, **kwargs):
    requirement = cuda_requirement
    fp8 = lambda x: hasattr(x, "dtype") and quant.is_float8(x.dtype)
    if requirement is None and any(map(fp8, jax.tree.leaves((args, kwargs)))):
      requirement = FP8_REQUIREMENT

    operands = by_target_operands(args, kwargs)

    def backend_for(target: Target, arrays: Sequence[object]) -> str | None:
      on_tpu = auto_on_tpu(arrays, target) if callable(auto_on_tpu) else auto_on_tpu
      return kernel_backend(
          target, impl, family, auto_on_cuda=auto_on_cuda, auto_on_tpu=on_tpu,
          cuda_requirement=requirement,
      )

    def choose(target: Target):
      if target.partitioned and elementwise:
        runs_kernel = lambda t, arrays: backend_for(t, arrays) is not None
        per_shard = _per_shard_lowering(target, operands, call, impl, runs_kernel)
        if per_shard is not None:
          return per_shard
      if impl == "interpret":
        return interpreted
      backend = backend_for(target, operands)
      return None if backend is None else functools.partial(
          kernel, backend=backend, interpret=False
      )

    return by_target(reference, choose, narrowable_args=narrowable_args)(*args, **kwargs)

  return _mesh_aware(call, reference, impl, elementwise)
