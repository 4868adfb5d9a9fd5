"""Choosing between the Pallas kernels and the XLA reference.

Every kernel family exposes a pure-jnp reference and a Pallas kernel with the
same signature. `dispatch` turns the pair into the one function to call, from
an ``impl`` string:

* ``"auto"``: the best measured path of the *chip the call is compiled for*,
  as the family's row of `pallasopt.kernels.policy` says for that platform
  (the one place the measured rules live: on TPU the Mosaic kernel where it
  moves fewer bytes than XLA in a train step, on CUDA GPUs the Triton kernel
  where XLA was not faster), unless the chip cannot run the kernel
  (``cuda_requirement``, e.g. fp8 conversions below sm_89); the reference on
  CPUs and anything else.
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
the chip with ``jax.sharding.use_abstract_mesh`` (docs/guides/implementation.md).

Sharded operands (`pallasopt.kernels._per_shard`). A ``pallas_call`` is never
partitioned by XLA, so a family marked ``elementwise`` (every element updated
on its own) runs per shard inside `shard_map`, with the layout its operands
arrive with, in every way a step is sharded:

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
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Literal, Protocol

import jax

from pallasopt.kernels import policy, quant
from pallasopt.kernels._by_target import by_target, by_target_operands, callable_name
from pallasopt.kernels._per_shard import mesh_aware, per_shard_lowering
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
    auto: policy.Choice = "pallas",
    cuda_requirement: CudaRequirement | None = None,
) -> str | None:
  """The Pallas backend a family's kernel runs with on ``target``, or None for the reference.

  Applies what a chip can run and where a kernel can be placed to the
  policy's choice; raises the ValueError for an ``impl="pallas"`` that
  ``target`` cannot take.

  Args:
    target: the lowering's platform and chip.
    impl: ``"auto"`` or ``"pallas"``.
    family: the kernel's name, for messages.
    auto: what `policy.auto_choice` says ``"auto"`` runs on this target and
      call: ``"pallas"`` or ``"xla"``.
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
    return "tpu" if impl == "pallas" or auto == "pallas" else None
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
    if target.platform == "cuda" and auto == "pallas" and why_not is None:
      return "triton"
    return None
  if impl == "auto":
    return None
  raise ValueError(
      f"impl='pallas' cannot run the {family} kernel on platform {target.platform!r}: Pallas "
      "compiles for TPU and GPU only. Use impl='interpret' to run the kernel in the Pallas "
      "interpreter, or 'xla'."
  )


def dispatch(
    reference: Callable[..., object],
    kernel: KernelFn,
    impl: str = "auto",
    *,
    family: str,
    cuda_requirement: CudaRequirement | None = None,
    kernel_takes: bool = True,
    elementwise: bool = False,
    narrowable_args: Sequence[int] = (),
) -> Callable[..., object]:
  """Returns the function that runs a kernel family as ``impl`` asks.

  Args:
    reference: the pure-jnp implementation.
    kernel: the Pallas implementation; takes the reference's arguments plus
      keyword-only ``backend`` (``"tpu"`` or ``"triton"``) and ``interpret``.
    impl: see the module docstring.
    family: the family's row of the auto policy (`policy.FAMILIES`): what
      ``"auto"`` runs on each target, read when the call is lowered with its
      array leaves (their local shards when it runs per shard).
    cuda_requirement: what the GPU kernel needs of the chip; on a chip
      without it ``"auto"`` runs the reference and ``"pallas"`` raises.
    kernel_takes: false where the kernel cannot take the call's operands
      on any chip (blockwise state with a ragged last block): every ``impl``
      then runs the reference, which computes the same values.
    elementwise: every output element depends only on the same element of
      the array operands, so the kernel may run per shard.
    narrowable_args: positional arguments the kernel reads in bfloat16 as
      well as f32, with the same results (`_by_target.by_target`): where the
      step converts them from bfloat16 (a bf16 matmul's weight gradient),
      the kernel reads the bfloat16 array.
  """
  if family not in policy.FAMILIES:
    raise ValueError(f"family must be one of {policy.FAMILIES}; got {family!r}.")
  impl = resolve_impl(impl)
  if impl == "xla" or not kernel_takes:
    return reference
  name = callable_name(kernel).removesuffix("_kernel")
  interpreted = functools.partial(kernel, backend="tpu", interpret=True)

  def call(*args, **kwargs):
    requirement = cuda_requirement
    fp8 = lambda x: hasattr(x, "dtype") and quant.is_float8(x.dtype)
    if requirement is None and any(map(fp8, jax.tree.leaves((args, kwargs)))):
      requirement = FP8_REQUIREMENT

    operands = by_target_operands(args, kwargs)

    def backend_for(target: Target, arrays: Sequence[object]) -> str | None:
      auto = policy.auto_choice(family, arrays, target) if impl == "auto" else "pallas"
      return kernel_backend(target, impl, name, auto=auto, cuda_requirement=requirement)

    def choose(target: Target):
      if target.partitioned and elementwise:
        runs_kernel = lambda t, arrays: backend_for(t, arrays) is not None
        per_shard = per_shard_lowering(target, operands, call, impl, runs_kernel)
        if per_shard is not None:
          return per_shard
      if impl == "interpret":
        return interpreted
      backend = backend_for(target, operands)
      return None if backend is None else functools.partial(
          kernel, backend=backend, interpret=False
      )

    return by_target(reference, choose, narrowable_args=narrowable_args)(*args, **kwargs)

  return mesh_aware(call, reference, impl, elementwise)
