"""Adafactor as a drop-in for `optax.adafactor`, backed by the fused Adafactor kernels."""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from pallasopt.kernels import adafactor as adafactor_kernels
from pallasopt.kernels import quant
from pallasopt.kernels._dispatch import resolve_impl
from pallasopt.kernels._update import store_moment
from pallasopt.optim import _validation as v
from pallasopt.optim._elementwise_tx import (
    check_low_bit_options,
    check_moment_storage,
    is_quantized,
    leaf_decay_rate,
    moment_arrays,
    moment_value,
    momentum_rounding,
    stored_moment_trees,
    with_decay_link,
)
from pallasopt.optim._base import (
    FusedGradientTransformation,
    advance_schedule,
    fused_transformation,
    scaled_grads,
    schedule_value,
)
from pallasopt.optim._types import MaskOrFn, Numeric, ScalarOrSchedule

__all__ = ["adafactor", "ADAFACTOR_STATIC_ARGS"]

_OWNER = "pallasopt.optim.adafactor"

# The arguments to name in ``optax.inject_hyperparams(adafactor,
# static_args=ADAFACTOR_STATIC_ARGS)``: the two ints decide shapes at trace
# time, and inject_hyperparams would take the dtype class for a schedule.
ADAFACTOR_STATIC_ARGS = ("min_dim_size_to_factor", "stacked_axes", "dtype_momentum")


def _state_shapes(shape, dtype, dims):
  """Optax's per-leaf (v_row, v_col, v) shapes; (1,) placeholders where unused."""
  one = jax.ShapeDtypeStruct((1,), dtype)
  if dims is None:
    return one, one, jax.ShapeDtypeStruct(shape, dtype)
  d1, d0 = dims
  drop = lambda axis: jax.ShapeDtypeStruct(shape[:axis] + shape[axis + 1:], dtype)
  return drop(d0), drop(d1), one


def adafactor(
    learning_rate: ScalarOrSchedule | None = None,
    min_dim_size_to_factor: int = 128,
    decay_rate: Numeric = 0.8,
    decay_offset: Numeric = 0,
    multiply_by_parameter_scale: bool = True,
    clipping_threshold: Numeric | None = 1.0,
    momentum: Numeric | None = None,
    dtype_momentum: Any = jnp.float32,
    weight_decay_rate: ScalarOrSchedule | None = None,
    eps: Numeric = 1e-30,
    factored: bool = True,
    weight_decay_mask: MaskOrFn = None,
    *,
    stacked_axes: int | None = None,
    state_format: str | None = None,
    seed: int | None = None,
    impl: str = "auto",
) -> FusedGradientTransformation:
  r"""Adafactor with factored second moments, fused per leaf.

  Same arguments, defaults, math and state as `optax.adafactor` (Shazeer &
  Stern, `Adafactor: Adaptive Learning Rates with Sublinear Memory Cost
  <https://arxiv.org/abs/1804.04235>`_, 2018); see
  `pallasopt.kernels.adafactor` for the math and the passes each
  configuration makes over HBM. Optax chains ``scale_by_factored_rms``,
  ``clip_by_block_rms``, ``scale_by_learning_rate``,
  ``scale_by_param_block_rms``, ``ema`` (momentum), ``add_decayed_weights``
  and ``scale(-1)``, each present as its argument asks; so:

  .. math::

    u = -\left(\mathrm{ema}_\mu\!\left[\eta\,
        \frac{\hat u}{\max(1, \mathrm{rms}(\hat u)/\tau)}
        \max(\mathrm{rms}(p), 10^{-3})\right] + \lambda p\right),

  with :math:`\hat u` the gradient scaled by its factored (or, for small
  leaves, full) second-moment estimate. Note that, as in Optax, weight decay
  is *not* multiplied by the learning rate.

  The state is exactly ``optax.adafactor(...).init(params)``'s: a tuple of
  ``FactoredState(count, v_row, v_col, v)`` (``(1,)`` placeholders where a
  leaf does not use an entry, in the params' dtypes) followed by the states
  of the other links of the chain (``EmaState`` with momentum, schedule
  counts, ``MaskedState`` with a mask). A checkpoint written with one
  restores into the other.

  ``update`` returns Optax updates. ``apply_gradients`` (or
  `pallasopt.optim.apply_gradients`) writes the new params (and momentum)
  in place instead, saving the ``optax.apply_updates`` pass.

  **Stacked layers.** ``stacked_axes=k`` declares the first ``k`` axes of
  every leaf stacked-layer axes (``[layers, d_in, d_out]`` with ``k = 1``):
  they are never factored (the factored pair is Optax's choice among the
  other axes) and the clipping and parameter-scale RMS are per layer, so each
  layer is updated as if it were its own leaf. Optax (``k = 0``, the
  default) factors a ``[layers, d_in, d_out]`` leaf over its two largest
  axes: over ``(d_in, d_out)`` while ``layers`` is the smallest axis, with
  ``v_row``/``v_col`` of shapes ``[layers, d_in]``/``[layers, d_out]``, but
  over ``layers`` once it is one of the two largest, and its RMS values mix
  all layers. A leaf with at most ``k`` axes raises a ValueError naming it
  (stack a per-layer scalar as ``[layers, 1]``). With ``k > 0`` the state
  keeps Optax's structure and field
  names; leaf shapes differ from Optax's only where Optax would have
  factored over a stacked axis.

  Args:
    learning_rate: a scalar or an ``optax`` schedule of the step count, or
      None for no learning-rate scaling (Optax's default).
    min_dim_size_to_factor: factor a leaf only if its second-largest axis
      has at least this many elements. A static int.
    decay_rate: exponent of the second-moment decay
      :math:`\hat\beta_t = 1 - (t + 1)^{-\text{decay\_rate}}`.
    decay_offset: step at which the decay schedule starts (fine-tuning).
    multiply_by_parameter_scale: scale updates by the block RMS of the params
      (floored at 1e-3).
    clipping_threshold: clip the update's block RMS to this value (>= 0), or
      None for no clipping.
    momentum: EMA decay of the updates in [0, 1], or None for no momentum.
    dtype_momentum: dtype of the momentum accumulator (float32, bfloat16, or
      None for the params' dtype).
    weight_decay_rate: decoupled weight decay (scalar or schedule), or None.
    eps: added to the squared gradient, >= 0.
    factored: whether to factor second moments at all.
    weight_decay_mask: a tree of bools (or a prefix of the params tree, or a
      callable returning one) selecting the leaves that decay.
    stacked_axes: number of leading stacked-layer axes of every leaf (see
      above). A static int; None (the default) means 0, and keeps it out of
      ``optax.inject_hyperparams``' traced hyperparameters.
    state_format: storage of the momentum (needs ``momentum``): None
      (``dtype_momentum``, Optax's), ``"bf16"`` (stochastic rounding on
      every store), ``"int8"``, ``"fp8"`` or ``"int4"`` (blockwise codes, on
      the signed map for int8 and int4, for leaves of at least 4096
      elements, f32 below); see
      `pallasopt.optim.adamw`. With a format, ``dtype_momentum`` must stay
      float32 (its default). The kernel updates the momentum in f32 and XLA
      re-encodes it: one more pass over the momentum than AdamW's formats.
    seed: seed of the stochastic roundings (None: 0).
    impl: ``"auto" | "pallas" | "interpret" | "xla"``; see
      `pallasopt.kernels.use_impl`.

  Returns:
    A `FusedGradientTransformation`. Under ``optax.inject_hyperparams``,
    pass ``static_args=ADAFACTOR_STATIC_ARGS``.

  Dtypes: float32 and bfloat16 leaves run the fused kernel; any other leaf
  Optax accepts (float16, float64, complex) runs Optax's own chain for that
  leaf, in its dtype, in every ``impl``.

  Raises:
    ValueError: a concrete hyperparameter out of range or NaN; at update time,
      missing params, or grads, params and state trees that do not match.
    TypeError: a leaf or ``dtype_momentum`` whose dtype is not float32 or
      bfloat16; a traced ``min_dim_size_to_factor`` or ``stacked_axes``.
  """
  hint = dict(static_args="ADAFACTOR_STATIC_ARGS")
  min_dim_size_to_factor = v.static_int(
      _OWNER, "min_dim_size_to_factor", min_dim_size_to_factor, **hint)
  stacked_axes = v.static_int(
      _OWNER, "stacked_axes", 0 if stacked_axes is None else stacked_axes, **hint)
  inf = float("inf")
  for name, value in (("learning_rate", learning_rate), ("weight_decay_rate", weight_decay_rate)):
    v.check_finite(_OWNER, name, value)
  for name, value, low, high in (
      ("decay_rate", decay_rate, 0.0, inf),
      ("decay_offset", decay_offset, -inf, inf),
      ("clipping_threshold", clipping_threshold, 0.0, inf),
      ("momentum", momentum, 0.0, 1.0),
      ("eps", eps, 0.0, inf),
  ):
    if value is not None:
      v.check_hyperparameter(_OWNER, name, value, low=low, high=high)
  resolve_impl(impl)
  if momentum is not None and dtype_momentum is not None:
    # Optax reads dtype_momentum only with momentum; so do we.
    if isinstance(dtype_momentum, jax.Array):
      # optax.inject_hyperparams takes dtype classes (callables) for schedules.
      raise TypeError(
          f"{_OWNER}: dtype_momentum must be a dtype, not an array; under "
          "optax.inject_hyperparams pass static_args=ADAFACTOR_STATIC_ARGS."
      )
    dtype_momentum = v.optional_dtype(_OWNER, "dtype_momentum", dtype_momentum)
  if state_format is not None:
    if momentum is None:
      raise ValueError(
          f"{_OWNER}: state_format={state_format!r} stores the momentum; momentum is None."
      )
    if dtype_momentum != jnp.float32:
      raise ValueError(
          f"{_OWNER}: dtype_momentum={dtype_momentum} and state_format={state_format!r} both"
          " set the momentum's storage; leave dtype_momentum at float32."
      )
  seed = check_low_bit_options(_OWNER, state_format, "nearest", seed)

  # Optax's chain after scale_by_factored_rms: their init gives our states.
  links = {}
  if clipping_threshold is not None:
    links["clip"] = optax.clip_by_block_rms(clipping_threshold)
  if learning_rate is not None:
    links["lr"] = optax.scale_by_learning_rate(learning_rate, flip_sign=False)
  if multiply_by_parameter_scale:
    links["param_scale"] = optax.scale_by_param_block_rms()
  if momentum is not None:
    links["momentum"] = optax.ema(momentum, debias=False, accumulator_dtype=dtype_momentum)
  if weight_decay_rate is not None:
    links["decay"] = optax.add_decayed_weights(weight_decay_rate, mask=weight_decay_mask)
  links["sign"] = optax.scale(-1)
  position = {name: 1 + i for i, name in enumerate(links)}
  never_decays = weight_decay_rate is None or (
      isinstance(weight_decay_rate, (int, float)) and weight_decay_rate == 0
  )

  def dims_of(shape):
    return adafactor_kernels.factored_dims(
        tuple(shape), factored, min_dim_size_to_factor, stacked_axes)

  def expected_state(params):
    v.check_stacked_axes(_OWNER, params, stacked_axes)
    shapes = [_state_shapes(p.shape, p.dtype, dims_of(p.shape)) for p in jax.tree.leaves(params)]
    treedef = jax.tree.structure(params)
    return [treedef.unflatten(column) for column in zip(*shapes)] if shapes else [params] * 3

  factored_rms = optax.scale_by_factored_rms(
      factored, decay_rate, decay_offset, min_dim_size_to_factor, eps
  )

  def optax_leaf(p, g, vr, vc, vf, m, state, decay, mode, learning_rate_now, decay_now):
    """One leaf by Optax's chain, in its own dtypes: (first, v_row, v_col, v, m)."""
    factored_state = state[0]._replace(v_row=[vr], v_col=[vc], v=[vf])
    (u,), new_factored = factored_rms.update([g], factored_state, [p])
    if "clip" in links:
      (u,), _ = links["clip"].update([u], optax.EmptyState())
    if learning_rate_now is not None:
      u = jnp.asarray(learning_rate_now, jnp.result_type(u)) * u
    if "param_scale" in links:
      (u,), _ = links["param_scale"].update([u], optax.EmptyState(), [p])
    if "momentum" in links:
      ema_state = state[position["momentum"]]._replace(ema=[m])
      (u,), new_ema = links["momentum"].update([u], ema_state)
      (m,) = new_ema.ema
    if decay:
      u = u + decay_now * p
    u = -u
    first = optax.apply_updates(p, u) if mode == "apply" else u
    return (first, *(x[0] for x in new_factored[1:]), m)

  def init_fn(params):
    # An array of its leaf's shape is laid out as the leaf (`zeros_like` keeps a sharded type).
    zeros = lambda s, p: (
        jnp.zeros_like(p, s.dtype) if s.shape == jnp.shape(p) else jnp.zeros(s.shape, s.dtype))
    v_row, v_col, v_full = (jax.tree.map(zeros, tree, params) for tree in expected_state(params))
    factored_state = optax.FactoredState(
        count=jnp.zeros([], jnp.int32), v_row=v_row, v_col=v_col, v=v_full
    )
    state = [factored_state, *(link.init(params) for link in links.values())]
    if state_format is not None:
      i = position["momentum"]
      state[i] = state[i]._replace(
          ema=stored_moment_trees(
              [state[i].ema], params, roles=(quant.SIGNED,), state_format=state_format)[0]
      )
    return tuple(state)

  def step(grads, state, params, mode, grad_scale, learning_rate_now, decay_link=None):
    if params is None:
      raise ValueError(f"{_OWNER}: params are required (Adafactor's statistics use their shapes).")
    v.check_same_tree(_OWNER, "grads", grads, "params", params)
    factored_state = state[0]
    for name, tree, want in zip(("v_row", "v_col", "v"),
                                factored_state[1:], expected_state(params)):
      v.check_same_tree(_OWNER, f"opt_state[0].{name}", tree, "the state for params", want)
    if "momentum" in links:
      field = f"opt_state[{position['momentum']}].ema"
      stored = state[position["momentum"]].ema
      v.check_same_tree(_OWNER, field, moment_arrays(stored), "params", params)
      # convert_state leaves Optax's ema state as it is (it serves other
      # transforms too): an array of any dtype steps, blockwise codes must fit.
      check_moment_storage(_OWNER, {field: stored}, (quant.SIGNED,), jax.tree.leaves(params),
                           grads, state_format=state_format, any_array=(field,))

    if learning_rate_now is None and learning_rate is not None:
      learning_rate_now = schedule_value(learning_rate, state[position["lr"]])
    decay_now = 0.0 if never_decays else schedule_value(weight_decay_rate, state[position["decay"]])
    leaves = jax.tree.leaves(params)
    decays = ([False] * len(leaves) if never_decays
              else v.broadcast_mask(_OWNER, weight_decay_mask, grads))
    if decay_link is not None and learning_rate_now is None:
      raise ValueError(
          f"{_OWNER}: decay_link needs a learning rate (the link's decay is lr * rate * p); "
          "this adafactor has learning_rate=None."
      )
    # Per leaf (own decay, link decay). The link adds -lr * rate * p to the
    # negated update, i.e. lr * rate to Adafactor's own (unscaled) rate.
    link_rate, decays = with_decay_link(_OWNER, decays, decay_link, grads)
    leaf_decay = functools.partial(
        leaf_decay_rate, own_rate=decay_now,
        link_rate=0.0 if decay_link is None else learning_rate_now * link_rate,
    )

    @functools.cache
    def scalars(decay):  # built only if some leaf runs a kernel
      return adafactor_kernels.adafactor_scalars(
          factored_state.count,
          learning_rate=1.0 if learning_rate_now is None else learning_rate_now,
          decay_rate=decay_rate, decay_offset=decay_offset, eps=eps,
          clipping_threshold=1.0 if clipping_threshold is None else clipping_threshold,
          momentum=0.0 if momentum is None else momentum,
          weight_decay=leaf_decay(decay),
          grad_scale=1.0 if grad_scale is None else grad_scale,
      )
    ms = (jax.tree.leaves(state[position["momentum"]].ema, is_leaf=is_quantized)
          if "momentum" in links else [None] * len(leaves))
    kernel = (adafactor_kernels.adafactor_apply if mode == "apply"
              else adafactor_kernels.adafactor_updates)

    def low_bit_step(index, path, p, g, vr, vc, vf, m, d):
      """A leaf whose momentum is stored as ``state_format``: decoded for the
      kernel, which updates it in f32, and re-encoded."""
      if not v.kernel_dtypes(g):
        raise TypeError(
            f"{_OWNER}: state_format={state_format!r} needs float32 or bfloat16 grads;"
            f" grads{path} has dtype {jnp.result_type(g)}."
        )
      m32 = moment_value(m).astype(jnp.float32)
      first, *stats, new_m = leaf_step(index, path, p, g, vr, vc, vf, m32, d)
      rounding = momentum_rounding(
          state_format, seed, optax.safe_increment(factored_state.count), index, jnp.shape(g))
      return (first, *stats, store_moment(new_m, m, **rounding))

    def leaf_step(index, path, p, g, vr, vc, vf, m, d):
      # Leaves whose params the kernels take store the momentum as
      # state_format says: 8-bit codes or bf16 to re-encode (f32 below 4096).
      if state_format is not None and v.kernel_dtypes(p) and (
          is_quantized(m) or jnp.result_type(m) == jnp.bfloat16
      ):
        return low_bit_step(index, path, p, g, vr, vc, vf, m, d)
      if v.kernel_dtypes(p, g, vr, vc, vf, m):
        return kernel(p, g, vr, vc, vf, m, scalars(d), factored_dims=dims_of(p.shape),
                      stacked_axes=stacked_axes, clipping=clipping_threshold is not None,
                      parameter_scale=multiply_by_parameter_scale, momentum=m is not None,
                      decay=bool(d), impl=impl)
      if stacked_axes:
        raise TypeError(
            f"{_OWNER}: stacked_axes={stacked_axes} needs float32 or bfloat16 leaves (Optax "
            f"has no stacked_axes to fall back on); got {jnp.result_type(p)}."
        )
      return optax_leaf(p, scaled_grads(g, grad_scale), vr, vc, vf, m, state, d, mode,
                        learning_rate_now, leaf_decay(d))

    paths = [path for path, _ in v.keyed_leaves(grads)]
    results = [
        leaf_step(i, path, p, g, vr, vc, vf, m, d)
        for i, (path, p, g, vr, vc, vf, m, d) in enumerate(zip(
            paths, leaves, jax.tree.leaves(grads), *map(jax.tree.leaves, factored_state[1:]),
            ms, decays, strict=True,
        ))
    ]
    treedef = jax.tree.structure(params)
    first, v_row, v_col, v_full, new_m = (
        treedef.unflatten(column) for column in (zip(*results) if results else [[]] * 5)
    )
    new_state = [
        optax.FactoredState(count=optax.safe_increment(factored_state.count),
                            v_row=v_row, v_col=v_col, v=v_full),
        *(advance_schedule(link_state) for link_state in state[1:]),
    ]
    if "momentum" in links:
      i = position["momentum"]
      new_state[i] = new_state[i]._replace(ema=new_m)
    return first, tuple(new_state)

  return fused_transformation(
      init_fn, step, learning_rate=learning_rate, stacked_axes=stacked_axes
  )
