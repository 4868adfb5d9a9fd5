"""Choosing between the Pallas kernels and the XLA reference.

Every kernel family exposes a pure-jnp reference and a Pallas kernel with the
same signature. `dispatch` turns the pair into the one function to call, from
an ``impl`` string:

* ``"auto"``: the best measured path of each *target platform*: the Mosaic
  kernel on TPU; on CUDA GPUs the Triton kernel, or the reference for a family
  whose Triton kernel was measured slower than XLA there
  (``auto_on_cuda="xla"``, said in that family's docstring); the reference on
  CPUs and anything else.
* ``"pallas"``: the Mosaic TPU kernel on TPU, the GPU kernel on GPUs (Triton,
  or Mosaic GPU for Newton–Schulz; kernels receive ``backend="triton"`` for
  either); a clear error on a platform Pallas cannot compile for (a CPU: use
  ``"interpret"``).
* ``"interpret"``: the Pallas kernel run by the Pallas interpreter, on any
  backend (slow; for tests and debugging).
* ``"xla"``: the reference only.

Target platforms. Only the branches of the platforms a computation is traced
for are traced at all, so a CPU run never traces a TPU or GPU kernel (whose
block specs, mesh rules and trace time it would pay for nothing). The targets
are, first to last: the innermost `lowering_platforms` block (use it to
``jax.export`` for other platforms from this host, e.g. ``("tpu", "cuda")``
for one artifact carrying both; several targets are chosen between by
`jax.lax.platform_dependent` when lowered), the platform of the abstract mesh's
device when JAX supplies one, else the platform of the default backend.

Sharded operands. A ``pallas_call`` is never partitioned by XLA and may not
be traced under a mesh whose axes are not all manual (``jax.set_mesh`` with
Explicit or Auto axes). There, a family marked ``elementwise`` runs its kernel
per shard inside `shard_map` (exact: every element is updated on its own),
with each operand's own sharding; any other family runs its reference under
``"auto"`` (XLA partitions it) and, under an explicit kernel ``impl``, its
kernel on gathered operands. Inside `shard_map` (all axes manual) kernels run
on the local shards as they are.

The global default is ``"auto"``. `use_impl` overrides it for a block of code,
the ``PALLASOPT_IMPL`` environment variable for a process (read when a kernel
is traced: set it before the process starts); an explicit ``impl`` other than
``"auto"`` always wins. `use_impl` and `lowering_platforms` are part of
``jax.jit``'s cache key (`jax.make_user_context`), so a function traced under
one choice is traced again under another: a jitted function never silently
keeps a stale implementation.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Literal, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from pallasopt.kernels import _compat

__all__ = [
    "Impl",
    "IMPLS",
    "PLATFORMS",
    "use_impl",
    "resolve_impl",
    "lowering_platforms",
    "target_platforms",
    "dispatch",
]

Impl = Literal["auto", "pallas", "interpret", "xla"]
IMPLS: tuple[str, ...] = ("auto", "pallas", "interpret", "xla")
# Platform names as `jax.lax.platform_dependent` and `jax.export` spell them.
PLATFORMS: tuple[str, ...] = ("cpu", "cuda", "rocm", "tpu")
ENV_VAR = "PALLASOPT_IMPL"

# Both are in jax.jit's cache key: changing either retraces.
_impl_override = jax.make_user_context(None)
_platform_override = jax.make_user_context(None)


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


@contextlib.contextmanager
def lowering_platforms(*platforms: str) -> Iterator[None]:
  """Traces kernels for ``platforms`` inside the block, whatever this host is.

  For cross-platform export::

    with pallasopt.kernels.lowering_platforms("tpu", "cuda"):
      exported = jax.export.export(jax.jit(step), platforms=["tpu", "cuda"])(*args)

  Args:
    platforms: names from `PLATFORMS`; with several, `impl="auto"` carries one
      branch each and `jax.lax.platform_dependent` picks when lowering.
  """
  if not platforms or any(p not in PLATFORMS for p in platforms):
    raise ValueError(
        f"lowering_platforms(*platforms) takes names from {PLATFORMS}; got {platforms!r}."
    )
  platforms = tuple(dict.fromkeys(platforms))
  with contextlib.ExitStack() as stack:
    stack.enter_context(_platform_override(platforms))
    if len(platforms) == 1 and platforms[0] in ("tpu", "cuda"):
      # jax >= 0.11 reads the target device from the abstract mesh.
      stack.enter_context(_compat.lowering_platform(platforms[0]))
    yield


def _backend_platform() -> str:
  platform = jax.devices()[0].client.platform
  return "cuda" if platform == "gpu" else platform


def target_platforms() -> tuple[str, ...]:
  """The platforms kernels are traced for now (see the module docstring)."""
  scoped = _platform_override.value
  if scoped is not None:
    return scoped
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if device is not None and getattr(device, "platform", None) in PLATFORMS:
    return (device.platform,)
  return (_backend_platform(),)


def _platform_branch(platform, impl, reference, mosaic, triton, auto_on_cuda):
  if platform == "tpu":
    return mosaic
  if platform in ("cuda", "rocm"):
    if impl == "pallas" or (platform == "cuda" and auto_on_cuda == "pallas"):
      return triton
    return reference
  if impl == "auto":
    return reference
  raise ValueError(
      f"impl='pallas' cannot run on platform {platform!r}: Pallas compiles for TPU and GPU "
      "only. Use impl='interpret' to run the kernel in the Pallas interpreter, or 'xla'."
  )


# ---- Kernels under a mesh whose axes are not all manual. ----


def _non_manual_mesh():
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.are_all_axes_manual:
    return None
  return mesh


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


def _mesh_aware(kernel_fn, reference, impl: str, elementwise: bool):
  """``kernel_fn`` made legal under a non-manual mesh (module docstring)."""

  def run(*args, **kwargs):
    mesh = _non_manual_mesh()
    if mesh is None:
      return kernel_fn(*args, **kwargs)
    if not elementwise and impl == "auto":
      return reference(*args, **kwargs)
    bound = lambda *a: kernel_fn(*a, **kwargs)
    return _under_shard_map(bound, mesh, args, per_shard=elementwise)

  return run


def dispatch(
    reference: Callable[..., object],
    kernel: KernelFn,
    impl: str = "auto",
    *,
    auto_on_cuda: Literal["pallas", "xla"] = "pallas",
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
    elementwise: every output element depends only on the same element of
      the array operands, so the kernel may run per shard.
  """
  if auto_on_cuda not in ("pallas", "xla"):
    raise ValueError(f"auto_on_cuda must be 'pallas' or 'xla'; got {auto_on_cuda!r}.")
  impl = resolve_impl(impl)
  if impl == "xla":
    return reference
  kernel_for = lambda backend, interpret: _mesh_aware(
      functools.partial(kernel, backend=backend, interpret=interpret), reference, impl,
      elementwise,
  )
  if impl == "interpret":
    return kernel_for("tpu", True)

  mosaic, triton = kernel_for("tpu", False), kernel_for("triton", False)
  branches = {
      platform: _platform_branch(platform, impl, reference, mosaic, triton, auto_on_cuda)
      for platform in target_platforms()
  }
  if len(set(branches.values())) == 1:
    return next(iter(branches.values()))

  def by_platform(*args, **kwargs):
    # platform_dependent passes only positional operands to its branches; the
    # keywords are static configuration, bound into every branch.
    bound = {p: functools.partial(fn, **kwargs) for p, fn in branches.items()}
    return jax.lax.platform_dependent(*args, **bound)

  return by_platform
