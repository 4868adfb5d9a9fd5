"""pallasopt: fused Pallas optimizer kernels as drop-in Optax transforms.

Subpackages:
  * `pallasopt.kernels`: per-family array kernels (a pure-jnp reference and a
    Pallas kernel with the same signature) and the shared tiling/dispatch
    machinery.
  * `pallasopt.optim`: Optax `GradientTransformation`s built on the kernels,
    state-compatible with their Optax counterparts, plus the fused
    `apply_gradients` path.
  * `pallasopt.pipeline`: the circular pipeline schedule under `shard_map`, its
    train step with a stage-local fused optimizer, and sharding rules for
    params and optimizer state.
"""

from pallasopt import kernels
from pallasopt import optim
from pallasopt import pipeline

__version__ = "0.1.0"

__all__ = ["kernels", "optim", "pipeline", "__version__"]
