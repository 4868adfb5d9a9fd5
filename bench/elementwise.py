"""Bench cases shared by the elementwise optimizer families (AdamW, Lion).

Such a family's fused kernel reads ``p``, ``g`` and its ``k`` state leaves
(the first moment in ``mu_dtype``, the others in the params' dtype, as Optax
keeps them) and writes ``p`` and the state back, once each. With ``s(x)``
bytes per element of ``x`` and ``n`` elements per leaf:

* fused apply, the floor: ``n * (s(g) + 2 s(p) + 2 sum_i s(state_i))``:
  28 B/param for f32 AdamW (k = 2), 20 B/param for f32 Lion (k = 1). It is
  the ``bytes_accessed`` of the apply kernel's ``pl.CostEstimate`` (both come
  from `pallasopt.kernels._elementwise.bytes_moved`).
* Optax path: the updates kernel (reads g, the state, and p where the leaf
  decays; writes u and the state) plus ``apply_updates`` (reads p, u; writes
  p): 40 B/param for f32 AdamW with decay, 32 for Lion.

Every case compares three implementations (`harness.optimizer_case`): jitted
Optax ``update`` + ``apply_updates``, pallasopt's Optax path and its fused
in-place ``apply_gradients``. Trees decay only their matrices (the usual mask:
no decay on norms and biases), given to Optax and pallasopt alike as ``mask``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from bench import harness, workloads
from pallasopt.kernels._elementwise import bytes_moved, updates_dtype

__all__ = ["ElementwiseFamily", "decay_mask"]


def decay_mask(workload: workloads.Workload) -> Any:
  """Weight decay on matrices only (None for a single leaf: it decays)."""
  if workload.name == "leaf":
    return None
  return jax.tree.map(lambda s: workloads.is_matrix(s, workload.stacked_axes), workload.tree)


@dataclasses.dataclass(frozen=True)
class ElementwiseFamily:
  """An elementwise optimizer: Optax's factory, pallasopt's, and its state.

  Attributes:
    name: the family name, e.g. ``"lion"``.
    moments: state leaves per parameter (AdamW: 2, Lion: 1).
    optax_factory: e.g. ``optax.lion``; takes ``mu_dtype`` and ``mask``.
    pallasopt_factory: the drop-in; also takes ``impl``.
    hyperparams: the arguments both factories get.
  """

  name: str
  moments: int
  optax_factory: Callable[..., Any]
  pallasopt_factory: Callable[..., Any]
  hyperparams: dict

  def _state(self, p: jax.ShapeDtypeStruct, mu_dtype) -> list[jax.ShapeDtypeStruct]:
    dtypes = [mu_dtype or p.dtype] + [p.dtype] * (self.moments - 1)
    return [jax.ShapeDtypeStruct(p.shape, d) for d in dtypes]

  def fused_bytes(self, tree: Any, mu_dtype=None) -> int:
    """Bytes the fused apply kernels move for ``tree`` (their cost estimates)."""
    total = 0
    for p in jax.tree.leaves(tree):
      state = self._state(p, mu_dtype)
      total += bytes_moved([p, *state, p], [p.dtype] + [s.dtype for s in state])
    return total

  def update_kernel_bytes(self, tree: Any, decays: list[bool], mu_dtype=None) -> int:
    """Bytes the updates-mode kernels move (their cost estimates)."""
    total = 0
    for p, d in zip(jax.tree.leaves(tree), decays, strict=True):
      state = self._state(p, mu_dtype)
      u = updates_dtype(p, p, *state)
      total += bytes_moved([p, *state] + ([p] if d else []), [u] + [s.dtype for s in state])
    return total

  def update_bytes(self, tree: Any, decays: list[bool], mu_dtype=None) -> int:
    """Bytes of the Optax path: the updates kernels plus ``optax.apply_updates``."""
    apply = 0
    for p in jax.tree.leaves(tree):
      n, u = math.prod(p.shape), updates_dtype(p, p, *self._state(p, mu_dtype))
      apply += n * (2 * jnp.dtype(p.dtype).itemsize + jnp.dtype(u).itemsize)
    return self.update_kernel_bytes(tree, decays, mu_dtype) + apply

  def case(self, workload: workloads.Workload, mu_dtype=None) -> harness.Case:
    """The family's case for a workload (``mu_dtype`` as in Optax)."""
    mask = decay_mask(workload)
    decays = [True] * workload.leaves if mask is None else jax.tree.leaves(mask)
    mu = None if mu_dtype is None else jnp.dtype(mu_dtype)
    label = workload.label if mu is None else f"{workload.label}/mu-{mu.name.replace('float', 'f')}"
    kwargs = dict(self.hyperparams, mu_dtype=mu, mask=mask)
    return harness.optimizer_case(
        family=self.name,
        workload=workload,
        label=label,
        optax_tx=self.optax_factory(**kwargs),
        pallasopt_tx=lambda impl: self.pallasopt_factory(**kwargs, impl=impl),
        bytes=self.fused_bytes(workload.tree, mu),
        update_bytes=self.update_bytes(workload.tree, decays, mu),
        auto_on_cuda="xla",  # kernels/adamw.py, kernels/lion.py
    )

  def cases(self, tier: str) -> list[harness.Case]:
    """f32 and bf16-params/f32-first-moment leaves over the tier's sizes, then trees."""
    out = []
    for size in workloads.leaf_sizes(tier):
      if tier != "ci" or size != 4096:
        out.append(self.case(workloads.leaf(size, "f32")))
      if tier != "ci" or size == 4096:
        out.append(self.case(workloads.leaf(size, "bf16"), jnp.float32))
    for w in workloads.for_tier(tier, ("f32", "mixed")):
      out.append(self.case(w, jnp.float32 if w.label == "mixed" else None))
    return out
