r"""Fused Adafactor: factored second moments, block-RMS clipping, parameter scale.

Shazeer & Stern, `Adafactor: Adaptive Learning Rates with Sublinear Memory
Cost <https://arxiv.org/abs/1804.04235>`_ (2018), exactly as
``optax.adafactor`` chains it (``scale_by_factored_rms``,
``clip_by_block_rms``, ``scale_by_learning_rate``,
``scale_by_param_block_rms``, ``ema``, ``add_decayed_weights``,
``scale(-1)``). With step count :math:`t` (before this step's increment),
gradient :math:`g` (times ``grad_scale``) and
:math:`\hat\beta_t = 1 - (t - \text{decay\_offset} + 1)^{-\text{decay\_rate}}`:

.. math::

  G &= g^2 + \epsilon \\
  \text{factored:}\quad
  R &= \hat\beta_t R + (1 - \hat\beta_t)\,\mathrm{mean}_{d_0} G, \quad
  C = \hat\beta_t C + (1 - \hat\beta_t)\,\mathrm{mean}_{d_1} G, \\
  u &= g \cdot (R / \mathrm{mean}_{d_1} R)^{-1/2} \cdot C^{-1/2} \\
  \text{unfactored:}\quad
  V &= \hat\beta_t V + (1 - \hat\beta_t) G, \quad u = g \cdot V^{-1/2} \\
  u &\leftarrow \eta\, u \,/\, \max(1, \mathrm{rms}(u) / \text{clipping\_threshold})
      \cdot \max(\mathrm{rms}(p), 10^{-3}) \\
  m &= (1 - \mu)\, u + \mu\, m, \quad u \leftarrow m \\
  u &\leftarrow -(u + \lambda p)

:math:`d_0` and :math:`d_1` are the largest and second-largest axes of the leaf
(`factored_dims`, Optax's rule); a leaf is factored only if
:math:`d_1` has at least ``min_dim_size_to_factor`` elements. RMS values are
per *block*: the whole leaf, or each slice along ``stacked_axes`` leading
axes (see below). The clipping, parameter-scale, momentum and weight-decay
terms are each optional, as in Optax.

Passes over HBM
---------------
Whole-leaf statistics must be complete before any element can be updated, so
one kernel cannot do it all. Per leaf (``n`` elements; vectors of length
R, C and the partial sums of `_reduction` are a few percent more):

* **factored** (``[P, R, C]`` view):

  1. statistics: reads ``g`` (and ``p`` with parameter scale) and produces the
     row and column sums of :math:`G` (and the sum of :math:`p^2`); XLA turns
     them into the new ``v_row``/``v_col`` and the row and column factors
     (vectors only);
  2. only with clipping: reads ``g`` again for :math:`\sum u^2`. ``u`` needs
     the factors, which need every element of ``g``, and the clip factor
     needs every ``u``, so this cannot join pass 1 or 3 (writing ``u`` in pass
     2 and reading it in 3 would move more bytes than reading ``g`` twice);
  3. update: reads ``g`` (``p`` in apply mode or with weight decay; ``m`` with
     momentum) and writes ``p`` or ``u`` (and ``m``).

  Two passes without clipping, three with it. f32, Optax's defaults
  (clipping, parameter scale), apply mode: 8 + 4 + 12 = **24 bytes per
  parameter**; updates mode 20 (+12 for ``optax.apply_updates``).

* **unfactored** (the leaf's own ``[P, R, C]`` view, `leaf_view`, where
  each RMS block is whole matrices of it; rows of the block's elements only
  where stacked axes reach into the last two dims):

  1. only with clipping or parameter scale: reads ``g`` and ``v`` for
     :math:`\sum u^2` (with clipping) and ``p`` for :math:`\sum p^2` (with
     parameter scale); parameter scale alone reads only ``p``. Nothing is
     written: the update pass recomputes ``V`` from ``g`` and ``v``, which
     costs the same bytes as writing ``V`` here and reading it there;
  2. update: reads ``g``, ``v`` (``p``, ``m``) and writes ``V``, ``p``/``u``
     (``m``). One pass without clipping and parameter scale.

  f32 defaults, apply mode: 12 + 20 = 32 bytes per parameter.

Where each path pays (`pallasopt.kernels.policy`'s Adafactor row). On a CUDA GPU ``impl="auto"`` runs these kernels
(timed on an H100: 1.11x Optax on GPT-2 small, 1.20x on the 1B decoder). On a
TPU it runs the XLA reference: compiled for v5e and v6e (`bench.compiled
--optimizer adafactor`), XLA fuses the statistics into fewer passes than the
kernels make (a factored matrix: 16 B/param against the kernels' 20) and the
kernels' operands cost temporary memory and relayouts on a model's tree
(GPT-2 small: 35-47 MB and 12-13 copies of 1 MiB or more; XLA none).
``impl="pallas"`` still runs the Mosaic kernels there.

Every per-step number (learning rate, :math:`\hat\beta_t`, thresholds, the
per-block scale) is kernel data, never a Python constant. Math is f32 whatever
the operand dtypes; each result is rounded once, to its own dtype. The
reference takes :math:`x^{-1/2}` as Optax does (an XLA power), so on f32 it
follows Optax's rounding; the kernels use one ``rsqrt`` per element instead.

Stacked leaves and layouts
--------------------------
Optax factors the two largest axes of *every* leaf, including stacking axes:
a ``[layers, d_in, d_out]`` weight with ``layers < min(d_in, d_out)`` is
factored over ``(d_in, d_out)`` with ``v_row`` of shape ``[layers, d_in]``
or ``[layers, d_out]`` (so each layer has its own statistics), but its clip
and parameter-scale RMS are taken over all layers together, and once
``layers`` is one of the two largest axes Optax factors over it. With
``stacked_axes=k`` the first ``k`` axes are batch axes: never factored,
``factored_dims`` is chosen among the other axes, and the RMS values are per
slice, so a stacked leaf is updated exactly like its slices as separate
leaves. ``stacked_axes=0`` is Optax's behaviour.

The Pallas path needs the two factored axes to be the last two axes of the
leaf that are larger than 1 (``[..., d_in, d_out]``, ``[layers, ..., d_in,
d_out]``, conv kernels ``[kh, kw, c_in, c_out]``): then ``[P, R, C]`` is a
free reshape. Any other factored layout (e.g. ``[d_model, heads, head_dim]``
factored over axes 0 and 2) runs the XLA reference for that leaf.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallasopt.kernels import _reduction as red
from pallasopt.kernels import policy
from pallasopt.kernels._dispatch import dispatch
from pallasopt.kernels._tiling import BlockPlan, leaf_view, plan_blocks

__all__ = [
    "AdafactorScalars",
    "adafactor_scalars",
    "factored_dims",
    "matrix_view",
    "adafactor_reference",
    "adafactor_kernel",
    "adafactor_apply",
    "adafactor_updates",
    "MIN_PARAMETER_SCALE",
]

# `optax.scale_by_param_block_rms`'s floor, which `optax.adafactor` keeps.
MIN_PARAMETER_SCALE = 1e-3

# Per-element work of each pass, for the cost estimates.
_STATS_FLOPS, _RMS_FLOPS, _UPDATE_FLOPS = 6, 6, 10


class AdafactorScalars(NamedTuple):
  """Per-step scalars of an Adafactor update; every field is a 0-d value."""

  learning_rate: jax.typing.ArrayLike  # 1 when the transform has none
  decay_rate: jax.typing.ArrayLike  # this step's beta2: 1 - (t + 1)**-decay_rate
  one_minus_decay_rate: jax.typing.ArrayLike
  eps: jax.typing.ArrayLike
  clipping_threshold: jax.typing.ArrayLike
  momentum: jax.typing.ArrayLike
  # 1 - momentum, computed before rounding momentum to f32.
  one_minus_momentum: jax.typing.ArrayLike
  weight_decay: jax.typing.ArrayLike
  grad_scale: jax.typing.ArrayLike  # multiplies g on load, e.g. a clip factor


def adafactor_scalars(
    count: jax.typing.ArrayLike,
    *,
    learning_rate: jax.typing.ArrayLike = 1.0,
    decay_rate: jax.typing.ArrayLike = 0.8,
    decay_offset: jax.typing.ArrayLike = 0,
    eps: jax.typing.ArrayLike = 1e-30,
    clipping_threshold: jax.typing.ArrayLike = 1.0,
    momentum: jax.typing.ArrayLike = 0.0,
    weight_decay: jax.typing.ArrayLike = 0.0,
    grad_scale: jax.typing.ArrayLike = 1.0,
) -> AdafactorScalars:
  """Builds the scalars of the step whose state count is ``count``.

  ``count`` is the state's count *before* this step (0 on the first step),
  as `optax.scale_by_factored_rms` uses it. The second-moment decay is Optax's
  ``1 - (count - decay_offset + 1) ** -decay_rate``, in f32.
  """
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  t = jnp.asarray(jnp.asarray(count) - decay_offset + 1, jnp.float32)
  beta2 = 1.0 - t ** (-f32(decay_rate))
  return AdafactorScalars(
      learning_rate=f32(learning_rate),
      decay_rate=beta2,
      one_minus_decay_rate=1.0 - beta2,
      eps=f32(eps),
      clipping_threshold=f32(clipping_threshold),
      momentum=f32(momentum),
      one_minus_momentum=f32(1 - momentum),
      weight_decay=f32(weight_decay),
      grad_scale=f32(grad_scale),
  )


def factored_dims(
    shape: tuple[int, ...],
    factored: bool = True,
    min_dim_size_to_factor: int = 128,
    stacked_axes: int = 0,
) -> tuple[int, int] | None:
  """The axes ``(d1, d0)`` whose second moments are factored, or None.

  Optax's rule (`optax._src.factorized._factored_dims`) applied to the axes
  after the first ``stacked_axes``: ``d0`` is the largest axis and ``d1`` the
  second largest (ties resolved by ``np.argsort``, as Optax does), and the
  leaf is factored only if ``factored`` and ``shape[d1] >=
  min_dim_size_to_factor``. The axes returned index the full shape.
  """
  stacked = min(stacked_axes, len(shape))
  inner = tuple(shape[stacked:])
  if not factored or len(inner) < 2:
    return None
  order = np.argsort(inner)
  if inner[order[-2]] < min_dim_size_to_factor:
    return None
  return stacked + int(order[-2]), stacked + int(order[-1])


def matrix_view(
    shape: tuple[int, ...], dims: tuple[int, int]
) -> tuple[int, int, int] | None:
  """``(P, R, C)`` if a factored leaf reshapes freely to ``[P, R, C]``, else None.

  R and C are the factored axes, in the order they appear in ``shape``; it
  works when no axis after the first of them, other than the second, is
  larger than 1.
  """
  i, j = sorted(dims)
  if any(d != 1 for k, d in enumerate(shape[i + 1:], i + 1) if k != j):
    return None
  return math.prod(shape[:i]), shape[i], shape[j]


def _check(mode: str, p, m, *, parameter_scale: bool, momentum: bool, decay: bool) -> None:
  if mode not in ("apply", "updates"):
    raise ValueError(f"mode must be 'apply' or 'updates'; got {mode!r}.")
  needs = [why for why, used in (("in 'apply' mode", mode == "apply"),
                                 ("with parameter scale", parameter_scale),
                                 ("with decay", decay)) if used]
  if p is None and needs:
    raise ValueError(f"p is required {' and '.join(needs)}.")
  if momentum != (m is not None):
    raise ValueError("m must be given exactly when momentum is on.")


def _updates_dtype(p, g, moment, m):
  # Optax's updates: the gradient times factors in the state's dtype (the
  # params'), promoted with the momentum accumulator.
  return jnp.result_type(*(x.dtype for x in (p, g, moment, m) if x is not None))


def _block_scale(s: AdafactorScalars, u_sq_mean, p_sq_mean):
  """lr / clip denominator * parameter scale, from per-block means."""
  k = s.learning_rate
  if u_sq_mean is not None:
    k = k / jnp.maximum(1.0, jnp.sqrt(u_sq_mean) / s.clipping_threshold)
  if p_sq_mean is not None:
    rms = jnp.sqrt(p_sq_mean)
    k = k * jnp.where(rms <= MIN_PARAMETER_SCALE, MIN_PARAMETER_SCALE, rms)
  return k


def _finish(s: AdafactorScalars, u, p, m, *, mode: str, momentum: bool, decay: bool):
  """Momentum, weight decay and sign on f32 values: returns (p + u or u, m)."""
  if momentum:
    m = s.one_minus_momentum * u + s.momentum * m
    u = m
  if decay:
    u = u + s.weight_decay * p
  u = -u
  return (p + u if mode == "apply" else u), m


def _optax_inv_sqrt(x):
  # Optax's own op (an XLA power); the kernels use one rsqrt instead.
  return x ** -0.5


def _unfactored_u(s: AdafactorScalars, g, v, inv_sqrt=jax.lax.rsqrt):
  """(g * grad_scale) / sqrt(V) and the new V, on f32 values."""
  g = g * s.grad_scale
  v = s.decay_rate * v + s.one_minus_decay_rate * (g * g + s.eps)
  return g * inv_sqrt(v), v


def _factors(s: AdafactorScalars, row_mean, col_mean, v_row, v_col):
  """New (v_row, v_col) and the factor along d1 and d0, from the means of G.

  ``row_mean`` is the mean of G over d0 (shaped like ``v_row``), ``col_mean``
  over d1 (like ``v_col``); the mean of ``v_row`` is over its last axis here,
  the d1 axis of the caller's ``[P, d1]`` view.
  """
  v_row = s.decay_rate * v_row + s.one_minus_decay_rate * row_mean
  v_col = s.decay_rate * v_col + s.one_minus_decay_rate * col_mean
  along_d1 = _optax_inv_sqrt(v_row / jnp.mean(v_row, axis=-1, keepdims=True))
  return v_row, v_col, along_d1, _optax_inv_sqrt(v_col)


def adafactor_reference(
    p, g, v_row, v_col, v, m, scalars: AdafactorScalars, *, mode: str,
    factored_dims: tuple[int, int] | None, stacked_axes: int = 0,
    clipping: bool = True, parameter_scale: bool = True, momentum: bool = False,
    decay: bool = False,
):
  """Pure-jnp Adafactor for one leaf; the XLA path and the kernels' specification.

  Args:
    p: params (None only in ``"updates"`` mode without parameter scale and
      decay).
    g: gradient, same shape as ``p``.
    v_row, v_col, v: the leaf's `optax.FactoredState` entries: with
      ``factored_dims`` the factored statistics (``v`` is a placeholder),
      otherwise ``v`` (``v_row`` and ``v_col`` are placeholders). As in
      Optax, the placeholders come back as zeros.
    m: the momentum accumulator, or None without momentum.
    scalars: `AdafactorScalars` of this step.
    mode: ``"apply"`` returns ``p + u`` first; ``"updates"`` returns ``u``.
    factored_dims: `factored_dims` of the leaf's shape, or None.
    stacked_axes: leading axes that are batch axes of the RMS blocks.
    clipping: clip ``u`` by its block RMS (``clipping_threshold``).
    parameter_scale: multiply by the block RMS of ``p`` (floored at 1e-3).
    momentum: keep an EMA of the updates in ``m``.
    decay: add ``weight_decay * p``.

  Returns:
    ``(p + u or u, v_row, v_col, v, m)``; math in f32, each result in its
    input's dtype (``u`` in Optax's promoted dtype).
  """
  _check(mode, p, m, parameter_scale=parameter_scale, momentum=momentum, decay=decay)
  s = AdafactorScalars(*(jnp.asarray(x, jnp.float32) for x in scalars))
  f32 = lambda x: None if x is None else x.astype(jnp.float32)
  g32 = f32(g) * s.grad_scale
  if factored_dims is not None:
    d1, d0 = factored_dims
    grad_sq = g32 * g32 + s.eps
    # v_row lacks d0; its d1 axis sits at d1 or d1 - 1. Move it last to share
    # `_factors` with the kernel's [P, d1] view.
    row_axis = d1 - 1 if d1 > d0 else d1
    new_row, new_col, along_d1, along_d0 = _factors(
        s, jnp.moveaxis(jnp.mean(grad_sq, axis=d0), row_axis, -1),
        jnp.mean(grad_sq, axis=d1), jnp.moveaxis(f32(v_row), row_axis, -1), f32(v_col),
    )
    u = (g32 * jnp.expand_dims(jnp.moveaxis(along_d1, -1, row_axis), d0)
         * jnp.expand_dims(along_d0, d1))
    moment = v_row
    state = (jnp.moveaxis(new_row, -1, row_axis).astype(v_row.dtype),
             new_col.astype(v_col.dtype), jnp.zeros_like(v))
  else:
    u, new_v = _unfactored_u(s, f32(g), f32(v), _optax_inv_sqrt)
    moment = v
    state = (jnp.zeros_like(v_row), jnp.zeros_like(v_col), new_v.astype(v.dtype))
  blocks = tuple(range(min(stacked_axes, g.ndim), g.ndim))
  u = u * _block_scale(
      s,
      jnp.mean(u * u, axis=blocks, keepdims=True) if clipping else None,
      jnp.mean(jnp.square(f32(p)), axis=blocks, keepdims=True) if parameter_scale else None,
  )
  first, new_m = _finish(s, u, f32(p), f32(m), mode=mode, momentum=momentum, decay=decay)
  if mode == "apply":
    first = first.astype(p.dtype)
  else:
    first = first.astype(_updates_dtype(p, g, moment, m))
  return (first, *state, None if m is None else new_m.astype(m.dtype))


class _Direction(NamedTuple):
  """What the update pass needs from the passes before it.

  ``fn(scalars, *blocks) -> (u, extras)`` computes the unscaled update from
  the first ``len(operands)`` operands of the update pass; ``extras`` are
  further outputs (the new V) with ``extra_aliases`` ``{operand: output}``.
  ``u_sq`` and ``p_sq`` are per-matrix sums of u² and p² (None when not
  needed); ``state`` is the new ``(v_row, v_col, v)`` when the update pass
  does not produce it.
  """

  plan: BlockPlan
  operands: list
  fn: Callable
  extra_dtypes: list
  extra_aliases: dict
  u_sq: jax.Array | None
  p_sq: jax.Array | None
  state: tuple | None


def _full(plan: BlockPlan, x):
  return (red.FULL, x.reshape(plan.shape))


def _factored_direction(s, p, g, v_row, v_col, v, view, dims, *, clipping, parameter_scale,
                        call) -> _Direction:
  """Statistics pass (and RMS pass with clipping) of a factored leaf."""
  plan = plan_blocks(view, call["backend"])
  _, rows, cols = view
  d1, d0 = dims
  d0_is_cols = d0 > d1

  def stats_body(values, g, *p):
    t = AdafactorScalars(*values)
    g = g * t.grad_scale
    grad_sq = g * g + t.eps
    return (grad_sq, grad_sq) + ((p[0] * p[0],) if p else ())

  row_sum, col_sum, *p_sq = red.reduce_call(
      stats_body, [_full(plan, g)] + ([_full(plan, p)] if parameter_scale else []), tuple(s),
      ["rows", "cols"] + ["total"] * parameter_scale, plan,
      name="adafactor_stats", flops_per_element=_STATS_FLOPS, **call,
  )
  # Means of G over the C axis (one per row) and over the R axis (per column).
  means = (row_sum / cols, col_sum / rows)
  over_d0, over_d1 = means if d0_is_cols else means[::-1]
  matrices = plan.shape[0]
  new_row, new_col, along_d1, along_d0 = _factors(
      s, over_d0, over_d1, v_row.reshape(matrices, -1).astype(jnp.float32),
      v_col.reshape(matrices, -1).astype(jnp.float32),
  )
  row_factor, col_factor = (along_d1, along_d0) if d0_is_cols else (along_d0, along_d1)
  operands = [_full(plan, g), (red.ROWS, row_factor), (red.COLS, col_factor)]

  def fn(t, g, row_factor, col_factor):
    return g * t.grad_scale * row_factor * col_factor, ()

  u_sq = None
  if clipping:
    (u_sq,) = red.reduce_call(
        lambda values, *blocks: (jnp.square(fn(AdafactorScalars(*values), *blocks)[0]),),
        operands, tuple(s), ["total"], plan,
        name="adafactor_rms", flops_per_element=_RMS_FLOPS, **call,
    )
  state = (new_row.reshape(v_row.shape).astype(v_row.dtype),
           new_col.reshape(v_col.shape).astype(v_col.dtype), jnp.zeros_like(v))
  return _Direction(plan, operands, fn, [], {}, u_sq, p_sq[0] if p_sq else None, state)


def _unfactored_direction(s, p, g, v, blocks, *, clipping, parameter_scale,
                          call) -> _Direction:
  """RMS pass of an unfactored leaf (with clipping or parameter scale).

  The leaf is read in its own layout (`leaf_view`) where each RMS block is
  whole matrices of that view; otherwise (stacked axes reaching into the last
  two) as rows of its blocks (`plan_flat`, a relayout on TPU).
  """
  view = leaf_view(g.shape)
  if view[0] % blocks == 0:
    plan = plan_blocks(view, call["backend"])
  else:
    plan = red.plan_flat(blocks, g.size // blocks, call["backend"])
  operands = [_full(plan, g), _full(plan, v)]

  def fn(t, g, v):
    u, v = _unfactored_u(t, g, v)
    return u, (v,)

  with_p = [_full(plan, p)] if parameter_scale else []
  u_sq = p_sq = None
  if clipping:

    def rms_body(values, g, v, *p):
      u, _ = _unfactored_u(AdafactorScalars(*values), g, v)
      return (u * u,) + ((p[0] * p[0],) if p else ())

    u_sq, *p_sq = red.reduce_call(
        rms_body, operands + with_p, tuple(s), ["total"] * (1 + parameter_scale), plan,
        name="adafactor_rms", flops_per_element=_RMS_FLOPS, transcendentals_per_element=1,
        **call,
    )
    p_sq = p_sq[0] if p_sq else None
  elif parameter_scale:
    (p_sq,) = red.reduce_call(
        lambda values, p: (p * p,), with_p, tuple(s), ["total"], plan,
        name="adafactor_param_rms", flops_per_element=2, **call,
    )
  # The new V is output 1, written over v (operand 1).
  return _Direction(plan, operands, fn, [v.dtype], {1: 1}, u_sq, p_sq, None)


def adafactor_kernel(
    p, g, v_row, v_col, v, m, scalars: AdafactorScalars, *, mode: str,
    factored_dims: tuple[int, int] | None, stacked_axes: int = 0,
    clipping: bool = True, parameter_scale: bool = True, momentum: bool = False,
    decay: bool = False, backend: str, interpret: bool = False,
):
  """Pallas Adafactor, same signature and results as `adafactor_reference`.

  Runs the passes of the module docstring. In ``"apply"`` mode ``p`` (and
  ``m``, and unfactored ``v``) are aliased to the outputs; in ``"updates"``
  mode ``m`` and ``v`` are. Donate them in the enclosing jit to update in
  place. Empty leaves and factored layouts without a free ``[P, R, C]`` view
  (`matrix_view`) run the reference.

  Args:
    backend: ``"tpu"`` or ``"triton"``.
    interpret: run in the Pallas interpreter.
  """
  config = dict(mode=mode, factored_dims=factored_dims, stacked_axes=stacked_axes,
                clipping=clipping, parameter_scale=parameter_scale,
                momentum=momentum, decay=decay)
  _check(mode, p, m, parameter_scale=parameter_scale, momentum=momentum, decay=decay)
  view = None if factored_dims is None else matrix_view(g.shape, factored_dims)
  if g.size == 0 or (factored_dims is not None and view is None):
    return adafactor_reference(p, g, v_row, v_col, v, m, scalars, **config)

  s = AdafactorScalars(*(jnp.asarray(x, jnp.float32) for x in scalars))
  call = dict(backend=backend, interpret=interpret)
  blocks = math.prod(g.shape[: min(stacked_axes, g.ndim)])
  block_size = g.size // blocks
  if factored_dims is None:
    d = _unfactored_direction(s, p, g, v, blocks, clipping=clipping,
                              parameter_scale=parameter_scale, call=call)
  else:
    d = _factored_direction(s, p, g, v_row, v_col, v, view, factored_dims, clipping=clipping,
                            parameter_scale=parameter_scale, call=call)

  # Per-block lr / clip denominator * parameter scale, one value per matrix.
  mean = lambda sums: None if sums is None else sums.reshape(blocks, -1).sum(1) / block_size
  scale = jnp.broadcast_to(_block_scale(s, mean(d.u_sq), mean(d.p_sq)), (blocks,))
  matrices = d.plan.shape[0]
  with_p = mode == "apply" or decay
  operands = d.operands + [(red.MATRIX, jnp.repeat(scale, matrices // blocks))]
  operands += ([_full(d.plan, p)] if with_p else []) + ([_full(d.plan, m)] if momentum else [])
  num_direction = len(d.operands)

  def update_body(values, *blocks_in):
    t = AdafactorScalars(*values)
    u, extras = d.fn(t, *blocks_in[:num_direction])
    rest = list(blocks_in[num_direction + 1:])
    p_block = rest.pop(0) if with_p else None
    m_block = rest.pop(0) if momentum else None
    first, new_m = _finish(t, u * blocks_in[num_direction], p_block, m_block,
                           mode=mode, momentum=momentum, decay=decay)
    return (first, *extras) + ((new_m,) if momentum else ())

  moment = v if factored_dims is None else v_row
  first_dtype = p.dtype if mode == "apply" else _updates_dtype(p, g, moment, m)
  out_dtypes = [first_dtype, *d.extra_dtypes] + ([m.dtype] if momentum else [])
  aliases = dict(d.extra_aliases)
  if mode == "apply":
    aliases[num_direction + 1] = 0
  if momentum:
    aliases[len(operands) - 1] = len(out_dtypes) - 1
  outs = red.broadcast_call(
      update_body, operands, tuple(s), out_dtypes, d.plan,
      name=f"adafactor_{mode}", aliases=aliases, flops_per_element=_UPDATE_FLOPS,
      transcendentals_per_element=int(factored_dims is None), **call,
  )
  first, *rest = (o.reshape(g.shape) for o in outs)
  state = d.state or (jnp.zeros_like(v_row), jnp.zeros_like(v_col), rest[0])
  return (first, *state, rest[-1] if momentum else None)


def adafactor_apply(
    p, g, v_row, v_col, v, m, scalars: AdafactorScalars, *,
    factored_dims: tuple[int, int] | None, stacked_axes: int = 0,
    clipping: bool = True, parameter_scale: bool = True, momentum: bool = False,
    decay: bool = False, impl: str = "auto",
):
  """One fused Adafactor step: returns ``(p + u, v_row, v_col, v, m)``.

  Args:
    p, g: one leaf's params and gradient (f32 or bf16).
    v_row, v_col, v: its `optax.FactoredState` entries.
    m: its momentum accumulator, or None without momentum.
    scalars: `AdafactorScalars` of this step (see `adafactor_scalars`).
    factored_dims, stacked_axes, clipping, parameter_scale, momentum, decay:
      see `adafactor_reference`.
    impl: ``"auto" | "pallas" | "interpret" | "xla"`` (see `use_impl`).
  """
  fn = dispatch(adafactor_reference, adafactor_kernel, impl, family=policy.ADAFACTOR)
  return fn(p, g, v_row, v_col, v, m, scalars, mode="apply", factored_dims=factored_dims,
            stacked_axes=stacked_axes, clipping=clipping, parameter_scale=parameter_scale,
            momentum=momentum, decay=decay)


def adafactor_updates(
    p, g, v_row, v_col, v, m, scalars: AdafactorScalars, *,
    factored_dims: tuple[int, int] | None, stacked_axes: int = 0,
    clipping: bool = True, parameter_scale: bool = True, momentum: bool = False,
    decay: bool = False, impl: str = "auto",
):
  """Adafactor in Optax form: returns ``(u, v_row, v_col, v, m)``.

  ``p`` may be None without parameter scale and decay.
  """
  fn = dispatch(adafactor_reference, adafactor_kernel, impl, family=policy.ADAFACTOR)
  return fn(p, g, v_row, v_col, v, m, scalars, mode="updates", factored_dims=factored_dims,
            stacked_axes=stacked_axes, clipping=clipping, parameter_scale=parameter_scale,
            momentum=momentum, decay=decay)
