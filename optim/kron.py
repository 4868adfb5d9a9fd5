r"""PSGD Kron as a drop-in for psgd_jax's ``kron`` and ``scale_by_kron``.

Xi-Lin Li's PSGD with Kronecker-factored preconditioners (`Preconditioned
Stochastic Gradient Descent <https://arxiv.org/abs/1512.04202>`_, 2015;
`Black Box Lie Group Preconditioners for SGD
<https://arxiv.org/abs/2211.04422>`_, 2022), with the arguments, defaults,
state and step of psgd_jax 0.2.9 (Evan Walters), written from the algorithm
(see `pallasopt.kernels.kron` for the math). One step, with step count
:math:`t` (from 1):

1. :math:`m \leftarrow \beta_1 m + (1 - \beta_1) g`, :math:`\hat m = m / (1 -
   \beta_1^t)` (no momentum when :math:`\beta_1 = 0`: :math:`\hat m = g`).
2. On update steps: with probability 0.01 rebalance each layer's factors to
   a common max-abs norm (their geometric mean); draw a probe :math:`V`; damp
   the input :math:`G` (:math:`\hat m`, or :math:`g` without
   ``momentum_into_precond_update``) as :math:`G + \sqrt{\epsilon_{32}}\,
   \mathrm{mean}|G|\, V`; update every factor (kernel b).
3. :math:`u = \mathrm{clip}_{\mathrm{RMS}\le 1.1}(P \hat m)` per layer
   (kernel a); ``kron`` then adds :math:`\lambda p` (``weight_decay``, on
   ``weight_decay_mask``) and scales by :math:`-\eta`.

Reproducibility: the probes and the rebalancing draw come from
``key = jax.random.fold_in(PRNGKey(5318008), count)``: rebalancing from the
first half of ``jax.random.split(key)``, and the probe of layer ``l`` (its
row-major index over the leaf's stacked axes; 0 for an unstacked leaf) of
leaf ``i`` from the second half, ``i`` and ``l`` alone (threefry counters;
see `_probes`). Whether a step updates
the preconditioner is psgd_jax's deterministic counter: ``update_counter``
counts steps since the last update and an update happens once it reaches
``1 / p(t)``, ``p`` the update probability (or schedule) at step ``t``. The
same run is bit-for-bit the same run again.

State (as psgd_jax): ``dict(count, mu, Qs_preconditioners, update_counter)``;
``mu`` is None when ``b1 == 0``; ``Qs_preconditioners`` has the params' tree
with, per leaf, a list of factors (``(d, d)`` upper-triangular or ``(d,)``
diagonal, one 0-d factor for a 0-d leaf) with the stacked axes in front.
``kron``'s state is the chain's: ``(that dict, [add_decayed_weights state if
weight_decay > 0], scale_by_learning_rate state)``.

Stacked layers: ``stacked_axes=n`` treats the first ``n`` axes of every leaf
as independent layers (``[repeats, stages, d_in, d_out]`` with ``n = 2``): no
factor for them, and each layer gets its own factors, damping mean and RMS
clip. A leaf of rank ``n`` or less is an error that names it (stack a
per-layer scalar as ``(layers, 1)``). ``scanned_layers`` (psgd_jax's
per-leaf bools) marks one such axis per
leaf. psgd_jax takes the damping mean and the RMS clip over a scanned leaf as
a whole; here they are per layer, and each layer's probe comes from its
own key, which is what lets a pipeline stage update its layers without the
others and equal the unpipelined step (``apply_gradients``'s
``layer_index_fn`` gives a slice's layers their indices in the whole leaf).
Unstacked leaves follow psgd_jax's math; their probe values are this
module's own draw.
``lax_map_scanned_layers`` / ``lax_map_batch_size`` run the XLA path's
per-layer math with ``lax.map``; the kernels always walk layers with a grid.

Under ``optax.inject_hyperparams``, name the integer structure arguments
static: ``optax.inject_hyperparams(kron, static_args=KRON_STATIC_ARGS)``.
"""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.random import threefry2x32_p

from pallasopt.kernels import _compat
from pallasopt.kernels import kron as kk
from pallasopt.kernels.kron_factor import kron_factor_update
from pallasopt.kernels._dispatch import resolve_impl
from pallasopt.optim import _validation as v
from pallasopt.optim._base import (
    FusedGradientTransformation,
    advance_schedule,
    fused_transformation,
    schedule_value,
)
from pallasopt.optim._types import MaskOrFn, Numeric, ScalarOrSchedule

__all__ = [
    "KRON_STATIC_ARGS",
    "PRNG_SEED",
    "precond_update_prob_schedule",
    "scale_by_kron",
    "kron",
]

_OWNER = "pallasopt.optim.kron"
PRNG_SEED = 5318008
MEMORY_SAVE_MODES = (None, "one_diag", "all_diag")
KRON_STATIC_ARGS = ("max_size_triangular", "min_ndim_triangular", "lax_map_batch_size", "stacked_axes")
_DAMPING = float(np.sqrt(np.finfo(np.float32).eps))
# psgd_jax rebalances on 1% of updates.
_BALANCE_PROB = 0.01


def precond_update_prob_schedule(
    max_prob: float = 1.0, min_prob: float = 0.03, decay: float = 0.001, flat_start: int = 500
) -> Callable[[Numeric], jax.Array]:
  """psgd_jax's annealed update probability: ``max_prob`` for ``flat_start``
  steps, then ``max_prob * exp(-decay (n - flat_start))``, floored at
  ``min_prob`` (0.03 by about step 4000 with the defaults)."""

  def schedule(n):
    return jnp.minimum(jnp.maximum(max_prob * jnp.exp(-decay * (n - flat_start)), min_prob), max_prob)

  return schedule


def _structural(name: str, value: Any) -> int:
  return v.static_int(_OWNER, name, value, static_args="KRON_STATIC_ARGS")


def _init_layer_factors(inner, leaf_dtype, scale, max_size, min_ndim, memory_save_mode, dtype):
  """One layer's factors, as psgd_jax initialises them."""
  if not inner:
    return [scale * jnp.ones((), dtype or leaf_dtype)]
  scale = scale ** (1 / len(inner))
  diag = [False] * len(inner)
  if memory_save_mode == "one_diag":
    # The largest axis (the last of the largest on ties).
    diag[int(np.argsort(inner, kind="stable")[-1])] = True
  elif memory_save_mode == "all_diag":
    diag = [True] * len(inner)
  factors = []
  for size, forced in zip(inner, diag):
    if size == 1 or size > max_size or len(inner) < min_ndim or forced:
      factors.append(scale * jnp.ones((size,), dtype or jnp.float32))
    else:
      factors.append(scale * jnp.eye(size, dtype=dtype or jnp.float32))
  return factors


def _dense(q, stacked: int) -> bool:
  return q.ndim - stacked == 2


def _balance(qs, stacked: int):
  """Scales a layer's factors to the geometric mean of their max-abs norms."""
  if len(qs) < 2:
    return qs
  axes = lambda q: tuple(range(stacked, q.ndim))
  norms = [jnp.max(jnp.abs(q.astype(jnp.float32)), axis=axes(q)) for q in qs]
  gmean = math.prod(norms) ** (1 / len(qs))
  return [
      q * (gmean / n).reshape(n.shape + (1,) * (q.ndim - stacked)).astype(q.dtype)
      for q, n in zip(qs, norms)
  ]


def _threefry(key_words, x1, x2):
  """Threefry-2x32 of the counter pairs ``(x1, x2)`` under keys ``key_words``
  (``[2, ...]`` uint32, broadcast): two uint32 arrays."""
  k1, k2, x1, x2 = jnp.broadcast_arrays(key_words[0], key_words[1], x1, x2)
  return threefry2x32_p.bind(*(a.astype(jnp.uint32) for a in (k1, k2, x1, x2)))


def _probes(key, shapes, stacked, layer_index_fn):
  """Per leaf, its layers' probes ``[layers, *inner shape]``, standard normal.

  Layer ``l`` of leaf ``i`` (``l`` its row-major index over the whole leaf's
  stacked axes, from ``layer_index_fn(local stacked shape)``, or ``arange``
  when None; 0 for an unstacked leaf) has the key ``threefry(key, (i,
  l))``, and its element ``e`` (row-major in the layer) is ``sqrt(2)
  erfinv(u)``, ``u`` uniform in (-1, 1) from ``threefry(layer key, (e,
  0))``: the same values whatever slice of the leaf is updated. Two
  threefry hashes for all leaves, whose compile time would dominate small
  steps if drawn per leaf.
  """
  batches = [math.prod(shape[:n]) for shape, n in zip(shapes, stacked)]
  sizes = [math.prod(shape[n:]) for shape, n in zip(shapes, stacked)]
  layers = jnp.concatenate([
      jnp.reshape(layer_index_fn(shape[:n]), (b,)) if layer_index_fn and n else jnp.arange(b)
      for shape, n, b in zip(shapes, stacked, batches)
  ])
  leaves = np.repeat(np.arange(len(shapes)), batches)
  layer_keys = jnp.stack(_threefry(jax.random.key_data(key), leaves, layers))
  rows = np.cumsum([0] + batches)
  bits = _threefry(
      jnp.concatenate([
          jnp.broadcast_to(layer_keys[:, r:r + b, None], (2, b, m)).reshape(2, b * m)
          for r, b, m in zip(rows, batches, sizes)
      ], axis=1),
      jnp.concatenate([
          jax.lax.broadcasted_iota(jnp.uint32, (b, m), 1).reshape(b * m)
          for b, m in zip(batches, sizes)
      ]),
      0,
  )[0]
  unit = jax.lax.bitcast_convert_type((bits >> 9) | np.uint32(0x3F800000), jnp.float32) - 1.0
  low = np.nextafter(np.float32(-1.0), np.float32(0.0))
  normal = np.float32(np.sqrt(2)) * jax.lax.erf_inv(jnp.maximum(low, unit * (1.0 - low) + low))
  starts = np.cumsum([0] + [b * m for b, m in zip(batches, sizes)])
  return [
      normal[start:start + b * m].reshape((b,) + shape[n:])
      for start, b, m, shape, n in zip(starts, batches, sizes, shapes, stacked)
  ]


class _KronOptions(NamedTuple):
  """`scale_by_kron`'s arguments (psgd_jax's), which `kron` passes on as they are."""

  b1: Any
  preconditioner_update_probability: Any
  max_size_triangular: Any
  min_ndim_triangular: Any
  memory_save_mode: Any
  momentum_into_precond_update: Any
  preconditioner_lr: Any
  preconditioner_init_scale: Any
  mu_dtype: Any
  precond_dtype: Any
  precond_update_precision: Any
  precond_grads_precision: Any
  scanned_layers: Any
  lax_map_scanned_layers: Any
  lax_map_batch_size: Any
  stacked_axes: Any
  impl: Any


class _Core:
  """The shared step of `scale_by_kron` and `kron` (psgd_jax's update_fn)."""

  def __init__(self, options: _KronOptions):
    for name, value, high, inclusive in (
        ("b1", options.b1, 1.0, False),
        ("preconditioner_update_probability", options.preconditioner_update_probability, 1.0,
         True),
        ("preconditioner_lr", options.preconditioner_lr, math.inf, True),
        ("preconditioner_init_scale", options.preconditioner_init_scale, math.inf, True),
    ):
      v.check_hyperparameter(_OWNER, name, value, high=high, high_inclusive=inclusive)
    if options.memory_save_mode not in MEMORY_SAVE_MODES:
      raise ValueError(
          f"{_OWNER}: memory_save_mode must be one of {MEMORY_SAVE_MODES}; got "
          f"{options.memory_save_mode!r}."
      )
    for name, precision in (
        ("precond_update_precision", options.precond_update_precision),
        ("precond_grads_precision", options.precond_grads_precision),
    ):
      if precision not in kk.PRECISIONS:
        raise ValueError(f"{_OWNER}: {name} must be one of {kk.PRECISIONS}; got {precision!r}.")
    self.stacked_axes = _structural("stacked_axes", options.stacked_axes)
    if self.stacked_axes and options.scanned_layers is not None:
      raise ValueError(
          f"{_OWNER}: pass stacked_axes or scanned_layers, not both (scanned_layers marks "
          "one stacked axis per leaf; stacked_axes marks the same axes on every leaf)."
      )
    self.max_size = _structural("max_size_triangular", options.max_size_triangular)
    self.min_ndim = _structural("min_ndim_triangular", options.min_ndim_triangular)
    self.map_batch_size = (
        _structural("lax_map_batch_size", options.lax_map_batch_size)
        if options.lax_map_scanned_layers else None
    )
    resolve_impl(options.impl)
    self.b1 = options.b1
    self.probability = options.preconditioner_update_probability
    self.memory_save_mode = options.memory_save_mode
    self.momentum_into_precond_update = options.momentum_into_precond_update
    self.preconditioner_lr = options.preconditioner_lr
    self.init_scale = options.preconditioner_init_scale
    self.mu_dtype = v.optional_float_dtype(_OWNER, "mu_dtype", options.mu_dtype)
    self.precond_dtype = v.optional_float_dtype(_OWNER, "precond_dtype", options.precond_dtype)
    self.update_precision = options.precond_update_precision
    self.grads_precision = options.precond_grads_precision
    self.scanned_layers = options.scanned_layers
    self.impl = options.impl

  def stacked(self, tree) -> list[int]:
    """Per leaf, the number of leading layer axes (at most its rank)."""
    if self.scanned_layers is None:
      v.check_stacked_axes(_OWNER, tree, self.stacked_axes)
      counts = [self.stacked_axes] * len(jax.tree.leaves(tree))
    else:
      counts = [int(s) for s in v.broadcast_mask(_OWNER + " scanned_layers", self.scanned_layers, tree)]
    return [min(n, jnp.ndim(x)) for n, x in zip(counts, jax.tree.leaves(tree))]

  def init(self, params):
    v.check_float_leaves(_OWNER, "params", params)
    has_mu = v.concrete_value(_OWNER, "b1", self.b1) != 0.0
    mu = jax.tree.map(lambda p: jnp.zeros_like(p, self.mu_dtype or p.dtype), params) if has_mu else None
    qs = []
    for p, n in zip(jax.tree.leaves(params), self.stacked(params)):
      layer = _init_layer_factors(
          p.shape[n:], p.dtype, self.init_scale, self.max_size, self.min_ndim,
          self.memory_save_mode, self.precond_dtype,
      )
      qs.append([jnp.broadcast_to(q, p.shape[:n] + q.shape) for q in layer])
    return dict(
        count=jnp.zeros([], jnp.int32),
        mu=mu,
        Qs_preconditioners=jax.tree.structure(params).unflatten(qs),
        update_counter=jnp.zeros([], jnp.int32),
    )

  def _check_state(self, grads, state):
    v.check_float_leaves(_OWNER, "grads", grads)
    if state["mu"] is not None:
      v.check_same_tree(_OWNER, "grads", grads, "opt_state['mu']", state["mu"])
    treedef = jax.tree.structure(grads)
    try:
      # A leaf's factor list may come back as a mapping {0: Q0, 1: Q1}
      # (flax.nnx stores lists as State); its leaves are the factors in order.
      qs = [jax.tree.leaves(layer) for layer in treedef.flatten_up_to(state["Qs_preconditioners"])]
    except (ValueError, TypeError) as e:
      raise ValueError(
          f"{_OWNER}: grads must have the tree structure of opt_state['Qs_preconditioners']; {e}"
      ) from None
    for (path, g), layer_qs, n in zip(v.keyed_leaves(grads), qs, self.stacked(grads)):
      inner = jnp.shape(g)[n:] or (1,)
      dims = tuple(q.shape[n] if q.ndim > n else 1 for q in layer_qs)
      if dims != inner or any(q.shape[:n] != jnp.shape(g)[:n] for q in layer_qs):
        raise ValueError(
            f"{_OWNER}: grads{path} has shape {jnp.shape(g)} but its preconditioner factors "
            f"have shapes {[q.shape for q in layer_qs]} (with {n} stacked axes); they must match."
        )
    return qs

  def _update_factors(self, key, qs, precond_in, stacked, layer_index_fn):
    """psgd_jax's update_preconditioner on batched layers: balance, probe, kernel (b).

    The rebalancing decision and the probes come from the two halves of
    ``split(key)``; see `_probes`.
    """
    balance_key, probe_key = jax.random.split(key)
    qs = jax.lax.cond(
        jax.random.uniform(balance_key) < _BALANCE_PROB,
        lambda qs: _compat.reshard_like([_balance(q, n) for q, n in zip(qs, stacked)], qs),
        lambda qs: qs, qs,
    )
    probes = _probes(probe_key, [g.shape for g in precond_in], stacked, layer_index_fn)
    new_qs = []
    for layer_qs, g, probe, n in zip(qs, precond_in, probes, stacked):
      batch = math.prod(g.shape[:n])
      g = g.reshape((batch,) + g.shape[n:]).astype(jnp.float32)
      inner_axes = tuple(range(1, g.ndim))
      g = g + _DAMPING * jnp.mean(jnp.abs(g), axis=inner_axes, keepdims=True) * probe
      flat_qs = [q.reshape((batch,) + q.shape[n:]) for q in layer_qs]
      with jax.default_matmul_precision(self.update_precision):
        a = kk.map_layers(lambda g, *qs: kk.apply_factors(g, qs), (g, *flat_qs), self.map_batch_size)
        conj = kk.map_layers(lambda x, *qs: kk.conj_probe(x, qs), (probe, *flat_qs), self.map_batch_size)
      updated = []
      for axis, (q, q_flat) in enumerate(zip(layer_qs, flat_qs)):
        x = jax.vmap(lambda t: kk.matricize(t, axis))(a)
        y = jax.vmap(lambda t: kk.matricize(t, axis))(conj)
        new_q = kron_factor_update(
            q_flat if q_flat.ndim > 1 else q_flat[:, None], x, y, self.preconditioner_lr,
            precision=self.update_precision, map_batch_size=self.map_batch_size, impl=self.impl,
        )
        updated.append(new_q.reshape(q.shape).astype(self.precond_dtype or q.dtype))
      new_qs.append(updated)
    return new_qs

  def step(self, grads, state, params, *, mode, decays, scalars_fn, grad_scale, layer_index_fn=None):
    """One step; returns (outputs tree, new state dict)."""
    qs = self._check_state(grads, state)
    stacked = self.stacked(grads)
    treedef = jax.tree.structure(grads)
    count = state["count"]
    count_inc = optax.safe_increment(count)
    key = jax.random.fold_in(jax.random.PRNGKey(PRNG_SEED), count)
    probability = self.probability(count_inc) if callable(self.probability) else self.probability
    counter = optax.safe_increment(state["update_counter"])
    do_update = counter >= 1 / jnp.asarray(probability, jnp.float32)
    counter = jnp.where(do_update, 0, counter)
    gs = jax.tree.leaves(grads)
    mus = jax.tree.leaves(state["mu"]) if state["mu"] is not None else [None] * len(gs)
    scale = jnp.asarray(1.0 if grad_scale is None else grad_scale, jnp.float32)
    scalars = scalars_fn(count_inc, scale)

    def precond_input(g, mu):
      g = g.astype(jnp.float32) * scale
      if mu is None or not self.momentum_into_precond_update:
        return g
      return (scalars.b1 * mu.astype(jnp.float32) + scalars.one_minus_b1 * g) / scalars.bias_correction

    qs = jax.lax.cond(
        do_update,
        # Both branches must carry the factors' sharding (Explicit meshes).
        lambda key, qs, gs, mus: _compat.reshard_like(self._update_factors(
            key, qs, [precond_input(g, mu) for g, mu in zip(gs, mus)], stacked, layer_index_fn
        ), qs),
        lambda key, qs, gs, mus: qs,
        key, qs, gs, mus,
    )
    ps = jax.tree.leaves(params) if params is not None else [None] * len(gs)
    outs, new_mus = [], []
    for g, mu, p, layer_qs, n, decay in zip(gs, mus, ps, qs, stacked, decays):
      batch = math.prod(g.shape[:n])
      as_batch = lambda x: None if x is None else x.reshape((batch,) + g.shape[n:])
      out, new_mu = kk.kron_precondition(
          as_batch(g), as_batch(mu), as_batch(p),
          [q.reshape((batch,) + q.shape[n:]) for q in layer_qs], scalars,
          mode=mode, decay=decay, precision=self.grads_precision,
          map_batch_size=self.map_batch_size, impl=self.impl,
      )
      outs.append(out.reshape(g.shape))
      new_mus.append(None if new_mu is None else new_mu.reshape(g.shape))
    new_state = dict(
        count=count_inc,
        mu=None if state["mu"] is None else treedef.unflatten(new_mus),
        Qs_preconditioners=treedef.unflatten(qs),
        update_counter=counter,
    )
    return treedef.unflatten(outs), new_state


def scale_by_kron(
    b1: float = 0.9,
    preconditioner_update_probability: float | Callable[[int], float] = precond_update_prob_schedule(),
    max_size_triangular: int = 8192,
    min_ndim_triangular: int = 2,
    memory_save_mode: str | None = None,
    momentum_into_precond_update: bool = True,
    preconditioner_lr: float = 0.1,
    preconditioner_init_scale: float = 1.0,
    mu_dtype: Any | None = None,
    precond_dtype: Any | None = None,
    precond_update_precision: str | None = "tensorfloat32",
    precond_grads_precision: str | None = None,
    scanned_layers: Any | None = None,
    lax_map_scanned_layers: bool = False,
    lax_map_batch_size: int = 8,
    *,
    stacked_axes: int = 0,
    impl: str = "auto",
) -> optax.GradientTransformationExtraArgs:
  """psgd_jax's ``scale_by_kron``: returns the clipped preconditioned momentum.

  Arguments as psgd_jax 0.2.9 (see the module docstring), plus:

  Args:
    b1: momentum decay in [0, 1); 0 keeps no momentum (``mu`` is None).
    preconditioner_update_probability: a probability in [0, 1] or a schedule
      of the step count (default: `precond_update_prob_schedule`).
    max_size_triangular: axes longer than this get a diagonal factor.
    min_ndim_triangular: layers of lower rank get only diagonal factors.
    memory_save_mode: None, ``"one_diag"`` (the largest axis diagonal) or
      ``"all_diag"``.
    momentum_into_precond_update: fit the preconditioner to the momentum
      rather than the raw gradient.
    preconditioner_lr: the factors' step size.
    preconditioner_init_scale: initial factors are ``scale^(1/N) I``.
    mu_dtype: momentum dtype (None: the params').
    precond_dtype: factor dtype (None: float32).
    precond_update_precision: matmul precision of factor updates.
    precond_grads_precision: matmul precision of preconditioning.
    scanned_layers: per-leaf bools (a tree or prefix, or a callable): the
      leaf's first axis is a layer axis.
    lax_map_scanned_layers: run per-layer XLA math with ``lax.map``.
    lax_map_batch_size: its batch size.
    stacked_axes: leading layer axes on every leaf (contract 2).
    impl: ``"auto" | "pallas" | "interpret" | "xla"``.
  """
  core = _Core(_KronOptions(
      b1=b1,
      preconditioner_update_probability=preconditioner_update_probability,
      max_size_triangular=max_size_triangular,
      min_ndim_triangular=min_ndim_triangular,
      memory_save_mode=memory_save_mode,
      momentum_into_precond_update=momentum_into_precond_update,
      preconditioner_lr=preconditioner_lr,
      preconditioner_init_scale=preconditioner_init_scale,
      mu_dtype=mu_dtype,
      precond_dtype=precond_dtype,
      precond_update_precision=precond_update_precision,
      precond_grads_precision=precond_grads_precision,
      scanned_layers=scanned_layers,
      lax_map_scanned_layers=lax_map_scanned_layers,
      lax_map_batch_size=lax_map_batch_size,
      stacked_axes=stacked_axes,
      impl=impl,
  ))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    return core.step(
        updates, state, None, mode="precond",
        decays=[False] * len(jax.tree.leaves(updates)),
        scalars_fn=lambda count, scale: kk.kron_scalars(count, b1=b1, grad_scale=scale),
        grad_scale=None,
    )

  return optax.GradientTransformationExtraArgs(core.init, update_fn)


def kron(
    learning_rate: ScalarOrSchedule = 0.001,
    b1: float = 0.9,
    weight_decay: float = 0.0,
    weight_decay_mask: MaskOrFn = None,
    preconditioner_update_probability: float | Callable[[int], float] = precond_update_prob_schedule(),
    max_size_triangular: int = 8192,
    min_ndim_triangular: int = 2,
    memory_save_mode: str | None = None,
    momentum_into_precond_update: bool = True,
    preconditioner_lr: float = 0.1,
    preconditioner_init_scale: float = 1.0,
    mu_dtype: Any | None = None,
    precond_dtype: Any | None = None,
    precond_update_precision: str | None = "tensorfloat32",
    precond_grads_precision: str | None = None,
    scanned_layers: Any | None = None,
    lax_map_scanned_layers: bool = False,
    lax_map_batch_size: int = 8,
    *,
    stacked_axes: int = 0,
    impl: str = "auto",
) -> FusedGradientTransformation:
  r"""PSGD Kron, a drop-in for psgd_jax 0.2.9's ``kron``.

  ``scale_by_kron`` followed by decoupled weight decay (``weight_decay > 0``,
  on ``weight_decay_mask``) and the learning rate:
  :math:`u = -\eta_t (\mathrm{clip}(P \hat m) + \lambda p)`. Same arguments
  and state as psgd_jax (``(scale_by_kron dict, [decay state], lr state)``);
  see `scale_by_kron` and the module docstring.

  ``update`` returns Optax updates, one fused kernel (a) per leaf;
  ``apply_gradients(params, grads, state, *, grad_scale=None,
  learning_rate=None, layer_index_fn=None)`` writes ``p + u`` and the
  momentum in place instead. When the leaves are shards of larger stacked
  leaves, ``layer_index_fn(stacked_shape)`` returns, for a leaf's local
  stacked shape, the int array (of that shape) of each local layer's
  row-major index over the whole leaf's stacked axes, which picks its probe
  (see the module docstring); None means the leaves are whole (``arange``).
  The stage-local layer passes it inside ``shard_map``.

  Raises:
    ValueError: a hyperparameter out of range; mismatched grads and state.
    TypeError: a leaf (or ``mu_dtype``/``precond_dtype``) not float32/bfloat16.
  """
  v.check_finite(_OWNER, "learning_rate", learning_rate)
  v.check_finite(_OWNER, "weight_decay", weight_decay)
  if callable(weight_decay):
    raise TypeError(f"{_OWNER}: weight_decay must be a scalar (psgd_jax takes no schedule).")
  core = _Core(_KronOptions(
      b1=b1,
      preconditioner_update_probability=preconditioner_update_probability,
      max_size_triangular=max_size_triangular,
      min_ndim_triangular=min_ndim_triangular,
      memory_save_mode=memory_save_mode,
      momentum_into_precond_update=momentum_into_precond_update,
      preconditioner_lr=preconditioner_lr,
      preconditioner_init_scale=preconditioner_init_scale,
      mu_dtype=mu_dtype,
      precond_dtype=precond_dtype,
      precond_update_precision=precond_update_precision,
      precond_grads_precision=precond_grads_precision,
      scanned_layers=scanned_layers,
      lax_map_scanned_layers=lax_map_scanned_layers,
      lax_map_batch_size=lax_map_batch_size,
      stacked_axes=stacked_axes,
      impl=impl,
  ))
  with_decay = v.concrete_value(_OWNER, "weight_decay", weight_decay) != 0.0
  decay_tx = optax.add_decayed_weights(weight_decay, weight_decay_mask)
  lr_tx = optax.scale_by_learning_rate(learning_rate)

  def init_fn(params):
    parts = [core.init(params)]
    if with_decay:
      parts.append(decay_tx.init(params))
    return (*parts, lr_tx.init(params))

  def step(grads, state, params, mode, grad_scale, learning_rate_now, layer_index_fn=None):
    kron_state, *decay_state, lr_state = state
    decays = (
        v.broadcast_mask(_OWNER, weight_decay_mask, grads)
        if decay_state else [False] * len(jax.tree.leaves(grads))
    )
    v.checked_param_leaves(_OWNER, params, grads, mode=mode, decays=decays)
    if learning_rate_now is None:
      learning_rate_now = schedule_value(learning_rate, lr_state)
    first, kron_state = core.step(
        grads, kron_state, params, mode=mode, decays=decays, grad_scale=grad_scale,
        layer_index_fn=layer_index_fn, scalars_fn=lambda count, scale: kk.kron_scalars(
            count, learning_rate_now, b1, weight_decay if decay_state else 0.0, scale
        ),
    )
    return first, (kron_state, *decay_state, advance_schedule(lr_state))

  return fused_transformation(
      init_fn, step, stacked_axes=core.stacked_axes, layer_indexed=True
  )
