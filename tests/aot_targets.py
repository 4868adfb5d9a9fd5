"""Real GPU and TPU targets for the compile tier, from this CPU-only host.

`jax.experimental.topologies` gives compile-only devices: TPU generations
from libtpu (``pip install -e ".[aot]"``), NVIDIA chips from a
`GpuTargetConfigProto` (the device facts in ``tests/data/gpu_targets``) with
the CUDA plugin and ptxas from the nvcc wheel. ``.compile()`` on them runs the
real compilers: libtpu's Mosaic, Triton + ptxas, Mosaic GPU.

The process must not initialise a GPU or TPU backend of its own: the tier
runs with ``JAX_PLATFORMS=cpu`` (BUILD.md), and so does its CI step.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re

import jax
import pytest

from helpers import CHIPS

_DATA = pathlib.Path(__file__).parent / "data" / "gpu_targets"

# Chip (`helpers.CHIPS`) -> its topology: a libtpu topology name, or the GPU
# target config file of a one-device topology.
TOPOLOGIES: dict[str, str] = {
    "h100": "h100.txtpb",
    "a100": "a100.txtpb",
    "b200": "b200.txtpb",
    "v4": "v4:2x2x1",
    "v5e": "v5e:2x2",
    "v5p": "v5p:2x2x1",
    "v6e": "v6e:2x2",
    "tpu7x": "tpu7x:2x2x1",
}
TPU_TARGETS = tuple(name for name in TOPOLOGIES if CHIPS[name][1] == "tpu")

# What each compiled kernel is called in the compiled module's HLO.
COMPILED_CALLS = {
    "tpu": re.compile(r'custom_call_target="tpu_custom_call"'),
    "triton": re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton"'),
    "mosaic_gpu": re.compile(r'custom_call_target="mosaic_gpu[^"]*"'),
}


def _missing(platform: str) -> str | None:
  """Why targets of ``platform`` cannot be compiled for here, or None."""
  if os.environ.get("JAX_PLATFORMS") != "cpu":
    return "the compile tier runs with JAX_PLATFORMS=cpu (BUILD.md)"
  try:
    if platform == "tpu":
      import libtpu  # noqa: F401
    else:
      import jax_plugins.xla_cuda12  # noqa: F401
      import nvidia.cuda_nvcc  # noqa: F401
  except ImportError as e:
    return f"needs the compile tier's packages (pip install -e '.[aot]'): {e}"
  return None


def require(name: str) -> None:
  """Skips the calling test unless target ``name`` can be compiled for here."""
  why = _missing(CHIPS[name][1])
  if why is not None:
    pytest.skip(why)


def _put_ptxas_on_path() -> None:
  import nvidia.cuda_nvcc

  bin_dir = str(pathlib.Path(next(iter(nvidia.cuda_nvcc.__path__))) / "bin")
  if bin_dir not in os.environ["PATH"].split(os.pathsep):
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ["PATH"]


@functools.cache
def devices(name: str):
  """The devices of target ``name``'s compile-only topology."""
  require(name)
  from jax.experimental import topologies

  spec = TOPOLOGIES[name]
  if CHIPS[name][1] == "tpu":
    # libtpu takes a lockfile for the TPU it drives; a compile-only topology
    # drives none, so the tier's parallel workers may each load it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return topologies.get_topology_desc(topology_name=spec, platform="tpu").devices
  _put_ptxas_on_path()
  config = (_DATA / spec).read_text()
  topology = topologies.get_topology_desc(name, "cuda", target_config=config, topology="1x1x1")
  return topology.devices


def on_device(tree, name: str):
  """``tree``'s ShapeDtypeStructs placed on target ``name``'s device."""
  sharding = jax.sharding.SingleDeviceSharding(devices(name)[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def compile_for(fn, name: str, *args, donate_argnums=()):
  """``jax.jit(fn)`` compiled for target ``name`` on ``args`` (ShapeDtypeStruct pytrees)."""
  placed = [on_device(a, name) for a in args]
  return jax.jit(fn, donate_argnums=donate_argnums).lower(*placed).compile()


def compiled_kernels(compiled) -> dict[str, int]:
  """Kernel custom calls of each kind in a compiled module."""
  text = compiled.as_text()
  return {kind: len(pattern.findall(text)) for kind, pattern in COMPILED_CALLS.items()}
