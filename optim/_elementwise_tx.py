"""The Optax drop-in shared by the elementwise optimizers (AdamW, Lion).

Its per-leaf step (`fused_leaf_steps`: kernel or Optax's math per leaf,
low-bit state checks, random keys) and its low-bit state helpers also serve
RMSProp and MARS, whose chains keep other state layouts.

Optax builds each of them as the chain::

  scale_by_X(b1, b2, ..., mu_dtype)       # state: X's NamedTuple (count, moments...)
  add_decayed_weights(weight_decay, mask)  # state: empty, or a schedule count
  scale_by_learning_rate(learning_rate)    # state: empty, or a schedule count

`elementwise_transform` keeps exactly that state tree (the last two states
come from Optax's own ``init``) and replaces the three passes with one kernel
per leaf, in ``"updates"`` mode for ``update`` and in ``"apply"`` mode for the
fused ``apply_gradients``. A family supplies only its kernels and how to build
its per-step scalars.

Low-bit state (``state_format``): ``"bf16"`` stores the moments in bfloat16,
rounded stochastically on every store; ``"int8"`` (``"fp8"``, ``"int4"``) stores each
moment of a leaf with at least `quant.MIN_QUANTIZED_SIZE` elements blockwise
(`quant`): codes and per-block absmax, inside Optax's own state NamedTuple,
in place of the array, a second moment as its root (`quant.RootBlockwise`),
a first moment that is divided by it as their ratio
(`quant.RatioBlockwise`), others as themselves (`quant.Int8Blockwise`,
`quant.Fp8Blockwise`, `quant.Int4Blockwise`); the moments of smaller leaves
stay f32.
Both apply to leaves whose params are float32 or bfloat16; any other leaf
keeps Optax's state. ``param_rounding="stochastic"`` rounds bf16 params
stochastically in the fused apply. The random bits hash (``seed``, step,
leaf index, element index): reproducible run to run and the same in every
``impl``.

Leaves the kernels do not take (float16, float64, complex or integer params,
grads or moments) are updated by Optax's own scaling transform for that leaf
(``scale_by_X``, the same hyperparameters), then decayed and scaled by the
learning rate as Optax's chain does, in every ``impl``: their numbers and
dtypes are Optax's.
"""

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pallasopt.kernels import quant, rounding
from pallasopt.kernels._dispatch import resolve_impl
from pallasopt.kernels._update import (
    Gate, check_rounding, gated_accumulator, gated_gradient, held_where_closed, leaf_gate,
    open_gate,
)
from pallasopt.optim import _validation as v
from pallasopt.optim._base import (
    FusedGradientTransformation,
    advance_schedule,
    fused_transformation,
    gated_results,
    held_counters,
    scaled_grads,
    split_accumulator,
    schedule_value,
)
from pallasopt.optim._types import MaskOrFn, ScalarOrSchedule

__all__ = [
    "STATE_FORMATS",
    "elementwise_transform",
    "check_state_format",
    "check_moment_storage",
    "stored_moment",
    "stored_leaf_moments",
    "stored_moment_trees",
    "moment_value",
    "is_quantized",
    "moment_arrays",
    "momentum_rounding",
    "check_seed",
    "check_low_bit_options",
    "decay_link_leaves",
    "with_decay_link",
    "leaf_decay_rate",
    "fused_leaf_steps",
]

STATE_FORMATS: tuple[str | None, ...] = (None, "bf16", *quant.FORMATS)


def is_quantized(x: Any) -> bool:
  """Whether a state node is a blockwise moment (a leaf for tree maps over moments)."""
  return quant.is_blockwise(x)


def check_state_format(owner: str, state_format: Any) -> None:
  """``state_format`` is one of `STATE_FORMATS`."""
  if state_format not in STATE_FORMATS:
    raise ValueError(
        f"{owner}: state_format must be one of {STATE_FORMATS}; got {state_format!r}."
    )


def stored_moment(
    value: jax.Array, param: Any, *, state_format: str | None, role: str = quant.SIGNED,
    root: jax.Array | None = None, dtype: jnp.dtype | None = None,
    kept_dtype: jnp.dtype | None = None,
) -> jax.Array | quant.Blockwise:
  """A moment ``value`` stored as ``state_format`` keeps it for ``param``'s leaf.

  ``None``, and leaves whose params are not float32 or bfloat16: ``dtype``
  (default: the param's), as Optax's init. ``"bf16"``: ``kept_dtype``,
  default bfloat16 (rounded to nearest here; the steps round bf16
  stochastically). ``"int8"``, ``"fp8"`` and ``"int4"``: blockwise in ``role``
  (`quant.quantize`, rounded to nearest here; a `quant.RATIO` needs ``root``,
  the f32 root of its second moment); ``kept_dtype``, default float32, for
  leaves under `quant.MIN_QUANTIZED_SIZE` elements. A transform's
  ``mu_dtype`` is its first moment's ``kept_dtype``: the dtype it has wherever
  the format keeps it as an array (blockwise moments are computed in f32).
  """
  kept = _kept_as(param, state_format, kept_dtype)
  if kept is None:
    return value.astype(dtype or jnp.result_type(param))
  if isinstance(kept, str):  # a blockwise format
    return quant.quantize(value, role=role, fmt=kept, root=root)
  return value.astype(kept)


def _kept_as(like: Any, state_format: str | None, kept_dtype: jnp.dtype | None) -> Any:
  """How ``state_format`` keeps a moment of a leaf like ``like`` (its param, or its
  gradient where the param is not given): None for Optax's state (the leaf's own
  dtypes), a `quant.FORMATS` entry for blockwise codes, else the array's dtype."""
  if state_format is None or not v.kernel_dtypes(like):
    return None
  if state_format == "bf16":
    return jnp.dtype(kept_dtype or jnp.bfloat16)
  if math.prod(jnp.shape(like)) < quant.MIN_QUANTIZED_SIZE:
    return jnp.dtype(kept_dtype or jnp.float32)
  return state_format


def stored_leaf_moments(
    values: Sequence[jax.Array], param: Any, *, roles: Sequence[str], state_format: str | None,
    dtypes: Sequence[jnp.dtype | None] | None = None,
    kept_dtypes: Sequence[jnp.dtype | None] | None = None,
) -> tuple[Any, ...]:
  """One leaf's moments (f32 ``values``, one per role) stored as ``state_format`` keeps them.

  ``dtypes`` and ``kept_dtypes``: per moment, `stored_moment`'s. A
  `quant.RATIO` moment is divided by the root of the leaf's `quant.ROOT`
  moment.
  """
  root = None
  if quant.ROOT in roles:
    root = quant.to_stored(values[roles.index(quant.ROOT)].astype(jnp.float32), quant.ROOT)
  dtypes = dtypes or [None] * len(values)
  kept_dtypes = kept_dtypes or [None] * len(values)
  return tuple(
      stored_moment(x, param, state_format=state_format, role=r, root=root, dtype=d,
                    kept_dtype=k)
      for x, r, d, k in zip(values, roles, dtypes, kept_dtypes, strict=True)
  )


def _is_array_leaf(x: Any) -> bool:
  if x is None:
    return False
  treedef = jax.tree.structure(x)
  return treedef.num_leaves == treedef.num_nodes == 1


def _wraps_one_array(x: Any) -> bool:
  """Whether ``x`` is a pytree node whose one child is an array, as flax's
  ``nnx.Variable`` wraps a param's value (not a container of Python's, which
  holds its items)."""
  if x is None or isinstance(x, (dict, list, tuple)) or _is_array_leaf(x):
    return False
  children = jax.tree_util.tree_flatten(x, is_leaf=lambda child: child is not x)[0]
  return len(children) == 1 and _is_array_leaf(children[0])


def _wrapped_like(node: Any, moment: Any) -> Any:
  """``moment`` where ``node`` stood in the params: each of its arrays wrapped as
  ``node`` wraps its own, where ``node`` `_wraps_one_array`."""
  if not _wraps_one_array(node):
    return moment
  treedef = jax.tree.structure(node)
  return jax.tree.map(lambda a: treedef.unflatten([a]), moment)


def _unwrapped(x: Any) -> Any:
  return jax.tree.leaves(x)[0] if _wraps_one_array(x) else x


def stored_moment_trees(
    trees: Sequence[Any], params: Any, *, roles: Sequence[str], state_format: str | None,
    kept_dtypes: Sequence[jnp.dtype | None] | None = None,
) -> list[Any]:
  """`stored_leaf_moments` of every leaf: one tree per moment, Optax's state in
  its tree's dtype.

  Where the params wrap each array in a node (flax's ``nnx.Param``), a
  blockwise moment's codes and scales are each wrapped so, not the moment
  whole: ``nnx.Optimizer`` writes each step's state back array by array, and
  so keeps the moment's type.
  """
  nodes, treedef = jax.tree.flatten(params, is_leaf=_wraps_one_array)
  columns = [jax.tree.leaves(t, is_leaf=_wraps_one_array) for t in trees]
  per_leaf = [
      [_wrapped_like(node, m) for m in stored_leaf_moments(
          values, _unwrapped(node), roles=roles, state_format=state_format,
          dtypes=[x.dtype for x in values], kept_dtypes=kept_dtypes)]
      for node, *values in zip(nodes, *([_unwrapped(x) for x in c] for c in columns),
                               strict=True)
  ]
  by_moment = list(zip(*per_leaf, strict=True)) or [()] * len(trees)
  return [treedef.unflatten(column) for column in by_moment]


def moment_value(moment: Any, *, root: jax.Array | None = None) -> jax.Array:
  """The array a stored moment holds (a blockwise one decoded to f32).

  A `quant.RatioBlockwise` needs ``root``: `quant.stored_values` of its
  second moment's `quant.RootBlockwise`.
  """
  return quant.dequantize(moment, root=root) if is_quantized(moment) else moment


def _storage(m: Any) -> str:
  """How a stored moment is kept, and by which ``state_format``, for messages."""
  if is_quantized(m):
    return f"{quant.format_of(m)} blockwise codes ({type(m).__name__}: state_format=" \
           f"{quant.format_of(m)!r})"
  dtype = jnp.result_type(m)
  made_by = "'bf16'" if dtype == jnp.bfloat16 else "None, Optax's"
  return f"a {dtype} array (state_format={made_by})"


def _is_bf16_format(m: Any, param: Any, free_dtype: bool) -> bool:
  """Whether an array moment is one only ``state_format="bf16"`` stores: bfloat16
  for a float32 param, and not the moment ``mu_dtype`` sets (``free_dtype``)."""
  return (not free_dtype and param is not None and jnp.result_type(m) == jnp.bfloat16
          and jnp.result_type(param) == jnp.float32)


def check_moment_storage(
    owner: str, moments: Mapping[str, Any], roles: Sequence[str], params: Sequence[Any],
    grads: Any, *, state_format: str | None, mu_dtype: jnp.dtype | None = None,
    mu_dtype_fields: Sequence[str] = (), any_array: Sequence[str] = (),
) -> None:
  """Every moment is stored as this transform's ``state_format`` keeps it.

  A state of another format (f32 or bf16 arrays where blockwise codes belong,
  codes of another format, pallasopt's bf16 state where Optax's belongs, a
  second moment on the map of states saved before 2026-11-26) would
  otherwise step silently in its own format, or fail deep in XLA.

  Args:
    owner: the transform's name, for messages.
    moments: each moment tree (blockwise moments as leaves) by where it sits
      in the state, e.g. ``{"opt_state[0].mu": ..., "opt_state[0].nu": ...}``.
    roles: per moment, how it is stored when blockwise (`quant.ROLES`).
    params: the param leaves, None entries where they are not given.
    grads: the gradient tree.
    state_format: the transform's.
    mu_dtype: the transform's: the dtype of the moments ``mu_dtype_fields``
      wherever the format keeps them as arrays (in Optax's state, any dtype).
    mu_dtype_fields: the moments whose dtype ``mu_dtype`` sets.
    any_array: the moments taken as arrays of any dtype in every format: those
      `pallasopt.optim.convert_state` leaves as they were (Optax's ``trace``
      and ``ema`` states).

  Raises:
    ValueError: naming the leaf, both formats and `convert_state`.
  """
  likes = list(zip(params, jax.tree.leaves(grads), strict=True))
  for (field, tree), role in zip(moments.items(), roles, strict=True):
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_quantized)[0]
    for (path, m), (p, g) in zip(leaves, likes, strict=True):
      want = _kept_as(g if p is None else p, state_format,
                      mu_dtype if field in mu_dtype_fields else None)
      cls = quant.blockwise_class(role, want) if isinstance(want, str) else None
      if cls is not None:
        # A root is on the same map in "int8" and "fp8": the same state.
        fits = type(m) is cls and quant.codec_of(m) == quant.codec(role, want)
        expected = f"{want} blockwise codes ({cls.__name__})"
      elif is_quantized(m):
        fits, expected = False, "an array" if want is None else f"a {want} array"
      elif want is None:
        # Refused only where a float32 param's moment is bfloat16.
        fits, expected = not _is_bf16_format(m, p, field in mu_dtype_fields), "a float32 array"
      else:
        fits, expected = jnp.result_type(m) == want, f"a {want} array"
      if fits or (field in any_array and not is_quantized(m)):
        continue
      raise ValueError(
          f"{owner}: {field}{jax.tree_util.keystr(path)} is stored as {_storage(m)}, but this "
          f"transform (state_format={state_format!r}) stores it as {expected}; a state of "
          "another format is not stepped in it. Convert the state: "
          f"pallasopt.optim.convert_state(opt_state, params, {state_format!r})."
          + _saved_before(m, role if cls is not None else None)
      )


def _saved_before(m: Any, role: str | None) -> str:
  """For messages: when a blockwise moment stored in an old way was saved, and how to restore it."""
  if not is_quantized(m) or role is None:
    return ""
  if role != quant.SIGNED and quant.role_of(m) == quant.SIGNED:
    when, how = "2026-11-26", "a second moment was stored as itself (the old map)"
  elif not quant.is_current(m):
    when, how = "2026-12-07", "int8 moments were uint8 codes on the dynamic map"
  else:
    return ""
  return (f" It was saved before {when}, when {how}: convert_state reads it, and "
          f"pallasopt.optim.legacy_state_structure(..., saved_before={when!r}) is the tree to "
          "restore such a checkpoint into.")


# (count, learning_rate, weight_decay, grad_scale) -> the kernel's scalars.
ScalarsFn = Callable[[jax.Array, Any, Any, Any], tuple]
# kernel(p, g, *moments, scalars, decay=..., impl=...) -> (p + u or u, *moments).
KernelFn = Callable[..., tuple]


def _check_hyperparameters(
    owner: str,
    learning_rate: Any,
    weight_decay: Any,
    betas: Mapping[str, Any],
    nonnegative: Mapping[str, Any],
) -> None:
  v.check_finite(owner, "learning_rate", learning_rate)
  for name, value in betas.items():
    v.check_hyperparameter(owner, name, value, high=1.0, high_inclusive=False)
  for name, value in nonnegative.items():
    v.check_hyperparameter(owner, name, value)
  v.check_finite(owner, "weight_decay", weight_decay)


def momentum_rounding(
    state_format: str | None, seed: Any, count: jax.Array, leaf: int, shape: tuple[int, ...]
) -> dict[str, Any]:
  """How a momentum re-encoded in XLA (Muon, Adafactor) rounds: `store_moment`'s keywords.

  The momentum's stream (1) of leaf ``leaf`` at step ``count``, as the
  fused kernels draw it for their first moment: ``bits`` (by element index)
  for bf16, the step's ``key`` (`rounding.code_bits` hash the values) for
  blockwise codes; nothing (to nearest) otherwise.
  """
  if state_format == "bf16":
    key = rounding.leaf_key(seed, count, leaf)
    return {"bits": rounding.random_bits(key, rounding.element_index(shape), 1)}
  if state_format in quant.FORMATS:
    return {"key": rounding.step_key(seed, count), "stream": 1}
  return {}


def moment_arrays(tree: Any) -> Any:
  """A moment tree with each blockwise moment replaced by its codes (the param's shape)."""
  return jax.tree.map(lambda m: m.codes if is_quantized(m) else m, tree, is_leaf=is_quantized)


def check_low_bit_options(owner: str, state_format: Any, param_rounding: Any, seed: Any) -> Any:
  """Checks a transform's low-bit options; returns the seed (None means 0)."""
  check_state_format(owner, state_format)
  check_rounding(f"{owner}: param_rounding", param_rounding)
  seed = 0 if seed is None else seed
  check_seed(owner, seed)
  return seed


def decay_link_leaves(owner: str, decay_link: Any, grads: Any) -> tuple[Any, list[bool]]:
  """A folded decay link's ``(rate, per-leaf flags)``; ``(0, all False)`` for None.

  ``decay_link`` is the ``(rate, mask)`` a fused entry point received (see
  `FusedGradientTransformation`).
  """
  if decay_link is None:
    return 0.0, [False] * len(jax.tree.leaves(grads))
  rate, mask = decay_link
  return rate, v.broadcast_mask(owner, mask, grads)


def with_decay_link(
    owner: str, decays: list[bool], decay_link: Any, grads: Any
) -> tuple[Any, list[Any]]:
  """An optimizer's own per-leaf decay flags merged with a folded decay link's.

  Returns the link's rate (0 for None) and, per leaf, ``(own, link)`` where
  either decays, else False (``decays`` unchanged when ``decay_link`` is
  None); `leaf_decay_rate` reads them.
  """
  if decay_link is None:
    return 0.0, decays
  link_rate, links = decay_link_leaves(owner, decay_link, grads)
  return link_rate, [(own, link) if own or link else False for own, link in zip(decays, links)]


def leaf_decay_rate(decay: Any, own_rate: Any, link_rate: Any) -> Any:
  """A leaf's decay rate from its `with_decay_link` flags: ``own_rate`` for a
  plain flag; else ``own_rate`` if it decays by its own plus ``link_rate`` if
  by the link."""
  if not isinstance(decay, tuple):
    return own_rate
  own, link = decay
  return (own_rate if own else 0.0) + (link_rate if link else 0.0)


def check_seed(owner: str, seed: Any) -> None:
  # A traced seed (optax.inject_hyperparams makes one) is fine: it only feeds the hash.
  if isinstance(seed, jax.core.Tracer):
    return
  value = np.asarray(seed)
  if value.shape or value.dtype.kind not in "iu" or not -(2**31) <= int(value) < 2**31:
    raise ValueError(f"{owner}: seed must be an int32 value; got {seed!r}.")


def _refuse_unrounded_updates(owner: str, grads: Any, params: list[Any]) -> None:
  """``param_rounding="stochastic"`` rounds where the step writes the params.

  ``update`` returns updates, and ``optax.apply_updates`` would round the
  bfloat16 params to nearest: the rounding asked for would silently not
  happen, so a step that returns updates for bfloat16 params is an error.
  (For float32 params the option changes nothing.)
  """
  for (path, g), p in zip(v.keyed_leaves(grads), params, strict=True):
    if jnp.result_type(g if p is None else p) == jnp.bfloat16:
      raise ValueError(
          f"{owner}: param_rounding='stochastic' rounds bfloat16 params only where the "
          f"optimizer writes them, in apply_gradients; update returns updates, which "
          f"optax.apply_updates would round to nearest (leaf{path} is bfloat16). Call "
          "tx.apply_gradients(params, grads, opt_state) or "
          "pallasopt.optim.apply_gradients(tx, ...) on this transform itself (not on a "
          "chain around it), or pass param_rounding='nearest'."
      )


def fused_leaf_steps(
    owner: str,
    grads: Any,
    params: list[Any],
    moments: Sequence[Any],
    decays: list[Any],
    *,
    mode: str,
    kernel: KernelFn,
    scalars: Callable[[Any], tuple],
    optax_fallback: Callable[..., tuple],
    grad_scale: Any,
    state_format: str | None,
    param_rounding: str,
    seed: Any,
    count: jax.Array,
    impl: str,
    gate: jax.Array | Gate | None = None,
) -> list[Any]:
  """One elementwise step of every leaf: the trees ``[first, *moments]``.

  ``first`` (new params or updates) and each new moment tree have the
  structure of ``grads``.

  A leaf runs ``kernel(p, g, *moments, scalars(decay), key, decay=bool(decay),
  impl=, state_rounding=[, param_rounding=])`` when its params, grads and moments
  are float32 or bfloat16 or its state is low-bit (which then needs such
  grads), else ``optax_fallback(p, g, moments, decay)`` (Optax's math in the
  leaf's dtypes, on grads already scaled by ``grad_scale``). The random key of
  leaf ``i`` is ``rounding.leaf_key(seed, count, i)`` where something rounds by
  element index (bf16 moments or params), else the step's
  ``rounding.step_key(seed, count)`` (blockwise codes hash their values).

  Args:
    owner: the public name, for messages.
    grads: the gradient tree.
    params: the param leaves (None entries where they are not read).
    moments: the moment trees (8-bit moments as leaves).
    decays: per leaf, a hashable value that is false when the leaf does not
      decay; ``scalars`` and ``optax_fallback`` get it (a family whose leaves
      decay by different rates tells them apart by it).
    gate: None, or a boolean scalar: where false each leaf holds (its params
      or zero updates, its moments as stored), inside the kernel (its
      ``gate``) or after Optax's math; or a `kernels._update.Gate` whose
      ``acc`` is the accumulator tree (the grads' structure; ``like`` is
      each leaf's gradient): the step runs on the accumulated gradients, and
      the tree of stored accumulators is returned last.
  """
  if mode == "updates" and param_rounding == "stochastic":
    _refuse_unrounded_updates(owner, grads, params)
  state_rounding = "stochastic" if state_format == "bf16" else "nearest"
  rounds = state_format is not None or param_rounding == "stochastic"

  accumulating = isinstance(gate, Gate)

  def leaf_step(index, path, p, g, *ms, decay, acc=None):
    one_gate = leaf_gate(gate, acc, g)
    # Leaves whose params the kernels take hold low-bit state; the others
    # hold Optax's, in the params' dtype.
    low_bit = state_format is not None and all(is_quantized(m) or v.kernel_dtypes(m) for m in ms)
    if low_bit and not v.kernel_dtypes(g):
      raise TypeError(
          f"{owner}: state_format={state_format!r} needs float32 or bfloat16 grads;"
          f" grads{path} has dtype {jnp.result_type(g)}."
      )
    if low_bit or v.kernel_dtypes(p, g, *ms):
      options = {"state_rounding": state_rounding}
      if mode == "apply":
        options["param_rounding"] = param_rounding
      by_index = state_format == "bf16" or (
          mode == "apply" and param_rounding == "stochastic"
          and jnp.result_type(p) == jnp.bfloat16)
      key = None if not rounds else (
          rounding.leaf_key(seed, count, index) if by_index else rounding.step_key(seed, count))
      if gate is not None:
        options["gate"] = one_gate
      return kernel(p, g, *ms, scalars(decay), key, decay=bool(decay), impl=impl, **options)
    # Optax's MultiSteps' accumulation, in XLA.
    first, *new = optax_fallback(p, scaled_grads(gated_gradient(g, one_gate), grad_scale), ms,
                                 decay)
    held = p if mode == "apply" else jnp.zeros_like(first)
    results = held_where_closed(open_gate(gate), (first, *new), (held, *ms))
    if accumulating:
      results = (*results, gated_accumulator(g, one_gate))
    return results

  moment_leaves = [jax.tree.leaves(m, is_leaf=is_quantized) for m in moments]
  paths = [path for path, _ in v.keyed_leaves(grads)]
  columns = (paths, params, jax.tree.leaves(grads), *moment_leaves, decays)
  accumulators = jax.tree.leaves(gate.acc) if accumulating else [None] * len(paths)
  results = [
      leaf_step(i, path, p, g, *ms, decay=d, acc=a)
      for i, (path, p, g, *ms, d, a) in enumerate(zip(*columns, accumulators, strict=True))
  ]
  treedef = jax.tree.structure(grads)
  by_output = list(zip(*results, strict=True)) or [()] * (1 + len(moments) + accumulating)
  return [treedef.unflatten(column) for column in by_output]


def elementwise_transform(
    owner: str,
    learning_rate: ScalarOrSchedule,
    weight_decay: ScalarOrSchedule,
    mask: MaskOrFn,
    mu_dtype: Any | None,
    impl: str,
    *,
    betas: Mapping[str, Any],
    nonnegative: Mapping[str, Any] | None = None,
    state_cls: type,
    scalars: ScalarsFn,
    apply_kernel: KernelFn,
    updates_kernel: KernelFn,
    optax_scaling: optax.GradientTransformation,
    roles: Sequence[str],
    state_format: str | None = None,
    param_rounding: str = "nearest",
    seed: int | None = None,
) -> FusedGradientTransformation:
  """Builds an elementwise optimizer with Optax's state tree and a fused apply.

  Args:
    owner: the public name, e.g. ``"pallasopt.optim.lion"``, for messages.
    learning_rate: a scalar or schedule; checked to be finite when concrete.
    weight_decay: a scalar or schedule; checked to be finite when concrete.
    mask: Optax's weight-decay mask (tree, prefix tree or callable).
    mu_dtype: dtype of the first moment, float32 or bfloat16, or None.
    impl: the kernels' ``impl``; checked here.
    betas: named hyperparameters that must lie in [0, 1).
    nonnegative: other named hyperparameters that must be >= 0.
    state_cls: Optax's state NamedTuple of the scaling transform, with fields
      ``(count, first_moment, *other_moments)``, e.g. ``optax.ScaleByLionState``.
      The first moment is stored in ``mu_dtype`` (default: the params'
      dtype), the others in the params' dtype, as Optax initialises them.
    scalars: ``scalars(count, learning_rate, weight_decay, grad_scale)``, the
      kernel scalars of the step whose incremented counter is ``count``.
    apply_kernel: ``(p, g, *moments, scalars, decay=, impl=) -> (p + u,
      *moments)``.
    updates_kernel: the same returning ``(u, *moments)``; ``p`` may be None.
    optax_scaling: Optax's ``scale_by_X`` with the same hyperparameters, run
      on the leaves whose dtypes no kernel takes.
    roles: per moment, how a blockwise one is stored (`quant.ROLES`).
    state_format: ``None``, ``"bf16"``, ``"int8"``, ``"fp8"`` or ``"int4"`` (module docstring).
    param_rounding: ``"nearest"`` or ``"stochastic"``, for bf16 params in
      ``apply_gradients``.
    seed: the seed of the stochastic roundings (None: 0).
  """
  _check_hyperparameters(owner, learning_rate, weight_decay, betas, nonnegative or {})
  resolve_impl(impl)
  mu_dtype = v.optional_dtype(owner, "mu_dtype", mu_dtype)
  seed = check_low_bit_options(owner, state_format, param_rounding, seed)
  first_moment = state_cls._fields[1]
  num_moments = len(state_cls._fields) - 1
  # Optax builds these two states; reusing their init keeps ours identical.
  decay_tx = optax.add_decayed_weights(weight_decay, mask)
  lr_tx = optax.scale_by_learning_rate(learning_rate)
  never_decays = isinstance(weight_decay, (int, float)) and weight_decay == 0

  def optax_leaf(p, g, ms, count, learning_rate_now, weight_decay_now, decay, mode):
    """One leaf by Optax's math, in the leaf's own dtypes: (first, *moments)."""
    (u,), new = optax_scaling.update([g], state_cls(count, *([m] for m in ms)), [p])
    if decay:
      u = u + weight_decay_now * p
    u = jnp.asarray(-learning_rate_now, jnp.result_type(u)) * u
    first = optax.apply_updates(p, u) if mode == "apply" else u
    return (first, *(m for (m,) in new[1:]))

  def init_fn(params):
    # The first moment in mu_dtype, the others (and mu by default) as the params;
    # laid out as the params (`zeros_like` keeps a sharded type), as Optax's are.
    dtypes = [mu_dtype] + [None] * (num_moments - 1)
    zeros = [
        jax.tree.map(lambda p, d=d: jnp.zeros_like(p, d or jnp.result_type(p)), params)
        for d in dtypes
    ]
    moments = stored_moment_trees(zeros, params, roles=roles, state_format=state_format,
                                  kept_dtypes=dtypes)
    return state_cls(jnp.zeros([], jnp.int32), *moments), decay_tx.init(params), lr_tx.init(params)

  def step(grads, state, params, mode, grad_scale, learning_rate_now, decay_link=None,
           gate=None):
    moment_state, decay_state, lr_state = state
    moments = moment_state[1:]
    v.check_same_tree(
        owner, "grads", grads, f"opt_state.{first_moment}", moment_arrays(moments[0])
    )
    num_leaves = len(jax.tree.leaves(grads))
    decays = [False] * num_leaves if never_decays else v.broadcast_mask(owner, mask, grads)
    # Per leaf (own decay, link decay): the kernels add both rates times lr p.
    link_rate, decays = with_decay_link(owner, decays, decay_link, grads)
    ps = v.checked_param_leaves(owner, params, grads, mode=mode, decays=decays)
    check_moment_storage(
        owner, {f"opt_state[0].{f}": m for f, m in zip(state_cls._fields[1:], moments)}, roles,
        ps, grads, state_format=state_format, mu_dtype=mu_dtype,
        mu_dtype_fields=(f"opt_state[0].{first_moment}",))

    count = optax.safe_increment(moment_state.count)
    if learning_rate_now is None:
      learning_rate_now = schedule_value(learning_rate, lr_state)
    weight_decay_now = schedule_value(weight_decay, decay_state)
    kernel = apply_kernel if mode == "apply" else updates_kernel

    leaf_decay = functools.partial(
        leaf_decay_rate, own_rate=weight_decay_now, link_rate=link_rate
    )

    @functools.cache
    def step_scalars(decay):  # built only if some leaf runs a kernel
      return scalars(
          count, learning_rate_now, leaf_decay(decay), 1.0 if grad_scale is None else grad_scale
      )

    def optax_fallback(p, g, ms, decay):
      return optax_leaf(
          p, g, ms, moment_state.count, learning_rate_now, leaf_decay(decay), bool(decay), mode
      )

    first, *new_moments = fused_leaf_steps(
        owner, grads, ps, moments, decays, mode=mode, kernel=kernel, scalars=step_scalars,
        optax_fallback=optax_fallback, grad_scale=grad_scale, state_format=state_format,
        param_rounding=param_rounding, seed=seed, count=count, impl=impl, gate=gate,
    )
    new_moments, accumulator = split_accumulator(gate, new_moments)
    new_state = (
        state_cls(count, *new_moments),
        advance_schedule(decay_state),
        advance_schedule(lr_state),
    )
    return gated_results(gate, first, held_counters(gate, new_state, state), accumulator)

  return fused_transformation(
      init_fn, step, learning_rate=learning_rate, elementwise=True, gated=True)
