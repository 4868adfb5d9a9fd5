"""Choosing between the Pallas kernels and the XLA reference.

Every kernel family exposes a pure-jnp reference and a Pallas kernel with the
same signature. `dispatch` turns the pair into the one function to call, from
an ``impl`` string:

* ``"auto"``: one traced function that carries the Mosaic TPU kernel, the
  Triton kernel and the XLA reference, picked per platform by
  `jax.lax.platform_dependent` when it is lowered. CPUs run the reference; so
  do CUDA GPUs for a family whose Triton kernel was measured slower than XLA
  there (``auto_on_cuda="xla"``, said in that family's docstring).
* ``"pallas"``: the Mosaic TPU kernel on TPU, the Triton kernel elsewhere
  (lowering fails with JAX's own error on a platform Pallas cannot compile for).
* ``"interpret"``: the Pallas kernel run by the Pallas interpreter, on any
  backend (slow; for tests and debugging).
* ``"xla"``: the reference only.

The global default is ``"auto"``. It can be overridden for a block of code with
`use_impl` or for a process with the ``PALLASOPT_IMPL`` environment variable;
an explicit ``impl`` other than ``"auto"`` always wins. The choice is made
while tracing, so a function already jitted keeps the choice it was traced
with.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Callable, Iterator
from typing import Literal, Protocol

import jax

__all__ = ["Impl", "IMPLS", "use_impl", "resolve_impl", "dispatch"]

Impl = Literal["auto", "pallas", "interpret", "xla"]
IMPLS: tuple[str, ...] = ("auto", "pallas", "interpret", "xla")
ENV_VAR = "PALLASOPT_IMPL"

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "pallasopt_impl", default=None
)


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

  Args:
    impl: one of ``"auto"``, ``"pallas"``, ``"interpret"``, ``"xla"``.
  """
  token = _override.set(_check_impl(impl, "use_impl(impl)"))
  try:
    yield
  finally:
    _override.reset(token)


def resolve_impl(impl: str = "auto") -> str:
  """Returns the implementation a kernel call with ``impl`` will use.

  An explicit ``impl`` other than ``"auto"`` wins; otherwise the innermost
  `use_impl` block, then ``$PALLASOPT_IMPL``, then ``"auto"``.
  """
  _check_impl(impl, "impl")
  if impl != "auto":
    return impl
  scoped = _override.get()
  if scoped is not None:
    return scoped
  from_env = os.environ.get(ENV_VAR)
  if from_env:
    return _check_impl(from_env, f"${ENV_VAR}")
  return "auto"


def dispatch(
    reference: Callable[..., object],
    kernel: KernelFn,
    impl: str = "auto",
    *,
    auto_on_cuda: Literal["pallas", "xla"] = "pallas",
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
  """
  if auto_on_cuda not in ("pallas", "xla"):
    raise ValueError(f"auto_on_cuda must be 'pallas' or 'xla'; got {auto_on_cuda!r}.")
  impl = resolve_impl(impl)
  if impl == "xla":
    return reference

  if impl == "interpret":
    return functools.partial(kernel, backend="tpu", interpret=True)

  mosaic = functools.partial(kernel, backend="tpu", interpret=False)
  triton = functools.partial(kernel, backend="triton", interpret=False)

  def by_platform(*args, **kwargs):
    # platform_dependent passes only positional operands to its branches; the
    # keywords are static configuration, bound into every branch.
    bind = lambda fn: functools.partial(fn, **kwargs)
    if impl == "auto":
      cuda = triton if auto_on_cuda == "pallas" else reference
      return jax.lax.platform_dependent(
          *args, tpu=bind(mosaic), cuda=bind(cuda), default=bind(reference)
      )
    return jax.lax.platform_dependent(*args, tpu=bind(mosaic), default=bind(triton))

  return by_platform
