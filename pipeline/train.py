"""A pipeline-parallel train step with a stage-local fused optimizer.

`make_train_step` puts the pieces together in one jitted function:

1. forward and backward (`jax.value_and_grad`) through `circular_pipeline`;
   the gradients come out sharded like the params, over the stage axis (and,
   with a data axis, summed over it by the backward pass of the pipeline's
   ``shard_map``);
2. the global gradient norm from the per-stage sums of squares and one
   scalar ``psum`` over the stage axis;
3. inside a second ``shard_map`` (``check_vma=False``, as Pallas kernels
   need), every device calls ``tx.apply_gradients_stage_local`` on its own
   stage's params, gradients and optimizer state, with the global norm for
   clipping and ``stacked_spec=(None, stage_axis)`` (where its slice sits in
   the stacked leaves): the fused kernels update them in place (params and state are
   donated), and no weight or optimizer state crosses a device.

``tx`` is a stage-local transform (`pallasopt.optim.eformer.OptimizerFactory`)
or a plain pallasopt transform, which the step runs as ``optax.chain(tx)``
through `pallasopt.optim.eformer.fused_stage_local_apply`. How its operands
are laid out under FSDP follows from the transform itself (its fused entry
points say whether it is elementwise and which axes it stacks).

The optimizer state is sharded like the params by
`pallasopt.pipeline.sharding.optimizer_state_specs` (moments like their
params, Adafactor's factored statistics with the reduced spec, Kron's factors
on their stage dims, scalars replicated). Stacked leaves are
``[R, S, (lps), ...]``, so the optimizer must be built with
``stacked_axes=schedule.stacked_axes``: Adafactor, Muon and Kron then treat
those dims as batch dims and update each layer's matrix as the unpipelined
model would (Kron draws each layer's probe from the layer's global index), so
a pipelined step equals the unpipelined one. Example (8 fake CPU devices)::

  schedule = CircularSchedule(num_stages=4, num_microbatches=8, num_repeats=2)
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("stage", "data"))
  tx, _ = OptimizerFactory.create("adamw", SchedulerConfig(learning_rate=1e-3),
                                  clip_grad=1.0, stacked_axes=schedule.stacked_axes)
  step = make_train_step(layer, mse, tx, mesh=mesh, schedule=schedule, data_axis="data")
  params = step.shard_params(layers_to_stages(layers, schedule))
  opt_state = step.init(params)
  params, opt_state, metrics = step(params, opt_state, inputs, targets)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from pallasopt.kernels._compat import shard_map
from pallasopt.optim._base import fused_update
from pallasopt.optim.eformer import (
    StageLocalOptimizerMetadata,
    fused_stage_local_apply,
    make_stage_local_gradient_transformation,
    stage_local_grad_norm,
)
from pallasopt.pipeline.circular import StageFn, _check_config, circular_pipeline, io_specs
from pallasopt.pipeline.layout import (
    FSDP_MIN_SIZE,
    STAGE_AXIS,
    check_stacked,
    fsdp_dims,
    stage_shardings,
    stage_specs,
)
from pallasopt.pipeline.schedule import CircularSchedule
from pallasopt.pipeline.sharding import named_shardings, optimizer_state_specs

__all__ = ["PipelineTrainStep", "make_train_step"]

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]

# Optimizers whose update of an element reads only that element's gradient,
# moments and param: with FSDP they update each device's slices in place.
@dataclasses.dataclass(frozen=True)
class PipelineTrainStep:
  """A jitted pipeline train step and the helpers that place its arrays.

  Call it as ``params, opt_state, metrics = step(params, opt_state, inputs,
  targets)``; ``metrics`` holds the scalars ``loss`` and ``grad_norm`` (the
  global norm before clipping). `params` and `opt_state` are donated: their
  old buffers are reused for the new ones. Build it with `make_train_step`.
  """

  stage_fn: StageFn
  loss_fn: LossFn
  tx: Any
  mesh: Mesh
  schedule: CircularSchedule
  stage_axis: str = STAGE_AXIS
  data_axis: str | None = None
  remat: bool = True
  learning_rate_fn: optax.Schedule | None = None
  fsdp_axis: str | None = None
  fsdp_min_size: int = FSDP_MIN_SIZE
  fsdp_regather: bool = True

  def __post_init__(self):
    step = jax.jit(self._step, donate_argnums=(0, 1))
    object.__setattr__(self, "_jitted", step)

  # ---- Placement. ----

  def fsdp_dims(self, params: PyTree) -> PyTree | None:
    """The dim of each leaf that ``fsdp_axis`` splits, or None (see `fsdp_dims`)."""
    if self.fsdp_axis is None:
      return None
    size = self.mesh.shape[self.fsdp_axis]
    return fsdp_dims(params, self.schedule, size, min_size=self.fsdp_min_size)

  def param_specs(self, params: PyTree) -> PyTree:
    """``PartitionSpec(None, stage_axis)`` per stacked leaf, and ``fsdp_axis`` on its split dim."""
    check_stacked(params, self.schedule, "params")
    return stage_specs(params, stage_axis=self.stage_axis, fsdp_axis=self.fsdp_axis,
                       fsdp=self.fsdp_dims(params))

  def state_specs(self, params: PyTree) -> PyTree:
    """The specs of ``tx.init(params)``, derived from the param specs; allocates nothing.

    With ``fsdp_axis`` the state of an elementwise optimizer (AdamW, Lion,
    RMSProp) is split like its params; any other optimizer's state is split
    over the layers instead (`_LayerLayout`): each device holds every
    statistic of ``1/F`` of the stage's layers.
    """
    shapes = jax.eval_shape(self.tx.init, params)
    return optimizer_state_specs(shapes, params, self._update_specs(params), mesh=self.mesh)

  def shard_params(self, params: PyTree) -> PyTree:
    """`params` placed on the mesh, each stage's slice on its devices (split over ``fsdp_axis``)."""
    check_stacked(params, self.schedule, "params")
    return jax.device_put(params, stage_shardings(
        self.mesh, params, stage_axis=self.stage_axis, fsdp_axis=self.fsdp_axis,
        fsdp=self.fsdp_dims(params),
    ))

  def shard_batch(self, *trees: PyTree) -> tuple[PyTree, ...]:
    """Inputs or targets ``[M, microbatch, ...]`` placed as `io_specs` says."""
    spec = io_specs(self.schedule, stage_axis=self.stage_axis, data_axis=self.data_axis,
                    fsdp_axis=self.fsdp_axis)
    sharding = NamedSharding(self.mesh, spec)
    return tuple(jax.device_put(tree, sharding) for tree in trees)

  def init(self, params: PyTree) -> PyTree:
    """``tx.init(params)``, created directly in its sharded layout."""
    shardings = named_shardings(self.mesh, self.state_specs(params))
    return jax.jit(self.tx.init, out_shardings=shardings)(params)

  # ---- The step. ----

  def __call__(self, params: PyTree, opt_state: PyTree, inputs: PyTree, targets: PyTree):
    return self._jitted(params, opt_state, inputs, targets)

  def lower(self, params: PyTree, opt_state: PyTree, inputs: PyTree, targets: PyTree):
    """The step lowered for these arguments (``.compile().as_text()`` is its HLO)."""
    return self._jitted.lower(params, opt_state, inputs, targets)

  def _step(self, params, opt_state, inputs, targets):
    def loss_of(params):
      outputs = circular_pipeline(
          self.stage_fn, params, inputs, mesh=self.mesh, schedule=self.schedule,
          stage_axis=self.stage_axis, data_axis=self.data_axis, remat=self.remat,
          fsdp_axis=self.fsdp_axis, fsdp_min_size=self.fsdp_min_size,
          fsdp_regather=self.fsdp_regather,
      )
      loss = self.loss_fn(outputs, targets)
      if jnp.shape(loss) != ():
        raise ValueError(f"loss_fn must return a scalar, got shape {jnp.shape(loss)}.")
      return loss

    loss, grads = jax.value_and_grad(loss_of)(params)
    param_specs = self.param_specs(params)
    state_specs = optimizer_state_specs(
        opt_state, params, self._update_specs(params), mesh=self.mesh
    )
    local_update = functools.partial(
        self._local_update, self._layer_layout(), self.fsdp_dims(params)
    )
    update = shard_map(
        local_update,
        mesh=self.mesh,
        in_specs=(param_specs, param_specs, state_specs),
        out_specs=(param_specs, state_specs, jax.sharding.PartitionSpec()),
        check_vma=False,  # the optimizer's Pallas kernels run in here
    )
    params, opt_state, grad_norm = update(params, grads, opt_state)
    return params, opt_state, {"loss": loss, "grad_norm": grad_norm}

  # ---- The optimizer's layout. ----

  def _layer_layout(self) -> _LayerLayout | None:
    """How the optimizer sees the params under FSDP: None for its slices in place."""
    if self.fsdp_axis is None:
      return None
    accumulating = getattr(self.tx.metadata, "gradient_accumulation_steps", 1) > 1
    fused = getattr(self.tx, "fused", None)
    if fused is not None and fused.elementwise and not (
        accumulating and self.tx.metadata.clip_grad
    ):
      return None
    return _LayerLayout.choose(self.schedule, self.fsdp_axis, self.mesh.shape[self.fsdp_axis])

  def _update_specs(self, params: PyTree) -> PyTree:
    """The specs of the params as the optimizer updates them (and of its state)."""
    layout = self._layer_layout()
    if layout is None:
      return self.param_specs(params)
    return jax.tree.map(lambda _: layout.spec(self.stage_axis), params)

  def _local_update(self, layout, fsdp, params, grads, opt_state):
    if layout is not None:
      params, grads = (layout.to_layers(tree, fsdp) for tree in (params, grads))
      stacked_spec, norm_axes = layout.stacked_spec(self.stage_axis), (self.stage_axis,
                                                                        layout.axis)
      grad_norm = stage_local_grad_norm(grads, norm_axes)
    else:
      stacked_spec, norm_axes = (None, self.stage_axis), self.stage_axis
      grad_norm = _split_grad_norm(grads, fsdp, self.stage_axis, self.fsdp_axis)
    accumulating = getattr(self.tx.metadata, "gradient_accumulation_steps", 1) > 1
    # With accumulation the clip applies to the averaged gradient, whose norm
    # the stage-local step computes itself (one more scalar psum; every leaf
    # is split over `norm_axes` here).
    norm_args = dict(axis_name=norm_axes) if accumulating else dict(global_grad_norm=grad_norm)
    params, opt_state = self.tx.apply_gradients_stage_local(
        params=params, grads=grads, opt_state=opt_state,
        learning_rate_fn=self.learning_rate_fn, stacked_spec=stacked_spec, **norm_args,
    )
    if layout is not None:
      params = layout.from_layers(params, fsdp)
    return params, opt_state, grad_norm


def _split_grad_norm(grads: PyTree, fsdp: PyTree | None, stage_axis: str,
                     fsdp_axis: str | None) -> jax.Array:
  """The global norm of gradients split over the stages, some leaves also over `fsdp_axis`.

  Every leaf is split over the stage axis and replicated over the others,
  except the leaves `fsdp` gives a dim, split over `fsdp_axis` too: each
  group's psum counts each element once.
  """
  if fsdp is None:
    return stage_local_grad_norm(grads, stage_axis)
  leaves, treedef = jax.tree.flatten(grads)
  dims = treedef.flatten_up_to(fsdp)
  split = [g for g, dim in zip(leaves, dims) if dim is not None]
  whole = [g for g, dim in zip(leaves, dims) if dim is None]
  squares = [stage_local_grad_norm(split, (stage_axis, fsdp_axis)),
             stage_local_grad_norm(whole, stage_axis)]
  return jnp.sqrt(sum(jnp.square(n) for n in squares))


@dataclasses.dataclass(frozen=True)
class _LayerLayout:
  """An optimizer's view of FSDP-split params: whole layers, ``1/F`` of them per device.

  An optimizer that is not elementwise (Adafactor's factored statistics,
  Muon's Newton-Schulz, Kron's preconditioners) needs each layer's matrices
  whole. Each device of the FSDP axis takes every slice of ``1/F`` of the
  stage's layers (one all-to-all of the gradients), updates them with their
  state, and returns the slices (one all-to-all of the params): the state
  stays split ``1/F`` per device, and Muon's Newton–Schulz is split over the
  axis's devices, one ``F``-th of the layers each. The layers split over
  the repeats dim (``R % F == 0``), else over the layers-per-stage dim.
  """

  axis: str
  dim: int  # the stacked dim split over `axis`: 0 (repeats) or 2 (layers per stage)

  @classmethod
  def choose(cls, schedule: CircularSchedule, axis: str, size: int) -> _LayerLayout:
    if schedule.num_repeats % size == 0:
      return cls(axis, 0)
    if schedule.stacked_axes == 3 and schedule.layers_per_stage % size == 0:
      return cls(axis, 2)
    raise ValueError(
        f"fsdp_axis {axis!r} has {size} devices; an optimizer that is not elementwise updates"
        f" whole layers, {schedule.num_layers // schedule.num_stages} per stage split over them,"
        f" which needs num_repeats={schedule.num_repeats} or layers_per_stage="
        f"{schedule.layers_per_stage} divisible by {size}."
    )

  def stacked_spec(self, stage_axis: str) -> tuple[str | None, ...]:
    return (self.axis, stage_axis) if self.dim == 0 else (None, stage_axis, self.axis)

  def spec(self, stage_axis: str) -> jax.sharding.PartitionSpec:
    return jax.sharding.PartitionSpec(*self.stacked_spec(stage_axis))

  def to_layers(self, tree: PyTree, fsdp: PyTree) -> PyTree:
    def move(x, dim):
      if dim is None:
        count = x.shape[self.dim] // jax.lax.axis_size(self.axis)
        start = jax.lax.axis_index(self.axis) * count
        return jax.lax.dynamic_slice_in_dim(x, start, count, self.dim)
      return jax.lax.all_to_all(x, self.axis, self.dim, dim, tiled=True)

    return jax.tree.map(move, tree, fsdp)

  def from_layers(self, tree: PyTree, fsdp: PyTree) -> PyTree:
    def move(x, dim):
      if dim is None:
        return jax.lax.all_gather(x, self.axis, axis=self.dim, tiled=True)
      return jax.lax.all_to_all(x, self.axis, dim, self.dim, tiled=True)

    return jax.tree.map(move, tree, fsdp)


def make_train_step(
    stage_fn: StageFn,
    loss_fn: LossFn,
    tx: Any,
    *,
    mesh: Mesh,
    schedule: CircularSchedule,
    stage_axis: str = STAGE_AXIS,
    data_axis: str | None = None,
    remat: bool = True,
    learning_rate_fn: optax.Schedule | None = None,
    fsdp_axis: str | None = None,
    fsdp_min_size: int = FSDP_MIN_SIZE,
    fsdp_regather: bool = True,
) -> PipelineTrainStep:
  """A train step for stage-stacked params: pipelined forward/backward, stage-local update.

  Args:
    stage_fn: ``stage_fn(stage_params, x) -> x``, as for `circular_pipeline`.
    loss_fn: ``loss_fn(outputs, targets) -> scalar``; ``outputs`` and
      ``targets`` are ``[M, microbatch, ...]``. With streamed io they stay
      sharded over the stages, so a loss that reduces them (a mean) costs one
      scalar all-reduce and never gathers them.
    tx: a pallasopt transform (``pallasopt.optim.adamw(...)``, ...; its
      state is then ``optax.chain(tx)``'s, a 1-tuple) or a stage-local
      transform (`pallasopt.optim.eformer.OptimizerFactory.create`). One with
      per-layer math (Adafactor, Muon, Kron) must be built with
      ``stacked_axes=schedule.stacked_axes``.
    mesh: the device mesh, with `stage_axis` (and `data_axis`).
    schedule: the `CircularSchedule`.
    stage_axis: the mesh axis of the stages.
    data_axis: a mesh axis for data parallelism inside a stage (gradients
      are summed over it; the optimizer stays local to each device), or None.
    remat: see `circular_pipeline`.
    learning_rate_fn: overrides the optimizer's schedule, evaluated at its
      step count (see ``apply_gradients_stage_local``).
    fsdp_axis: a mesh axis over which each stage's params, gradients and
      optimizer state are split as well (FSDP inside the stage; it also
      splits the microbatches, and may be `data_axis` itself, ZeRO-3), or
      None. Every device then holds ``1/(S F)`` of the stacked tree, apart
      from leaves whose layer slice has fewer than `fsdp_min_size` elements,
      which stay whole. The forward and backward passes gather a repeat's
      weights in a sliding window (see `circular_pipeline`); gradients are
      reduce-scattered. AdamW, Lion and RMSProp update each device's slices
      in place; other optimizers update ``1/F`` of the stage's layers whole
      on each device (`state_specs`), so Muon's Newton–Schulz is split over
      the axis.
    fsdp_min_size: see `fsdp_dims`.
    fsdp_regather: see `circular_pipeline`.

  Returns:
    A `PipelineTrainStep`.

  Raises:
    TypeError: `tx` is neither a pallasopt transform nor has
      ``apply_gradients_stage_local``; bad mesh or schedule types.
    NotImplementedError: `tx` was built without a stage-local path
      (`make_unsupported_stage_local_gradient_transformation`).
    ValueError: `tx` built for other stacked axes than the schedule's; mesh
      axes missing or of the wrong size; Muon's ``distributed_axes`` naming
      `fsdp_axis` (its devices hold different layers already).
  """
  _check_config(mesh, schedule, stage_axis, data_axis, fsdp_axis)
  if not callable(getattr(tx, "apply_gradients_stage_local", None)):
    tx = _stage_local(tx, schedule)
  unsupported = getattr(tx.apply_gradients_stage_local, "unsupported_reason", None)
  if unsupported:
    raise NotImplementedError(unsupported)
  metadata = getattr(tx, "metadata", None)
  fused = getattr(tx, "fused", None)
  stacked_axes = getattr(metadata, "stacked_axes", schedule.stacked_axes)
  if fused is not None and fused.stacked_axes is not None:
    stacked_axes = fused.stacked_axes
  if stacked_axes != schedule.stacked_axes:
    raise ValueError(
        f"tx was built with stacked_axes={stacked_axes}, but the pipeline's params are stacked"
        f" {schedule.stacked_shape} (stacked_axes={schedule.stacked_axes}); build it with"
        f" stacked_axes={schedule.stacked_axes} (or OptimizerFactory.create(...,"
        f" stacked_axes={schedule.stacked_axes})) so that the optimizer treats the stacked dims"
        " as batch dims."
    )
  distributed = () if fused is None else fused.collective_axes
  if fsdp_axis is not None and fsdp_axis in distributed:
    raise ValueError(
        f"the optimizer's distributed_axes={distributed} names fsdp_axis {fsdp_axis!r}:"
        " under FSDP each of its devices updates its own layers, so Newton-Schulz is split"
        " over it already; name only other (data-parallel) axes there."
    )
  return PipelineTrainStep(
      stage_fn, loss_fn, tx, mesh, schedule, stage_axis, data_axis, remat, learning_rate_fn,
      fsdp_axis, fsdp_min_size, fsdp_regather,
  )


def _stage_local(tx: Any, schedule: CircularSchedule) -> Any:
  """A plain pallasopt transform as the stage-local step runs it: ``optax.chain(tx)``.

  The chain of one link is the layout `fused_stage_local_apply` reads (no
  clip, no decay link, no accumulation); its state is ``(tx's state,)``.
  """
  fused = fused_update(tx)
  if fused is None:
    raise TypeError(
        "tx must be a pallasopt transform (pallasopt.optim.adamw(...), ...: its fused"
        " apply_gradients updates each stage in place) or a stage-local transform with"
        " apply_gradients_stage_local (pallasopt.optim.eformer.OptimizerFactory.create); got"
        f" {type(tx).__name__}. An optax.chain is neither: clip inside the fused step with"
        " OptimizerFactory.create(..., clip_grad=...)."
    )
  metadata = StageLocalOptimizerMetadata(
      scheduler=fused.learning_rate, stacked_axes=schedule.stacked_axes
  )
  return make_stage_local_gradient_transformation(
      optax.chain(tx), metadata, fused_stage_local_apply(tx)
  )

