"""Stage-local optimizer steps for pipeline-parallel training.

In a pipeline, each stage holds only its own slice of the params (stacked
``[stages, ...]`` or ``[repeats, stages, ...]`` and sharded over the ``stage``
mesh axis) and of their gradients. A stage-local step updates that slice from
those gradients alone, leaf by leaf, inside the same ``jax.shard_map`` that
computed them: no gather, and for global-norm clipping one scalar ``psum``.

The API is eFormer's (``eformer.optimizers``): `StageLocalOptimizerMetadata`,
`StageLocalGradientTransformation.apply_gradients_stage_local`,
`make_stage_local_gradient_transformation` and
`make_unsupported_stage_local_gradient_transformation`; the factory
(`pallasopt.optim.eformer.OptimizerFactory`) attaches the path. Here the step runs
pallasopt's fused kernels in place
(``FusedGradientTransformation.apply_gradients``), the clip factor is applied
inside the kernel, and gradient accumulation works on the stage-local path.

Example, inside the pipeline's ``shard_map`` over the ``stage`` axis (with
``check_vma=False``, which Pallas calls inside ``shard_map`` need)::

  tx, schedule = OptimizerFactory.create(
      "adamw",
      SchedulerConfig("cosine", learning_rate=3e-4, warmup_steps=100, steps=10_000),
      AdamWConfig(b2=0.95), weight_decay=0.1, clip_grad=1.0, stacked_axes=1)
  ...
  params, opt_state = tx.apply_gradients_stage_local(
      params=params, grads=grads, opt_state=opt_state, axis_name="stage")

``tx.update`` + ``optax.apply_updates`` on the whole model gives the same
result; the stage-local path is that computation, done per stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optax

from pallasopt.optim import _validation as v
from pallasopt.optim._base import FusedUpdate
from pallasopt.optim._types import Numeric

__all__ = [
    "StageLocalOptimizerMetadata",
    "StageLocalApplyFn",
    "StageLocalGradientTransformation",
    "make_stage_local_gradient_transformation",
    "make_unsupported_stage_local_gradient_transformation",
]

_OWNER = "pallasopt.optim.eformer.stage_local"

AxisName = str | tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class StageLocalOptimizerMetadata:
  """What a stage-local step needs to know about the transform it mirrors.

  The transform is ``[MultiSteps of] chain([clip_by_global_norm,] optimizer,
  [scheduled weight decay])`` as `pallasopt.optim.eformer.OptimizerFactory` builds it;
  these fields describe that layout and the hyperparameters. Field names and
  meanings are eFormer's, plus ``stacked_axes``.

  Attributes:
    scheduler: the learning-rate schedule the optimizer was built with.
    weight_decay: rate of the scheduled decay link after the optimizer
      (``-scheduler(t) * weight_decay`` times the params; 0: no link).
    weight_decay_mask: which leaves that link decays (a tree of bools, a
      prefix of one, or a callable returning one; None: all).
    gradient_accumulation_steps: gradients are averaged over this many calls
      and applied on every k-th, as ``optax.MultiSteps`` does (1: every call).
    clip_grad: maximum global gradient norm (``optax.clip_by_global_norm``);
      None or 0 means no clipping, as in eFormer.
    adamw_b1: AdamW's ``b1`` when the optimizer is AdamW, else None.
    adamw_b2: AdamW's ``b2`` when the optimizer is AdamW, else None.
    adamw_eps: AdamW's ``eps`` when the optimizer is AdamW, else None.
    adamw_eps_root: AdamW's ``eps_root`` when the optimizer is AdamW, else None.
    adamw_mu_dtype: AdamW's ``mu_dtype`` when the optimizer is AdamW, else None.
    optimizer_config: the optimizer's config object.
    extra_kwargs: further options the builder's ``build_mpmd`` was given.
    stacked_axes: leading axes of every leaf that stack layers (``[repeats,
      stages, ...]`` is 2); the optimizers that are not elementwise treat them
      as batch axes.

  Raises:
    ValueError: ``gradient_accumulation_steps`` not an int >= 1,
      ``clip_grad`` negative or not finite, ``stacked_axes`` not an int >= 0.
  """

  scheduler: optax.Schedule
  weight_decay: float = 0.0
  weight_decay_mask: Any | None = None
  gradient_accumulation_steps: int = 1
  clip_grad: float | None = None
  adamw_b1: float | None = None
  adamw_b2: float | None = None
  adamw_eps: float | None = None
  adamw_eps_root: float | None = None
  adamw_mu_dtype: Any | None = None
  optimizer_config: Any | None = None
  extra_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  stacked_axes: int = 0

  def __post_init__(self):
    where = f"{_OWNER}.StageLocalOptimizerMetadata"
    v.check_accumulation_and_clip(where, self.gradient_accumulation_steps, self.clip_grad)
    if not v.is_int(self.stacked_axes) or self.stacked_axes < 0:
      raise ValueError(f"{where}: stacked_axes must be an int >= 0; got {self.stacked_axes!r}.")


StageLocalApplyFn = Callable[..., tuple[optax.Params, optax.OptState]]
"""A stage-local step: keyword-only ``params``, ``grads``, ``opt_state``,
``learning_rate_fn`` and ``delete_grads``, plus ``axis_name``,
``global_grad_norm`` and ``stacked_spec`` when the caller sets them and
``metadata`` when the transform has metadata; returns ``(new_params, new_opt_state)``."""


class StageLocalGradientTransformation(optax.GradientTransformationExtraArgs):
  """An Optax transform with an explicit stage-local apply path.

  ``init`` and ``update`` are the wrapped transform's, untouched, so it works
  wherever Optax transforms do. `apply_gradients_stage_local` is the
  pipeline-parallel entry point. Build one with
  `make_stage_local_gradient_transformation` or
  `pallasopt.optim.OptimizerFactory.create`.

  Attributes:
    metadata: the `StageLocalOptimizerMetadata` it was built with, or None.
  """

  # Instance attributes, not NamedTuple fields: optax.chain unpacks
  # ``init, update = tx``.
  metadata: StageLocalOptimizerMetadata | None

  def __new__(cls, init, update, *, apply_fn: StageLocalApplyFn, metadata=None):
    self = super().__new__(cls, init, update)
    self.metadata = metadata
    self._stage_local_apply = apply_fn
    return self

  @property
  def fused(self) -> FusedUpdate | None:
    """The fused entry points of the optimizer its stage-local step runs, if any.

    Set for a step from `fused_stage_local_apply` (its ``stacked_axes`` and
    ``elementwise`` say how a pipeline may lay out the operands); None for
    any other ``apply_fn``.
    """
    return getattr(self._stage_local_apply, "fused", None)

  def apply_gradients_stage_local(
      self,
      *,
      params: optax.Params,
      grads: optax.Updates,
      opt_state: optax.OptState,
      learning_rate_fn: optax.Schedule | None = None,
      delete_grads: bool = False,
      axis_name: AxisName | None = None,
      global_grad_norm: Numeric | None = None,
      stacked_spec: Sequence[AxisName | None] | None = None,
  ) -> tuple[optax.Params, optax.OptState]:
    """Updates the params this stage holds from its own gradients.

    Leafwise over whatever (local) arrays it is given, pure and jittable:
    call it inside ``jax.shard_map`` with each device's slice. For a
    transform from ``OptimizerFactory.create`` it runs the optimizer's fused
    ``apply_gradients`` (params and state written in place under donation)
    and equals ``tx.update`` + ``optax.apply_updates`` on the same arrays.

    Args:
      params: this stage's params.
      grads: their gradients, with the structure of `params`; a None leaf
        (or subtree) freezes those params: they and their optimizer state
        (moments, statistics, accumulators) come back untouched, as in
        eFormer; step counters still advance, and the leaf counts as a zero
        gradient in the clip's global norm.
      opt_state: this transform's state for `params` (from ``init``,
        ``update`` or earlier calls).
      learning_rate_fn: a schedule evaluated at the optimizer's step count
        (the number of steps applied) that replaces ``metadata.scheduler``
        for this step, weight decay included.
      delete_grads: delete the gradient buffers once used. This works on
        concrete arrays (an eager call); under ``jax.jit`` there is nothing
        to delete, so donate the grads instead (``donate_argnums``), which
        lets XLA reuse their memory.
      axis_name: the mesh axis (or axes) the params are partitioned over,
        when called inside ``shard_map``: for ``clip_grad`` the global norm
        is ``sqrt(psum(local sum of squares, axis_name))``, one scalar
        all-reduce. Every leaf must be partitioned over those axes (a leaf
        replicated over them would be counted once per device).
      global_grad_norm: the global gradient norm, computed by the caller;
        used instead of `axis_name` when ``clip_grad`` is set. Not allowed
        with gradient accumulation, whose norm is that of the averaged
        gradient at the applying step.
      stacked_spec: inside ``shard_map``, the ``PartitionSpec`` entries of
        the leaves' leading stacked axes (``(None, "stage")`` for a pipeline's
        ``[R, S, ...]``): the mesh axis each stacked axis is split over, or
        None. Optimizers whose step depends on a layer's position in the
        whole stacked leaf (Kron's probes) then use its global position, so
        the stage-local step equals the unsharded one; the others ignore it.

    Returns:
      ``(new_params, new_opt_state)``.

    Raises:
      NotImplementedError: the transform has no stage-local path.
      ValueError: grads or state that do not match the params or the
        transform's layout (named by leaf path).
    """
    kwargs = dict(
        params=params, grads=grads, opt_state=opt_state, learning_rate_fn=learning_rate_fn,
        delete_grads=delete_grads,
    )
    # Passed only when used, so an eFormer-style apply_fn without them works.
    if axis_name is not None:
      kwargs["axis_name"] = axis_name
    if global_grad_norm is not None:
      kwargs["global_grad_norm"] = global_grad_norm
    if stacked_spec is not None:
      kwargs["stacked_spec"] = stacked_spec
    if self.metadata is not None:
      kwargs["metadata"] = self.metadata
    return self._stage_local_apply(**kwargs)


def make_stage_local_gradient_transformation(
    tx: optax.GradientTransformation | optax.MultiSteps,
    metadata: StageLocalOptimizerMetadata | None = None,
    apply_fn: StageLocalApplyFn | None = None,
) -> StageLocalGradientTransformation:
  """Attaches a stage-local apply path to an Optax transform.

  Args:
    tx: the transform (or ``optax.MultiSteps``); its ``init`` and ``update``
      are kept as they are.
    metadata: describes `tx` for `apply_fn`; when given, `apply_fn` is also
      called with ``metadata=metadata`` (eFormer's convention). Unlike
      eFormer's wrapper, this one does not clip the grads first: `apply_fn`
      gets them as they are and clips itself (the fused step passes the clip
      factor into the kernel).
    apply_fn: the `StageLocalApplyFn`. For ``[MultiSteps of] chain([clip,]
      fused optimizer)`` use ``fused_stage_local_apply(optimizer)`` with
      metadata describing that layout.

  Returns:
    A `StageLocalGradientTransformation`.

  Raises:
    ValueError: `apply_fn` is None.
    TypeError: `apply_fn` or `metadata` of the wrong type.
  """
  if apply_fn is None:
    raise ValueError(
        f"{_OWNER}: make_stage_local_gradient_transformation needs apply_fn (for a "
        "pallasopt optimizer: fused_stage_local_apply(optimizer)); use "
        "make_unsupported_stage_local_gradient_transformation for a transform without one."
    )
  if not callable(apply_fn):
    raise TypeError(f"{_OWNER}: apply_fn must be callable; got {apply_fn!r}.")
  if metadata is not None and not isinstance(metadata, StageLocalOptimizerMetadata):
    raise TypeError(
        f"{_OWNER}: metadata must be a StageLocalOptimizerMetadata; got {type(metadata).__name__}."
    )
  if not isinstance(tx, (optax.GradientTransformationExtraArgs, optax.MultiSteps)):
    tx = optax.with_extra_args_support(tx)
  return StageLocalGradientTransformation(tx.init, tx.update, apply_fn=apply_fn, metadata=metadata)


def make_unsupported_stage_local_gradient_transformation(
    tx: optax.GradientTransformation | optax.MultiSteps,
    *,
    optimizer_type: str,
    reason: str | None = None,
    metadata: StageLocalOptimizerMetadata | None = None,
) -> StageLocalGradientTransformation:
  """`tx` with a stage-local path that explains why it does not exist.

  ``init`` and ``update`` work as usual; `apply_gradients_stage_local`
  raises a ``NotImplementedError`` that names the optimizer and says how to
  give it a stage-local path.

  Args:
    tx: the transform.
    optimizer_type: its registered name, for the message.
    reason: an extra sentence for the message.
    metadata: kept as the transform's ``metadata``.
  """
  detail = f" Reason: {reason}" if reason else ""
  message = (
      f"{_OWNER}: optimizer {optimizer_type!r} has no stage-local apply, so it cannot "
      "update a pipeline stage with apply_gradients_stage_local. Fix: register it with a "
      "builder that returns a pallasopt FusedGradientTransformation (whose "
      "apply_gradients(params, grads, state, *, grad_scale, learning_rate) is the fused "
      "step), or wrap the transform with make_stage_local_gradient_transformation(tx, "
      "metadata, apply_fn). tx.update still works outside the pipeline." + detail
  )

  def apply_fn(**unused_kwargs):
    raise NotImplementedError(message)

  # Read by pipeline.make_train_step, which rejects such a transform when built.
  apply_fn.unsupported_reason = message

  return make_stage_local_gradient_transformation(tx, metadata, apply_fn)
