"""Optax transforms backed by pallasopt's fused kernels.

Every transform here is a drop-in for its Optax counterpart: same arguments
(plus keyword-only ``impl``), same state tree, and it composes with
``optax.chain``, ``optax.masked``, ``optax.MultiSteps`` and
``optax.inject_hyperparams``. `apply_gradients` runs the fused in-place path;
`multi_steps` is ``optax.MultiSteps`` (its arguments and state) with its
per-call select between the stepped and the kept state done inside the
kernels, so that accumulating gradients around low-bit state copies nothing;
`clipped` is ``optax.chain(optax.clip_by_global_norm(c), tx)`` (its state)
with the clip factor applied inside ``tx``'s kernels.

=====================  ======================================
pallasopt              counterpart
=====================  ======================================
`adamw`, `nadamw`      ``optax.adamw``, ``optax.nadamw``
`lion`                 ``optax.lion``
`rmsprop`              ``optax.rmsprop``
`mars`                 eFormer's ``mars`` (``_tx.mars``)
`adafactor`            ``optax.adafactor``
`muon`                 ``optax.contrib.muon``
`kron`                 psgd_jax 0.2.9 ``kron``
`quad`, `skew`         eFormer's White-Kron ``quad``, ``skew``
=====================  ======================================

eFormer's layer is `pallasopt.optim.eformer` (as ``eformer.optimizers``):
its factory (`eformer.OptimizerFactory`, the builders, registries and
configs) builds these transforms with eFormer's calls, chain and state tree,
and its stage-local path (``apply_gradients_stage_local``) updates one
pipeline stage's params from its own gradients with the same fused kernels.

Low-bit state: the elementwise optimizers take ``state_format="bf16"``,
``"int8"``, ``"fp8"`` or ``"int4"`` (moments in bfloat16 with stochastic
rounding, or blockwise codes) and ``param_rounding="stochastic"`` for bfloat16 params;
`convert_state` switches a state between formats.
"""

from pallasopt.kernels.quant import (
    DynamicInt8Blockwise, Fp8Blockwise, Int4Blockwise, Int8Blockwise, Int8RatioBlockwise,
    RatioBlockwise, RootBlockwise,
)
from pallasopt.optim._base import FusedGradientTransformation, FusedUpdate, apply_gradients, fused_update
from pallasopt.optim.adafactor import ADAFACTOR_STATIC_ARGS, adafactor
from pallasopt.optim.adamw import adamw, nadamw
from pallasopt.optim.clip import clipped
from pallasopt.optim.kron import KRON_STATIC_ARGS, kron, precond_update_prob_schedule, scale_by_kron
from pallasopt.optim.lion import lion
from pallasopt.optim.mars import ScaleByMarsState, mars, scale_by_mars
from pallasopt.optim.multi_steps import multi_steps
from pallasopt.optim.rmsprop import rmsprop
from pallasopt.optim.state_formats import convert_state, legacy_state_structure
from pallasopt.optim._types import MaskOrFn, Numeric, ScalarOrSchedule
from pallasopt.optim.white_kron import quad, scale_by_quad, scale_by_skew, skew
from pallasopt.optim.muon import (
    MUON_STATIC_ARGS,
    MuonDimensionNumbers,
    MuonSecondMomentState,
    MuonState,
    muon,
)
__all__ = [
    "FusedGradientTransformation",
    "FusedUpdate",
    "apply_gradients",
    "fused_update",
    "multi_steps",
    "clipped",
    "convert_state",
    "legacy_state_structure",
    "Int8Blockwise",
    "Fp8Blockwise",
    "Int4Blockwise",
    "RootBlockwise",
    "RatioBlockwise",
    "Int8RatioBlockwise",
    "DynamicInt8Blockwise",
    # Type aliases of the signatures.
    "ScalarOrSchedule",
    "Numeric",
    "MaskOrFn",
    # Drop-ins.
    "adafactor",
    "adamw",
    "kron",
    "lion",
    "muon",
    "nadamw",
    "rmsprop",
    "mars",
    "scale_by_mars",
    "ScaleByMarsState",
    "scale_by_kron",
    "quad",
    "skew",
    "scale_by_quad",
    "scale_by_skew",
    "ADAFACTOR_STATIC_ARGS",
    "precond_update_prob_schedule",
    "KRON_STATIC_ARGS",
    "MUON_STATIC_ARGS",
    "MuonDimensionNumbers",
    "MuonSecondMomentState",
    "MuonState",
    "eformer",
]

from pallasopt.optim import eformer  # noqa: E402  (after the drop-ins it builds)


def __getattr__(name: str):
  # eFormer's names lived here until 2026-11-26: say where they went.
  if name in eformer.__all__:
    raise AttributeError(
        f"pallasopt.optim.{name} moved to pallasopt.optim.eformer.{name} (eFormer's layer is "
        "its own package): import it from there."
    )
  raise AttributeError(f"module 'pallasopt.optim' has no attribute {name!r}")
