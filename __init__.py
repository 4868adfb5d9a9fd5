"""pallasopt: fused Pallas optimizer kernels as drop-in Optax transforms.

Subpackages:
  * `pallasopt.kernels`: per-family array kernels (a pure-jnp reference and a
    Pallas kernel with the same signature) and the shared tiling/dispatch
    machinery.
  * `pallasopt.optim`: Optax `GradientTransformation`s built on the kernels,
    state-compatible with their Optax counterparts, plus the fused
    `apply_gradients` path.
  * `pallasopt.pipeline`: pipeline-parallel helpers built on `pallasopt.optim`.
"""

from pallasopt import kernels
from pallasopt import optim

__version__ = "0.1.0"

__all__ = ["kernels", "optim", "__version__"]
