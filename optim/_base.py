"""The fused-transform type and the `apply_gradients` entry point."""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from pallasopt.kernels._update import Gate, open_gate
from pallasopt.optim._types import ScalarOrSchedule

__all__ = [
    "FusedGradientTransformation",
    "FusedUpdate",
    "fused_update",
    "apply_gradients",
    "fused_transformation",
    "chained_transformation",
    "clip_factor",
    "scaled_grads",
    "held_counters",
    "split_accumulator",
    "gated_results",
]

ApplyFn = Callable[..., tuple[optax.Params, optax.OptState]]


@dataclasses.dataclass(frozen=True, eq=False)
class FusedUpdate:
  """An Optax ``update`` function that carries the fused entry points.

  Calling it is calling ``update``; like a function it compares and hashes by
  identity (a learning rate may be an array) and copies as itself. The entry points ride on the update
  function rather than on the transform so that everything Optax and JAX do
  to a transform keeps them: ``copy.copy``, ``copy.deepcopy``,
  ``jax.tree.map(f, tx)``, ``tx._replace(init=...)``, and rebuilding it as a
  plain ``optax.GradientTransformationExtraArgs(tx.init, tx.update)``.

  Attributes:
    update: the Optax update function.
    apply_gradients: ``(params, grads, opt_state, *, grad_scale=None,
      learning_rate=None) -> (params, opt_state)``.
    scaled_update: ``(grads, opt_state, params=None, *, grad_scale=None,
      learning_rate=None) -> (updates, opt_state)``, or None.
    learning_rate: the transform's learning rate where its entry points take
      ``decay_link``, else None.
    stacked_axes: for a transform with per-layer math (Adafactor's factored
      statistics, Muon, Kron), the leading axes of every leaf it treats as
      stacked layers (batch axes of that math); None for one without.
    elementwise: each element's update depends on that element's gradient
      and state alone, so any slice of a leaf may be updated on its own (a
      pipeline stage's FSDP shard, in place).
    collective_axes: mesh axes the step communicates over itself (Muon's
      ``distributed_axes``): their devices must hold the same layers.
    layer_indexed: the entry points take ``layer_index_fn``, the global
      index of each stacked layer of a shard (Kron draws a layer's probe from
      it), so a sharded step equals the whole one.
    gated: the entry points take ``gate``, a boolean scalar: where it is
      false the step holds (params and state as they are, zero updates),
      decided inside the kernels, which then write the state they read
      (`pallasopt.optim.multi_steps`); or a `kernels._update.Gate`, which
      also folds a gradient accumulator tree (``acc``) into the kernels'
      pass: the entry points then return the stored accumulator third.
  """

  update: Callable[..., tuple[optax.Updates, optax.OptState]]
  apply_gradients: ApplyFn
  scaled_update: ApplyFn | None = None
  learning_rate: ScalarOrSchedule | None = None
  stacked_axes: int | None = None
  elementwise: bool = False
  collective_axes: tuple[str, ...] = ()
  layer_indexed: bool = False
  gated: bool = False

  def __call__(self, updates, state, params=None, **extra_args):
    return self.update(updates, state, params, **extra_args)

  # Copied as functions are: the same object.
  def __copy__(self) -> "FusedUpdate":
    return self

  def __deepcopy__(self, memo) -> "FusedUpdate":
    return self


class FusedGradientTransformation(optax.GradientTransformationExtraArgs):
  """An Optax transform that can also apply gradients in one fused pass.

  It *is* a `optax.GradientTransformationExtraArgs` with Optax's two fields
  and no others: ``init`` and ``update`` keep the Optax contract, so it
  composes with ``optax.chain``, ``optax.masked``, ``optax.MultiSteps`` and the
  rest, and copies, tree maps and ``_replace`` work as on Optax's. Its
  ``update`` is a `FusedUpdate`, whose entry points the transform shows as
  attributes::

    apply_gradients(params, grads, opt_state, *, grad_scale=None,
                    learning_rate=None) -> (params, opt_state)

  runs the update and its application to the params as one kernel per leaf,
  writing params and state in place. ``grad_scale`` (a scalar, e.g. a global
  norm clipping factor) multiplies the gradients inside the kernel;
  ``learning_rate`` (a scalar) replaces the transform's learning rate or
  schedule value for this step. Prefer the module-level `apply_gradients`,
  which also accepts transforms that are not fused. And::

    scaled_update(grads, opt_state, params=None, *, grad_scale=None,
                  learning_rate=None) -> (updates, opt_state)

  is ``update`` with the same two options, for a step whose updates go
  through another transform before they are applied; None when the
  transform does not provide it.

  A transform whose ``learning_rate`` attribute is set (AdamW, Lion,
  RMSProp, MARS, Adafactor) can fold a decay link that follows it in a chain: both
  entry points then take ``decay_link=(rate, mask)`` and add
  ``-learning_rate(t) * rate * p`` to the update of each masked leaf, in the
  same kernel. That is ``add_scheduled_weight_decay(lambda t:
  -learning_rate(t) * rate, mask)`` after the transform, with the link's
  counter equal to the transform's (as in the factory's chain).
  """

  __slots__ = ()

  def __new__(
      cls, init, update, apply_gradients: ApplyFn | None = None,
      scaled_update: ApplyFn | None = None, learning_rate: ScalarOrSchedule | None = None,
      *, stacked_axes: int | None = None, elementwise: bool = False,
      collective_axes: tuple[str, ...] = (), layer_indexed: bool = False, gated: bool = False,
  ):
    # Copies and tree maps rebuild the tuple from (init, update) alone: the
    # entry points are already on ``update`` then.
    if apply_gradients is not None:
      update = FusedUpdate(
          update, apply_gradients, scaled_update, learning_rate, stacked_axes, elementwise,
          collective_axes, layer_indexed, gated,
      )
    return super().__new__(cls, init, update)

  @property
  def apply_gradients(self) -> ApplyFn:
    return _entry_points(self).apply_gradients

  @property
  def scaled_update(self) -> ApplyFn | None:
    return _entry_points(self).scaled_update

  @property
  def learning_rate(self) -> ScalarOrSchedule | None:
    return _entry_points(self).learning_rate


def fused_update(tx: Any) -> FusedUpdate | None:
  """``tx``'s fused entry points (a `FusedUpdate`), or None for any other transform."""
  update = getattr(tx, "update", None)
  return update if isinstance(update, FusedUpdate) else None


def _entry_points(tx: FusedGradientTransformation) -> FusedUpdate:
  entry = fused_update(tx)
  if entry is None:
    raise TypeError(
        f"this FusedGradientTransformation's update is a {type(tx.update).__name__}, not the "
        "FusedUpdate it was built with (was it replaced?), so it has no fused entry points; "
        "pallasopt.optim.apply_gradients(tx, ...) runs its update instead."
    )
  return entry


def fused_transformation(
    init_fn: Callable[[optax.Params], optax.OptState], step: Callable[..., Any],
    learning_rate: ScalarOrSchedule | None = None, *,
    update: Callable[..., tuple[optax.Updates, optax.OptState]] | None = None,
    stacked_axes: int | None = None, elementwise: bool = False,
    collective_axes: tuple[str, ...] = (), layer_indexed: bool = False, gated: bool = False,
) -> FusedGradientTransformation:
  """A `FusedGradientTransformation` whose paths share one ``step``: every transform's builder.

  Args:
    init_fn: Optax ``init``.
    step: ``step(grads, state, params, mode, grad_scale, learning_rate) ->
      (first, new_state)``: ``mode="updates"`` (``params`` may be None)
      returns Optax updates, ``mode="apply"`` returns the new params. None
      ``grad_scale`` means 1, None ``learning_rate`` means the transform's own.
      Keywords given to the fused entry points (``decay_link``) are passed on.
    learning_rate: the transform's learning rate, when ``step`` takes
      ``decay_link`` (see `FusedGradientTransformation`).
    update: the Optax ``update``, where it is not ``step``'s ``"updates"``
      mode (Muon keeps ``optax.partition``'s, Optax's own path).
    stacked_axes, elementwise, collective_axes, layer_indexed, gated: see
      `FusedUpdate` (``gated``: ``step`` takes ``gate``).
  """

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    return step(updates, state, params, "updates", None, None)

  def apply_fn(params, grads, state, *, grad_scale=None, learning_rate=None, **options):
    return step(grads, state, params, "apply", grad_scale, learning_rate, **options)

  def scaled_update_fn(
      grads, state, params=None, *, grad_scale=None, learning_rate=None, **options
  ):
    return step(grads, state, params, "updates", grad_scale, learning_rate, **options)

  return FusedGradientTransformation(
      init_fn, update or update_fn, apply_fn, scaled_update_fn, learning_rate=learning_rate,
      stacked_axes=stacked_axes, elementwise=elementwise, collective_axes=collective_axes,
      layer_indexed=layer_indexed, gated=gated,
  )


def clip_factor(grads: optax.Updates, max_norm: Any, grad_scale: Any = None) -> jax.Array:
  """The factor that clips ``grad_scale * grads`` to a global norm of ``max_norm``.

  Optax's ``clip_by_global_norm``: 1 where the norm over every leaf
  (`optax.tree.norm`) is below ``max_norm``, else ``max_norm / norm`` (an
  infinite ``max_norm`` never clips). Times ``grad_scale`` (a factor >= 0
  already applied outside, None for 1), so that the result scales ``grads``
  themselves.
  """
  norm = optax.tree.norm(grads)
  if grad_scale is not None:
    norm = norm * grad_scale
  factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
  return factor if grad_scale is None else factor * grad_scale


def scaled_grads(grads: optax.Updates, grad_scale: Any) -> optax.Updates:
  """``grad_scale * grads``, each leaf kept in its dtype (a tree or one leaf).

  The fused entry points' ``grad_scale`` (a clip factor) where the gradient
  reaches XLA's math rather than a kernel (which scales it on load). None:
  the grads as they are.
  """
  if grad_scale is None:
    return grads
  return jax.tree.map(lambda g: (g * grad_scale).astype(g.dtype), grads)


def chained_transformation(
    scaling: optax.GradientTransformation,
    decay: optax.GradientTransformation | None,
    learning_rate: ScalarOrSchedule,
    *,
    stacked_axes: int | None = None,
) -> FusedGradientTransformation:
  """``optax.chain(scaling, [decay], scale_by_learning_rate(learning_rate))``
  with the fused entry points.

  For optimizers whose scaling is not one elementwise kernel (it runs its own
  kernels inside): ``apply_gradients`` and ``scaled_update`` run the chain
  on ``grad_scale * grads`` with ``learning_rate`` (when given) in place of
  the schedule's value, advancing its counter as the chain does; the state is
  the chain's. ``stacked_axes``: see `FusedUpdate`.
  """
  lr_tx = optax.scale_by_learning_rate(learning_rate)
  links = [scaling] + ([] if decay is None else [decay])
  chain = optax.chain(*links, lr_tx)

  def step(grads, state, params, mode, grad_scale, learning_rate_now):
    grads = scaled_grads(grads, grad_scale)
    *link_states, lr_state = state
    updates, new_states = grads, []
    for tx, link_state in zip(links, link_states, strict=True):
      updates, link_state = tx.update(updates, link_state, params)
      new_states.append(link_state)
    if learning_rate_now is None:
      updates, lr_state = lr_tx.update(updates, lr_state, params)
    else:
      updates = jax.tree.map(lambda u: jnp.asarray(-learning_rate_now, u.dtype) * u, updates)
      lr_state = advance_schedule(lr_state)
    first = optax.apply_updates(params, updates) if mode == "apply" else updates
    return first, (*new_states, lr_state)

  return fused_transformation(chain.init, step, stacked_axes=stacked_axes)


def apply_gradients(
    tx: optax.GradientTransformation,
    params: optax.Params,
    grads: optax.Updates,
    opt_state: optax.OptState,
    *,
    max_grad_norm: float | None = None,
) -> tuple[optax.Params, optax.OptState]:
  """Applies one optimizer step and returns ``(new_params, new_opt_state)``.

  For a pallasopt transform this is the fused path: where a kernel runs (int8
  or fp8 state under ``impl="auto"``; every leaf under ``"pallas"``), one
  kernel per leaf reads params, grads and state once and writes params and
  state in place (AdamW's f32 kernel: 28 bytes per parameter, against 36 for
  ``update`` and ``optax.apply_updates``, whose add cannot fuse into the
  kernel's custom call); where XLA runs, XLA fuses it as it fuses Optax's.
  The in-place write needs the old buffers donated::

    @functools.partial(jax.jit, donate_argnums=(0, 2))
    def step(params, grads, opt_state):
      return pallasopt.optim.apply_gradients(tx, params, grads, opt_state)

  Without donation the result is the same, and XLA copies the buffers first.
  The fused path is found on ``tx.update`` (a `FusedUpdate`), so a copy of a
  pallasopt transform, or one rebuilt as a plain
  ``optax.GradientTransformationExtraArgs(tx.init, tx.update)``, takes it too.
  For any other transform (e.g. an ``optax.chain``) it falls back to
  ``tx.update`` and ``optax.apply_updates``, so a training loop can always
  call it.

  Args:
    tx: the optimizer.
    params: current parameters.
    grads: gradients, with the structure of `params`.
    opt_state: ``tx``'s state for `params`.
    max_grad_norm: clip the gradients by their global norm first, as
      ``optax.chain(optax.clip_by_global_norm(max_grad_norm), tx)`` does
      (Pascanu et al., 2013): ``g * max_grad_norm / max(|g|, max_grad_norm)``
      with ``|g|`` the norm over all leaves (`optax.tree.norm`). A fused
      transform applies the factor inside its kernels, so the clipped
      gradients are never written (the chain writes them and reads them
      back: pallasopt's int8 AdamW in a train step moves 4-7% more bytes
      that way, `pallasopt.whole_step`). The state is ``tx``'s own, not the
      chain's.

  Examples:
    >>> import functools, jax, jax.numpy as jnp, pallasopt
    >>> tx = pallasopt.optim.adamw(1e-3, state_format="int8")
    >>> params = {"w": jnp.ones((64, 256))}
    >>> opt_state = tx.init(params)
    >>> @functools.partial(jax.jit, donate_argnums=(0, 2))
    ... def step(params, grads, opt_state):
    ...   return pallasopt.optim.apply_gradients(tx, params, grads, opt_state,
    ...                                          max_grad_norm=1.0)
    >>> params, opt_state = step(params, {"w": jnp.full((64, 256), 0.01)}, opt_state)
    >>> round(float(params["w"][0, 0]), 6)
    0.999
  """
  scale = None
  if max_grad_norm is not None:
    if not max_grad_norm > 0:
      raise ValueError(f"apply_gradients: max_grad_norm must be > 0 or None; got {max_grad_norm!r}.")
    scale = clip_factor(grads, max_grad_norm)
  entry = fused_update(tx)
  if entry is not None:
    return entry.apply_gradients(params, grads, opt_state, grad_scale=scale)
  updates, opt_state = tx.update(scaled_grads(grads, scale), opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def _has_count(state: Any) -> bool:
  # NamedTuple states are tuples, whose `count` *method* hasattr would find.
  return "count" in getattr(state, "_fields", ())


def schedule_count(state: Any):
  """The step counter of an Optax schedule state (possibly masked), or None."""
  if isinstance(state, optax.MaskedState):
    return schedule_count(state.inner_state)
  return state.count if _has_count(state) else None


def schedule_value(value: ScalarOrSchedule, state: Any):
  """`value` at `state`'s step count if it is a schedule, else `value` itself."""
  return value(schedule_count(state)) if callable(value) else value


def held_counters(gate: Any, stepped: Any, held: Any) -> Any:
  """A gated step's state: its 0-d leaves (step counters) from ``held`` where ``gate`` is false.

  ``gate``: None, a boolean scalar or a `kernels._update.Gate` (its
  ``apply``). The moments are held by the step's kernels (or its per-leaf
  fallback), which write the codes they read: selecting them again here
  would keep the old state alive past the kernels, which XLA then copies.
  """
  if gate is None:
    return stepped
  apply = open_gate(gate)
  return jax.tree.map(
      lambda new, old: jnp.where(apply, new, old) if jnp.ndim(new) == 0 else new, stepped, held)


def split_accumulator(gate: Any, outputs: list[Any]) -> tuple[list[Any], Any]:
  """``(moment trees, accumulator tree or None)`` from `fused_leaf_steps`' trees after the first."""
  if isinstance(gate, Gate):
    return outputs[:-1], outputs[-1]
  return outputs, None


def gated_results(gate: Any, first: Any, state: Any, accumulator: Any) -> tuple[Any, ...]:
  """A step's results: ``(first, state)``, and the stored accumulator third under a `Gate`."""
  return (first, state) if not isinstance(gate, Gate) else (first, state, accumulator)


def advance_schedule(state: Any) -> Any:
  """`state` with its schedule counter (if any) incremented, as Optax does."""
  if isinstance(state, optax.MaskedState):
    return state._replace(inner_state=advance_schedule(state.inner_state))
  if _has_count(state):
    return state._replace(count=optax.safe_increment(state.count))
  return state
