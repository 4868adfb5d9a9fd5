r"""eFormer's White-Kron optimizers, ``quad`` and ``skew``, with its state and numbers.

eFormer 0.0.101 (``eformer.optimizers._tx.white_kron``) registers two PSGD
variants whose Kronecker factors are learned online from the gradient alone
(no probe solves): ``"QUAD"`` and ``"skew"`` (a Procrustes rotation keeps the
factors near symmetric). The block math is in `pallasopt.kernels.white_kron`;
this module is the Optax transform around it, written to reproduce eFormer's
trajectories and opt_state tree. One step, with :math:`t` the step (from 1):

1. :math:`m \leftarrow \beta_1 m + (1-\beta_1) g`, :math:`\hat m = m / (1 -
   \beta_1^t)` (``b1 = 0``: :math:`\hat m = g`), both cast to ``dtype``;
   ``normalize_grads`` divides each leaf by its norm.
2. Each leaf is viewed as ``(B, m, n)`` (``B`` its stacked layers; more
   axes merged into the most balanced two) and routed by size: both dims
   at most ``max_size_dense``: split into ``block_size`` square blocks,
   all such blocks of all leaves preconditioned as one batch with dense
   factors (the ``"dense"`` state); one dim larger: blocks along the other
   dim, a diagonal factor for the large one; both larger: diagonal factors;
   a vector (or a scalar): one diagonal factor. Factors are rescaled to a
   common magnitude every 100 steps; the preconditioner step size is
   :math:`\max(\eta_P / \sqrt{1 + t/10^4}, 0.4)`.
3. Each leaf's output is clipped to RMS 1.1, and divided by 5 when
   ``lr_style="adam"``.

``quad`` / ``skew`` add decoupled weight decay (``weight_decay > 0``) and the
learning rate: ``chain(scale_by_*, [add_decayed_weights], scale_by_learning_rate)``.

State: ``dict(count, mu, large=[LeafState per leaf], [dense=DenseState])``
with eFormer's field names (a `LeafState` keeps its layout as static data).
Random numbers (the noise on the gradients, the power-iteration probes) come
from ``jax.random.fold_in(PRNGKey(k), t)`` split per block, ``k`` = 42 for
dense blocks, 43 / 44 / 45 for diagonal-diagonal / column-blocked /
row-blocked leaves and 46 for vectors, as in eFormer.

pallasopt adds keyword-only ``stacked_axes`` (every leaf's first axes are
stacked layers; eFormer's ``scanned_layers`` marks one axis per leaf) and
``impl`` (the preconditioner application's kernel).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from pallasopt.kernels import white_kron as wk
from pallasopt.kernels._dispatch import resolve_impl
from pallasopt.optim import _validation as v
from pallasopt.optim._base import FusedGradientTransformation, chained_transformation
from pallasopt.optim._types import MaskOrFn, ScalarOrSchedule

__all__ = [
    "DenseState",
    "LeafState",
    "is_white_kron_state",
    "keep_frozen",
    "scale_by_quad",
    "scale_by_skew",
    "quad",
    "skew",
]

_OWNER = "pallasopt.optim.white_kron"

# Leaf routes (eFormer's codes, kept in the state).
DENSE_PATH, LARGE_PATH, ONE_D_PATH = 0, 1, 2
# PRNG streams per route.
_DENSE_SEED, _DIAG_SEED, _COLS_SEED, _ROWS_SEED, _VECTOR_SEED = 42, 43, 44, 45, 46
_BALANCE_EVERY = 100
_PRECOND_LR_FLOOR = 0.4
_PRECOND_LR_HALF_LIFE = 10_000.0
_RMS_CLIP = 1.1
_ADAM_SCALE = 5.0


def _pytree_dataclass(cls, meta: tuple[str, ...]):
  cls = dataclasses.dataclass(frozen=True)(cls)
  data = [f.name for f in dataclasses.fields(cls) if f.name not in meta]
  return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=list(meta))


class DenseState:
  """The dense factors of every small matrix leaf's blocks, stacked.

  Attributes:
    Ql, Qr: ``(blocks, bs, bs)`` left and right factors.
    Ll, Lr: ``(blocks,)`` float32 Lipschitz estimates.
    valid_rows, valid_cols: ``(blocks,)`` int32 unpadded extent of each block.
    valid_count: blocks that hold gradients (the rest pad to the pipeline
      axis size); static.
    block_size: ``bs``; static.
  """

  Ql: jax.Array
  Qr: jax.Array
  Ll: jax.Array
  Lr: jax.Array
  valid_rows: jax.Array
  valid_cols: jax.Array
  valid_count: int
  block_size: int


DenseState = _pytree_dataclass(DenseState, ("valid_count", "block_size"))


class LeafState:
  """One leaf's layout (static) and, for non-dense routes, its factors.

  Attributes:
    kind: the route (0 dense blocks, 1 large, 2 vector).
    scanned: 1 if the leaf's leading axis (or ``stacked_axes``) holds layers.
    B: its number of layers.
    shape: a vector leaf's per-layer shape.
    merged: its per-layer shape as ``(m, n)`` (or ``(d,)``).
    nr, nc: row / column blocks.
    block_size: the block size where it is blocked.
    diag_left, diag_right: which factors are diagonal (large route).
    stack: factor batch size (large route).
    Ql, Qr, Ll, Lr, valid_rows, valid_cols: the factors and their
      estimates and extents (large and vector routes; None otherwise).
  """

  kind: int
  scanned: int
  B: int
  shape: tuple[int, ...] | None = None
  merged: tuple[int, ...] | None = None
  nr: int | None = None
  nc: int | None = None
  block_size: int | None = None
  diag_left: bool | None = None
  diag_right: bool | None = None
  stack: int | None = None
  Ql: jax.Array | None = None
  Qr: jax.Array | None = None
  Ll: jax.Array | None = None
  Lr: jax.Array | None = None
  valid_rows: jax.Array | None = None
  valid_cols: jax.Array | None = None


LeafState = _pytree_dataclass(
    LeafState,
    ("kind", "scanned", "B", "shape", "merged", "nr", "nc", "block_size", "diag_left",
     "diag_right", "stack"),
)


def is_white_kron_state(state: Any) -> bool:
  """Whether ``state`` is `scale_by_quad`'s / `scale_by_skew`'s state dict."""
  return (
      isinstance(state, dict) and {"count", "mu", "large"} <= set(state)
      and all(isinstance(st, LeafState) for st in state["large"])
  )


def keep_frozen(new: dict, old: dict, frozen: list[bool]) -> dict:
  """``new`` with every factor, estimate and moment of the frozen leaves from ``old``.

  For the stage-local path's frozen (None-grad) leaves: their ``large``
  entries, their blocks of the dense stack and their momentum are ``old``'s;
  the count is ``new``'s.
  """
  out = dict(new, large=[o if f else n for n, o, f in zip(new["large"], old["large"], frozen,
                                                           strict=True)])
  if new["mu"] is not None:
    leaves, treedef = jax.tree.flatten(new["mu"])
    out["mu"] = treedef.unflatten(
        [o if f else n for n, o, f in zip(leaves, jax.tree.leaves(old["mu"]), frozen, strict=True)])
  if "dense" in new:
    dense, old_dense = new["dense"], old["dense"]
    kept = np.zeros(dense.Ql.shape[0], bool)
    start = 0
    for st, f in zip(new["large"], frozen, strict=True):
      if st.kind == DENSE_PATH:
        kept[start:start + st.B * st.nr * st.nc] = f
        start += st.B * st.nr * st.nc
    pick = lambda n, o: jnp.where(kept.reshape(-1, *[1] * (n.ndim - 1)), o, n)
    out["dense"] = dataclasses.replace(dense, **{
        name: pick(getattr(dense, name), getattr(old_dense, name)) for name in ("Ql", "Qr", "Ll", "Lr")})
  return out


# ---- Layout helpers (the block layout itself: `pallasopt.kernels.white_kron`). ----


def _constrain(x, axis_name: str | None):
  return x if axis_name is None else jax.lax.with_sharding_constraint(x, PartitionSpec(axis_name))


def _layers(x, scanned: bool, stacked_axes: int):
  """``x`` with its layers on one leading axis."""
  if stacked_axes:
    return x.reshape((-1, *x.shape[stacked_axes:]))
  return x if scanned else x[None]


def _white_kron(
    style: str,
    lr_style: str | None,
    b1: float,
    normalize_grads: bool,
    max_size_dense: int,
    preconditioner_lr: float,
    preconditioner_init_scale: float,
    dtype: Any,
    scanned_layers: Any,
    block_size: int,
    pipeline_axis_name: str | None,
    pipeline_axis_size: int,
    params_partition_specs: Any,
    noise_scale: float,
    stacked_axes: int,
    impl: str,
) -> optax.GradientTransformation:
  owner = f"{_OWNER}.scale_by_{style.lower()}"
  dtype = jnp.dtype(dtype)
  if dtype not in (jnp.bfloat16, jnp.float32):
    raise ValueError(f"{owner}: dtype must be bfloat16 or float32; got {dtype}.")
  if lr_style not in ("adam", None):
    # eFormer scales only for "adam" and accepts anything else as None.
    warnings.warn(
        f"{owner}: lr_style={lr_style!r} is neither 'adam' nor None; the updates are not "
        "rescaled (as in eFormer, where only 'adam' divides them by 5).", stacklevel=3)
  v.check_hyperparameter(owner, "b1", b1, high=1.0, high_inclusive=False)
  for name, value in (("block_size", block_size), ("max_size_dense", max_size_dense),
                      ("pipeline_axis_size", pipeline_axis_size)):
    v.static_int(owner, name, value, low=1)
  stacked_axes = v.static_int(owner, "stacked_axes", stacked_axes)
  if stacked_axes and scanned_layers is not None:
    raise ValueError(f"{owner}: set scanned_layers or stacked_axes, not both.")
  resolve_impl(impl)
  scale = preconditioner_init_scale
  pipeline_pad = lambda count: (-count) % pipeline_axis_size

  def flags_for(params):
    if scanned_layers is None:
      return [bool(stacked_axes)] * len(jax.tree.leaves(params))
    return v.broadcast_mask(owner, scanned_layers, params)

  def init_fn(params):
    if stacked_axes:
      v.check_stacked_axes(owner, params, stacked_axes)
    mu = None
    if b1 > 0:
      mu = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=dtype), params)
      if params_partition_specs is not None:
        mu = jax.lax.with_sharding_constraint(mu, params_partition_specs)
    dense_q_rows, dense_q_cols, dense_valid = [], [], []
    leaf_states = []
    for leaf, scanned in zip(jax.tree.leaves(params), flags_for(params), strict=True):
      layers = _layers(leaf, scanned, stacked_axes)
      batch, shape = layers.shape[0], tuple(layers.shape[1:])
      merged = wk.two_dims(shape)
      common = dict(scanned=int(scanned), B=batch)
      if len(merged) <= 1:
        d = math.prod(shape)
        leaf_states.append(LeafState(
            kind=ONE_D_PATH, **common, shape=shape, merged=(d,),
            Ql=jnp.ones((batch, d), dtype) * scale, Ll=jnp.zeros((batch,), jnp.float32),
        ))
        continue
      m, n = merged
      if m <= max_size_dense and n <= max_size_dense:
        rows, cols = wk.block_extents(m, block_size), wk.block_extents(n, block_size)
        for _ in range(batch):
          for vr in rows:
            for vc in cols:
              dense_q_rows.append(wk.padded_identity(block_size, vr, dtype, scale))
              dense_q_cols.append(wk.padded_identity(block_size, vc, dtype, scale))
              dense_valid.append((vr, vc))
        leaf_states.append(LeafState(
            kind=DENSE_PATH, **common, merged=(m, n), nr=len(rows), nc=len(cols),
            block_size=block_size,
        ))
        continue
      leaf_states.append(_large_leaf(common, m, n, m > max_size_dense, n > max_size_dense))
    state = dict(count=jnp.zeros([], jnp.int32), mu=mu, large=leaf_states)
    if dense_valid:
      count = len(dense_valid)
      pad = pipeline_pad(count)
      eye = jnp.eye(block_size, dtype=dtype)
      rows = jnp.array([r for r, _ in dense_valid] + [block_size] * pad, jnp.int32)
      cols = jnp.array([c for _, c in dense_valid] + [block_size] * pad, jnp.int32)
      state["dense"] = DenseState(
          Ql=_constrain(wk.pad_rows_to(jnp.stack(dense_q_rows), count + pad, eye), pipeline_axis_name),
          Qr=_constrain(wk.pad_rows_to(jnp.stack(dense_q_cols), count + pad, eye), pipeline_axis_name),
          Ll=_constrain(wk.pad_rows_to(jnp.zeros((count,), jnp.float32), count + pad, 1.0), pipeline_axis_name),
          Lr=_constrain(wk.pad_rows_to(jnp.zeros((count,), jnp.float32), count + pad, 1.0), pipeline_axis_name),
          valid_rows=_constrain(rows, pipeline_axis_name),
          valid_cols=_constrain(cols, pipeline_axis_name),
          valid_count=count, block_size=block_size,
      )
    return state

  def _large_leaf(common, m, n, diag_left, diag_right):
    """The factors of a leaf with a dim over ``max_size_dense``."""
    batch = common["B"]
    if diag_left and diag_right:
      stack = batch + pipeline_pad(batch)
      ones = lambda d: wk.pad_rows_to(jnp.ones((batch, d), dtype) * scale, stack, 1.0)
      return LeafState(
          kind=LARGE_PATH, **common, merged=(m, n), diag_left=True, diag_right=True,
          Ql=_constrain(ones(m), pipeline_axis_name), Qr=_constrain(ones(n), pipeline_axis_name),
          Ll=_constrain(wk.pad_rows_to(jnp.zeros((batch,), jnp.float32), stack, 1.0), pipeline_axis_name),
          Lr=_constrain(wk.pad_rows_to(jnp.zeros((batch,), jnp.float32), stack, 1.0), pipeline_axis_name),
          valid_rows=_constrain(jnp.full((stack,), m, jnp.int32), pipeline_axis_name),
          valid_cols=_constrain(jnp.full((stack,), n, jnp.int32), pipeline_axis_name),
          stack=stack,
      )
    blocked_rows = not diag_left  # the small dim is split into blocks
    blocked, other = (m, n) if blocked_rows else (n, m)
    extents = wk.block_extents(blocked, block_size)
    count = batch * len(extents)
    stack = count + pipeline_pad(count)
    eye = jnp.eye(block_size, dtype=dtype)
    dense = wk.pad_rows_to(
        jnp.stack([wk.padded_identity(block_size, e, dtype, scale) for _ in range(batch) for e in extents]),
        stack, eye)
    diagonal = wk.pad_rows_to(jnp.ones((count, other), dtype) * scale, stack, 1.0)
    block_extent = jnp.array(extents * batch + [block_size] * (stack - count), jnp.int32)
    other_extent = jnp.full((stack,), other, jnp.int32)
    return LeafState(
        kind=LARGE_PATH, **common, merged=(m, n), diag_left=diag_left, diag_right=diag_right,
        Ql=_constrain(dense if blocked_rows else diagonal, pipeline_axis_name),
        Qr=_constrain(diagonal if blocked_rows else dense, pipeline_axis_name),
        Ll=_constrain(wk.pad_rows_to(jnp.zeros((count,), jnp.float32), stack, 1.0), pipeline_axis_name),
        Lr=_constrain(wk.pad_rows_to(jnp.zeros((count,), jnp.float32), stack, 1.0), pipeline_axis_name),
        valid_rows=_constrain(block_extent if blocked_rows else other_extent, pipeline_axis_name),
        valid_cols=_constrain(other_extent if blocked_rows else block_extent, pipeline_axis_name),
        stack=stack,
        nr=len(extents) if blocked_rows else None,
        nc=None if blocked_rows else len(extents),
        block_size=block_size,
    )

  def step_factors(seed, step, plr, balance_now, ql, qr, Ll, Lr, blocks, rows, cols, diag_left,
                   diag_right):
    """One batch of blocks: balance, update the factors, precondition."""
    keys = _constrain(
        jax.random.split(jax.random.fold_in(jax.random.PRNGKey(seed), step), blocks.shape[0]),
        pipeline_axis_name)
    ql, qr = jax.lax.cond(balance_now, lambda q: wk.balance(*q), lambda q: q, (ql, qr))
    ql, qr, Ll, Lr, out = wk.precondition_blocks(
        keys, ql, qr, Ll, Lr, _constrain(blocks, pipeline_axis_name), (rows, cols),
        diag_left=diag_left, diag_right=diag_right, lr=plr, noise_scale=noise_scale,
        style=style, impl=impl,
    )
    casts = (ql.astype(dtype), qr.astype(dtype), Ll.astype(jnp.float32), Lr.astype(jnp.float32))
    return tuple(_constrain(x, pipeline_axis_name) for x in casts), _constrain(out, pipeline_axis_name)

  def update_fn(updates, state, params=None):
    del params
    leaf_states = list(state["large"])
    if len(leaf_states) != len(jax.tree.leaves(updates)):
      raise ValueError(
          f"{owner}: opt_state has {len(leaf_states)} leaves' layouts; the grads have "
          f"{len(jax.tree.leaves(updates))} leaves. Use the state from this transform's init."
      )
    for (path, leaf), st in zip(v.keyed_leaves(updates), leaf_states):
      if math.prod(leaf.shape) != st.B * math.prod(st.merged):
        raise ValueError(
            f"{owner}: grads{path} has shape {leaf.shape}, but opt_state was built for "
            f"{st.B} layer(s) of {st.merged}. White-Kron keeps the blocks of all leaves in one "
            "stack, so its state cannot be split over a pipeline's stages: update the whole "
            "model (or build the state for these shapes)."
        )
    step = optax.safe_increment(state["count"])
    plr = jnp.maximum(preconditioner_lr * jax.lax.rsqrt(1.0 + step / _PRECOND_LR_HALF_LIFE),
                      _PRECOND_LR_FLOOR)
    balance_now = step % _BALANCE_EVERY == 0
    mu, first = state["mu"], updates
    if mu is not None:
      mu = optax.tree.update_moment(updates, mu, b1, 1)
      if params_partition_specs is not None:
        mu = jax.lax.with_sharding_constraint(mu, params_partition_specs)
      first = optax.tree.bias_correction(mu, b1, step)
      mu = optax.tree.cast(mu, dtype)
    first = optax.tree.cast(first, dtype)
    if normalize_grads:
      first = jax.tree.map(lambda g: g / (jnp.linalg.norm(g) + 1e-6), first)
    leaves, treedef = jax.tree.flatten(first)
    outs = list(leaves)
    layer_views = [
        leaf.reshape(st.B, *st.merged) if st.kind != ONE_D_PATH else leaf.reshape(st.B, -1)
        for leaf, st in zip(leaves, leaf_states)
    ]
    new_state = dict(state, count=step, mu=mu)

    dense_ids = [i for i, st in enumerate(leaf_states) if st.kind == DENSE_PATH]
    if dense_ids:
      ds = state["dense"]
      blocks = jnp.concatenate([
          wk.to_blocks(layer_views[i], ds.block_size, rows=True, cols=True) for i in dense_ids])
      blocks = wk.pad_rows_to(blocks, ds.Ql.shape[0], 1.0)
      (ql, qr, Ll, Lr), out = step_factors(
          _DENSE_SEED, step, plr, balance_now, ds.Ql, ds.Qr, ds.Ll, ds.Lr, blocks,
          ds.valid_rows, ds.valid_cols, False, False)
      new_state["dense"] = dataclasses.replace(ds, Ql=ql, Qr=qr, Ll=Ll, Lr=Lr)
      start = 0
      for i in dense_ids:
        st = leaf_states[i]
        count = st.B * st.nr * st.nc
        outs[i] = wk.from_blocks(out[start:start + count], st.B, *st.merged, ds.block_size,
                               rows=True, cols=True).reshape(leaves[i].shape)
        start += count

    for i, st in enumerate(leaf_states):
      if st.kind == LARGE_PATH:
        both_diag = st.diag_left and st.diag_right
        blocked_rows, blocked_cols = (False, False) if both_diag else (
            not st.diag_left, not st.diag_right)
        blocks = wk.to_blocks(layer_views[i], st.block_size or 1, rows=blocked_rows,
                            cols=blocked_cols)
        seed = _DIAG_SEED if both_diag else (_ROWS_SEED if blocked_rows else _COLS_SEED)
        (ql, qr, Ll, Lr), out = step_factors(
            seed, step, plr, balance_now, st.Ql, st.Qr, st.Ll, st.Lr,
            wk.pad_rows_to(blocks, st.stack, 1.0), st.valid_rows, st.valid_cols, st.diag_left,
            st.diag_right)
        count = blocks.shape[0]
        outs[i] = wk.from_blocks(out[:count], st.B, *st.merged, st.block_size or 1,
                               rows=blocked_rows, cols=blocked_cols).reshape(leaves[i].shape)
        leaf_states[i] = dataclasses.replace(st, Ql=ql, Qr=qr, Ll=Ll, Lr=Lr)
      elif st.kind == ONE_D_PATH:
        keys = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(_VECTOR_SEED), step), st.B)
        q, L, out = wk.precondition_vectors(
            keys, st.Ql, st.Ll, layer_views[i], lr=plr, noise_scale=noise_scale, style=style)
        leaf_states[i] = dataclasses.replace(st, Ql=q.astype(dtype), Ll=L.astype(jnp.float32))
        outs[i] = out.reshape(leaves[i].shape)

    out = treedef.unflatten(outs)
    if params_partition_specs is not None:
      out = jax.lax.with_sharding_constraint(out, params_partition_specs)
    out = jax.tree.map(
        lambda g: g * (_RMS_CLIP / jnp.maximum(jnp.sqrt(jnp.mean(jnp.square(g))), _RMS_CLIP)), out)
    if lr_style == "adam":
      out = jax.tree.map(lambda g: g / jnp.array(_ADAM_SCALE, g.dtype), out)
    new_state["large"] = leaf_states
    return out, new_state

  return optax.GradientTransformation(init_fn, update_fn)


def _scale_by(style: str):
  def scale_by(
      lr_style: str | None = "adam",
      b1: float = 0.95,
      normalize_grads: bool = False,
      max_size_dense: int = 16384,
      preconditioner_lr: float = 0.7,
      preconditioner_init_scale: float = 1.0,
      dtype: Any = jnp.bfloat16,
      scanned_layers: Any | None = None,
      block_size: int = 256,
      pipeline_axis_name: str | None = None,
      pipeline_axis_size: int = 1,
      params_partition_specs: Any | None = None,
      noise_scale: float = 1e-9,
      *,
      stacked_axes: int = 0,
      impl: str = "auto",
  ) -> optax.GradientTransformation:
    return _white_kron(
        style, lr_style, b1, normalize_grads, max_size_dense, preconditioner_lr,
        preconditioner_init_scale, dtype, scanned_layers, block_size, pipeline_axis_name,
        pipeline_axis_size, params_partition_specs, noise_scale, stacked_axes, impl,
    )

  return scale_by


_SCALE_ARGS = """

  Args:
    lr_style: ``"adam"`` divides the output by 5 (Adam-like step sizes); None
      (or any other value, with a warning, as eFormer accepts) keeps it.
    b1: momentum decay (0: none).
    normalize_grads: divide each (momentum) leaf by its norm first.
    max_size_dense: largest dim that gets a dense factor.
    preconditioner_lr: the factors' step size :math:`\\eta_P` (annealed, floor 0.4).
    preconditioner_init_scale: the factors' initial scale.
    dtype: bfloat16 or float32: the momentum's, the factors' and the
      computation's dtype.
    scanned_layers: per leaf, whether its leading axis stacks layers (a tree
      of bools or a prefix of one).
    block_size: the blocks' size.
    pipeline_axis_name: a mesh axis to shard the stacked blocks over.
    pipeline_axis_size: its size (block stacks are padded to a multiple).
    params_partition_specs: the params' partition specs (momentum and output
      are constrained to them).
    noise_scale: scale of the noise added to the gradient blocks.
    stacked_axes: pallasopt's: the first ``n`` axes of every leaf stack layers
      (instead of ``scanned_layers``).
    impl: pallasopt's: the preconditioner application's kernel, see
      `pallasopt.kernels.use_impl`.
"""

scale_by_quad = _scale_by("QUAD")
scale_by_quad.__name__ = scale_by_quad.__qualname__ = "scale_by_quad"
scale_by_quad.__doc__ = (
    "White-Kron scaling with QUAD factor steps (eFormer's ``scale_by_quad``).\n"
    "\n  See the module docstring for the math and the state." + _SCALE_ARGS
)
scale_by_skew = _scale_by("skew")
scale_by_skew.__name__ = scale_by_skew.__qualname__ = "scale_by_skew"
scale_by_skew.__doc__ = (
    "White-Kron scaling with skew (Procrustes) factor steps (eFormer's ``scale_by_skew``).\n"
    "\n  See the module docstring for the math and the state." + _SCALE_ARGS
)


def _optimizer(style: str):
  scale = scale_by_quad if style == "QUAD" else scale_by_skew

  def optimizer(
      learning_rate: ScalarOrSchedule = 0.001,
      lr_style: str | None = "adam",
      b1: float = 0.95,
      weight_decay: float = 0.1,
      weight_decay_mask: MaskOrFn = None,
      normalize_grads: bool = False,
      max_size_dense: int = 16384,
      preconditioner_lr: float = 0.7,
      preconditioner_init_scale: float = 1.0,
      dtype: Any = jnp.bfloat16,
      scanned_layers: Any | None = None,
      block_size: int = 256,
      pipeline_axis_name: str | None = None,
      pipeline_axis_size: int = 1,
      params_partition_specs: Any | None = None,
      noise_scale: float = 1e-9,
      *,
      stacked_axes: int = 0,
      impl: str = "auto",
  ) -> FusedGradientTransformation:
    owner = f"{_OWNER}.{style.lower()}"
    v.check_finite(owner, "learning_rate", learning_rate)
    v.check_finite(owner, "weight_decay", weight_decay)
    scaling = scale(
        lr_style, b1, normalize_grads, max_size_dense, preconditioner_lr,
        preconditioner_init_scale, dtype, scanned_layers, block_size, pipeline_axis_name,
        pipeline_axis_size, params_partition_specs, noise_scale, stacked_axes=stacked_axes,
        impl=impl,
    )
    decay = optax.add_decayed_weights(weight_decay, weight_decay_mask) if weight_decay > 0 else None
    return chained_transformation(scaling, decay, learning_rate, stacked_axes=stacked_axes)

  return optimizer


_OPTIMIZER_ARGS = """
  ``chain(scale_by_*, [add_decayed_weights(weight_decay, weight_decay_mask)
  when weight_decay > 0], scale_by_learning_rate(learning_rate))``, eFormer's
  layout and state; ``apply_gradients`` / ``scaled_update`` (the stage-local
  entry points) run the same chain with the gradients scaled and the
  learning rate overridden. The other arguments are `scale_by_quad`'s.
"""

quad = _optimizer("QUAD")
quad.__name__ = quad.__qualname__ = "quad"
quad.__doc__ = "eFormer's ``quad``: White-Kron with QUAD factor steps.\n" + _OPTIMIZER_ARGS
skew = _optimizer("skew")
skew.__name__ = skew.__qualname__ = "skew"
skew.__doc__ = "eFormer's ``skew``: White-Kron with skew factor steps.\n" + _OPTIMIZER_ARGS
