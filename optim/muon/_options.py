"""Muon's presets and modes, the state of its second-moment option, and its shape scales."""

import math
from typing import Any, NamedTuple

import optax

from pallasopt.kernels import ns_coefficients


OWNER = "pallasopt.optim.muon"
DEFAULT_NS_COEFFS = ns_coefficients.PRESETS["simple"][0]
# Optax's own preset names (used with Optax's step semantics): the same
# numbers as Emerging-Optimizers' "simple" and "quintic" tables.
OPTAX_PRESETS: dict[str, Any] = {
    "standard": DEFAULT_NS_COEFFS,
    "dion": ns_coefficients.PRESETS["quintic"],
}
SCALE_MODES = ("shape_scaling", "spectral", "unit_rms_norm")
SECOND_MOMENTS = ("adamuon", "normuon", "namo")
MOMENTUM_STYLES = ("optax", "lerp")
# Structural arguments to keep static under optax.inject_hyperparams.
MUON_STATIC_ARGS = ("ns_steps", "stacked_axes", "gram_levels")
PRECONDITIONINGS = ("frobenius", "spectral", "aol", "schatten")


class MuonSecondMomentState(NamedTuple):
  """Second moments of the ``second_moment`` option, per Muon leaf.

  Leaves are laid out as the ``(batch, fan_in, fan_out)`` view of the matrix
  (``batch`` = product of the batch axes): ``adamuon`` keeps the full view,
  ``normuon`` keeps ``(batch, fan_in, 1)`` or ``(batch, 1, fan_out)`` (see
  `muon`), ``namo`` keeps ``(batch,)``. Always float32.
  """

  nu: optax.Updates


def shape_scale(fan_in: int, fan_out: int, mode: str) -> float:
  r"""The update scale of Emerging-Optimizers' ``scale_mode`` for a matrix.

  * ``"shape_scaling"``: :math:`\sqrt{\max(1, \text{out}/\text{in})}`
    (Jordan's Muon; Optax's default);
  * ``"spectral"``: :math:`\sqrt{\max(\text{out}, \text{in})}` (Liu et al.,
    Muon is Scalable, arXiv:2502.16982; Optax's ``consistent_rms`` times this);
  * ``"unit_rms_norm"``: :math:`\sqrt{\text{out}/\text{in}}` (Pethick et al.,
    arXiv:2502.07529).
  """
  if mode == "shape_scaling":
    return math.sqrt(max(1.0, fan_out / fan_in))
  if mode == "spectral":
    return math.sqrt(max(fan_out, fan_in))
  if mode == "unit_rms_norm":
    return math.sqrt(fan_out / fan_in)
  raise ValueError(f"{OWNER}: scale_mode must be one of {SCALE_MODES}; got {mode!r}.")
