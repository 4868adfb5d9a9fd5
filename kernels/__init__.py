"""Array-level optimizer kernels: a pure-jnp reference and a Pallas kernel each.

This layer knows arrays, not pytrees or Optax. Every family module exposes a
reference (the XLA path), a Pallas kernel with the same signature, and
dispatching entry points that take ``impl="auto" | "pallas" | "interpret" |
"xla"`` (see `use_impl`).
"""

from pallasopt.kernels._dispatch import IMPLS, Impl, resolve_impl, use_impl
from pallasopt.kernels._tiling import TilePlan, plan_tiles
from pallasopt.kernels.adamw import (
    AdamWScalars,
    adamw_apply,
    adamw_kernel,
    adamw_reference,
    adamw_scalars,
    adamw_updates,
)

__all__ = [
    "IMPLS",
    "Impl",
    "resolve_impl",
    "use_impl",
    "TilePlan",
    "plan_tiles",
    "AdamWScalars",
    "adamw_apply",
    "adamw_kernel",
    "adamw_reference",
    "adamw_scalars",
    "adamw_updates",
]
