r"""Fused RMSProp: one pass over (p, g, [mu,] nu, [trace]) per leaf.

RMSProp (Hinton, `Neural Networks for Machine Learning, lecture 6e
<https://www.cs.toronto.edu/~tijmen/csc321/slides/lecture_slides_lec6.pdf>`_,
2012; the centered form after Graves, `Generating Sequences With Recurrent
Neural Networks <https://arxiv.org/abs/1308.0850>`_, 2013), exactly as
`optax.rmsprop` chains it: ``scale_by_rms`` (or ``scale_by_stddev`` when
centered), ``scale_by_learning_rate``, then ``trace`` when there is
momentum. With step :math:`t`, decay :math:`\rho` and gradient :math:`g`:

.. math::

  \nu_t &= \rho\,\nu_{t-1} + (1 - \rho)\,g^2, \qquad
  \mu_t = \rho\,\mu_{t-1} + (1 - \rho)\,g \quad\text{(centered)} \\
  s &= \left(\hat\nu - \hat\mu^2 + \epsilon\right)^{-1/2}
     \quad\text{or, with eps outside the root,}\quad
     1 / \left(\sqrt{\hat\nu - \hat\mu^2} + \epsilon\right) \\
  u &= -\eta\, s\, g, \qquad
  \tau_t = u + \beta \tau_{t-1}, \qquad
  u \leftarrow \tau_t \text{ or, with Nesterov, } u + \beta\tau_t

where the hats divide by :math:`1 - \rho^t` with ``bias_correction`` (else
1), :math:`\hat\mu = 0` unless centered, and the trace :math:`\tau` exists
only with momentum :math:`\beta`. With ``decay=True`` (a weight-decay link
that follows the chain, as eFormer's factory appends one), a leaf's update
becomes :math:`u + r\,p`, ``r`` the scalars' ``decay_rate``. The moments in kernel order are
``(mu if centered, nu, trace if momentum)``; modes, dtypes, 8-bit moments and
stochastic rounding are those of `_update.kernel_update`.

Dispatch: like AdamW's, the elementwise update rows of `pallasopt.kernels.policy`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallasopt.kernels import quant
from pallasopt.kernels._update import (
    kernel_update,
    reference_update,
    scalars_decay_rate,
    update_dispatch,
)

__all__ = [
    "RMSPropScalars",
    "rmsprop_scalars",
    "rmsprop_reference",
    "rmsprop_kernel",
    "rmsprop_apply",
    "rmsprop_updates",
    "moment_roles",
]

# Gradient scale, nu, mu, correction, centering, root and scale, lr, trace.
FLOPS_PER_ELEMENT = 18


class RMSPropScalars(NamedTuple):
  """Per-step scalars of an RMSProp update; every field is a 0-d value."""

  learning_rate: jax.typing.ArrayLike
  decay: jax.typing.ArrayLike
  one_minus_decay: jax.typing.ArrayLike  # 1 - decay before rounding to f32
  eps: jax.typing.ArrayLike
  bias_correction: jax.typing.ArrayLike  # 1 - decay**t, or 1 without correction
  momentum: jax.typing.ArrayLike  # 0 without momentum
  grad_scale: jax.typing.ArrayLike  # multiplies g on load, e.g. a clip factor
  decay_rate: jax.typing.ArrayLike  # r of a decaying leaf's u + r p


def rmsprop_scalars(
    learning_rate: jax.typing.ArrayLike,
    decay: jax.typing.ArrayLike,
    eps: jax.typing.ArrayLike,
    *,
    count: jax.typing.ArrayLike | None = None,
    momentum: jax.typing.ArrayLike | None = None,
    grad_scale: jax.typing.ArrayLike = 1.0,
    decay_rate: jax.typing.ArrayLike = 0.0,
) -> RMSPropScalars:
  """The scalars of one step; ``count`` (from 1) only with bias correction;
  ``decay_rate`` the ``r`` of decaying leaves (e.g. ``-lr * weight_decay``)."""
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  correction = 1.0 if count is None else 1 - decay ** jnp.asarray(count)
  return RMSPropScalars(
      learning_rate=f32(learning_rate),
      decay=f32(decay),
      one_minus_decay=f32(1 - decay),
      eps=f32(eps),
      bias_correction=f32(correction),
      momentum=f32(0.0 if momentum is None else momentum),
      grad_scale=f32(grad_scale),
      decay_rate=f32(decay_rate),
  )


def moment_roles(*, centered: bool, momentum: bool) -> tuple[str, ...]:
  """How each kernel moment ``(mu, nu, trace)`` present is stored when blockwise.

  ``nu`` as its root (`quant.ROOT`), the mean and the trace as themselves.
  """
  return (quant.SIGNED,) * centered + (quant.ROOT,) + (quant.SIGNED,) * momentum


def _rmsprop_math(
    s: RMSPropScalars, p, g, *moments, centered: bool, eps_in_sqrt: bool, momentum: bool,
    nesterov: bool, floor_spread: bool, decay: bool,
):
  """The update on f32 values: returns ``(u, *moments)``.

  ``floor_spread``: the centered spread is taken as at least 0. Blockwise
  state rounds the mean and the root of ``nu`` apart (and saturates each
  block's outlier, `quant.saturates_outliers`), so ``nu - mu^2``, which an
  f32 state keeps at or above 0 up to rounding, can come out negative there,
  and its root NaN.
  """
  rest = iter(moments)
  mu = next(rest) if centered else None
  nu = next(rest)
  trace = next(rest) if momentum else None
  g = g * s.grad_scale
  nu = s.one_minus_decay * (g * g) + s.decay * nu
  spread = nu / s.bias_correction
  if centered:
    mu = s.one_minus_decay * g + s.decay * mu
    mu_hat = mu / s.bias_correction
    spread = spread - mu_hat * mu_hat
    if floor_spread:
      spread = jnp.maximum(spread, 0.0)
  if eps_in_sqrt:
    scaling = jax.lax.rsqrt(spread + s.eps)
  else:
    scaling = 1 / (jnp.sqrt(spread) + s.eps)
  u = -s.learning_rate * (scaling * g)
  new = ((mu,) if centered else ()) + (nu,)
  if momentum:
    trace = u + s.momentum * trace
    u = u + s.momentum * trace if nesterov else trace
    new += (trace,)
  if decay:
    u = u + s.decay_rate * p
  return (u, *new)


def _math(centered, eps_in_sqrt, momentum, nesterov, moments):
  """The math of a leaf with these ``moments`` (`_rmsprop_math`)."""
  return functools.partial(
      _rmsprop_math, centered=centered, eps_in_sqrt=eps_in_sqrt, momentum=momentum,
      nesterov=nesterov, floor_spread=centered and any(map(quant.is_blockwise, moments)),
  )


def rmsprop_reference(
    p, g, moments, scalars: RMSPropScalars, key=None, gate=None, *, mode: str, centered: bool,
    eps_in_sqrt: bool, nesterov: bool, decay: bool = False, state_rounding: str = "nearest",
    param_rounding: str = "nearest",
):
  """Pure-jnp RMSProp; the XLA path and the kernels' specification.

  Args:
    p: params, or None in ``"updates"`` mode without decay.
    g: gradient.
    moments: ``(mu if centered, nu, trace if momentum)``, arrays or
      blockwise (`moment_roles`: nu a `quant.RootBlockwise`).
    scalars: `RMSPropScalars` of this step; momentum is on when ``moments``
      has a trace.
    key: the leaf's random key, when something rounds stochastically.
    mode: ``"apply"`` returns ``(p + u, *moments)``; ``"updates"``
      ``(u, *moments)``.
    centered, eps_in_sqrt, nesterov: as `optax.rmsprop`.
    decay: add ``decay_rate * p`` to the update (see the module docstring).
    state_rounding, param_rounding: see `_update.reference_update`.
    gate: None, or a boolean scalar: where false the step holds
      (`_update.reference_update`).
  """
  momentum = len(moments) == 1 + centered + 1
  return reference_update(
      _math(centered, eps_in_sqrt, momentum, nesterov, moments), p, g, moments, scalars,
      mode=mode,
      decay=decay, roles=moment_roles(centered=centered, momentum=momentum),
      state_rounding=state_rounding, param_rounding=param_rounding, key=key, gate=gate,
  )


def rmsprop_kernel(
    p, g, moments, scalars: RMSPropScalars, key=None, gate=None, *, mode: str, centered: bool,
    eps_in_sqrt: bool, nesterov: bool, decay: bool = False, backend: str,
    interpret: bool = False, state_rounding: str = "nearest", param_rounding: str = "nearest",
):
  """Pallas RMSProp, same signature and results as `rmsprop_reference`.

  Args:
    backend: ``"tpu"`` or ``"triton"``.
    interpret: run in the Pallas interpreter.
  """
  momentum = len(moments) == 1 + centered + 1
  return kernel_update(
      _math(centered, eps_in_sqrt, momentum, nesterov, moments), p, g, moments, scalars,
      mode=mode,
      decay=decay, backend=backend, interpret=interpret, name="rmsprop",
      flops_per_element=FLOPS_PER_ELEMENT, transcendentals_per_element=1,
      roles=moment_roles(centered=centered, momentum=momentum),
      state_rounding=state_rounding, param_rounding=param_rounding, key=key,
      decay_rate=scalars_decay_rate, gate=gate,
  )


def _run(p, g, moments, scalars, key, gate, *, mode, impl, rounding, **config):
  fn = update_dispatch(
      rmsprop_reference, rmsprop_kernel, impl, moments,
      roundings=tuple(rounding.values()),
  )
  return fn(p, g, tuple(moments), scalars, key, gate, mode=mode, **config, **rounding)


def rmsprop_apply(
    p, g, moments, scalars: RMSPropScalars, key=None, gate=None, *, centered: bool = False,
    eps_in_sqrt: bool = True, nesterov: bool = False, decay: bool = False, impl: str = "auto",
    state_rounding: str = "nearest", param_rounding: str = "nearest",
):
  """One fused RMSProp step: returns ``(p + u, *moments)`` (see `rmsprop_reference`)."""
  return _run(
      p, g, moments, scalars, key, gate, mode="apply", impl=impl, centered=centered,
      eps_in_sqrt=eps_in_sqrt, nesterov=nesterov, decay=decay,
      rounding=dict(state_rounding=state_rounding, param_rounding=param_rounding),
  )


def rmsprop_updates(
    p, g, moments, scalars: RMSPropScalars, key=None, gate=None, *, centered: bool = False,
    eps_in_sqrt: bool = True, nesterov: bool = False, decay: bool = False, impl: str = "auto",
    state_rounding: str = "nearest",
):
  """RMSProp in Optax form: returns ``(u, *moments)``; ``p`` is read only with decay."""
  return _run(
      p if decay else None, g, moments, scalars, key, gate, mode="updates", impl=impl,
      centered=centered, eps_in_sqrt=eps_in_sqrt, nesterov=nesterov, decay=decay,
      rounding=dict(state_rounding=state_rounding),
  )
