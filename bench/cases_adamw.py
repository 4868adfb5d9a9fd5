"""AdamW: single leaves at several sizes and realistic trees (`bench.workloads`).

Three implementations per case (`harness.optimizer_case`): jitted
``optax.adamw`` + ``optax.apply_updates``; ``pallasopt.optim.adamw``'s Optax
path (``update`` + ``apply_updates``); its fused in-place ``apply_gradients``.

Bytes model (per leaf of ``n`` elements; ``s(x)`` = bytes per element):

* fused apply, the floor: reads g, m, v, p and writes p, m, v:
  ``n * (s(g) + 2 s(m) + 2 s(v) + 2 s(p))`` = 28 B/param in f32. It is the
  ``bytes_accessed`` of the apply kernel's ``pl.CostEstimate`` (both come from
  `pallasopt.kernels._elementwise.bytes_moved`; tests/test_bench.py checks).
* Optax path: the updates kernel (reads g, m, v, and p where the leaf
  decays; writes u, m, v) plus ``apply_updates`` (reads p, u; writes p):
  40 B/param in f32 with decay.

Trees decay only their matrices (the usual mask: no decay on norms and
biases), which both Optax and pallasopt take as ``mask``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from bench import harness, workloads
from pallasopt.kernels._elementwise import bytes_moved, updates_dtype
from pallasopt.optim.adamw import adamw

FAMILY = "adamw"
HYPERPARAMS = dict(learning_rate=3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


def _moments(p: jax.ShapeDtypeStruct, mu_dtype) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
  return (
      jax.ShapeDtypeStruct(p.shape, mu_dtype or p.dtype),
      jax.ShapeDtypeStruct(p.shape, p.dtype),
  )


def fused_bytes(tree: Any, mu_dtype=None) -> int:
  """Bytes the fused apply kernels move for ``tree`` (their cost estimates)."""
  total = 0
  for p in jax.tree.leaves(tree):
    m, v = _moments(p, mu_dtype)
    total += bytes_moved([p, m, v, p], [p.dtype, m.dtype, v.dtype])
  return total


def update_kernel_bytes(tree: Any, decays: list[bool], mu_dtype=None) -> int:
  """Bytes the updates-mode kernels move (their cost estimates)."""
  total = 0
  for p, d in zip(jax.tree.leaves(tree), decays, strict=True):
    m, v = _moments(p, mu_dtype)
    u = updates_dtype(p, p, m, v)
    total += bytes_moved([p, m, v] + ([p] if d else []), [u, m.dtype, v.dtype])
  return total


def update_bytes(tree: Any, decays: list[bool], mu_dtype=None) -> int:
  """Bytes of the Optax path: the updates kernels plus ``optax.apply_updates``."""
  apply = 0
  for p in jax.tree.leaves(tree):
    m, v = _moments(p, mu_dtype)
    n, u = math.prod(p.shape), updates_dtype(p, p, m, v)
    apply += n * (2 * jnp.dtype(p.dtype).itemsize + jnp.dtype(u).itemsize)
  return update_kernel_bytes(tree, decays, mu_dtype) + apply


def decay_mask(workload: workloads.Workload) -> Any:
  """Weight decay on matrices only (None for a single leaf: it decays)."""
  if workload.name == "leaf":
    return None
  return jax.tree.map(lambda s: workloads.is_matrix(s, workload.stacked_axes), workload.tree)


def case(workload: workloads.Workload, mu_dtype=None) -> harness.Case:
  """The AdamW case for a workload (``mu_dtype`` as in ``optax.adamw``)."""
  mask = decay_mask(workload)
  decays = [True] * workload.leaves if mask is None else jax.tree.leaves(mask)
  mu = None if mu_dtype is None else jnp.dtype(mu_dtype)
  label = workload.label if mu is None else f"{workload.label}/mu-{mu.name.replace('float', 'f')}"
  return harness.optimizer_case(
      family=FAMILY,
      workload=workload,
      label=label,
      optax_tx=optax.adamw(**HYPERPARAMS, mu_dtype=mu, mask=mask),
      pallasopt_tx=lambda impl: adamw(**HYPERPARAMS, mu_dtype=mu, mask=mask, impl=impl),
      bytes=fused_bytes(workload.tree, mu),
      update_bytes=update_bytes(workload.tree, decays, mu),
  )


def cases(tier: str) -> list[harness.Case]:
  """f32 and bf16-params/f32-first-moment leaves over the tier's sizes, then trees."""
  out = []
  for size in workloads.leaf_sizes(tier):
    if tier != "ci" or size != 4096:
      out.append(case(workloads.leaf(size, "f32")))
    if tier != "ci" or size == 4096:
      out.append(case(workloads.leaf(size, "bf16"), jnp.float32))
  for w in workloads.for_tier(tier, ("f32", "mixed")):
    out.append(case(w, jnp.float32 if w.label == "mixed" else None))
  return out
