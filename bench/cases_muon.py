"""Muon: one optimizer step, dominated by Newton–Schulz, against Optax.

Cases are ``"compute"`` cases: TFLOP/s of the Newton–Schulz flops (5 steps:
``20 m^2 n + 10 m^3`` per matrix, `newton_schulz.ns_flops`) against the
device's matmul peak, with ``optax.contrib.muon`` (update + apply_updates,
jitted) timed in the same run as the baseline. The tiled regime computes only
``15 m^2 n + 5 m^3`` of them; the flop count stays the dense one, so its
speed-up shows as a higher rate.

Sizes: 1024², 4096², 4096×11008 and a stack of 64 × (256, 1024) (one leaf
with ``stacked_axes=1``; Optax gets the matching dimension numbers), in f32;
4096² and the stack again with bf16 params, whose iterates are bf16 in both
implementations, so their rate is also given as a % of the bf16 matmul peak.
The ``quick`` tier on a CPU host and the ``ci`` tier use tiny matrices.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from bench import harness, workloads
from pallasopt.kernels.newton_schulz import ns_flops
from pallasopt.optim.muon import muon

FAMILY = "muon"
HYPERPARAMS = dict(learning_rate=2e-2, weight_decay=0.01)
NS_STEPS = 5


def _workload(shape: tuple[int, ...], dtype=jnp.float32) -> workloads.Workload:
  stacked = len(shape) - 2
  label = "x".join(map(str, shape)) + ("" if dtype == jnp.float32 else f"/{jnp.dtype(dtype).name}")
  tree = {"w": jax.ShapeDtypeStruct(shape, dtype)}
  return workloads.Workload("matrix" if not stacked else "stack", label, tree, stacked_axes=stacked)


def case(workload: workloads.Workload) -> harness.Case:
  (spec,) = jax.tree.leaves(workload.tree)
  stacked = workload.stacked_axes
  batch = math.prod(spec.shape[:stacked])
  dims = {"w": MuonDimensionNumbers(stacked, stacked + 1)} if stacked else None
  optax_tx = optax.contrib.muon(**HYPERPARAMS, ns_steps=NS_STEPS, muon_weight_dimension_numbers=dims)
  itemsize = jnp.dtype(spec.dtype).itemsize
  size = math.prod(spec.shape)
  return harness.optimizer_case(
      family=FAMILY,
      workload=workload,
      optax_tx=optax_tx,
      pallasopt_tx=lambda impl: muon(
          **HYPERPARAMS, ns_steps=NS_STEPS, stacked_axes=stacked, impl=impl
      ),
      # p, g, mu read; p, mu written (the NS working set stays on chip or in
      # the tiles' re-reads, which the flop rate accounts for).
      bytes=5 * size * itemsize,
      flops=batch * ns_flops(*spec.shape[-2:], NS_STEPS),
      metric="compute",
      compute_dtype=spec.dtype.name,  # the Newton-Schulz iterates' dtype (iter_dtype=None)
      auto_on_cuda="xla",
  )


def cases(tier: str) -> list[harness.Case]:
  on_cpu = jax.default_backend() == "cpu"
  f32, bf16 = jnp.float32, jnp.bfloat16
  if tier == "ci" or (tier == "quick" and on_cpu):
    shapes = [((64, 96), f32), ((4, 32, 64), f32), ((64, 96), bf16)]
  elif tier == "quick":
    shapes = [((1024, 1024), f32), ((64, 256, 1024), f32)]
  else:
    shapes = [((1024, 1024), f32), ((4096, 4096), f32), ((4096, 11008), f32),
              ((64, 256, 1024), f32), ((4096, 4096), bf16), ((64, 256, 1024), bf16)]
  return [case(_workload(shape, dtype)) for shape, dtype in shapes]
