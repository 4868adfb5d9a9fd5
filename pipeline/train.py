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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from pallasopt.kernels._compat import shard_map
from pallasopt.optim.eformer import stage_local_grad_norm
from pallasopt.pipeline.circular import StageFn, _check_config, circular_pipeline, io_specs
from pallasopt.pipeline.layout import STAGE_AXIS, check_stacked, stage_shardings, stage_specs
from pallasopt.pipeline.schedule import CircularSchedule
from pallasopt.pipeline.sharding import named_shardings, optimizer_state_specs

__all__ = ["PipelineTrainStep", "make_train_step"]

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]


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

  def __post_init__(self):
    step = jax.jit(self._step, donate_argnums=(0, 1))
    object.__setattr__(self, "_jitted", step)

  # ---- Placement. ----

  def param_specs(self, params: PyTree) -> PyTree:
    """``PartitionSpec(None, stage_axis)`` for every stacked leaf."""
    check_stacked(params, self.schedule, "params")
    return stage_specs(params, stage_axis=self.stage_axis)

  def state_specs(self, params: PyTree) -> PyTree:
    """The specs of ``tx.init(params)``, derived from the param specs; allocates nothing."""
    shapes = jax.eval_shape(self.tx.init, params)
    return optimizer_state_specs(shapes, params, self.param_specs(params), mesh=self.mesh)

  def shard_params(self, params: PyTree) -> PyTree:
    """`params` placed on the mesh, each stage's slice on its devices."""
    check_stacked(params, self.schedule, "params")
    return jax.device_put(params, stage_shardings(self.mesh, params, stage_axis=self.stage_axis))

  def shard_batch(self, *trees: PyTree) -> tuple[PyTree, ...]:
    """Inputs or targets ``[M, microbatch, ...]`` placed as `io_specs` says."""
    spec = io_specs(self.schedule, stage_axis=self.stage_axis, data_axis=self.data_axis)
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
      )
      loss = self.loss_fn(outputs, targets)
      if jnp.shape(loss) != ():
        raise ValueError(f"loss_fn must return a scalar, got shape {jnp.shape(loss)}.")
      return loss

    loss, grads = jax.value_and_grad(loss_of)(params)
    param_specs = self.param_specs(params)
    state_specs = optimizer_state_specs(opt_state, params, param_specs, mesh=self.mesh)
    update = shard_map(
        self._local_update,
        mesh=self.mesh,
        in_specs=(param_specs, param_specs, state_specs),
        out_specs=(param_specs, state_specs, jax.sharding.PartitionSpec()),
        check_vma=False,  # the optimizer's Pallas kernels run in here
    )
    params, opt_state, grad_norm = update(params, grads, opt_state)
    return params, opt_state, {"loss": loss, "grad_norm": grad_norm}

  def _local_update(self, params, grads, opt_state):
    # Every leaf is sharded over the stage axis and replicated over the
    # others, so the stage axis alone sums each element's square once.
    grad_norm = stage_local_grad_norm(grads, self.stage_axis)
    accumulating = getattr(self.tx.metadata, "gradient_accumulation_steps", 1) > 1
    # With accumulation the clip applies to the averaged gradient, whose norm
    # the stage-local step computes itself (one more scalar psum).
    norm_args = (
        dict(axis_name=self.stage_axis) if accumulating else dict(global_grad_norm=grad_norm)
    )
    params, opt_state = self.tx.apply_gradients_stage_local(
        params=params, grads=grads, opt_state=opt_state,
        learning_rate_fn=self.learning_rate_fn, stacked_spec=(None, self.stage_axis),
        **norm_args,
    )
    return params, opt_state, grad_norm


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
) -> PipelineTrainStep:
  """A train step for stage-stacked params: pipelined forward/backward, stage-local update.

  Args:
    stage_fn: ``stage_fn(stage_params, x) -> x``, as for `circular_pipeline`.
    loss_fn: ``loss_fn(outputs, targets) -> scalar``; ``outputs`` and
      ``targets`` are ``[M, microbatch, ...]``. With streamed io they stay
      sharded over the stages, so a loss that reduces them (a mean) costs one
      scalar all-reduce and never gathers them.
    tx: a stage-local transform (`pallasopt.optim.eformer.OptimizerFactory.create`)
      built with ``stacked_axes=schedule.stacked_axes``.
    mesh: the device mesh, with `stage_axis` (and `data_axis`).
    schedule: the `CircularSchedule`.
    stage_axis: the mesh axis of the stages.
    data_axis: a mesh axis for data parallelism inside a stage (gradients
      are summed over it; the optimizer stays local to each device), or None.
    remat: see `circular_pipeline`.
    learning_rate_fn: overrides the optimizer's schedule, evaluated at its
      step count (see ``apply_gradients_stage_local``).

  Returns:
    A `PipelineTrainStep`.

  Raises:
    TypeError: `tx` has no ``apply_gradients_stage_local``; bad mesh or
      schedule types.
    NotImplementedError: `tx` was built without a stage-local path
      (`make_unsupported_stage_local_gradient_transformation`).
    ValueError: ``tx.metadata.stacked_axes != schedule.stacked_axes``; mesh
      axes missing or of the wrong size.
  """
  _check_config(mesh, schedule, stage_axis, data_axis)
  if not callable(getattr(tx, "apply_gradients_stage_local", None)):
    raise TypeError(
        "tx must be a stage-local transform with apply_gradients_stage_local (build it with"
        f" pallasopt.optim.eformer.OptimizerFactory.create), got {type(tx).__name__}."
    )
  unsupported = getattr(tx.apply_gradients_stage_local, "unsupported_reason", None)
  if unsupported:
    raise NotImplementedError(unsupported)
  metadata = getattr(tx, "metadata", None)
  stacked_axes = getattr(metadata, "stacked_axes", schedule.stacked_axes)
  if stacked_axes != schedule.stacked_axes:
    raise ValueError(
        f"tx was built with stacked_axes={stacked_axes}, but the pipeline's params are stacked"
        f" {schedule.stacked_shape} (stacked_axes={schedule.stacked_axes}); build it with"
        f" OptimizerFactory.create(..., stacked_axes={schedule.stacked_axes}) so that the optimizer"
        " treats the stacked dims as batch dims."
    )
  return PipelineTrainStep(
      stage_fn, loss_fn, tx, mesh, schedule, stage_axis, data_axis, remat, learning_rate_fn
  )
