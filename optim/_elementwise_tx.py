"""The Optax drop-in shared by the elementwise optimizers (AdamW, Lion).

Optax builds each of them as the chain::

  scale_by_X(b1, b2, ..., mu_dtype)       # state: X's NamedTuple (count, moments...)
  add_decayed_weights(weight_decay, mask)  # state: empty, or a schedule count
  scale_by_learning_rate(learning_rate)    # state: empty, or a schedule count

`elementwise_transform` keeps exactly that state tree (the last two states
come from Optax's own ``init``) and replaces the three passes with one kernel
per leaf, in ``"updates"`` mode for ``update`` and in ``"apply"`` mode for the
fused ``apply_gradients``. A family supplies only its kernels and how to build
its per-step scalars.

Leaves the kernels do not take (float16, float64, complex or integer params,
grads or moments) are updated by Optax's own scaling transform for that leaf
(``scale_by_X``, the same hyperparameters), then decayed and scaled by the
learning rate as Optax's chain does, in every ``impl``: their numbers and
dtypes are Optax's.
"""

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from pallasopt.kernels._dispatch import resolve_impl
from pallasopt.optim import _validation as v
from pallasopt.optim._base import (
    FusedGradientTransformation,
    advance_schedule,
    fused_transformation,
    schedule_value,
)

__all__ = ["elementwise_transform"]

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
  v.check_hyperparameter(owner, "learning_rate", learning_rate)
  for name, value in betas.items():
    v.check_hyperparameter(owner, name, value, high=1.0, high_inclusive=False)
  for name, value in nonnegative.items():
    v.check_hyperparameter(owner, name, value)
  v.check_hyperparameter(owner, "weight_decay", weight_decay)


def elementwise_transform(
    owner: str,
    learning_rate: optax.ScalarOrSchedule,
    weight_decay: optax.ScalarOrSchedule,
    mask: Any | Callable[[optax.Params], Any] | None,
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
) -> FusedGradientTransformation:
  """Builds an elementwise optimizer with Optax's state tree and a fused apply.

  Args:
    owner: the public name, e.g. ``"pallasopt.optim.lion"``, for messages.
    learning_rate: a scalar or schedule; checked to be >= 0 when concrete.
    weight_decay: a scalar or schedule; checked to be >= 0 when concrete.
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
  """
  _check_hyperparameters(owner, learning_rate, weight_decay, betas, nonnegative or {})
  resolve_impl(impl)
  mu_dtype = v.optional_dtype(owner, "mu_dtype", mu_dtype)
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
    # The first moment in mu_dtype, the others (and mu by default) as the params.
    dtypes = [mu_dtype] + [None] * (num_moments - 1)
    moments = [
        jax.tree.map(lambda p, d=d: jnp.zeros_like(p, d or p.dtype), params) for d in dtypes
    ]
    return state_cls(jnp.zeros([], jnp.int32), *moments), decay_tx.init(params), lr_tx.init(params)

  def step(grads, state, params, mode, grad_scale, learning_rate_now):
    moment_state, decay_state, lr_state = state
    moments = moment_state[1:]
    v.check_same_tree(owner, "grads", grads, f"opt_state.{first_moment}", moments[0])
    num_leaves = len(jax.tree.leaves(grads))
    decays = [False] * num_leaves if never_decays else v.broadcast_mask(owner, mask, grads)
    ps = v.checked_param_leaves(owner, params, grads, mode=mode, decays=decays)

    count = optax.safe_increment(moment_state.count)
    if learning_rate_now is None:
      learning_rate_now = schedule_value(learning_rate, lr_state)
    weight_decay_now = schedule_value(weight_decay, decay_state)
    kernel = apply_kernel if mode == "apply" else updates_kernel

    @functools.cache
    def step_scalars():  # built only if some leaf runs a kernel
      return scalars(
          count, learning_rate_now, weight_decay_now, 1.0 if grad_scale is None else grad_scale
      )

    def leaf_step(p, g, *ms, decay):
      if v.kernel_dtypes(p, g, *ms):
        return kernel(p, g, *ms, step_scalars(), decay=decay, impl=impl)
      if grad_scale is not None:
        g = (g * grad_scale).astype(g.dtype)
      return optax_leaf(
          p, g, ms, moment_state.count, learning_rate_now, weight_decay_now, decay, mode
      )

    columns = (ps, jax.tree.leaves(grads), *map(jax.tree.leaves, moments), decays)
    results = [leaf_step(p, g, *ms, decay=d) for p, g, *ms, d in zip(*columns, strict=True)]
    treedef = jax.tree.structure(grads)
    by_output = list(zip(*results, strict=True)) or [()] * (1 + num_moments)
    first, *new_moments = (treedef.unflatten(column) for column in by_output)
    new_state = (
        state_cls(count, *new_moments),
        advance_schedule(decay_state),
        advance_schedule(lr_state),
    )
    return first, new_state

  return fused_transformation(init_fn, step)
