"""Converting an optimizer state between storage formats mid-training.

`convert_state` rewrites the moments of every AdamW / NAdamW
(``optax.ScaleByAdamState``), Lion (``optax.ScaleByLionState``), Muon
(``optax.contrib.MuonState``), MARS (`ScaleByMarsState`) and RMSProp
(``optax.ScaleByRmsState``, ``ScaleByRStdDevState`` and their ``WithCount``
forms) state inside an optimizer state, wherever it sits (``optax.chain``,
``optax.inject_hyperparams``, ``optax.MultiSteps``, ...), into another
``state_format``, so a run can switch between Optax's fp32 state and
pallasopt's bf16 or 8-bit state::

  tx = pallasopt.optim.adamw(1e-3)                     # or optax.adamw(1e-3)
  ...
  tx8 = pallasopt.optim.adamw(1e-3, state_format="int8")
  state = pallasopt.optim.convert_state(state, params, "int8")
  params, state = tx8.apply_gradients(params, grads, state)

Converting to a lower precision rounds each moment to nearest (8-bit: the
map value nearest to the moment over its block's absmax); converting back
dequantizes exactly. The count and every other state leaf are kept, Optax
``trace`` and ``ema`` states included (they serve SGD's momentum and
parameter averages too): RMSProp's momentum trace and Adafactor's momentum
keep their storage, which those transforms accept with any ``state_format``.
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax.contrib import MuonState

from pallasopt.kernels import quant
from pallasopt.optim import _validation as v
from pallasopt.optim.mars import ScaleByMarsState
from pallasopt.optim._elementwise_tx import (
    check_state_format,
    is_quantized,
    moment_arrays,
    moment_value,
    stored_moment,
)

__all__ = ["convert_state"]

_OWNER = "pallasopt.optim.convert_state"
# The moment fields of each state class and whether each one is signed.
_MOMENTS: dict[type, dict[str, bool]] = {
    optax.ScaleByAdamState: {"mu": True, "nu": False},
    optax.ScaleByLionState: {"mu": True},
    MuonState: {"mu": True},
    ScaleByMarsState: {"mu": True, "nu": False, "mog": True},
    optax.ScaleByRmsState: {"nu": False},
    optax.ScaleByRStdDevState: {"mu": True, "nu": False},
    # Optax does not export the bias-corrected forms' classes; their inits do.
    type(optax.scale_by_rms(bias_correction=True).init({})): {"nu": False},
    type(optax.scale_by_stddev(bias_correction=True).init({})): {"mu": True, "nu": False},
}


def _masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _moment_leaf(x: Any) -> bool:
  return _masked(x) or is_quantized(x)


def convert_state(
    opt_state: optax.OptState,
    params: optax.Params,
    state_format: str | None,
    *,
    mu_dtype: Any | None = None,
    legacy_scales: bool = False,
) -> optax.OptState:
  """Returns ``opt_state`` with its AdamW and Lion moments stored as ``state_format``.

  Args:
    opt_state: a state of `pallasopt.optim.adamw`, ``nadamw``, ``lion``,
      ``muon``, ``mars`` or ``rmsprop`` (any ``state_format``) or of
      ``optax.adamw`` / ``nadamw`` / ``lion`` / ``rmsprop`` /
      ``contrib.muon``, possibly wrapped.
    params: the params the state belongs to (arrays or
      ``jax.ShapeDtypeStruct``s): they decide each leaf's storage, as
      ``init`` does.
    state_format: ``None`` (Optax's state), ``"bf16"``, ``"int8"`` or ``"fp8"``.
    mu_dtype: with ``state_format=None``, the first moment's dtype (as the
      transform's ``mu_dtype``; default the params' dtype).
    legacy_scales: ``opt_state`` was saved by pallasopt before 2026-11-25
      with 8-bit or fp8 moments: a matrix whose rows hold whole blocks kept
      its scales as ``(..., rows, blocks per row)``, now ``(..., blocks per
      row, rows)`` (`pallasopt.kernels.quant.scales_shape`). A moment in the
      old layout loaded without this flag is a ValueError that names it.

  Returns:
    The state, the same tree except for the moments' storage: what
    ``init`` of a transform with that ``state_format`` returns, holding these
    moments.

  Raises:
    ValueError: for an unknown ``state_format``, ``mu_dtype`` with a low-bit
      format, or moments whose tree or shapes differ from ``params``'.
  """
  mu_dtype = v.optional_dtype(_OWNER, "mu_dtype", mu_dtype)
  check_state_format(_OWNER, state_format, mu_dtype)

  def current(moment):
    return quant.from_row_major_scales(moment) if legacy_scales and is_quantized(moment) else moment

  def convert_node(node):
    if type(node) not in _MOMENTS:
      return node
    fields = {}
    for i, (name, signed) in enumerate(_MOMENTS[type(node)].items()):
      moments = getattr(node, name)
      # Under optax.masked / optax.partition a moment tree holds MaskedNodes
      # where other transforms own the params.
      try:
        owned = jax.tree.map(
            lambda m, p: m if _masked(m) else p, moments, params, is_leaf=_moment_leaf
        )
      except (ValueError, TypeError):
        owned = params
      v.check_same_tree(_OWNER, f"opt_state.{name}", moment_arrays(moments), "params", owned)
      dtype = mu_dtype if i == 0 else None
      fields[name] = jax.tree.map(
          lambda m, p, s=signed, d=dtype: m if _masked(m) else stored_moment(
              jnp.asarray(moment_value(current(m), signed=s), jnp.float32), p, signed=s,
              state_format=state_format, dtype=d,
          ),
          moments, owned, is_leaf=_moment_leaf,
      )
    return node._replace(**fields)

  return jax.tree.map(
      convert_node, opt_state, is_leaf=lambda x: type(x) in _MOMENTS or is_quantized(x)
  )
