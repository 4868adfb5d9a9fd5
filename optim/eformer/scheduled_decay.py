"""Weight decay whose rate follows a schedule: the factory's decay link.

eFormer's factory appends this transform (``optax_add_scheduled_weight_decay``)
after the optimizer, with the rate ``-schedule(step) * weight_decay``: the
decay is scaled by the learning rate but is not part of the optimizer's own
update, and it has its own step counter in the state. `OptimizerFactory`
builds the same link, so the opt_state tree (and a checkpoint) is eFormer's.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from pallasopt.optim._types import MaskOrFn

__all__ = [
    "OptaxScheduledWeightDecayState",
    "add_scheduled_weight_decay",
    "optax_add_scheduled_weight_decay",
]

_OWNER = "pallasopt.optim.eformer.add_scheduled_weight_decay"


class OptaxScheduledWeightDecayState(NamedTuple):
  """The step counter the decay schedule is evaluated at (eFormer's name)."""

  count: jax.Array


def add_scheduled_weight_decay(
    schedule_fn: Callable[[jax.Array], jax.Array],
    mask: MaskOrFn = None,
) -> optax.GradientTransformation:
  r"""Adds ``schedule_fn(count) * params`` to the updates.

  .. math:: u \leftarrow u + s(t)\, p, \qquad t \leftarrow t + 1

  with :math:`t` the transform's own counter (starting at 0). For decoupled
  weight decay scaled by the learning rate, as eFormer's factory builds it,
  :math:`s(t) = -\eta(t)\,\lambda` (Loshchilov & Hutter, `Decoupled Weight
  Decay Regularization <https://arxiv.org/abs/1711.05101>`_, 2019). Unlike
  ``optax.add_decayed_weights`` the rate is a function of this counter, so it
  follows the learning-rate schedule when placed after the optimizer.

  Args:
    schedule_fn: the rate as a function of the step count.
    mask: which leaves decay: a tree of bools (or a prefix of the params
      tree, or a callable returning one), as ``optax.masked`` takes; None:
      all leaves.

  Returns:
    An Optax transform with state `OptaxScheduledWeightDecayState` (inside
    ``optax.MaskedState`` when `mask` is given).

  Raises:
    TypeError: `schedule_fn` is not callable.
    ValueError: at update time, no params.
  """
  if not callable(schedule_fn):
    raise TypeError(f"{_OWNER}: schedule_fn must be callable; got {schedule_fn!r}.")

  def init_fn(params):
    del params
    return OptaxScheduledWeightDecayState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(f"{_OWNER}: update needs params (the decay is a multiple of them).")
    rate = schedule_fn(state.count)
    updates = jax.tree.map(lambda u, p: u + rate * p, updates, params)
    return updates, OptaxScheduledWeightDecayState(count=optax.safe_increment(state.count))

  tx = optax.GradientTransformation(init_fn, update_fn)
  return tx if mask is None else optax.masked(tx, mask)


optax_add_scheduled_weight_decay = add_scheduled_weight_decay
"""eFormer's name for `add_scheduled_weight_decay`."""
