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
  backend (slow; for tests and debugging).
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

Sharded operands. A ``pallas_call`` is never partitioned by XLA. Under a mesh
whose axes are not all manual, in context (``jax.set_mesh``) or, with none in
context, in the operands' types (arrays sharded over Explicit axes), a family
marked ``elementwise`` runs per shard inside `shard_map` (exact: every element is
updated on its own) where the operands' types carry their layout (Explicit
axes); with Auto axes the layout is XLA's to choose, so ``"auto"`` runs the
reference, and so does any other family under ``"auto"`` (XLA partitions
it). An explicit kernel ``impl`` runs the kernel on gathered operands there.
Where no mesh is in context but XLA partitions the computation (``jax.jit``
with shardings only, the legacy ``with mesh:``), ``"auto"`` lowers the
reference and ``"pallas"`` is a ValueError that says to use ``jax.set_mesh``.
Inside `shard_map` (all axes manual) kernels run on the local shards as they
are.

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
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Literal, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from pallasopt.kernels import _compat, quant
from pallasopt.kernels._by_target import by_target, callable_name
from pallasopt.kernels._target import Target

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
        "computation over several devices (jax.jit with shardings and no mesh in context, or "
        "the legacy `with mesh:`): a Pallas call cannot be partitioned. Put the mesh in "
        "context with jax.set_mesh(mesh) (the kernel then runs on each local shard) or call "
        "the step inside jax.shard_map; impl='auto' runs the XLA reference there."
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


def _under_shard_map(fn, mesh, args: Sequence[object], *, per_shard: bool):
  """Runs ``fn(*args)`` in `shard_map` over ``mesh``'s non-manual axes.

  ``per_shard``: the array operands (one shape) are laid out like the first
  one that is sharded, and so are the outputs (an elementwise kernel);
  otherwise every operand is gathered and the outputs are replicated.
  """
  leaves, treedef = jax.tree.flatten(args)
  ranked = [x for x in leaves if jnp.ndim(x) > 0]
  specs = [_compat.explicit_spec(x) for x in ranked] if per_shard else []
  layout = next((s for s in specs if s is not None), PartitionSpec())
  placed = [
      jax.sharding.reshard(x, layout)
      if jnp.ndim(x) > 0 and (_compat.explicit_spec(x) or PartitionSpec()) != layout else x
      for x in leaves
  ]
  in_specs = tuple(layout if jnp.ndim(x) > 0 else PartitionSpec() for x in leaves)
  axes = frozenset(a for a in mesh.axis_names if a not in mesh.manual_axes)

  def local(*flat):
    return fn(*jax.tree.unflatten(treedef, flat))

  mapped = _compat.shard_map(
      local, mesh=mesh, in_specs=in_specs, out_specs=layout, axis_names=axes, check_vma=False,
  )
  return mapped(*placed)


def _layouts_known(mesh) -> bool:
  """Whether the operands' types carry their layout over ``mesh``'s free axes."""
  return all(
      t == jax.sharding.AxisType.Explicit
      for name, t in zip(mesh.axis_names, mesh.axis_types)
      if name not in mesh.manual_axes
  )


def _mesh_aware(call, reference, impl: str, elementwise: bool):
  """``call`` made legal under a non-manual mesh (module docstring)."""

  def run(*args, **kwargs):
    mesh, in_context = _non_manual_mesh(args)
    if mesh is None:
      return call(*args, **kwargs)
    per_shard = elementwise and _layouts_known(mesh)
    if impl == "auto" and not per_shard:
      return reference(*args, **kwargs)
    bound = lambda *a: call(*a, **kwargs)
    if in_context:
      return _under_shard_map(bound, mesh, args, per_shard=per_shard)
    with jax.sharding.use_abstract_mesh(mesh):
      return _under_shard_map(bound, mesh, args, per_shard=per_shard)

  return run


def dispatch(
    reference: Callable[..., object],
    kernel: KernelFn,
    impl: str = "auto",
    *,
    auto_on_cuda: Literal["pallas", "xla"] = "pallas",
    auto_on_tpu: (
        Literal["pallas", "xla"] | Callable[[Sequence[jax.Array]], Literal["pallas", "xla"]]
    ) = "pallas",
    cuda_requirement: CudaRequirement | None = None,
    elementwise: bool = False,
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
      runs per shard) that says which (for a family whose kernel pays only on
      some shapes or modes).
    cuda_requirement: what the GPU kernel needs of the chip; on a chip
      without it ``"auto"`` runs the reference and ``"pallas"`` raises.
    elementwise: every output element depends only on the same element of
      the array operands, so the kernel may run per shard.
  """
  if auto_on_cuda not in ("pallas", "xla"):
    raise ValueError(f"auto_on_cuda must be 'pallas' or 'xla'; got {auto_on_cuda!r}.")
  if not callable(auto_on_tpu) and auto_on_tpu not in ("pallas", "xla"):
    raise ValueError(f"auto_on_tpu must be 'pallas', 'xla' or a function; got {auto_on_tpu!r}.")
  impl = resolve_impl(impl)
  if impl == "xla":
    return reference
  if impl == "interpret":
    interpreted = functools.partial(kernel, backend="tpu", interpret=True)
    return _mesh_aware(interpreted, reference, impl, elementwise)
  family = callable_name(kernel).removesuffix("_kernel")

  def call(*args, **kwargs):
    requirement = cuda_requirement
    fp8 = lambda x: hasattr(x, "dtype") and quant.is_float8(x.dtype)
    if requirement is None and any(map(fp8, jax.tree.leaves((args, kwargs)))):
      requirement = FP8_REQUIREMENT

    arrays = [x for x in jax.tree.leaves((args, kwargs)) if hasattr(x, "shape")]
    on_tpu = auto_on_tpu(arrays) if callable(auto_on_tpu) else auto_on_tpu

    def choose(target: Target):
      backend = kernel_backend(
          target, impl, family, auto_on_cuda=auto_on_cuda, auto_on_tpu=on_tpu,
          cuda_requirement=requirement,
      )
      return None if backend is None else functools.partial(
          kernel, backend=backend, interpret=False
      )

    return by_target(reference, choose)(*args, **kwargs)

  return _mesh_aware(call, reference, impl, elementwise)


