r"""Fused Lion: one pass over (p, g, m) per leaf.

Lion (Chen et al., `Symbolic Discovery of Optimization Algorithms
<https://arxiv.org/abs/2302.06675>`_, 2023), exactly as `optax.lion` computes
it. With gradient :math:`g`, momentum :math:`m`, learning rate :math:`\eta`
and weight decay :math:`\lambda` (multiplied by the learning rate, as in
Optax and PyTorch):

.. math::

  c &= \beta_1 m_{t-1} + (1 - \beta_1) g \\
  u &= -\eta \left(\operatorname{sign}(c) + \lambda p\right) \\
  m_t &= \beta_2 m_{t-1} + (1 - \beta_2) g

:math:`\operatorname{sign}(0) = 0`. The term :math:`\lambda p` is present only
where weight decay applies (``decay=True``). Lion keeps one moment, so the two
modes move fewer bytes than AdamW's:

* *apply* (`lion_apply`): reads p, g, m and writes p + u, m in place,
  20 bytes per f32 parameter;
* *updates* (`lion_updates`): writes u, m (the Optax contract), reading p only
  when it decays; the caller's ``optax.apply_updates`` adds a pass.

Math is f32 inside the kernel whatever the operand dtypes (f32 or bf16); ``m``
keeps its dtype (``mu_dtype``). Every per-step number is a `LionScalars`
field, passed to the kernel as data, so a changing learning rate never
recompiles.

Dispatch: as for AdamW, the elementwise update rows of
`pallasopt.kernels.policy`. Measured on an H100 (bench/results/
nvidia-h100-80gb-hbm3, commit 5e874f6, against jitted Optax): the in-place
step 0.66x Optax's speed on a 4K leaf, 0.99-1.00x from 16M up;
``update`` + ``apply_updates`` 0.48-0.72x. ``impl="pallas"`` still runs Triton.
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
    "LionScalars",
    "lion_scalars",
    "lion_reference",
    "lion_kernel",
    "lion_apply",
    "lion_updates",
    "FLOPS_PER_ELEMENT",
]

# Gradient scale 1, interpolation 3, sign 3, decay 2, lr 1, momentum 3, add 1.
FLOPS_PER_ELEMENT = 14


class LionScalars(NamedTuple):
  """Per-step scalars of a Lion update; every field is a 0-d value."""

  learning_rate: jax.typing.ArrayLike
  b1: jax.typing.ArrayLike
  b2: jax.typing.ArrayLike
  # 1 - b, computed before rounding b to f32, as Optax's Python floats are.
  one_minus_b1: jax.typing.ArrayLike
  one_minus_b2: jax.typing.ArrayLike
  weight_decay: jax.typing.ArrayLike
  grad_scale: jax.typing.ArrayLike  # multiplies g on load, e.g. a clip factor


def lion_scalars(
    learning_rate: jax.typing.ArrayLike,
    b1: jax.typing.ArrayLike,
    b2: jax.typing.ArrayLike,
    weight_decay: jax.typing.ArrayLike,
    grad_scale: jax.typing.ArrayLike = 1.0,
) -> LionScalars:
  """Builds the scalars of one Lion step, as f32 (Lion has no bias correction).

  Fold a global-norm clipping factor into ``grad_scale``: the kernel applies
  it to ``g`` as it loads it, with no pass of its own.
  """
  values = (learning_rate, b1, b2, 1 - b1, 1 - b2, weight_decay, grad_scale)
  return LionScalars(*(jnp.asarray(x, jnp.float32) for x in values))


def _sign(x):
  """`jnp.sign` (NaN and signed zeros included) from compares and selects.

  Mosaic's own ``sign`` lowering asks for the TPU generation, which a host
  lowering for TPU ahead of time does not have; selects lower everywhere.
  """
  # x * 0 keeps NaN and the sign of zero, and is 0 for a flushed subnormal.
  return jnp.where(x > 0, 1.0, jnp.where(x < 0, -1.0, x * 0.0))


def _lion_math(s: LionScalars, p, g, m, *, decay: bool, sign=_sign):
  """The update on f32 values: returns (u, m). ``sign`` is `jnp.sign` in XLA."""
  g = g * s.grad_scale
  u = sign(s.b1 * m + s.one_minus_b1 * g)
  if decay:
    u = u + s.weight_decay * p
  m = s.b2 * m + s.one_minus_b2 * g
  return -s.learning_rate * u, m


def lion_reference(
    p, g, m, scalars: LionScalars, key=None, gate=None, *, mode: str, decay: bool,
    state_rounding: str = "nearest", param_rounding: str = "nearest",
):
  """Pure-jnp Lion; the XLA path and the kernels' specification.

  Args:
    p: params, or None in ``"updates"`` mode without decay.
    g: gradient, same shape as ``p``.
    m: momentum (any float dtype, e.g. ``mu_dtype``, or a
      `quant.Int8Blockwise` on the signed map).
    scalars: `LionScalars` of this step.
    mode: ``"apply"`` returns ``(p + u, m)``; ``"updates"`` returns ``(u, m)``,
      ``u`` in the promoted dtype of the operands, as Optax's updates.
    decay: add the weight decay term.
    state_rounding: ``"nearest"`` or ``"stochastic"`` rounding of a bf16
      momentum (see `_update.reference_update`).
    param_rounding: the same for bf16 params in ``"apply"`` mode.
    key: the leaf's random key, when something rounds stochastically.
    gate: None, or a boolean scalar: where false the step holds
      (`_update.reference_update`).
  """
  # jnp.sign is one op where _sign is five: it matters when tracing many leaves.
  math = functools.partial(_lion_math, sign=jnp.sign)
  return reference_update(
      math, p, g, (m,), scalars, mode=mode, decay=decay, roles=(quant.SIGNED,),
      state_rounding=state_rounding, param_rounding=param_rounding, key=key, gate=gate,
  )


def lion_kernel(
    p, g, m, scalars: LionScalars, key=None, gate=None, *, mode: str, decay: bool, backend: str,
    interpret: bool = False, state_rounding: str = "nearest", param_rounding: str = "nearest",
):
  """Pallas Lion, same signature and results as `lion_reference`.

  In ``"apply"`` mode p and m are aliased to the outputs; in ``"updates"``
  mode m is. Donate them in the enclosing jit to update in place.

  Args:
    backend: ``"tpu"`` or ``"triton"``.
    interpret: run in the Pallas interpreter.
  """
  return kernel_update(
      _lion_math, p, g, (m,), scalars, mode=mode, decay=decay, backend=backend,
      interpret=interpret, name="lion", flops_per_element=FLOPS_PER_ELEMENT,
      roles=(quant.SIGNED,),
      state_rounding=state_rounding, param_rounding=param_rounding, key=key,
      decay_rate=lr_times_weight_decay, gate=gate,
  )


def lion_apply(
    p, g, m, scalars: LionScalars, key=None, gate=None, *, decay: bool = True, impl: str = "auto",
    state_rounding: str = "nearest", param_rounding: str = "nearest",
):
  """One fused Lion step: returns ``(p + u, m)``.

  Args:
    p, g, m: one leaf's params, gradient and momentum (f32 or bf16; the
      momentum may be a `quant.Int8Blockwise`).
    scalars: `LionScalars` of this step (see `lion_scalars`).
    decay: whether weight decay applies to this leaf.
    impl: ``"auto" | "pallas" | "interpret" | "xla"`` (see `use_impl`).
    state_rounding: how a bf16 momentum is stored, ``"nearest"`` or
      ``"stochastic"``.
    param_rounding: how bf16 params are stored.
    key: the leaf's random key (`rounding.leaf_key`) for stochastic rounding.
    gate: None, or a boolean scalar: where false, ``(p, m)`` as they are.
  """
  fn = update_dispatch(
      lion_reference, lion_kernel, impl, (m,),
      roundings=(state_rounding, param_rounding),
  )
  return fn(
      p, g, m, scalars, key, gate, mode="apply", decay=decay, state_rounding=state_rounding,
      param_rounding=param_rounding,
  )


def lion_updates(
    p, g, m, scalars: LionScalars, key=None, gate=None, *, decay: bool = True, impl: str = "auto",
    state_rounding: str = "nearest",
):
  """Lion in Optax form: returns ``(u, m)``; ``p`` may be None without decay.

  ``gate``: None, or a boolean scalar: where false, ``(zeros, m)``.
  """
  fn = update_dispatch(
      lion_reference, lion_kernel, impl, (m,),
      roundings=(state_rounding,),
  )
  return fn(
      p, g, m, scalars, key, gate, mode="updates", decay=decay, state_rounding=state_rounding,
  )
