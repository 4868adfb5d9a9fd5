"""Converting an optimizer state between storage formats mid-training.

`convert_state` rewrites the moments of every AdamW / NAdamW
(``optax.ScaleByAdamState``), Lion (``optax.ScaleByLionState``), Muon
(``optax.contrib.MuonState``), MARS (`ScaleByMarsState`) and RMSProp
(``optax.ScaleByRmsState``, ``ScaleByRStdDevState`` and their ``WithCount``
forms) state inside an optimizer state, wherever it sits (``optax.chain``,
``optax.inject_hyperparams``, ``optax.MultiSteps``, ...), into another
``state_format``, so a run can switch between Optax's fp32 state and
pallasopt's bf16, 8-bit or 4-bit state::

  tx = pallasopt.optim.adamw(1e-3)                     # or optax.adamw(1e-3)
  ...
  tx8 = pallasopt.optim.adamw(1e-3, state_format="int8")
  state = pallasopt.optim.convert_state(state, params, "int8")
  params, state = tx8.apply_gradients(params, grads, state)

Converting to a lower precision rounds each moment to nearest (8-bit and
4-bit: the map value nearest to the moment over its block's absmax);
converting back dequantizes exactly. The count and every other state leaf are kept, Optax
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
    stored_leaf_moments,
)

__all__ = ["convert_state", "legacy_state_structure"]

_OWNER = "pallasopt.optim.convert_state"
# The moment fields of each state class and how each is stored when blockwise
# (`quant.ROLES`): a second moment as its root, a first moment that is
# divided by it as their ratio, the others as themselves.
_ADAM = {"mu": quant.RATIO, "nu": quant.ROOT}
_MOMENTS: dict[type, dict[str, str]] = {
    optax.ScaleByAdamState: _ADAM,
    optax.ScaleByLionState: {"mu": quant.SIGNED},
    MuonState: {"mu": quant.SIGNED},
    ScaleByMarsState: {**_ADAM, "mog": quant.SIGNED},
    optax.ScaleByRmsState: {"nu": quant.ROOT},
    optax.ScaleByRStdDevState: {"mu": quant.SIGNED, "nu": quant.ROOT},
    # Optax does not export the bias-corrected forms' classes; their inits do
    # (traced abstractly: importing pallasopt must not start JAX's backends,
    # or `jax.distributed.initialize` and XLA_FLAGS set after it come too late).
    type(jax.eval_shape(optax.scale_by_rms(bias_correction=True).init, {})): {"nu": quant.ROOT},
    type(jax.eval_shape(optax.scale_by_stddev(bias_correction=True).init, {})): {
        "mu": quant.SIGNED, "nu": quant.ROOT},
}


def _masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _moment_leaf(x: Any) -> bool:
  return _masked(x) or is_quantized(x)


def _leaf_values(moments: list[Any], roles: tuple[str, ...]) -> list[jax.Array]:
  """The f32 arrays one leaf's moments hold, in any format, current or saved before 2026-11-26.

  Before then a blockwise second moment was stored as itself (an
  `Int8Blockwise` or `Fp8Blockwise` where a `quant.RootBlockwise` is now)
  and a first moment too (where a `quant.RatioBlockwise` is now).
  """
  root = None
  if quant.ROOT in roles:
    stored = moments[roles.index(quant.ROOT)]
    if is_quantized(stored) and quant.role_of(stored) == quant.ROOT:
      root = quant.stored_values(stored)

  def value(m, role):
    if is_quantized(m) and role == quant.ROOT and quant.role_of(m) == quant.SIGNED:
      return quant.legacy_second_moment(m)
    return moment_value(m, root=root)

  return [jnp.asarray(value(m, r), jnp.float32) for m, r in zip(moments, roles, strict=True)]


def convert_state(
    opt_state: optax.OptState,
    params: optax.Params,
    state_format: str | None,
    *,
    mu_dtype: Any | None = None,
    legacy_scales: bool = False,
) -> optax.OptState:
  """Returns ``opt_state`` with its moments stored as ``state_format``.

  Args:
    opt_state: a state of `pallasopt.optim.adamw`, ``nadamw``, ``lion``,
      ``muon``, ``mars`` or ``rmsprop`` (any ``state_format``) or of
      ``optax.adamw`` / ``nadamw`` / ``lion`` / ``rmsprop`` /
      ``contrib.muon``, possibly wrapped. A low-bit state saved by pallasopt
      before 2026-12-07 (``"int8"`` on the dynamic map) or before 2026-11-26
      (second moments, and the first moments divided by them, stored as
      themselves) converts too: restore it with `legacy_state_structure` as
      the target. Where its second moment
      decoded to zero the converted first moment is zero too (the step that
      state would take there divides by ``eps``).
    params: the params the state belongs to (arrays or
      ``jax.ShapeDtypeStruct`` values): they decide each leaf's storage, as
      ``init`` does.
    state_format: ``None`` (Optax's state), ``"bf16"``, ``"int8"``, ``"fp8"`` or ``"int4"``.
    mu_dtype: the first moment's dtype wherever ``state_format`` keeps it
      as an array (as the transform's ``mu_dtype``; default the params' dtype
      for ``None``, bfloat16 for ``"bf16"``, float32 for the leaves a blockwise
      format keeps as arrays).
    legacy_scales: ``opt_state`` was saved by pallasopt from 2026-11-25 until
      2026-12-07 with blockwise moments: a matrix whose rows hold whole blocks
      kept its scales as ``(..., blocks per row, rows)``, now ``(..., rows,
      blocks per row)`` (`pallasopt.kernels.quant.scales_shape`; states saved
      before 2026-11-25 had today's layout). A moment in the old layout
      loaded without this flag is a ValueError that names it.

  Returns:
    The state, the same tree except for the moments' storage: what
    ``init`` of a transform with that ``state_format`` returns, holding these
    moments (rounded to nearest).

  Raises:
    ValueError: for an unknown ``state_format``, ``mu_dtype`` with a low-bit
      format, or moments whose tree or shapes differ from ``params``'.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, pallasopt
    >>> params = {"w": jnp.ones((64, 256))}
    >>> optax_state = optax.adamw(1e-3).init(params)
    >>> low_bit = pallasopt.optim.convert_state(optax_state, params, "int8")
    >>> type(low_bit[0].mu["w"]).__name__
    'Int8RatioBlockwise'
    >>> back = pallasopt.optim.convert_state(low_bit, params, None)
    >>> jax.tree.structure(back) == jax.tree.structure(optax_state)
    True
  """
  mu_dtype = v.optional_dtype(_OWNER, "mu_dtype", mu_dtype)
  check_state_format(_OWNER, state_format)

  def current(moment):
    return quant.from_transposed_scales(moment) if legacy_scales and is_quantized(moment) else moment

  def convert_node(node):
    if type(node) not in _MOMENTS:
      return node
    names, roles = zip(*_MOMENTS[type(node)].items())
    trees = [getattr(node, name) for name in names]
    # Under optax.masked / optax.partition a moment tree holds MaskedNodes
    # where other transforms own the params.
    try:
      owned = jax.tree.map(
          lambda m, p: m if _masked(m) else p, trees[0], params, is_leaf=_moment_leaf
      )
    except (ValueError, TypeError):
      owned = params
    for name, tree in zip(names, trees, strict=True):
      v.check_same_tree(_OWNER, f"opt_state.{name}", moment_arrays(tree), "params", owned)
    flat = [jax.tree.flatten(tree, is_leaf=_moment_leaf) for tree in trees]
    dtypes = [mu_dtype] + [None] * (len(names) - 1)

    def leaf(p, *moments):
      if _masked(moments[0]):
        return moments
      moments = [current(m) for m in moments]
      stored_so = lambda m, r: is_quantized(m) and quant.role_of(m) == r and (
          quant.is_current(m) and quant.codec_of(m) == quant.codec(r, state_format))
      if state_format in quant.FORMATS and all(map(stored_so, moments, roles)):
        return tuple(moments)  # already stored so: kept code for code
      values = _leaf_values(moments, roles)
      return stored_leaf_moments(
          values, p, roles=roles, state_format=state_format, dtypes=dtypes, kept_dtypes=dtypes
      )

    per_leaf = [
        leaf(p, *ms) for p, *ms in zip(
            jax.tree.leaves(owned, is_leaf=_masked), *(leaves for leaves, _ in flat), strict=True)
    ]
    columns = list(zip(*per_leaf, strict=True)) or [()] * len(names)
    return node._replace(**{
        name: treedef.unflatten(column)
        for name, (_, treedef), column in zip(names, flat, columns, strict=True)
    })

  return jax.tree.map(
      convert_node, opt_state, is_leaf=lambda x: type(x) in _MOMENTS or is_quantized(x)
  )


# The dates the blockwise storage changed, and the formats each change touched.
_LEGACY_FORMATS = {"2026-11-26": ("int8", "fp8"), "2026-12-07": ("int8",)}


def legacy_state_structure(
    opt_state: optax.OptState, state_format: str, *, saved_before: str = "2026-11-26"
) -> optax.OptState:
  """The tree of a ``state_format`` state like ``opt_state`` as saved before a storage change.

  Restore an old checkpoint with this tree as the target (``opt_state`` may
  hold ``jax.ShapeDtypeStruct`` values, e.g. ``jax.eval_shape(tx.init, params)``),
  then `convert_state` it::

    target = pallasopt.optim.legacy_state_structure(
        jax.eval_shape(tx.init, params), "int8", saved_before="2026-12-07")
    old = checkpointer.restore(path, target)
    opt_state = pallasopt.optim.convert_state(old, params, "int8", legacy_scales=True)

  Every state saved before 2026-12-07 also holds a matrix's scales as
  ``(..., blocks per row, rows)``: the tree gives them so, and
  ``legacy_scales=True`` converts them.

  The changes (each renamed the fields it touched, so that an old checkpoint
  does not restore into a new state unnoticed: orbax names the missing path,
  where it would cast codes of another map silently):

  * ``saved_before="2026-12-07"`` (``"int8"``): signed moments and ratios were
    uint8 codes on the dynamic map (`quant.DynamicInt8Blockwise`, and
    `quant.RatioBlockwise` with uint8 codes), now int8 codes on the e3m4 map;
  * ``saved_before="2026-11-26"`` (``"int8"``, ``"fp8"``): every blockwise
    moment was stored as itself with fields ``codes`` and ``scales``
    (`quant.DynamicInt8Blockwise`, `quant.Fp8Blockwise`), the second moment
    on the unsigned dynamic map; now second moments are
    `quant.RootBlockwise` and the first moments divided by them ratios.
  """
  formats = _LEGACY_FORMATS.get(saved_before)
  if formats is None:
    raise ValueError(
        f"legacy_state_structure: saved_before must be one of {tuple(_LEGACY_FORMATS)} (the "
        f"dates the blockwise storage changed); got {saved_before!r}."
    )
  if state_format not in formats:
    raise ValueError(
        f"legacy_state_structure: state_format must be one of {formats} (the blockwise "
        f"formats of states saved before {saved_before}); got {state_format!r}."
    )
  fp8 = state_format == "fp8"

  def saved(cls, codes, node):
    # Until 2026-12-07 a matrix's scales were laid out (..., blocks per row, rows).
    shape, scales = tuple(node.codes.shape), node.scales
    if quant.rows_hold_blocks(shape):
      scales = jax.ShapeDtypeStruct(shape[:-2] + (shape[-1] // quant.BLOCK, shape[-2]),
                                    scales.dtype)
    return cls(codes, scales)

  def codes_like(node):
    codes = node.codes
    return jax.ShapeDtypeStruct(codes.shape, jnp.float8_e4m3fn if fp8 else jnp.uint8,
                                sharding=getattr(codes, "sharding", None))

  def legacy(node):
    if not is_quantized(node):
      return node
    role = quant.role_of(node)
    if saved_before == "2026-12-07":
      if role == quant.ROOT:
        return saved(type(node), node.codes, node)
      cls = quant.RatioBlockwise if role == quant.RATIO else quant.DynamicInt8Blockwise
      return saved(cls, codes_like(node), node)
    if fp8 and role == quant.SIGNED:
      return saved(type(node), node.codes, node)
    return saved(quant.Fp8Blockwise if fp8 else quant.DynamicInt8Blockwise, codes_like(node), node)

  return jax.tree.map(legacy, opt_state, is_leaf=is_quantized)
