"""Version-sensitive JAX and Pallas imports, in one place.

pallasopt supports jax >= 0.10, < 0.13. Names that moved between those
releases are resolved here so the kernels import one stable spelling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallasopt.kernels._tiling import check_backend

__all__ = [
    "JAX_VERSION",
    "pl",
    "plgpu",
    "pltpu",
    "pltriton",
    "TPUCompilerParams",
    "TritonCompilerParams",
    "shard_map",
    "lowering_platform",
    "compiler_params",
    "mosaic_gpu_interpret",
    "explicit_spec",
    "reshard_like",
    "gathered",
]

JAX_VERSION: tuple[int, ...] = tuple(
    int(part) for part in jax.__version__.split(".")[:3] if part.isdigit()
)

def mosaic_gpu_interpret(interpret: bool) -> dict:
  """``plgpu.kernel`` keywords that run it in the Mosaic GPU interpreter (or not).

  The interpreter's parameters have no public name (JAX's own tests import
  them from ``jax._src``, as here).
  """
  if not interpret:
    return {}
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

  return {"interpret": InterpretGPUParams()}


TPUCompilerParams = getattr(pltpu, "CompilerParams", None) or getattr(
    pltpu, "TPUCompilerParams"
)
TritonCompilerParams = getattr(pltriton, "CompilerParams", None) or getattr(
    pltriton, "TritonCompilerParams"
)



def compiler_params(
    backend: str,
    dimension_semantics: tuple[str, ...],
    *,
    num_warps: int = 4,
    num_stages: int = 2,
    vmem_limit_bytes: int | None = None,
    interpret: bool = False,
):
  """Explicit compiler params for ``backend``, as every pallas_call passes them.

  TPU: the grid's ``dimension_semantics`` (and a VMEM limit, None for the
  default). Triton: ``num_warps`` and ``num_stages``. Passing them always
  pins the GPU lowering to Triton on every supported jax release. None when
  ``interpret``: the Pallas interpreter takes no compiler params.
  """
  check_backend(backend)
  if interpret:
    return None
  if backend == "tpu":
    return TPUCompilerParams(
        dimension_semantics=tuple(dimension_semantics), vmem_limit_bytes=vmem_limit_bytes
    )
  return TritonCompilerParams(num_warps=num_warps, num_stages=num_stages)


if hasattr(jax, "shard_map"):
  shard_map = jax.shard_map
else:  # pragma: no cover - jax < 0.10 is outside the supported range.
  from jax.experimental.shard_map import shard_map  # type: ignore[no-redef]


_DEVICE_KIND = {"tpu": "TPU v5 lite", "cuda": "NVIDIA H100 80GB HBM3"}


@contextlib.contextmanager
def lowering_platform(platform: str) -> Iterator[None]:
  """Context for lowering a function for `platform` from a host without it.

  From jax 0.11 on, Pallas reads the target device from the abstract mesh while
  lowering; outside a real device of that kind it must be supplied. On older
  releases this is a no-op.

  Args:
    platform: ``"tpu"`` or ``"cuda"``.
  """
  if JAX_VERSION < (0, 11):
    yield
    return
  device = jax.sharding.AbstractDevice(
      device_kind=_DEVICE_KIND[platform], num_cores=None, platform=platform
  )
  mesh = jax.sharding.AbstractMesh((), (), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    yield


def explicit_spec(x) -> jax.sharding.PartitionSpec | None:
  """``x``'s sharding as its type carries it (Explicit mesh axes), or None.

  None means the type says nothing (no mesh, Auto axes, or a replicated
  value): XLA's partitioner, not the type system, decides.
  """
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if not isinstance(spec, jax.sharding.PartitionSpec) or all(s is None for s in spec):
    return None
  return spec


def reshard_like(tree, like):
  """``tree`` with every leaf resharded to the explicit sharding of ``like``'s."""

  def one(x, ref):
    spec = explicit_spec(ref)
    if spec is None and explicit_spec(x) is None:
      return x
    return jax.sharding.reshard(x, spec or jax.sharding.PartitionSpec())

  return jax.tree.map(one, tree, like)


def gathered(x):
  """``x`` replicated if its type is sharded over Explicit axes, else ``x``."""
  if explicit_spec(x) is None:
    return x
  return jax.sharding.reshard(x, jax.sharding.PartitionSpec())
