"""Array-level optimizer kernels: a pure-jnp reference and a Pallas kernel each.

This layer knows arrays, not pytrees or Optax. Every family module exposes a
reference (the XLA path), a Pallas kernel with the same signature, and
dispatching entry points that take ``impl="auto" | "pallas" | "interpret" |
"xla"`` (see `use_impl`):

* `pallasopt.kernels.adamw`: fused AdamW / NAdamW (apply and updates modes);
* `pallasopt.kernels.lion`: fused Lion;
* `pallasopt.kernels.mars`: fused MARS (variance-reduced AdamW, eFormer's);
* `pallasopt.kernels.rmsprop`: fused RMSProp (centered, bias-corrected and
  with momentum, as Optax chains it);
* `pallasopt.kernels.adafactor`: factored second moments, update clipping,
  parameter scale and momentum in two passes over the gradient;
* `pallasopt.kernels.newton_schulz`: batched Newton–Schulz orthogonalization
  (Muon; entry point ``newton_schulz.newton_schulz``): on TPU resident on
  chip for small matrices, symmetric tiled matmuls for large ones; on CUDA a
  Mosaic GPU ``wgmma`` Gram kernel for bf16 iterates;
* `pallasopt.kernels.muon_momentum`: Muon's momentum step on blockwise
  (8- and 4-bit) state, decoded, stepped and re-encoded in one pass;
* `pallasopt.kernels.gram`: symmetric Gram matrices ``X Xᵀ``, upper blocks
  only (Newton–Schulz's symmetric products): a block recursion in XLA and a
  Mosaic GPU ``wgmma`` kernel;
* `pallasopt.kernels.kron` and `pallasopt.kernels.kron_factor`: PSGD Kron
  preconditioner application and factor update;
* `pallasopt.kernels.quant`: low-precision state shared by every family:
  8-bit and 4-bit blockwise codes (`codecs`), hashed random bits and
  stochastic rounding (`rounding`).

What ``impl="auto"`` runs on each target is one table per platform,
`pallasopt.kernels.policy`; `pallasopt.kernels._dispatch` applies it.
"""

from pallasopt.kernels import (
    adafactor,
    adamw,
    gram,
    kron,
    kron_factor,
    lion,
    mars,
    muon_momentum,
    newton_schulz,
    policy,
    quant,
    rmsprop,
)
from pallasopt.kernels._dispatch import (
    IMPLS,
    Impl,
    lowering_platforms,
    resolve_impl,
    use_impl,
)
from pallasopt.kernels._tiling import BlockPlan, leaf_view, plan_blocks
from pallasopt.kernels.adamw import (
    AdamWScalars,
    adamw_apply,
    adamw_kernel,
    adamw_reference,
    adamw_scalars,
    adamw_updates,
)
from pallasopt.kernels.kron import KronScalars, kron_precondition, kron_scalars, norm_lower_bound
from pallasopt.kernels.kron_factor import kron_factor_update
from pallasopt.kernels.lion import (
    LionScalars,
    lion_apply,
    lion_kernel,
    lion_reference,
    lion_scalars,
    lion_updates,
)
from pallasopt.kernels.newton_schulz import newton_schulz_kernel, newton_schulz_reference
from pallasopt.kernels.ns_coefficients import PRESETS, coefficient_table, preset_table

__all__ = [
    "IMPLS",
    "Impl",
    "resolve_impl",
    "use_impl",
    "lowering_platforms",
    "BlockPlan",
    "leaf_view",
    "plan_blocks",
    # Family modules.
    "adafactor",
    "adamw",
    "gram",
    "kron",
    "kron_factor",
    "lion",
    "mars",
    "newton_schulz",
    "policy",
    "quant",
    "rmsprop",
    # AdamW.
    "AdamWScalars",
    "adamw_apply",
    "adamw_kernel",
    "adamw_reference",
    "adamw_scalars",
    "adamw_updates",
    # Lion.
    "LionScalars",
    "lion_apply",
    "lion_kernel",
    "lion_reference",
    "lion_scalars",
    "lion_updates",
    # Newton–Schulz.
    "PRESETS",
    "coefficient_table",
    "newton_schulz_kernel",
    "newton_schulz_reference",
    "preset_table",
    # Kron.
    "KronScalars",
    "kron_factor_update",
    "kron_precondition",
    "kron_scalars",
    "norm_lower_bound",
]
