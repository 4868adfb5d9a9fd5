"""White-Kron (eFormer's quad and skew): step time of the kernel path against XLA.

Like Kron, a matmul- and latency-bound family: ``"compute"`` cases whose
baseline is pallasopt's own XLA path (``impl="xla"``; eFormer is not a bench
dependency, and its f32 math is what the XLA path reproduces, see
``tests/test_factory.py``). Every step updates every factor; the kernel path
runs the two preconditioner applications of all dense blocks as one batch on
`pallasopt.kernels.kron`'s kernel (a), the factor steps in XLA.

Workloads: stacked layers (``stacked_axes=1``) split into ``block_size``
blocks, in f32 (the factors' ``dtype`` is the params').
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from bench import harness, workloads
from pallasopt.optim import white_kron

FAMILY = "white_kron"
STYLES = ("quad", "skew")
HYPERPARAMS = dict(learning_rate=3e-4, b1=0.95, weight_decay=0.1)
# Dense-block matmuls per step, in units of 2 bs^3 flops: two applications of
# the preconditioner (4 products each), two Gram terms, and the factor steps:
# QUAD two products per side, skew one per side plus the Procrustes step's two.
_PRODUCTS = {"quad": 8 + 2 + 4, "skew": 8 + 2 + 2 + 4}


def _blocks(workload: workloads.Workload, block_size: int) -> int:
  """Dense blocks of the workload's stacked matrices (padded blocks count whole)."""
  total = 0
  for x in jax.tree.leaves(workload.tree):
    layers, (m, n) = x.shape[0], x.shape[1:]
    total += layers * math.ceil(m / block_size) * math.ceil(n / block_size)
  return total


def flops(workload: workloads.Workload, style: str, block_size: int) -> int:
  """The dense blocks' matmul flops of one step (power iterations excluded)."""
  return _blocks(workload, block_size) * _PRODUCTS[style] * 2 * block_size**3


def fused_bytes(workload: workloads.Workload, block_size: int) -> int:
  """Read g, p, mu and the two factors per block; write p, mu and the factors."""
  size = sum(math.prod(x.shape) for x in jax.tree.leaves(workload.tree))
  factors = _blocks(workload, block_size) * 2 * block_size**2
  return 4 * (5 * size + 2 * factors)


def case(workload: workloads.Workload, style: str, block_size: int) -> harness.Case:
  def make(impl):
    optimizer = getattr(white_kron, style)
    return optimizer(**HYPERPARAMS, block_size=block_size, dtype=jnp.float32,
                     stacked_axes=workload.stacked_axes, impl=impl)

  def inputs(key):
    kp, kg = jax.random.split(key)
    params = workloads.random_tree(kp, workload.tree)
    return (params, make("xla").init(params)), workloads.random_tree(kg, workload.tree)

  impls = harness.xla_and_kernel_impls(make)
  return harness.Case(
      family=FAMILY, workload=workload.name, label=f"{workload.label}/{style}/bs{block_size}",
      params=workload.params, leaves=workload.leaves, inputs=inputs, impls=impls,
      bytes=fused_bytes(workload, block_size), flops=flops(workload, style, block_size),
      metric="compute", baseline="xla", compute_dtype="float32",
  )


def _stack(layers: int, rows: int, cols: int) -> workloads.Workload:
  tree = {"w": jax.ShapeDtypeStruct((layers, rows, cols), jnp.float32)}
  return workloads.Workload(f"stack{layers}x{rows}x{cols}", "f32", tree, stacked_axes=1)


def cases(tier: str) -> list[harness.Case]:
  if tier == "ci":
    shapes = [((2, 16, 16), 8)]
  elif tier == "quick":
    shapes = [((12, 256, 256), 128)]
  else:
    shapes = [((12, 768, 768), 256), ((12, 768, 3072), 256), ((24, 1024, 1024), 256)]
  return [case(_stack(*shape), style, block) for shape, block in shapes for style in STYLES]
