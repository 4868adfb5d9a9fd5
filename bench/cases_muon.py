"""Muon: one optimizer step, dominated by Newton–Schulz, against Optax.

Cases are ``"compute"`` cases: TFLOP/s of the Newton–Schulz flops (5 steps:
``20 m^2 n + 10 m^3`` per matrix, `newton_schulz.ns_flops`) against the
device's matmul peak, with ``optax.contrib.muon`` (update + apply_updates,
jitted) timed in the same run as the baseline. The flop count stays the dense
one whatever a path computes (the symmetric kernels and the block-symmetric
XLA path compute fewer), so a saving shows as a higher rate; each record also
carries XLA's own ``xla_flops`` of the compiled step. On a CUDA GPU the kernel
rows are the Mosaic GPU kernel's (``mosaic-gpu``), which takes bf16 iterates:
f32 rows have none there.

Sizes: 1024², 4096², 4096×11008 and a stack of 64 × (256, 1024) (one leaf
with ``stacked_axes=1``; Optax gets the matching dimension numbers), in f32;
4096² and the stack again with bf16 params, whose iterates are bf16 in both
implementations, so their rate is also given as a % of the bf16 matmul peak;
4096² and the stack with f32 params and bf16 Newton–Schulz iterates
(``iter_dtype=bfloat16``, labels ``.../ns-bf16``; Optax stays f32); and the
Muon trees of GPT-2 small and the 1B decoder (every rank-2 leaf, as Optax
routes them), f32 and ``ns-bf16``; and 1024², 4096² and GPT-2 small's tree
with ``gram_levels`` 2 and 4 (labels ``.../gram-L2``, ``.../gram-L4``), the
block-symmetric XLA path that ``gram_levels=None`` takes only where it was
measured faster (`pallasopt.kernels.gram.gram_levels_for`). The ``quick``
tier on a CPU host and the ``ci`` tier use tiny matrices (``ci`` also the
tiny GPT-2 tree and one ``gram-L1`` row).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from bench import harness, workloads
from pallasopt.kernels import policy
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


def _tree(workload: workloads.Workload) -> workloads.Workload:
  """A model tree as a Muon workload: its rank-2 leaves (Optax's default routing)."""
  tree = {k: v for k, v in _flat(workload.tree).items() if len(v.shape) == 2}
  return workloads.Workload(workload.name, workload.label, tree)


def _flat(tree) -> dict[str, jax.ShapeDtypeStruct]:
  return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def case(workload: workloads.Workload, iter_dtype=None, gram_levels=None) -> harness.Case:
  specs = jax.tree.leaves(workload.tree)
  stacked = workload.stacked_axes
  dims = {"w": MuonDimensionNumbers(stacked, stacked + 1)} if stacked else None
  optax_tx = optax.contrib.muon(**HYPERPARAMS, ns_steps=NS_STEPS, muon_weight_dimension_numbers=dims)
  compute_dtype = jnp.dtype(iter_dtype or specs[0].dtype).name
  suffix = "/ns-bf16" if iter_dtype is not None else ""
  suffix += "" if gram_levels is None else f"/gram-L{gram_levels}"
  return harness.optimizer_case(
      family=FAMILY,
      workload=workload,
      label=workload.label + suffix,
      optax_tx=optax_tx,
      pallasopt_tx=lambda impl: muon(
          **HYPERPARAMS, ns_steps=NS_STEPS, stacked_axes=stacked, iter_dtype=iter_dtype,
          gram_levels=gram_levels, impl=impl,
      ),
      # p, g, mu read; p, mu written (the NS working set stays on chip or in
      # the tiles' re-reads, which the flop rate accounts for).
      bytes=sum(5 * math.prod(s.shape) * s.dtype.itemsize for s in specs),
      flops=sum(
          math.prod(s.shape[:stacked]) * ns_flops(*s.shape[-2:], NS_STEPS) for s in specs
      ),
      metric="compute",
      compute_dtype=compute_dtype,  # the Newton-Schulz iterates' dtype
      auto_on_cuda=policy.CUDA_AUTO[policy.NEWTON_SCHULZ].choice,
      cuda_kernel="mosaic-gpu" if compute_dtype == "bfloat16" else None,
  )


def cases(tier: str) -> list[harness.Case]:
  on_cpu = jax.default_backend() == "cpu"
  f32, bf16 = jnp.float32, jnp.bfloat16
  if tier == "ci" or (tier == "quick" and on_cpu):
    shapes = [((64, 96), f32), ((4, 32, 64), f32), ((64, 96), bf16)]
    ns_bf16, block_levels = [(64, 96)], [((64, 96), 1)]
    # The CPU quick tier stays single matrices (`workloads.for_tier`).
    trees = [w for w in workloads.for_tier(tier, ("f32",)) if w.name == "gpt2-tiny"]
    block_trees = []
  elif tier == "quick":
    shapes = [((1024, 1024), f32), ((64, 256, 1024), f32)]
    ns_bf16, block_levels, trees, block_trees = [], [], [], []
  else:
    shapes = [((1024, 1024), f32), ((4096, 4096), f32), ((4096, 11008), f32),
              ((64, 256, 1024), f32), ((4096, 4096), bf16), ((64, 256, 1024), bf16)]
    ns_bf16 = [(4096, 4096), (64, 256, 1024)]
    block_levels = [(shape, levels) for shape in ((1024, 1024), (4096, 4096)) for levels in (2, 4)]
    trees = [workloads.gpt2(**workloads.GPT2_SMALL, name="gpt2-small"),
             workloads.decoder(**workloads.DECODER_1B, name="decoder-1b")]
    block_trees = trees[:1]
  out = [case(_workload(shape, dtype)) for shape, dtype in shapes]
  out += [case(_workload(shape), iter_dtype=bf16) for shape in ns_bf16]
  out += [case(_workload(shape), gram_levels=levels) for shape, levels in block_levels]
  for tree in map(_tree, trees):
    out += [case(tree), case(tree, iter_dtype=bf16)]
  for tree in map(_tree, block_trees):
    out += [case(tree, gram_levels=levels) for levels in (2, 4)]
  return out
