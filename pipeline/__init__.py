"""Pipeline-parallel training built on `pallasopt.optim`.

* `CircularSchedule`: the arithmetic of a circular pipeline schedule.
* `layers_to_stages` / `stages_to_layers` and friends: ``[L, ...]`` per-layer
  params to and from the stage-stacked ``[R, S, (lps), ...]`` layout.
* `circular_pipeline`: the forward pass under ``shard_map``; `jax.grad`
  differentiates through it.
* `make_train_step`: forward, backward and a stage-local fused optimizer step
  on every stage, in one jitted step; with ``fsdp_axis`` each stage's params,
  gradients and optimizer state are also split over that axis (`fsdp_dims`).
* `pallasopt.pipeline.sharding`: partition specs for params and optimizer
  state, memory estimates, `barrier_sync`.
"""

from pallasopt.pipeline.circular import circular_pipeline, io_specs, scan_layers
from pallasopt.pipeline.layout import (
    check_stacked,
    fsdp_dims,
    layers_to_stages,
    stack_layers,
    stage_shardings,
    stage_specs,
    stages_to_layers,
    unstack_layers,
)
from pallasopt.pipeline.schedule import CircularSchedule
from pallasopt.pipeline.sharding import (
    AutoShardingRule,
    CompositeShardingRule,
    FactorInfo,
    FactorRule,
    MemoryConstrainedShardingRule,
    MemoryEstimate,
    ShapeBasedShardingRule,
    ShardingAnalyzer,
    ShardingRule,
    barrier_sync,
    named_shardings,
    optimizer_state_specs,
    replicate_factors,
    shard_factors_like_params,
)
from pallasopt.pipeline import sharding
from pallasopt.pipeline.train import PipelineTrainStep, make_train_step

__all__ = [
    "CircularSchedule",
    "circular_pipeline",
    "io_specs",
    "scan_layers",
    "check_stacked",
    "fsdp_dims",
    "layers_to_stages",
    "stack_layers",
    "stage_shardings",
    "stage_specs",
    "stages_to_layers",
    "unstack_layers",
    "PipelineTrainStep",
    "make_train_step",
    *sharding.__all__,
]
