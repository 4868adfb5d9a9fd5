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

import importlib

__version__ = "0.1.0"

__all__ = ["kernels", "optim", "pipeline", "__version__"]


# The subpackages import JAX, so they load on first use: `python -m
# pallasopt.compile_check` imports this package first and must still choose
# JAX's platform before JAX starts.
def __getattr__(name: str):
  if name in ("kernels", "optim", "pipeline"):
    return importlib.import_module(f"pallasopt.{name}")
  raise AttributeError(f"module 'pallasopt' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
