"""AdamW as a drop-in for `optax.adamw`, backed by the fused AdamW kernel."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from pallasopt.kernels import adamw as adamw_kernels
from pallasopt.kernels._dispatch import resolve_impl
from pallasopt.optim import _validation as v
from pallasopt.optim._base import (
    FusedGradientTransformation,
    advance_schedule,
    schedule_count,
)

__all__ = ["adamw", "nadamw"]

_OWNER = "pallasopt.optim.adamw"


def _current(value: optax.ScalarOrSchedule, state: Any):
  return value(schedule_count(state)) if callable(value) else value


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    eps_root: jax.typing.ArrayLike = 0.0,
    mu_dtype: Any | None = None,
    weight_decay: optax.ScalarOrSchedule = 1e-4,
    mask: Any | Callable[[optax.Params], Any] | None = None,
    *,
    nesterov: bool = False,
    impl: str = "auto",
) -> FusedGradientTransformation:
  r"""AdamW with decoupled weight decay, one fused kernel per leaf.

  Same arguments, math and state as `optax.adamw` (Loshchilov & Hutter,
  `Decoupled Weight Decay Regularization <https://arxiv.org/abs/1711.05101>`_,
  2019; with ``nesterov=True``, NAdamW after Dozat, 2016). With step
  :math:`t`, gradient :math:`g` and parameter :math:`p`:

  .. math::

    m_t = \beta_1 m_{t-1} + (1-\beta_1) g, \quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2) g^2, \\
    u_t = -\eta_t \left(\frac{m_t / (1-\beta_1^t)}
        {\sqrt{v_t / (1-\beta_2^t) + \epsilon_{root}} + \epsilon}
        + \lambda_t p \right).

  The state is exactly ``optax.adamw(...).init(params)``'s: a tuple of
  ``ScaleByAdamState(count, mu, nu)``, the weight-decay state and the
  learning-rate state. A checkpoint written with one restores into the other.

  ``update`` returns Optax updates (one kernel per leaf writes ``u``, ``m``,
  ``v``). ``apply_gradients`` (or `pallasopt.optim.apply_gradients`) writes
  ``p + u``, ``m`` and ``v`` in place instead, saving the separate
  ``optax.apply_updates`` pass.

  Args:
    learning_rate: a scalar or an ``optax`` schedule of the step count.
    b1: decay of the first moment, in [0, 1).
    b2: decay of the second moment, in [0, 1).
    eps: added to the denominator outside the square root, >= 0.
    eps_root: added inside the square root, >= 0.
    mu_dtype: dtype of the first moment (None: the params' dtype).
    weight_decay: decoupled weight decay (scalar or schedule), >= 0; as in
      Optax it is multiplied by the learning rate.
    mask: a tree of bools (or a prefix of the params tree, or a callable
      returning one) selecting the leaves that decay.
    nesterov: use Nesterov momentum (NAdamW).
    impl: ``"auto" | "pallas" | "interpret" | "xla"``; see
      `pallasopt.kernels.use_impl`.

  Returns:
    A `FusedGradientTransformation`.

  Raises:
    ValueError: a concrete hyperparameter out of range or NaN; at update time,
      grads, params and state trees that do not match.
    TypeError: a leaf whose dtype is not float32 or bfloat16.
  """
  for name, value, high, inclusive in (
      ("learning_rate", learning_rate, float("inf"), True),
      ("b1", b1, 1.0, False),
      ("b2", b2, 1.0, False),
      ("eps", eps, float("inf"), True),
      ("eps_root", eps_root, float("inf"), True),
      ("weight_decay", weight_decay, float("inf"), True),
  ):
    v.check_hyperparameter(_OWNER, name, value, high=high, high_inclusive=inclusive)
  resolve_impl(impl)
  mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)
  if mu_dtype is not None and mu_dtype not in v.SUPPORTED_DTYPES:
    raise TypeError(f"{_OWNER}: mu_dtype must be float32 or bfloat16; got {mu_dtype}.")
  # Optax builds these two states; reusing their init keeps ours identical.
  decay_tx = optax.add_decayed_weights(weight_decay, mask)
  lr_tx = optax.scale_by_learning_rate(learning_rate)
  never_decays = isinstance(weight_decay, (int, float)) and weight_decay == 0

  def init_fn(params):
    v.check_float_leaves(_OWNER, "params", params)
    adam_state = optax.ScaleByAdamState(
        count=jnp.zeros([], jnp.int32),
        mu=jax.tree.map(lambda p: jnp.zeros(p.shape, mu_dtype or p.dtype), params),
        nu=jax.tree.map(jnp.zeros_like, params),
    )
    return adam_state, decay_tx.init(params), lr_tx.init(params)

  def step(grads, state, params, mode, grad_scale=None, learning_rate_now=None):
    adam_state, decay_state, lr_state = state
    v.check_same_tree(_OWNER, "grads", grads, "opt_state.mu", adam_state.mu)
    v.check_float_leaves(_OWNER, "grads", grads)
    decays = (
        [False] * len(jax.tree.leaves(grads))
        if never_decays
        else v.broadcast_mask(_OWNER, mask, grads)
    )
    if params is None:
      if mode == "apply" or any(decays):
        raise ValueError(
            f"{_OWNER}: params are required "
            + ("to apply gradients." if mode == "apply" else "for weight decay.")
        )
      param_leaves = [None] * len(decays)
    else:
      v.check_same_tree(_OWNER, "params", params, "grads", grads)
      v.check_float_leaves(_OWNER, "params", params)
      param_leaves = jax.tree.leaves(params)

    count = optax.safe_increment(adam_state.count)
    if learning_rate_now is None:
      learning_rate_now = _current(learning_rate, lr_state)
    scalars = adamw_kernels.adamw_scalars(
        count, learning_rate_now, b1, b2, eps, eps_root,
        _current(weight_decay, decay_state),
        grad_scale=1.0 if grad_scale is None else grad_scale,
    )
    kernel = adamw_kernels.adamw_apply if mode == "apply" else adamw_kernels.adamw_updates
    results = [
        kernel(p, g, m, n, scalars, nesterov=nesterov, decay=d, impl=impl)
        for p, g, m, n, d in zip(
            param_leaves, jax.tree.leaves(grads), jax.tree.leaves(adam_state.mu),
            jax.tree.leaves(adam_state.nu), decays, strict=True,
        )
    ]
    treedef = jax.tree.structure(grads)
    first, mu, nu = (treedef.unflatten(column) for column in zip(*results, strict=True))
    new_state = (
        optax.ScaleByAdamState(count=count, mu=mu, nu=nu),
        advance_schedule(decay_state),
        advance_schedule(lr_state),
    )
    return first, new_state

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    return step(updates, state, params, "updates")

  def apply_fn(params, grads, state, *, grad_scale=None, learning_rate=None):
    return step(grads, state, params, "apply", grad_scale, learning_rate)

  return FusedGradientTransformation(init_fn, update_fn, apply_fn)


def nadamw(*args, **kwargs) -> FusedGradientTransformation:
  """`adamw` with ``nesterov=True``, a drop-in for `optax.nadamw`."""
  return adamw(*args, nesterov=True, **kwargs)
