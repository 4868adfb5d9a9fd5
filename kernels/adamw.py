r"""Fused AdamW: one pass over (p, g, m, v) per leaf.

With step :math:`t \ge 1`, gradient :math:`g`, and the decoupled weight decay of
Loshchilov & Hutter, `Decoupled Weight Decay Regularization
<https://arxiv.org/abs/1711.05101>`_ (2019), as Optax applies it:

.. math::

  m_t &= \beta_1 m_{t-1} + (1 - \beta_1) g \\
  v_t &= \beta_2 v_{t-1} + (1 - \beta_2) g^2 \\
  \hat m &= m_t / (1 - \beta_1^t)
     \quad\text{or, with Nesterov (Dozat, 2016),}\quad
     \beta_1 m_t / (1 - \beta_1^{t+1}) + (1 - \beta_1) g / (1 - \beta_1^t) \\
  \hat v &= v_t / (1 - \beta_2^t) \\
  u &= -\eta \left(\hat m / (\sqrt{\hat v + \epsilon_{root}} + \epsilon)
       + \lambda p\right)

The term :math:`\lambda p` is present only where weight decay applies
(``decay=True``). Two modes share that math:

* *apply* (`adamw_apply`): reads p, g, m, v and writes p + u, m, v in place,
  28 bytes per f32 parameter;
* *updates* (`adamw_updates`): writes u, m, v (the Optax contract), reading p
  only when it decays; the caller's ``optax.apply_updates`` adds a pass.

Math is f32 inside the kernel whatever the operand dtypes (f32 or bf16); the
moments keep their dtypes (``m`` may be ``mu_dtype``). Every per-step number is
an `AdamWScalars` field, passed to the kernel as data.

Dispatch: what ``impl="auto"`` runs on each target is the elementwise update
rows of `pallasopt.kernels.policy` (with f32 or bf16 moments XLA, which fuses
the update into the train step's weight-gradient matmuls on TPU and ties the
Triton kernel on an H100; with blockwise moments the kernel, where it reads
the leaf in place). ``impl="pallas"`` runs the Mosaic or Triton kernel.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallasopt.kernels import quant
from pallasopt.kernels._update import (
    kernel_update,
    lr_times_weight_decay,
    reference_update,
    update_dispatch,
)

__all__ = [
    "AdamWScalars",
    "adamw_scalars",
    "adamw_reference",
    "adamw_kernel",
    "adamw_apply",
    "adamw_updates",
    "FLOPS_PER_ELEMENT",
]

# How blockwise (m, v) are stored: m as its ratio to v's root, v as its root.
_ROLES = (quant.RATIO, quant.ROOT)
# Gradient scale, both moments, bias corrections, rescale, decay, lr, add.
FLOPS_PER_ELEMENT = 19


class AdamWScalars(NamedTuple):
  """Per-step scalars of an AdamW update; every field is a 0-d value."""

  learning_rate: jax.typing.ArrayLike
  b1: jax.typing.ArrayLike
  b2: jax.typing.ArrayLike
  # 1 - b, computed before rounding b to f32 (a float32 1 - b2 loses ~2e-6).
  one_minus_b1: jax.typing.ArrayLike
  one_minus_b2: jax.typing.ArrayLike
  eps: jax.typing.ArrayLike
  eps_root: jax.typing.ArrayLike
  weight_decay: jax.typing.ArrayLike
  bias_correction1: jax.typing.ArrayLike  # 1 - b1**t
  bias_correction2: jax.typing.ArrayLike  # 1 - b2**t
  bias_correction1_next: jax.typing.ArrayLike  # 1 - b1**(t+1), for Nesterov
  grad_scale: jax.typing.ArrayLike  # multiplies g on load, e.g. a clip factor


def adamw_scalars(
    count: jax.typing.ArrayLike,
    learning_rate: jax.typing.ArrayLike,
    b1: jax.typing.ArrayLike,
    b2: jax.typing.ArrayLike,
    eps: jax.typing.ArrayLike,
    eps_root: jax.typing.ArrayLike,
    weight_decay: jax.typing.ArrayLike,
    grad_scale: jax.typing.ArrayLike = 1.0,
) -> AdamWScalars:
  """Builds the scalars of step ``count`` (``t``, counted from 1).

  ``grad_scale`` multiplies the gradient inside the kernel, so global-norm
  clipping costs no extra pass over the gradients.
  """
  count = jnp.asarray(count)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return AdamWScalars(
      learning_rate=f32(learning_rate),
      b1=f32(b1),
      b2=f32(b2),
      one_minus_b1=f32(1 - b1),
      one_minus_b2=f32(1 - b2),
      eps=f32(eps),
      eps_root=f32(eps_root),
      weight_decay=f32(weight_decay),
      bias_correction1=f32(1 - b1**count),
      bias_correction2=f32(1 - b2**count),
      bias_correction1_next=f32(1 - b1 ** (count + 1)),
      grad_scale=f32(grad_scale),
  )


def _adamw_math(s: AdamWScalars, p, g, m, v, *, nesterov: bool, decay: bool):
  """The update on f32 values: returns (u, m, v)."""
  g = g * s.grad_scale
  m = s.b1 * m + s.one_minus_b1 * g
  v = s.b2 * v + s.one_minus_b2 * (g * g)
  if nesterov:
    m_hat = s.b1 * (m / s.bias_correction1_next) + s.one_minus_b1 * (g / s.bias_correction1)
  else:
    m_hat = m / s.bias_correction1
  v_hat = v / s.bias_correction2
  u = m_hat / (jnp.sqrt(v_hat + s.eps_root) + s.eps)
  if decay:
    u = u + s.weight_decay * p
  return -s.learning_rate * u, m, v


def adamw_reference(
    p, g, m, v, scalars: AdamWScalars, key=None, gate=None, *, mode: str, nesterov: bool, decay: bool,
    state_rounding: str = "nearest", param_rounding: str = "nearest",
):
  """Pure-jnp AdamW; the XLA path and the kernels' specification.

  Args:
    p: params, or None in ``"updates"`` mode without decay.
    g: gradient, same shape as ``p``.
    m: first moment (any float dtype, e.g. ``mu_dtype``, or a
      `quant.RatioBlockwise`: stored as its ratio to ``v``'s root).
    v: second moment (an array, or a `quant.RootBlockwise`: its root).
    scalars: `AdamWScalars` of this step.
    mode: ``"apply"`` returns ``(p + u, m, v)``; ``"updates"`` returns
      ``(u, m, v)``.
    nesterov: use Nesterov momentum (NAdamW).
    decay: add the decoupled weight decay term.
    state_rounding: ``"nearest"`` or ``"stochastic"`` rounding of bf16
      moments (see `_update.reference_update`).
    param_rounding: the same for bf16 params in ``"apply"`` mode.
    key: the leaf's random key, when something rounds stochastically.
    gate: None, or a boolean scalar: where false the step holds
      (`_update.reference_update`).
  """
  math = functools.partial(_adamw_math, nesterov=nesterov)
  return reference_update(
      math, p, g, (m, v), scalars, mode=mode, decay=decay, roles=_ROLES,
      state_rounding=state_rounding, param_rounding=param_rounding, key=key, gate=gate,
  )


def adamw_kernel(
    p, g, m, v, scalars: AdamWScalars, key=None, gate=None, *, mode: str, nesterov: bool, decay: bool,
    backend: str, interpret: bool = False, state_rounding: str = "nearest",
    param_rounding: str = "nearest",
):
  """Pallas AdamW, same signature and results as `adamw_reference`.

  In ``"apply"`` mode p, m and v are aliased to the outputs; in ``"updates"``
  mode m and v are. Donate them in the enclosing jit to update in place.

  Args:
    backend: ``"tpu"`` or ``"triton"``.
    interpret: run in the Pallas interpreter.
  """
  return kernel_update(
      functools.partial(_adamw_math, nesterov=nesterov), p, g, (m, v), scalars,
      mode=mode, decay=decay, backend=backend, interpret=interpret, name="adamw",
      flops_per_element=FLOPS_PER_ELEMENT, transcendentals_per_element=1, roles=_ROLES,
      state_rounding=state_rounding, param_rounding=param_rounding, key=key,
      decay_rate=lr_times_weight_decay, gate=gate,
  )


def adamw_apply(
    p, g, m, v, scalars: AdamWScalars, key=None, gate=None, *, nesterov: bool = False,
    decay: bool = True, impl: str = "auto", state_rounding: str = "nearest",
    param_rounding: str = "nearest",
):
  """One fused AdamW step: returns ``(p + u, m, v)``.

  Args:
    p, g, m, v: one leaf's params, gradient and moments (f32 or bf16; the
      moments may be blockwise: a `quant.RatioBlockwise` and a
      `quant.RootBlockwise`).
    scalars: `AdamWScalars` of this step (see `adamw_scalars`).
    nesterov: Nesterov momentum (NAdamW).
    decay: whether weight decay applies to this leaf.
    impl: ``"auto" | "pallas" | "interpret" | "xla"`` (see `use_impl`).
    state_rounding: how bf16 moments are stored, ``"nearest"`` or
      ``"stochastic"``.
    param_rounding: how bf16 params are stored.
    key: the leaf's random key (`rounding.leaf_key`) for stochastic rounding
      (bf16 params or moments; blockwise moments' codes always).
    gate: None, or a boolean scalar: where false, ``(p, m, v)`` as they are.
  """
  fn = update_dispatch(
      adamw_reference, adamw_kernel, impl, (m, v),
      roundings=(state_rounding, param_rounding),
  )
  return fn(
      p, g, m, v, scalars, key, gate, mode="apply", nesterov=nesterov, decay=decay,
      state_rounding=state_rounding, param_rounding=param_rounding,
  )


def adamw_updates(
    p, g, m, v, scalars: AdamWScalars, key=None, gate=None, *, nesterov: bool = False,
    decay: bool = True, impl: str = "auto", state_rounding: str = "nearest",
):
  """AdamW in Optax form: returns ``(u, m, v)``; ``p`` may be None without decay.

  ``gate``: None, or a boolean scalar: where false, ``(zeros, m, v)``.
  """
  fn = update_dispatch(
      adamw_reference, adamw_kernel, impl, (m, v),
      roundings=(state_rounding,),
  )
  return fn(
      p, g, m, v, scalars, key, gate, mode="updates", nesterov=nesterov, decay=decay,
      state_rounding=state_rounding,
  )
