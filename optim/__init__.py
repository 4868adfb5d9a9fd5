"""Optax transforms backed by pallasopt's fused kernels.

Every transform here is a drop-in for its Optax counterpart: same arguments
(plus keyword-only ``impl``), same state tree, and it composes with
``optax.chain``, ``optax.masked``, ``optax.MultiSteps`` and
``optax.inject_hyperparams``. `apply_gradients` runs the fused in-place path.
"""

from pallasopt.optim._base import FusedGradientTransformation, apply_gradients
from pallasopt.optim.adamw import adamw, nadamw

__all__ = ["FusedGradientTransformation", "apply_gradients", "adamw", "nadamw"]
