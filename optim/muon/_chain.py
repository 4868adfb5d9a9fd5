"""The Muon leaves' step: momentum, Newton–Schulz, scale, decay and learning rate.

`MuonOptions` holds `pallasopt.optim.muon.muon`'s arguments once validated;
`MuonChain` is the Optax transform of the leaves routed to Muon, with
``optax.contrib.muon``'s state (``(MuonState, EmptyState, decay state, lr
state[, MuonSecondMomentState])``) and a learning rate the fused entry points
may give per step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers, MuonState

from pallasopt.kernels import muon_momentum, ns_coefficients, quant
from pallasopt.kernels._update import (
    Gate,
    gated_accumulator,
    gated_gradient,
    held_where_closed,
    leaf_gate,
    open_gate,
    store_moment,
)
from pallasopt.optim import _validation as v
from pallasopt.optim._base import advance_schedule, held_counters, scaled_grads
from pallasopt.optim._elementwise_tx import (
    check_moment_storage,
    is_quantized,
    moment_arrays,
    moment_value,
    momentum_rounding,
    stored_moment_trees,
)
from pallasopt.optim._types import MaskOrFn, ScalarOrSchedule
from pallasopt.optim.muon._layout import Layout, Spec, broadcast_prefix, is_spec_leaf, split_parts
from pallasopt.optim.muon._options import OWNER, MuonSecondMomentState, shape_scale
from pallasopt.optim.muon._orthogonalize import compute_dtype, orthogonalize_all

__all__ = ["MuonOptions", "MuonChain"]


@dataclasses.dataclass(frozen=True)
class MuonOptions:
  """`muon`'s arguments for its Muon leaves, validated (see `muon` for each).

  Beyond them: ``init_coeffs``, the Newton–Schulz coefficients the state
  starts with (a row, or a table); ``table_steps``, the steps a single row
  expands to (None for a table); ``traced_steps``, whether ``ns_steps`` is
  traced (``optax.inject_hyperparams``), which runs Optax's loop.
  """

  learning_rate: ScalarOrSchedule
  ns_steps: Any
  beta: Any
  eps: float
  weight_decay: ScalarOrSchedule
  weight_decay_mask: MaskOrFn
  mu_dtype: Any
  nesterov: bool
  adaptive: bool
  preconditioning: str
  muon_weight_dimension_numbers: Any
  consistent_rms: float | None
  impl: str
  stacked_axes: int
  iter_dtype: Any
  gram_levels: int | None
  scale_mode: str | None
  extra_scale_factor: float
  momentum: str
  second_moment: str | None
  beta2: float
  second_moment_eps: float
  qkv_split_shapes: Any
  adamw_predicate: Callable[[str, jax.Array], bool] | None
  blockwise: tuple[int, int] | None
  distributed_axes: tuple[str, ...] | None
  state_format: str | None
  seed: Any
  init_coeffs: np.ndarray
  table_steps: int | None
  traced_steps: bool


class MuonChain:
  """``chain(momentum + Newton–Schulz + scale, add_decayed_weights, scale_by_learning_rate)``.

  The transform of the leaves routed to Muon, as ``optax.contrib.muon``
  chains it (the same state), with the routing of a tree's leaves
  (`specs`, `labels`) that the partition between Muon and AdamW uses.
  """

  def __init__(self, options: MuonOptions):
    self.options = options
    self._decay_tx = optax.add_decayed_weights(options.weight_decay, options.weight_decay_mask)
    self._lr_tx = optax.scale_by_learning_rate(options.learning_rate)

  def specs(self, tree) -> list[Spec]:
    opts = self.options
    leaves = v.keyed_leaves(tree)
    if opts.muon_weight_dimension_numbers is None:
      v.check_stacked_axes(OWNER, tree, opts.stacked_axes)
      dims = MuonDimensionNumbers(opts.stacked_axes, opts.stacked_axes + 1)
      chosen = [dims if jnp.ndim(x) == 2 + opts.stacked_axes else None for _, x in leaves]
    else:
      spec = opts.muon_weight_dimension_numbers
      spec = spec(tree) if callable(spec) else spec
      chosen = broadcast_prefix("muon_weight_dimension_numbers", spec, tree, is_spec_leaf)
      chosen = [None if isinstance(d, optax.MaskedNode) else d for d in chosen]
    if opts.adamw_predicate is not None:
      chosen = [None if opts.adamw_predicate(p, x) else d for (p, x), d in zip(leaves, chosen)]
    if opts.qkv_split_shapes is None:
      splits = [None] * len(leaves)
    else:
      split = opts.qkv_split_shapes
      split = split(tree) if callable(split) else split
      is_split = lambda x: x is None or (isinstance(x, tuple) and all(isinstance(i, int) for i in x))
      splits = broadcast_prefix("qkv_split_shapes", split, tree, is_split)
    return [Spec(d, s if d is not None else None) for d, s in zip(chosen, splits)]

  def labels(self, tree):
    return jax.tree.unflatten(jax.tree.structure(tree), [s.label for s in self.specs(tree)])

  def layouts(self, tree):
    return [
        (Layout.of(jnp.shape(x), s.dims, p), s)
        for (p, x), s in zip(v.keyed_leaves(tree), self.specs(tree))
    ]

  def _second_moment_init(self, layout: Layout):
    opts = self.options
    b, r, o = layout.flat
    if opts.second_moment == "adamuon":
      shape = (b, r, o)
    elif opts.second_moment == "normuon":
      shape = (b, 1, o) if o >= r else (b, r, 1)
    else:
      shape = (b,)
    return jnp.zeros(shape, jnp.float32)

  def init(self, params):
    opts = self.options
    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, opts.mu_dtype or jnp.result_type(p)), params)
    (mu,) = stored_moment_trees([zeros], params, roles=(quant.SIGNED,),
                                state_format=opts.state_format, kept_dtypes=(opts.mu_dtype,))
    state = (
        MuonState(count=jnp.zeros([], jnp.int32), mu=mu, ns_coeffs=jnp.asarray(opts.init_coeffs)),
        optax.EmptyState(),
        self._decay_tx.init(params),
        self._lr_tx.init(params),
    )
    if opts.second_moment is not None:
      nu = [self._second_moment_init(layout) for layout, _ in self.layouts(params)]
      state += (MuonSecondMomentState(jax.tree.unflatten(jax.tree.structure(params), nu)),)
    return state

  def _momentum_step(self, g, m, count, leaf, gate, grad_scale):
    """``(m_hat, m, accumulator or None)`` of one leaf; ``gate`` and ``grad_scale`` as `update`'s."""
    opts = self.options
    if is_quantized(m):
      # Blockwise state: one pass decodes, steps and re-encodes it in place
      # (XLA's codec would copy the momentum between layouts: `kernels.muon_momentum`).
      scalars = muon_momentum.muon_momentum_scalars(
          opts.beta, count, nesterov=opts.nesterov, lerp=opts.momentum == "lerp",
          grad_scale=1.0 if grad_scale is None else grad_scale)
      key = momentum_rounding(opts.state_format, opts.seed, count, leaf, jnp.shape(g))["key"]
      hat, m, *acc = muon_momentum.muon_momentum_updates(g, m, scalars, key, gate, impl=opts.impl)
      return hat, m, *(acc or [None])
    accumulator = gated_accumulator(g, gate) if isinstance(gate, Gate) else None
    # Optax's MultiSteps' accumulation, in XLA, then the clip factor.
    g = scaled_grads(gated_gradient(g, gate), grad_scale)
    # Optax's formulas, divisions included, at f32 at least; float64 and
    # complex leaves keep their precision (Optax's). The blockwise path above
    # folds the same corrections into two f32 multipliers
    # (`muon_momentum.muon_momentum_scalars`), which a kernel body rounds
    # alike on every backend.
    dtype = compute_dtype(g)
    real = jnp.finfo(dtype).dtype
    corrected = lambda x, t: x / jnp.asarray(1 - opts.beta**t, real)
    g32, m32 = g.astype(dtype), moment_value(m).astype(dtype)
    m_new = (1 - opts.beta) * g32 + opts.beta * m32
    if opts.momentum == "lerp":
      hat = (1 - opts.beta) * g32 + opts.beta * m_new if opts.nesterov else m_new
    elif opts.nesterov:
      hat = opts.beta * corrected(m_new, count + 1) + (1 - opts.beta) * corrected(g32, count)
    else:
      hat = corrected(m_new, count)
    rounding = momentum_rounding(opts.state_format, opts.seed, count, leaf, jnp.shape(g))
    hat, m_new = held_where_closed(
        open_gate(gate), (hat.astype(dtype), store_moment(m_new, m, **rounding)),
        (jnp.zeros_like(hat, dtype), m))
    return hat, m_new, accumulator

  def _scale_vector(self, layout: Layout, spec: Spec, parts):
    """Per-output-column scale (one value per part), broadcast on (b, r, o)."""
    _, fan_in, fan_out = layout.flat
    if spec.split is None:
      return self._scale_of(*parts[0])
    groups = fan_out // sum(spec.split)
    cols = [jnp.full((groups, s), self._scale_of(*shape)) for s, shape in zip(spec.split, parts)]
    return jnp.concatenate(cols, axis=1).reshape(fan_out)

  def _scale_of(self, fan_in, fan_out):
    opts = self.options
    if opts.scale_mode is not None:
      return shape_scale(fan_in, fan_out, opts.scale_mode) * opts.extra_scale_factor
    if opts.consistent_rms is not None:
      return math.sqrt(max(fan_in, fan_out)) * opts.consistent_rms
    return shape_scale(fan_in, fan_out, "shape_scaling")

  def _normalize(self, o, nu, g, hat):
    """The ``second_moment`` normalization of ``o`` (all (b, r, o) f32)."""
    opts = self.options
    if opts.second_moment == "adamuon":
      nu = opts.beta2 * nu + (1 - opts.beta2) * o * o
      return o / (jnp.sqrt(nu) + opts.second_moment_eps), nu
    if opts.second_moment == "normuon":
      axis = 1 if o.shape[2] >= o.shape[1] else 2
      nu = opts.beta2 * nu + (1 - opts.beta2) * jnp.mean(o * o, axis=axis, keepdims=True)
      return o * jax.lax.rsqrt(jnp.maximum(nu, opts.second_moment_eps)), nu
    nu = opts.beta2 * nu + (1 - opts.beta2) * jnp.sum(g * g, axis=(1, 2))
    alpha = jnp.sqrt(jnp.sum(hat * hat, axis=(1, 2))) / (jnp.sqrt(nu) + opts.second_moment_eps)
    return o * alpha[:, None, None], nu

  def update(
      self, updates, state, params=None, learning_rate_now=None, gate=None, grad_scale=None
  ):
    """Optax's update of the Muon leaves; ``gate`` as a gated entry point's.

    ``gate``: None; a boolean scalar: where false the updates are zero and the
    state holds (the momentum kernels write the codes they read); or a
    `kernels._update.Gate` whose ``acc`` is the accumulator tree: the step
    runs on the accumulated gradients and returns the stored accumulators
    third. ``grad_scale`` (a scalar, None for 1) multiplies the gradients
    the step runs on, inside the momentum kernels where they run.
    """
    opts = self.options
    muon_state, shape_state, decay_state, lr_state = state[:4]
    v.check_same_tree(OWNER, "grads", updates, "opt_state mu", moment_arrays(muon_state.mu))
    treedef = jax.tree.structure(updates)
    grads = jax.tree.leaves(updates)
    check_moment_storage(
        OWNER, {"MuonState.mu": muon_state.mu}, (quant.SIGNED,),
        [None] * len(grads) if params is None else jax.tree.leaves(params), updates,
        state_format=opts.state_format, mu_dtype=opts.mu_dtype,
        mu_dtype_fields=("MuonState.mu",))
    count = optax.safe_increment(muon_state.count)
    mus = jax.tree.leaves(muon_state.mu, is_leaf=is_quantized)
    accumulating = isinstance(gate, Gate)
    accumulators = jax.tree.leaves(gate.acc) if accumulating else [None] * len(grads)
    leaf_gates = [leaf_gate(gate, a, g) for g, a in zip(grads, accumulators, strict=True)]
    stepped = [self._momentum_step(g, m, count, i, one_gate, grad_scale)
               for i, (g, m, one_gate) in enumerate(zip(grads, mus, leaf_gates))]
    hats, mus, accs = (list(column) for column in zip(*stepped)) if stepped else ([], [], [])
    if opts.second_moment is not None:
      # The second moments read the gradient the step runs on.
      grads = [scaled_grads(gated_gradient(g, one_gate), grad_scale)
               for g, one_gate in zip(grads, leaf_gates)]
    layouts = self.layouts(updates)
    splitters, stacks, owners = [], [], []
    for (path, _), hat, (layout, spec) in zip(v.keyed_leaves(updates), hats, layouts):
      splitter = split_parts(layout.flat, spec.split, opts.blockwise, path)
      parts = splitter[0](layout.to_flat(hat))
      splitters.append(splitter)
      owners.append(len(parts))
      stacks.extend(parts)
    orthogonalize = functools.partial(
        orthogonalize_all, preconditioning=opts.preconditioning, eps=opts.eps,
        iter_dtype=opts.iter_dtype, gram_levels=opts.gram_levels, impl=opts.impl,
        distributed_axes=opts.distributed_axes,
    )
    if opts.traced_steps:
      results = orthogonalize(stacks, None, optax_coeffs=(muon_state.ns_coeffs, opts.ns_steps))
    else:
      table = ns_coefficients.coefficient_table(muon_state.ns_coeffs, opts.table_steps)
      results = orthogonalize(stacks, table, optax_coeffs=(table, table.shape[0]))
    nus = jax.tree.leaves(state[4].nu) if opts.second_moment is not None else [None] * len(grads)
    new_nus, outs, start = [], [], 0
    for hat, g, nu, (layout, spec), (_, merge, part_shapes), n in zip(
        hats, grads, nus, layouts, splitters, owners
    ):
      o = merge(results[start:start + n]).astype(compute_dtype(g))
      start += n
      if opts.second_moment is not None:
        flat_g = layout.to_flat(g.astype(jnp.float32))
        o, nu = self._normalize(o, nu, flat_g, layout.to_flat(hat))
        new_nus.append(nu)
      if opts.adaptive:
        o = jnp.sum(layout.to_flat(hat).conj() * o) * o
      o = o * self._scale_vector(layout, spec, part_shapes)
      outs.append(layout.from_flat(o).astype(g.dtype))
    out_tree = treedef.unflatten(outs)
    out_tree, decay_state = self._decay_tx.update(out_tree, decay_state, params)
    if learning_rate_now is None:
      out_tree, lr_state = self._lr_tx.update(out_tree, lr_state)
    else:
      out_tree = jax.tree.map(lambda u: -learning_rate_now * u, out_tree)
      lr_state = advance_schedule(lr_state)
    # A closed gate: zero updates (Newton-Schulz of the zero m_hat the momentum
    # step gave is not zero under every preconditioning).
    out_tree = held_where_closed(open_gate(gate), out_tree, jax.tree.map(jnp.zeros_like, out_tree))
    new_state = (
        MuonState(count=count, mu=treedef.unflatten(mus), ns_coeffs=muon_state.ns_coeffs),
        shape_state,
        decay_state,
        lr_state,
    )
    if opts.second_moment is not None:
      new_nus = held_where_closed(open_gate(gate), new_nus, nus)
      new_state += (MuonSecondMomentState(treedef.unflatten(new_nus)),)
    new_state = held_counters(gate, new_state, state)
    if accumulating:
      return out_tree, new_state, treedef.unflatten(accs)
    return out_tree, new_state
