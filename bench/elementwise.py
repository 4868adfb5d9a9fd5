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

Low-bit state cases (`ElementwiseFamily.low_bit_case`, label
``.../state-int8``, ``.../state-fp8`` or ``.../state-bf16``, and ``.../bf16-sr/state-int8`` for
bf16 params and grads with stochastic rounding) compare jitted Optax with
fp32 state (the baseline), Optax with ``mu_dtype=bfloat16``, and pallasopt
with that ``state_format``, each with its own state. Their floor is the
low-bit fused apply kernel's cost estimate: per f32 parameter of a leaf with
8-bit (int8 or fp8) state, ``12 + 2 k (1 + 4/256)`` bytes (16.06 for AdamW), with bf16
state ``12 + 4 k`` (20 for AdamW); leaves under 4096 elements keep f32 state.

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
from pallasopt.kernels import policy, quant
from pallasopt.kernels._elementwise import bytes_moved
from pallasopt.kernels._update import updates_dtype
from pallasopt.optim import convert_state

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
    optax_factory: e.g. ``optax.lion``; takes the `options`.
    pallasopt_factory: the drop-in; also takes ``impl``.
    hyperparams: the arguments both factories get.
    options: which of ``mu_dtype`` (the first moment's dtype) and ``mask``
      (weight decay's) the factories take; a family without ``mask`` never
      decays, and one without ``mu_dtype`` gets no mixed-dtype cases.
    baseline: the name of the baseline rows (``"optax"``; for a family
      Optax lacks, its own reference chain, e.g. ``"eformer-xla"``).
    low_bit: whether the family gets low-bit state cases (its state
      converts with `pallasopt.optim.convert_state`).
  """

  name: str
  moments: int
  optax_factory: Callable[..., Any]
  pallasopt_factory: Callable[..., Any]
  hyperparams: dict
  options: tuple[str, ...] = ("mu_dtype", "mask")
  baseline: str = "optax"
  low_bit: bool = True

  def _kwargs(self, mask: Any, mu_dtype: Any = None) -> dict:
    kwargs = dict(self.hyperparams)
    if "mask" in self.options:
      kwargs["mask"] = mask
    if "mu_dtype" in self.options:
      kwargs["mu_dtype"] = mu_dtype
    return kwargs

  def _decays(self, workload: workloads.Workload, mask: Any) -> list[bool]:
    if "mask" not in self.options:
      return [False] * workload.leaves
    return [True] * workload.leaves if mask is None else jax.tree.leaves(mask)

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
    """Bytes the updates-mode kernels move (their cost estimates).

    A kernel reads the params only for the decay of an update that is not
    f32: an f32 update leaves its decay term to XLA, fused with the apply.
    """
    total = 0
    for p, d in zip(jax.tree.leaves(tree), decays, strict=True):
      state = self._state(p, mu_dtype)
      u = updates_dtype(p, p, *state)
      reads_p = d and u != jnp.float32
      total += bytes_moved([p, *state] + ([p] if reads_p else []), [u] + [s.dtype for s in state])
    return total

  def update_bytes(self, tree: Any, decays: list[bool], mu_dtype=None) -> int:
    """Bytes of the Optax path: the updates kernels plus ``optax.apply_updates``."""
    apply = 0
    for p in jax.tree.leaves(tree):
      n, u = math.prod(p.shape), updates_dtype(p, p, *self._state(p, mu_dtype))
      apply += n * (2 * jnp.dtype(p.dtype).itemsize + jnp.dtype(u).itemsize)
    return self.update_kernel_bytes(tree, decays, mu_dtype) + apply

  def low_bit_bytes(self, tree: Any, state_format: str) -> int:
    """Bytes the fused apply kernels move with ``state_format`` state (their cost estimates)."""
    total = 0
    for p in jax.tree.leaves(tree):
      n = math.prod(p.shape)
      if state_format in quant.FORMATS and n >= quant.MIN_QUANTIZED_SIZE:
        codes = jax.ShapeDtypeStruct(p.shape, quant.code_dtype(quant.SIGNED, state_format))
        scales = jax.ShapeDtypeStruct(quant.scales_shape(p.shape), jnp.float32)
        state, sizes = [codes, scales] * self.moments, [n, n // quant.BLOCK] * self.moments
      else:
        dtype = jnp.bfloat16 if state_format == "bf16" else jnp.float32
        state, sizes = [jax.ShapeDtypeStruct(p.shape, dtype)] * self.moments, [n] * self.moments
      total += bytes_moved([p, p, *state], [p.dtype] + [s.dtype for s in state], [n, *sizes])
    return total

  def low_bit_case(
      self, workload: workloads.Workload, state_format: str, *, bf16_params: bool = False
  ) -> harness.Case:
    """Optax with f32 state (and with a bf16 first moment) against ``state_format`` state.

    ``bf16_params``: pallasopt's params and grads are bf16, rounded
    stochastically by the fused apply (to nearest by ``update`` +
    ``optax.apply_updates``), against Optax on the workload's f32 params.
    """
    mask = decay_mask(workload)
    decays = [True] * workload.leaves if mask is None else jax.tree.leaves(mask)
    kwargs = dict(self.hyperparams, mask=mask)
    ours_tree = workload.tree
    if bf16_params:
      ours_tree = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16), ours_tree)
    label = f"{workload.label}{'/bf16-sr' if bf16_params else ''}/state-{state_format}"
    # Only the fused apply rounds params stochastically: the update path
    # returns updates (optax.apply_updates rounds to nearest), so it runs
    # with "nearest", as it must.
    fused_rounding = "stochastic" if bf16_params else "nearest"
    ours = lambda impl, param_rounding="nearest": self.pallasopt_factory(
        **kwargs, state_format=state_format, param_rounding=param_rounding, impl=impl,
    )
    optax_tx, optax_bf16 = self.optax_factory(**kwargs), self.optax_factory(
        **kwargs, mu_dtype=jnp.bfloat16)

    def inputs_for(tree, state_format=None, mu_dtype=None):
      def inputs(key):
        params = workloads.random_tree(key, tree, stream=0)
        grads = workloads.random_tree(key, tree, stream=1)
        state = workloads.randomize_floats(key, optax_tx.init(params))
        if state_format is not None or mu_dtype is not None:
          state = convert_state(state, params, state_format, mu_dtype=mu_dtype)
        return (params, state), grads
      return inputs

    impls = (
        harness.Impl("optax", lambda k: harness.optax_step(optax_tx), pallas=False,
                     bytes=self.update_bytes(workload.tree, decays)),
        harness.Impl("optax.mu-bf16", lambda k: harness.optax_step(optax_bf16), pallas=False,
                     bytes=self.update_bytes(workload.tree, decays, jnp.bfloat16),
                     inputs=inputs_for(workload.tree, mu_dtype=jnp.bfloat16)),
        harness.Impl("pallasopt.update", lambda k: harness.optax_step(ours(k)),
                     inputs=inputs_for(ours_tree, state_format)),
        harness.Impl("pallasopt.fused", lambda k: harness.fused_step(ours(k, fused_rounding)),
                     bytes=self.low_bit_bytes(ours_tree, state_format),
                     inputs=inputs_for(ours_tree, state_format)),
    )
    return harness.Case(
        family=self.name, workload=workload.name, label=label, params=workload.params,
        leaves=workload.leaves, inputs=inputs_for(workload.tree), impls=impls,
        bytes=self.low_bit_bytes(ours_tree, state_format),
        auto_on_cuda=policy.CUDA_AUTO[
            policy.BLOCKWISE_UPDATE if state_format in quant.FORMATS else policy.UPDATE].choice,
    )

  def case(self, workload: workloads.Workload, mu_dtype=None) -> harness.Case:
    """The family's case for a workload (``mu_dtype`` as in Optax)."""
    mask = decay_mask(workload)
    decays = self._decays(workload, mask)
    mu = None if mu_dtype is None else jnp.dtype(mu_dtype)
    label = workload.label if mu is None else f"{workload.label}/mu-{mu.name.replace('float', 'f')}"
    kwargs = self._kwargs(mask, mu)
    return harness.optimizer_case(
        family=self.name,
        workload=workload,
        label=label,
        optax_tx=self.optax_factory(**kwargs),
        pallasopt_tx=lambda impl: self.pallasopt_factory(**kwargs, impl=impl),
        bytes=self.fused_bytes(workload.tree, mu),
        update_bytes=self.update_bytes(workload.tree, decays, mu),
        auto_on_cuda=policy.CUDA_AUTO[policy.UPDATE].choice,
        baseline=self.baseline,
    )

  def cases(self, tier: str) -> list[harness.Case]:
    """f32 and bf16-params/f32-first-moment leaves over the tier's sizes, then trees."""
    out = []
    mixed_mu = jnp.float32 if "mu_dtype" in self.options else None
    for size in workloads.leaf_sizes(tier):
      if tier != "ci" or size != 4096:
        out.append(self.case(workloads.leaf(size, "f32")))
      if tier != "ci" or size == 4096:
        out.append(self.case(workloads.leaf(size, "bf16"), mixed_mu))
    for w in workloads.for_tier(tier, ("f32", "mixed")):
      out.append(self.case(w, mixed_mu if w.label == "mixed" else None))
    if not self.low_bit:
      return out
    # Low-bit state on f32 leaves of at least 4096 elements and f32 trees.
    low_bit = [workloads.leaf(n, "f32") for n in workloads.leaf_sizes(tier) if n >= 4096]
    low_bit += [w for w in workloads.for_tier(tier, ("f32",)) if w.label == "f32"]
    for w in low_bit:
      out += [self.low_bit_case(w, "int8"), self.low_bit_case(w, "fp8"),
              self.low_bit_case(w, "int4"), self.low_bit_case(w, "bf16"),
              self.low_bit_case(w, "int8", bf16_params=True)]
    return out
