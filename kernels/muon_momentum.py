r"""Muon's momentum step on low-bit state: one pass over (g, m) per leaf.

Muon (Jordan et al., 2024; `optax.contrib.muon`) orthogonalizes a momentum
of the gradient. With gradient :math:`g` (times ``grad_scale``, a clip factor
applied as it is loaded), momentum :math:`m` and decay :math:`\beta`, a step
computes

.. math::

  m_t &= (1 - \beta) g + \beta m_{t-1} \\
  \hat m_t &= a\, m_t + b\, g

and hands :math:`\hat m_t` to Newton–Schulz. ``(a, b)`` select the variant,
as `muon_momentum_scalars` builds them: Optax's Nesterov form
:math:`\beta m_t / (1 - \beta^{t+1}) + (1 - \beta) g / (1 - \beta^t)`, the
bias-corrected momentum :math:`m_t / (1 - \beta^t)`, or the lerp forms
(no bias correction).

With the momentum in f32 XLA fuses this into Newton–Schulz's first pass,
and no kernel is needed. With blockwise state (``"int8"``, ``"fp8"``,
``"int4"``) XLA's codec copies the momentum between layouts (the block
scales are stored transposed: compiled for a v5e, one 2048 x 5632 leaf's
int8 step moved 704 MiB where Optax's f32 Muon moves 176), so the kernel
decodes, updates and re-encodes the momentum in place and writes
:math:`\hat m_t` in f32, as the elementwise update kernels of AdamW and
Lion do (`_update.kernel_update`): 10 bytes per parameter with int8 codes
(g and codes in, codes and :math:`\hat m_t` out; 133 MiB on that leaf).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallasopt.kernels import quant
from pallasopt.kernels._update import kernel_update, reference_update, update_dispatch

__all__ = [
    "MuonMomentumScalars",
    "muon_momentum_scalars",
    "muon_momentum_reference",
    "muon_momentum_kernel",
    "muon_momentum_updates",
    "FLOPS_PER_ELEMENT",
]

# Momentum 3, m_hat 3.
FLOPS_PER_ELEMENT = 6


class MuonMomentumScalars(NamedTuple):
  """Per-step scalars of Muon's momentum; every field is a 0-d value."""

  beta: jax.typing.ArrayLike
  # 1 - beta, computed before rounding beta to f32, as Optax's Python floats are.
  one_minus_beta: jax.typing.ArrayLike
  # m_hat = momentum_scale * m + gradient_weight * g.
  momentum_scale: jax.typing.ArrayLike
  gradient_weight: jax.typing.ArrayLike
  grad_scale: jax.typing.ArrayLike  # multiplies g on load, e.g. a clip factor


def muon_momentum_scalars(
    beta: float, count: jax.Array, *, nesterov: bool, lerp: bool,
    grad_scale: jax.typing.ArrayLike = 1.0,
) -> MuonMomentumScalars:
  """The scalars of the step whose count (Optax's, incremented) is ``count``.

  Args:
    beta: the momentum decay.
    count: this step's count, from 1.
    nesterov: Nesterov's look-ahead.
    lerp: the ``momentum="lerp"`` forms, without bias correction.
    grad_scale: multiplies the gradient as the kernel loads it (a global-norm
      clip factor), so the scaled gradient is never written.
  """
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  if lerp:
    scales = (beta, 1 - beta) if nesterov else (1.0, 0.0)
  else:
    correction = lambda t: 1 - f32(beta) ** f32(t)
    scales = ((f32(beta) / correction(count + 1), f32(1 - beta) / correction(count)) if nesterov
              else (1 / correction(count), 0.0))
  return MuonMomentumScalars(
      f32(beta), f32(1 - beta), *(f32(x) for x in scales), f32(grad_scale))


def _momentum_math(s: MuonMomentumScalars, p, g, m, *, decay: bool):
  """``(m_hat, m)`` on f32 values (``p`` and ``decay`` unused: Muon decays after)."""
  del p, decay
  g = g * s.grad_scale
  m = s.one_minus_beta * g + s.beta * m
  hat = s.momentum_scale * m + s.gradient_weight * g
  return hat, m


def muon_momentum_reference(p, g, m, scalars: MuonMomentumScalars, key=None, gate=None):
  """Pure-jnp momentum step; the XLA path and the kernel's specification.

  Args:
    p: unused (None): the elementwise families' argument order, whose
      dispatch reads the gradient as argument 1.
    g: gradient (f32 or bf16).
    m: the momentum, a `quant.Blockwise` in the signed role.
    scalars: `MuonMomentumScalars` of this step.
    key: the step's random key (`rounding.step_key`): the codes round
      stochastically.
    gate: None, a boolean scalar (where false: zeros and ``m`` as stored), or
      a `kernels._update.Gate` (the same on the accumulated gradient, the
      stored accumulator returned third).

  Returns:
    ``(m_hat, m)``: ``m_hat`` f32, ``m`` blockwise as given.
  """
  del p
  return reference_update(
      _momentum_math, None, g, (m,), scalars, mode="updates", decay=False,
      roles=(quant.SIGNED,), key=key, gate=gate,
  )


def muon_momentum_kernel(
    p, g, m, scalars: MuonMomentumScalars, key=None, gate=None, *, backend: str,
    interpret: bool = False,
):
  """Pallas momentum step, same signature and results as `muon_momentum_reference`.

  The momentum's codes and scales are aliased to their outputs.

  Args:
    backend: ``"tpu"`` or ``"triton"``.
    interpret: run in the Pallas interpreter.
  """
  del p
  return kernel_update(
      _momentum_math, None, g, (m,), scalars, mode="updates", decay=False, backend=backend,
      interpret=interpret, name="muon_momentum", flops_per_element=FLOPS_PER_ELEMENT,
      roles=(quant.SIGNED,), key=key, gate=gate,
  )


def muon_momentum_updates(
    g, m, scalars: MuonMomentumScalars, key=None, gate=None, *, impl: str = "auto"
):
  """One momentum step on blockwise state: ``(m_hat, m)``.

  Args:
    g: one leaf's gradient (f32 or bf16).
    m: its momentum, a `quant.Blockwise` in the signed role.
    scalars: `MuonMomentumScalars` of this step.
    key: the step's random key (`rounding.step_key`).
    gate: None, a boolean scalar or a `kernels._update.Gate` (see
      `muon_momentum_reference`).
    impl: ``"auto" | "pallas" | "interpret" | "xla"`` (see `use_impl`).
  """
  fn = update_dispatch(
      muon_momentum_reference, muon_momentum_kernel, impl, (m,), roundings=("nearest",),
  )
  return fn(None, g, m, scalars, key, gate)
