"""Input checks shared by every pallasopt transform.

Each check raises at trace time with a message that names the argument, the
leaf path (`jax.tree_util.keystr`) and what was expected, because a fused kernel
fed a mismatched tree or an unsupported dtype would otherwise fail deep inside
Pallas, or silently compute something meaningless.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_SUPPORTED_NAMES = "float32, bfloat16"


def keyed_leaves(tree: Any) -> list[tuple[str, Any]]:
  """The leaves of `tree` with their key paths rendered as strings."""
  return [
      (jax.tree_util.keystr(path) or "<root>", leaf)
      for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  ]


def check_same_tree(owner: str, name: str, tree: Any, ref_name: str, ref_tree: Any) -> None:
  """`tree` must have `ref_tree`'s structure and leaf shapes."""
  struct, ref_struct = jax.tree.structure(tree), jax.tree.structure(ref_tree)
  if struct != ref_struct:
    got = {p for p, _ in keyed_leaves(tree)}
    want = {p for p, _ in keyed_leaves(ref_tree)}
    details = []
    if want - got:
      details.append(f"missing in {name}: {path_list(want - got)}")
    if got - want:
      details.append(f"unexpected in {name}: {path_list(got - want)}")
    raise ValueError(
        f"{owner}: {name} must have the same tree structure as {ref_name}. "
        + ("; ".join(details) if details else f"{name}: {struct}; {ref_name}: {ref_struct}")
    )
  for (path, leaf), (_, ref_leaf) in zip(keyed_leaves(tree), keyed_leaves(ref_tree)):
    if jnp.shape(leaf) != jnp.shape(ref_leaf):
      raise ValueError(
          f"{owner}: {name}{path} has shape {jnp.shape(leaf)} but "
          f"{ref_name}{path} has shape {jnp.shape(ref_leaf)}; they must match."
      )


def path_list(paths: Iterable[str], most: int = 5) -> str:
  """Key paths (`jax.tree_util.keystr` strings) for a message: the first
  `most` in sorted order, comma-separated, as keystr writes them."""
  paths = set(paths)
  shown = sorted(paths)[:most]
  more = f" and {len(paths) - most} more" if len(paths) > most else ""
  return ", ".join(shown) + more


def check_float_leaves(owner: str, name: str, tree: Any) -> None:
  """Every leaf of `tree` must have a dtype the kernels take."""
  for path, leaf in keyed_leaves(tree):
    dtype = jnp.result_type(leaf)
    if dtype not in SUPPORTED_DTYPES:
      raise TypeError(
          f"{owner}: {name}{path} has dtype {dtype}; supported dtypes are "
          f"{_SUPPORTED_NAMES}."
      )


def optional_float_dtype(owner: str, name: str, dtype: Any) -> jnp.dtype | None:
  """`dtype` as a `jnp.dtype` the kernels take (float32 or bfloat16), or None."""
  if dtype is None:
    return None
  dtype = jnp.dtype(dtype)
  if dtype not in SUPPORTED_DTYPES:
    raise TypeError(f"{owner}: {name} must be float32 or bfloat16; got {dtype}.")
  return dtype


def optional_dtype(owner: str, name: str, dtype: Any) -> jnp.dtype | None:
  """`dtype` as a `jnp.dtype` (any JAX dtype, as Optax accepts), or None."""
  if dtype is None:
    return None
  try:
    return jnp.dtype(dtype)
  except (TypeError, ValueError):
    raise TypeError(f"{owner}: {name} must be a dtype or None; got {dtype!r}.") from None


def kernel_dtypes(*leaves: Any) -> bool:
  """Whether a fused kernel takes these leaves (None entries are ignored).

  The kernels compute in f32 from float32 or bfloat16 operands; any other
  dtype (float16, float64, complex, integer) runs the reference of Optax's
  math instead.
  """
  return all(x is None or jnp.result_type(x) in SUPPORTED_DTYPES for x in leaves)


def concrete_value(owner: str, name: str, value: Any) -> float | None:
  """The float value of a concrete scalar; None for None, tracers, schedules
  and non-scalar arrays.

  Raises:
    TypeError: ``value`` is text (``"3e-4"``, which Optax refuses too) or
      another non-number.
  """
  if value is None or callable(value) or isinstance(value, jax.core.Tracer):
    return None
  try:
    array = np.asarray(value)
  except (TypeError, jax.errors.TracerArrayConversionError):
    return None
  if array.dtype.kind in "OSUV":
    raise TypeError(
        f"{owner}: {name} must be a number, an array or a schedule (a callable of the step "
        f"count); got {type(value).__name__} {value!r}."
    )
  if array.shape != () or not np.issubdtype(array.dtype, np.number):
    return None
  return float(array)


def check_hyperparameter(
    owner: str,
    name: str,
    value: Any,
    *,
    low: float = 0.0,
    high: float = math.inf,
    high_inclusive: bool = True,
) -> None:
  """A concrete hyperparameter must be finite and within ``[low, high]``.

  Traced values (``optax.inject_hyperparams``) and schedules cannot be checked
  ahead of time and pass through.
  """
  x = concrete_value(owner, name, value)
  if x is None:
    return
  above = x > high if high_inclusive else x >= high
  if math.isnan(x) or x < low or above:
    bound = "]" if high_inclusive else ")"
    raise ValueError(
        f"{owner}: {name} must be in [{low}, {high}{bound}; got {value!r}."
    )


def check_finite(owner: str, name: str, value: Any) -> None:
  """A concrete hyperparameter must be a finite number; its sign is free.

  For learning rates and weight-decay rates, which Optax takes with either
  sign (a negative learning rate ascends). Traced values and schedules pass:
  their values exist only inside the step. With
  ``jax.config.update("jax_debug_nans", True)`` (and ``"jax_debug_infs"``)
  the first update a non-finite one spoils raises ``FloatingPointError``.
  """
  x = concrete_value(owner, name, value)
  if x is not None and not math.isfinite(x):
    raise ValueError(f"{owner}: {name} must be a finite number; got {value!r}.")


def is_int(value: Any) -> bool:
  """A Python int that is not a bool."""
  return isinstance(value, int) and not isinstance(value, bool)


def check_accumulation_and_clip(
    owner: str, gradient_accumulation_steps: Any, clip_grad: Any
) -> None:
  """A stage-local chain's ``gradient_accumulation_steps`` (an int >= 1) and
  ``clip_grad`` (None, or a finite number >= 0)."""
  k = gradient_accumulation_steps
  if not is_int(k) or k < 1:
    raise ValueError(f"{owner}: gradient_accumulation_steps must be an int >= 1; got {k!r}.")
  clip = clip_grad
  if clip is not None and (
      not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip < 0
  ):
    raise ValueError(f"{owner}: clip_grad must be None or a finite number >= 0; got {clip!r}.")


def broadcast_mask(
    owner: str, mask: Any | Callable[[Any], Any] | None, tree: Any
) -> list[bool]:
  """Per-leaf booleans from an Optax-style mask (a prefix tree or a callable).

  Args:
    owner: the transform's name, for messages.
    mask: None (every leaf True), a tree of bools with `tree`'s structure or a
      prefix of it, or a callable returning such a tree from `tree`.
    tree: the tree the mask applies to.
  """
  leaves = keyed_leaves(tree)
  if mask is None:
    return [True] * len(leaves)
  mask_tree = mask(tree) if callable(mask) else mask
  try:
    full = jax.tree.map(
        lambda m, sub: jax.tree.map(lambda _: m, sub), mask_tree, tree
    )
  except ValueError as e:
    raise ValueError(
        f"{owner}: mask must have the structure of the params or a prefix of it; {e}"
    ) from None
  flags = []
  for (path, _), flag in zip(leaves, jax.tree.leaves(full)):
    if not isinstance(flag, (bool, np.bool_)):
      raise TypeError(
          f"{owner}: mask{path} must be a Python bool; got {type(flag).__name__}."
      )
    flags.append(bool(flag))
  return flags


def static_int(owner: str, name: str, value: Any, *, low: int = 0, static_args: str = "") -> int:
  """A structural integer argument (an axis count, a size threshold) as a Python int.

  Such arguments decide shapes and kernels at trace time, so they cannot be
  traced. ``optax.inject_hyperparams`` turns every int argument into an array
  unless it is named in ``static_args``; a traced one is reported with that
  advice (``static_args`` names the tuple to pass, e.g.
  ``"ADAFACTOR_STATIC_ARGS"``).

  Raises:
    TypeError: ``value`` is traced.
    ValueError: ``value`` is a bool, not integral, or below ``low``.
  """
  if isinstance(value, jax.core.Tracer):
    hint = f"static_args={static_args}" if static_args else f"static_args=({name!r},)"
    raise TypeError(
        f"{owner}: {name} must be a Python int, not a traced value; under "
        f"optax.inject_hyperparams pass {hint}."
    )
  x = concrete_value(owner, name, value)
  if isinstance(value, bool) or x is None or x != int(x) or x < low:
    raise ValueError(f"{owner}: {name} must be an int >= {low}; got {value!r}.")
  return int(x)


def checked_param_leaves(
    owner: str, params: Any, grads: Any, *, mode: str, decays: list[bool]
) -> list[Any]:
  """The param leaves a step needs, or Nones where the Optax contract allows.

  ``update`` may be called without params unless a leaf decays; applying
  gradients always needs them. Params that are given must match the grads.

  Args:
    owner: the transform's name, for messages.
    params: the params passed to the step, or None.
    grads: the gradients.
    mode: ``"updates"`` (Optax ``update``) or ``"apply"`` (fused apply).
    decays: per-leaf weight-decay flags.
  """
  if params is not None:
    check_same_tree(owner, "params", params, "grads", grads)
    return jax.tree.leaves(params)
  if mode == "apply" or any(decays):
    raise ValueError(
        f"{owner}: params are required "
        + ("to apply gradients." if mode == "apply" else "for weight decay.")
    )
  return [None] * len(decays)



def check_stacked_axes(owner: str, tree: Any, stacked_axes: int) -> None:
  """Every leaf must have axes of its own after the ``stacked_axes`` layer axes.

  A leaf of rank ``stacked_axes`` or less (an unstacked embedding or norm in
  a stacked tree) would silently be updated as a stack of scalars; stack such
  leaves too (a per-layer scalar as ``(layers, 1)``) or keep them out of the
  stacked transform.
  """
  if not stacked_axes:
    return
  for path, leaf in keyed_leaves(tree):
    if jnp.ndim(leaf) <= stacked_axes:
      raise ValueError(
          f"{owner}: stacked_axes={stacked_axes} says every leaf has {stacked_axes} layer "
          f"axes and axes of its own after them, but leaf{path} has shape {jnp.shape(leaf)}."
      )
