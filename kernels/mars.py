r"""Fused MARS: one pass over (p, g, mu, nu, previous g) per leaf.

MARS (Yuan et al., `MARS: Unleashing the Power of Variance Reduction for
Training Large Models <https://arxiv.org/abs/2411.10438>`_, 2024) in the
AdamW-style form eFormer's ``scale_by_mars`` computes: a variance-reduced
gradient from the previous step's gradient :math:`g_{t-1}`, then Adam's
moments of it. With :math:`\gamma`, :math:`\beta_1`, :math:`\beta_2`:

.. math::

  c &= s \left(g + \frac{\gamma\beta_1}{1-\beta_1}(g - g_{t-1})\right) \\
  \mu_t &= \beta_1\mu_{t-1} + (1-\beta_1) c, \qquad
  \nu_t = \beta_2\nu_{t-1} + (1-\beta_2) c^2 \\
  u &= -\eta\,\frac{\mu_t/(1-\beta_1^t)}{\sqrt{\nu_t/(1-\beta_2^t) + \epsilon_{root}} + \epsilon}

where :math:`s = \min(1, \text{max\_grad\_norm} / (\lVert c\rVert + 10^{-6}))`
clips :math:`c` by its global norm over the whole tree (a scalar the caller
computes; 1 without clipping). The state keeps :math:`g` for the next step.
Moments in kernel order ``(mu, nu, mog)``; modes, dtypes, 8-bit moments and
stochastic rounding as in `_update.kernel_update`. Dispatch as AdamW's:
XLA on CUDA for f32/bf16 moments, the Triton kernel for 8-bit ones.
"""

from __future__ import annotations

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
    "MarsScalars",
    "mars_scalars",
    "correction_coefficient",
    "mars_reference",
    "mars_kernel",
    "mars_apply",
    "mars_updates",
    "ROLES",
]

# How blockwise (mu, nu, mog) are stored: mu as its ratio to nu's root, nu as
# its root, the previous gradient as itself.
ROLES = (quant.RATIO, quant.ROOT, quant.SIGNED)
# Gradient scale, correction 4, both moments 6, corrections 2, rescale 4, lr 1, add 1.
FLOPS_PER_ELEMENT = 19


class MarsScalars(NamedTuple):
  """Per-step scalars of a MARS update; every field is a 0-d value."""

  learning_rate: jax.typing.ArrayLike
  b1: jax.typing.ArrayLike
  b2: jax.typing.ArrayLike
  one_minus_b1: jax.typing.ArrayLike
  one_minus_b2: jax.typing.ArrayLike
  eps: jax.typing.ArrayLike
  eps_root: jax.typing.ArrayLike
  bias_correction1: jax.typing.ArrayLike  # 1 - b1**t
  bias_correction2: jax.typing.ArrayLike  # 1 - b2**t
  correction: jax.typing.ArrayLike  # gamma * b1 / (1 - b1)
  clip_scale: jax.typing.ArrayLike  # s, the global-norm clip of c (1: none)
  grad_scale: jax.typing.ArrayLike  # multiplies g on load, e.g. a clip factor
  decay_rate: jax.typing.ArrayLike  # r of a decaying leaf's u + r p


def correction_coefficient(gamma: float, b1: float) -> float:
  """:math:`\\gamma\\beta_1 / (1 - \\beta_1)`, as a Python float like eFormer's."""
  return gamma * b1 / (1 - b1)


def mars_scalars(
    count: jax.typing.ArrayLike,
    learning_rate: jax.typing.ArrayLike,
    b1: float,
    b2: float,
    gamma: float,
    eps: jax.typing.ArrayLike,
    eps_root: jax.typing.ArrayLike,
    *,
    clip_scale: jax.typing.ArrayLike = 1.0,
    grad_scale: jax.typing.ArrayLike = 1.0,
    decay_rate: jax.typing.ArrayLike = 0.0,
) -> MarsScalars:
  """The scalars of step ``count`` (counted from 1); ``decay_rate`` the ``r``
  of decaying leaves (a weight-decay link after MARS, e.g. ``-lr * wd``)."""
  count = jnp.asarray(count)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return MarsScalars(
      learning_rate=f32(learning_rate), b1=f32(b1), b2=f32(b2), one_minus_b1=f32(1 - b1),
      one_minus_b2=f32(1 - b2), eps=f32(eps), eps_root=f32(eps_root),
      bias_correction1=f32(1 - b1**count), bias_correction2=f32(1 - b2**count),
      correction=f32(correction_coefficient(gamma, b1)), clip_scale=f32(clip_scale),
      grad_scale=f32(grad_scale), decay_rate=f32(decay_rate),
  )


def _mars_math(s: MarsScalars, p, g, mu, nu, mog, *, decay: bool):
  """The update on f32 values: returns ``(u, mu, nu, g)``.

  MARS itself never decays; ``decay`` adds a following weight-decay link's
  ``decay_rate * p``.
  """
  g = g * s.grad_scale
  c = (g + s.correction * (g - mog)) * s.clip_scale
  mu = s.one_minus_b1 * c + s.b1 * mu
  nu = s.one_minus_b2 * (c * c) + s.b2 * nu
  u = -s.learning_rate * (
      (mu / s.bias_correction1) / (jnp.sqrt(nu / s.bias_correction2 + s.eps_root) + s.eps))
  if decay:
    u = u + s.decay_rate * p
  return u, mu, nu, g


def mars_reference(
    p, g, mu, nu, mog, scalars: MarsScalars, key=None, gate=None, *, mode: str, decay: bool = False,
    state_rounding: str = "nearest", param_rounding: str = "nearest",
):
  """Pure-jnp MARS; the XLA path and the kernels' specification.

  Args:
    p: params, or None in ``"updates"`` mode without decay.
    g: gradient.
    mu, nu: the moments (arrays, or blockwise: a `quant.RatioBlockwise` and
      a `quant.RootBlockwise`).
    mog: the previous step's gradient (an array or a signed blockwise one).
    scalars: `MarsScalars` of this step.
    key: the leaf's random key, when something rounds stochastically.
    mode: ``"apply"`` returns ``(p + u, mu, nu, g)``; ``"updates"``
      ``(u, mu, nu, g)``.
    decay: add ``decay_rate * p`` to the update.
    state_rounding, param_rounding: see `_update.reference_update`.
    gate: None, or a boolean scalar: where false the step holds
      (`_update.reference_update`).
  """
  return reference_update(
      _mars_math, p, g, (mu, nu, mog), scalars, mode=mode, decay=decay, roles=ROLES,
      state_rounding=state_rounding, param_rounding=param_rounding, key=key, gate=gate,
  )


def mars_kernel(
    p, g, mu, nu, mog, scalars: MarsScalars, key=None, gate=None, *, mode: str, decay: bool = False,
    backend: str, interpret: bool = False, state_rounding: str = "nearest",
    param_rounding: str = "nearest",
):
  """Pallas MARS, same signature and results as `mars_reference`.

  Args:
    backend: ``"tpu"`` or ``"triton"``.
    interpret: run in the Pallas interpreter.
  """
  return kernel_update(
      _mars_math, p, g, (mu, nu, mog), scalars, mode=mode, decay=decay, backend=backend,
      interpret=interpret, name="mars", flops_per_element=FLOPS_PER_ELEMENT,
      transcendentals_per_element=1, roles=ROLES, state_rounding=state_rounding,
      param_rounding=param_rounding, key=key,
      decay_rate=scalars_decay_rate, gate=gate,
  )


def mars_apply(
    p, g, mu, nu, mog, scalars: MarsScalars, key=None, gate=None, *, decay: bool = False,
    impl: str = "auto", state_rounding: str = "nearest", param_rounding: str = "nearest",
):
  """One fused MARS step: returns ``(p + u, mu, nu, g)`` (see `mars_reference`)."""
  moments = (mu, nu, mog)
  fn = update_dispatch(
      mars_reference, mars_kernel, impl, moments,
      roundings=(state_rounding, param_rounding),
  )
  return fn(p, g, mu, nu, mog, scalars, key, gate, mode="apply", decay=decay,
            state_rounding=state_rounding, param_rounding=param_rounding)


def mars_updates(
    p, g, mu, nu, mog, scalars: MarsScalars, key=None, gate=None, *, decay: bool = False,
    impl: str = "auto", state_rounding: str = "nearest",
):
  """MARS in Optax form: returns ``(u, mu, nu, g)``; ``p`` is read only with decay."""
  moments = (mu, nu, mog)
  fn = update_dispatch(
      mars_reference, mars_kernel, impl, moments,
      roundings=(state_rounding,),
  )
  return fn(p if decay else None, g, mu, nu, mog, scalars, key, gate, mode="updates", decay=decay,
            state_rounding=state_rounding)
