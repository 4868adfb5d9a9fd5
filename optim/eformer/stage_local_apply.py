"""The fused stage-local step: a pipeline stage's params updated in place from its own gradients.

`fused_stage_local_apply` is the ``apply_gradients_stage_local`` that
`pallasopt.optim.eformer.OptimizerFactory` attaches to pallasopt's fused
transforms (`pallasopt.optim.eformer.stage_local` draws the API): clipping
by the global norm (one ``psum``), the eFormer chain's scheduled weight
decay folded into the kernels, gradient accumulation, frozen leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from pallasopt.kernels import quant
from pallasopt.optim import _validation as v
from pallasopt.optim import white_kron
from pallasopt.optim._base import FusedGradientTransformation, advance_schedule, fused_update
from pallasopt.optim.eformer.scheduled_decay import (
    OptaxScheduledWeightDecayState,
    add_scheduled_weight_decay,
)
from pallasopt.optim.eformer.stage_local import (
    _OWNER,  # its errors name the stage-local API, as the wrappers' do
    AxisName,
    StageLocalApplyFn,
    StageLocalOptimizerMetadata,
)

__all__ = ["fused_stage_local_apply", "stage_local_grad_norm"]


def _is_none(x: Any) -> bool:
  return x is None


def _path_mismatch(params: Any, grads: Any) -> str:
  """Which grads paths are missing or unexpected, None leaves covering subtrees."""
  param_paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  grad_paths = [
      path for path, _ in jax.tree_util.tree_flatten_with_path(grads, is_leaf=_is_none)[0]
  ]
  covers = lambda g, p: p[: len(g)] == g
  missing = [p for p in param_paths if not any(covers(g, p) for g in grad_paths)]
  unexpected = [g for g in grad_paths if not any(covers(g, p) for p in param_paths)]
  details = [
      f"{what} in grads: {v.path_list(map(jax.tree_util.keystr, paths))}"
      for what, paths in (("missing", missing), ("unexpected", unexpected))
      if paths
  ]
  return "; ".join(details) or (
      f"grads: {jax.tree.structure(grads, is_leaf=_is_none)}; params: {jax.tree.structure(params)}"
  )


def _grads_or_zeros(params: Any, grads: Any) -> Any:
  """`grads` with None leaves or subtrees replaced by zeros like the params."""
  fill = lambda g, p: jax.tree.map(jnp.zeros_like, p) if g is None else g
  try:
    filled = jax.tree.map(fill, grads, params, is_leaf=_is_none)
  except (ValueError, TypeError):
    filled = None
  if filled is None or jax.tree.structure(filled) != jax.tree.structure(params):
    raise ValueError(
        f"{_OWNER}: grads must have the tree structure of params (None stands for a zero "
        f"gradient of a leaf or subtree); {_path_mismatch(params, grads)}."
    )
  v.check_same_tree(_OWNER, "grads", filled, "params", params)
  return filled


def _frozen_leaves(params: Any, grads: Any) -> list[bool]:
  """Per param leaf, whether its gradient (or a subtree above it) is None."""
  flags = jax.tree.map(
      lambda g, p: jax.tree.map(lambda _: g is None, p), grads, params, is_leaf=_is_none
  )
  return jax.tree.leaves(flags)


def _per_param_entries(node: Any, params_def: Any) -> list[Any] | None:
  """``node``'s entries, one per param, if it is stored per param; else None.

  Per param means the params' structure with one leaf per param (an array,
  a blockwise moment, an ``optax.MaskedNode``), or one list of arrays per param
  (Kron's factors): what `pipeline.sharding.optimizer_state_specs` matches.
  """
  entry = lambda x: isinstance(x, optax.MaskedNode) or quant.is_blockwise(x)
  if jax.tree.structure(node, is_leaf=entry) == params_def:
    return jax.tree.leaves(node, is_leaf=entry)
  if jax.tree_util.treedef_is_leaf(params_def):
    return None
  try:
    entries = params_def.flatten_up_to(node)
  except (ValueError, TypeError):
    return None
  factors = lambda e: type(e) in (list, tuple) and e and all(hasattr(f, "shape") for f in e)
  if any(map(factors, entries)) and all(factors(e) or entry(e) for e in entries):
    return entries
  return None


def _keep_frozen(new: Any, old: Any, params_def: Any, frozen: list[bool]) -> Any:
  """``new`` with the parts that belong to frozen params taken from ``old``.

  Walks the tree from the root: a node stored per param keeps ``old``'s
  entry for each frozen param (a White-Kron state: its blocks and factors,
  `white_kron.keep_frozen`); every other leaf (counters, hyperparameters)
  keeps ``new``'s.
  """
  if white_kron.is_white_kron_state(new):
    return white_kron.keep_frozen(new, old, frozen)
  entries = _per_param_entries(new, params_def)
  if entries is not None:
    olds = _per_param_entries(old, params_def)
    return params_def.unflatten(
        [o if f else n for n, o, f in zip(entries, olds, frozen, strict=True)]
    )
  if jax.tree_util.treedef_is_leaf(jax.tree.structure(new)):
    return new
  children, node_def = jax.tree_util.tree_flatten(new, is_leaf=lambda x: x is not new)
  old_children = node_def.flatten_up_to(old)
  return node_def.unflatten(
      [_keep_frozen(n, o, params_def, frozen) for n, o in zip(children, old_children, strict=True)]
  )


def _schedule_count(state: Any):
  """The optimizer's step count: the first ``count`` field of its state."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    key = path[-1] if path else None
    if getattr(key, "name", getattr(key, "key", None)) == "count":
      return leaf
  raise ValueError(
      f"{_OWNER}: learning_rate_fn is evaluated at the optimizer's step count, but its "
      "state has no 'count' field."
  )


def stage_local_grad_norm(grads: Any, axis_name: AxisName | None = None) -> jax.Array:
  """The global L2 norm of `grads`, from this shard's leaves and one scalar psum.

  Inside ``shard_map``, with every leaf partitioned over `axis_name` (and
  replicated over the other mesh axes), the psum of the local sums of squares
  counts each element once; nothing is gathered. With ``axis_name=None`` it is
  the norm of the local leaves.

  Args:
    grads: this shard's gradients.
    axis_name: the mesh axis (or axes) the leaves are partitioned over.
  """
  square = sum(
      (jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)),
      jnp.zeros([], jnp.float32),
  )
  if axis_name is not None:
    square = jax.lax.psum(square, axis_name)
  return jnp.sqrt(square)


def _clip_scale(grads: Any, max_norm: float, axis_name, global_grad_norm) -> jax.Array:
  """``optax.clip_by_global_norm``'s factor: 1 below `max_norm`, else max/norm."""
  if global_grad_norm is None:
    norm = stage_local_grad_norm(grads, axis_name)
  else:
    norm = jnp.asarray(global_grad_norm, jnp.float32)
  return jnp.where(norm < max_norm, 1.0, max_norm / norm).astype(jnp.float32)


def _layer_index_fn(
    stacked_spec: Sequence[AxisName | None],
) -> Callable[[tuple[int, ...]], jax.Array]:
  """``layer_index_fn`` for a shard whose stacked axes are split as `stacked_spec` says.

  Axis ``k`` of local size ``n_k`` split over mesh axis ``a`` is the block
  ``[axis_index(a) n_k, (axis_index(a) + 1) n_k)`` of a global axis of size
  ``axis_size(a) n_k``; the result is each local layer's row-major index
  over the global stacked axes.
  """

  def layer_index(shape):
    index = jnp.zeros(shape, jnp.int32)
    for axis, (local, name) in enumerate(zip(shape, (*stacked_spec, *[None] * len(shape)))):
      start, parts = (0, 1) if name is None else (jax.lax.axis_index(name), jax.lax.axis_size(name))
      position = start * local + jax.lax.broadcasted_iota(jnp.int32, shape, axis)
      index = index * (local * parts) + position
    return index

  return layer_index


def _chain_states(opt_state: Any, metadata: StageLocalOptimizerMetadata) -> tuple:
  """The ``chain([clip,] optimizer, [decay])`` state inside `opt_state`, checked."""
  accumulating = metadata.gradient_accumulation_steps > 1
  if accumulating != isinstance(opt_state, optax.MultiStepsState):
    raise ValueError(
        f"{_OWNER}: metadata.gradient_accumulation_steps is "
        f"{metadata.gradient_accumulation_steps}, so opt_state must "
        + ("be" if accumulating else "not be")
        + f" an optax.MultiStepsState; got {type(opt_state).__name__}. Use the state from "
        "this transform's init."
    )
  chain_state = opt_state.inner_opt_state if accumulating else opt_state
  links = [
      *(["clip_by_global_norm state"] if metadata.clip_grad else []),
      "optimizer state",
      *(["scheduled weight decay state"] if metadata.weight_decay != 0.0 else []),
  ]
  decay_ok = not metadata.weight_decay or (
      isinstance(chain_state, tuple) and chain_state
      and isinstance(_decay_inner(chain_state[-1]), OptaxScheduledWeightDecayState)
  )
  if type(chain_state) is not tuple or len(chain_state) != len(links) or not decay_ok:
    raise ValueError(
        f"{_OWNER}: opt_state{'.inner_opt_state' if accumulating else ''} must be the "
        f"optax.chain state ({', '.join(links)}) that metadata describes (clip_grad="
        f"{metadata.clip_grad}, weight_decay={metadata.weight_decay}); got "
        f"{type(chain_state).__name__}"
        + (f" of length {len(chain_state)}" if isinstance(chain_state, tuple) else "")
        + "."
    )
  return chain_state


def _decay_inner(state: Any) -> Any:
  return state.inner_state if isinstance(state, optax.MaskedState) else state


def _delete_arrays(tree: Any) -> None:
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
      if not leaf.is_deleted():
        leaf.delete()


def fused_stage_local_apply(optimizer: FusedGradientTransformation) -> StageLocalApplyFn:
  """The stage-local step of ``[MultiSteps of] chain([clip,] optimizer, [decay])``.

  For `make_stage_local_gradient_transformation` with metadata describing
  that layout (``clip_grad``, ``weight_decay``, ``gradient_accumulation_steps``),
  as `pallasopt.optim.eformer.OptimizerFactory` builds it. Per call:

  1. None grads become zeros for the step; afterwards their params and
     per-param state are put back (frozen leaves, `_keep_frozen`).
  2. With accumulation, ``acc += (g - acc) / (mini_step + 1)`` (Optax's
     running mean, in the accumulator's dtype); only every k-th call goes on.
  3. With ``clip_grad``, the global norm comes from ``global_grad_norm`` or
     one scalar ``psum`` over ``axis_name``; the factor
     ``min(1, clip_grad / norm)`` is passed to the kernel as ``grad_scale``.
  4. ``optimizer.apply_gradients(params, grads, state, grad_scale=...,
     learning_rate=learning_rate_fn(count))`` updates params and state in
     place; with ``stacked_spec``, an optimizer whose ``apply_gradients``
     takes ``layer_index_fn`` (Kron) also gets the global indices of this
     shard's layers.
  5. With ``weight_decay`` (the factory's decay link, ``-schedule(t) *
     weight_decay * p`` on the masked leaves): when the optimizer scales by
     that same schedule (``optimizer.learning_rate is metadata.scheduler``,
     or ``learning_rate_fn`` replaces both) and can fold it (AdamW, Lion,
     RMSProp, MARS, Adafactor),
     its kernels add the decay in the same pass (``decay_link``); otherwise
     step 4 runs ``optimizer.scaled_update`` (the same kernels writing
     updates), the link adds its decay, and XLA applies them, in eFormer's
     order of operations and with one elementwise pass more.

  The new state has the structure and dtypes ``tx.update`` produces.

  Args:
    optimizer: the fused optimizer in the chain.
  """
  fused = fused_update(optimizer)
  if fused is None:
    raise TypeError(
        f"{_OWNER}: fused_stage_local_apply needs a pallasopt FusedGradientTransformation; "
        f"got {type(optimizer).__name__}."
    )
  wants_layer_index = fused.layer_indexed

  def apply_fn(
      *,
      params,
      grads,
      opt_state,
      metadata: StageLocalOptimizerMetadata | None = None,
      learning_rate_fn=None,
      delete_grads=False,
      axis_name=None,
      global_grad_norm=None,
      stacked_spec=None,
  ):
    if metadata is None:
      raise ValueError(
          f"{_OWNER}: fused_stage_local_apply needs the transform's metadata; pass it to "
          "make_stage_local_gradient_transformation."
      )
    k = metadata.gradient_accumulation_steps
    if global_grad_norm is not None and k > 1:
      raise ValueError(
          f"{_OWNER}: global_grad_norm cannot be used with gradient_accumulation_steps={k}: "
          "clipping applies to the averaged gradient at the applying step, whose norm "
          "this step computes; pass axis_name instead."
      )
    full_grads = _grads_or_zeros(params, grads)
    frozen = _frozen_leaves(params, grads)
    chain_state = _chain_states(opt_state, metadata)
    clip = metadata.clip_grad or None
    layer_index = (
        dict(layer_index_fn=_layer_index_fn(stacked_spec))
        if wants_layer_index and stacked_spec is not None else {}
    )

    # The decay link folds into the optimizer's kernels when it scales by the
    # same learning rate (the factory builds both from one schedule); else
    # its updates go through the link before they are applied.
    folds = bool(metadata.weight_decay) and fused.learning_rate is not None and (
        learning_rate_fn is not None or fused.learning_rate is metadata.scheduler
    )
    if metadata.weight_decay and not folds:
      if fused.scaled_update is None:
        raise ValueError(
            f"{_OWNER}: metadata.weight_decay={metadata.weight_decay} needs the optimizer's "
            "scaled_update (its updates go through the decay link before they are applied); "
            "this FusedGradientTransformation has none."
        )
      schedule = learning_rate_fn or metadata.scheduler
      decay_link = add_scheduled_weight_decay(
          lambda t: -schedule(t) * metadata.weight_decay, metadata.weight_decay_mask
      )

    def step(params, grads, chain_state):
      clip_state = chain_state[:1] if clip else ()
      state = chain_state[len(clip_state)]
      scale = None if clip is None else _clip_scale(grads, clip, axis_name, global_grad_norm)
      lr = None if learning_rate_fn is None else learning_rate_fn(_schedule_count(state))
      options = dict(grad_scale=scale, learning_rate=lr, **layer_index)
      if not metadata.weight_decay:
        new_params, state = fused.apply_gradients(params, grads, state, **options)
        return new_params, (*clip_state, state)
      if folds:
        link = (metadata.weight_decay, metadata.weight_decay_mask)
        new_params, state = fused.apply_gradients(
            params, grads, state, decay_link=link, **options
        )
        return new_params, (*clip_state, state, advance_schedule(chain_state[-1]))
      # eFormer's order (and rounding): p + (u + s(t) p).
      updates, state = fused.scaled_update(grads, state, params, **options)
      updates, decay_state = decay_link.update(updates, chain_state[-1], params)
      return optax.apply_updates(params, updates), (*clip_state, state, decay_state)

    if k == 1:
      new_params, new_state = step(params, full_grads, chain_state)
    else:
      new_params, new_state = _accumulate_then(step, k, params, full_grads, opt_state)
    if any(frozen):
      treedef = jax.tree.structure(params)
      new_params = _keep_frozen(new_params, params, treedef, frozen)
      new_state = _keep_frozen(new_state, opt_state, treedef, frozen)
    if delete_grads:
      _delete_arrays(grads)
    return new_params, new_state

  # What the step runs, for callers that lay out its operands (the pipeline).
  apply_fn.fused = fused
  return apply_fn


def _accumulate_then(step, k: int, params, grads, state: optax.MultiStepsState):
  """``optax.MultiSteps(..., every_k_schedule=k)`` around the fused `step`."""
  v.check_same_tree(_OWNER, "grads", grads, "opt_state.acc_grads", state.acc_grads)
  acc = jax.tree.map(lambda g, a: a + (g - a) / (state.mini_step + 1), grads, state.acc_grads)
  emit = state.mini_step == k - 1

  def apply(params, chain_state):
    return step(params, jax.tree.map(lambda a, g: a.astype(g.dtype), acc, grads), chain_state)

  def hold(params, chain_state):
    return params, chain_state

  params, chain_state = jax.lax.cond(emit, apply, hold, params, state.inner_opt_state)
  return params, optax.MultiStepsState(
      mini_step=optax.safe_increment(state.mini_step) % k,
      gradient_step=jnp.where(emit, optax.safe_increment(state.gradient_step), state.gradient_step),
      inner_opt_state=chain_state,
      acc_grads=jax.tree.map(
          lambda a, old: ((1 - emit) * a).astype(old.dtype), acc, state.acc_grads
      ),
      skip_state=state.skip_state,
  )
