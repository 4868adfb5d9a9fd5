"""Partition specs for params and optimizer state, and per-device memory.

Four rules turn a pytree of arrays (or `jax.ShapeDtypeStruct`s) into a pytree
of `PartitionSpec`s: `AutoShardingRule`, `ShapeBasedShardingRule`,
`MemoryConstrainedShardingRule` and `CompositeShardingRule`; subclass
`ShardingRule` for more. `optimizer_state_specs` derives the specs of every
optimizer state leaf from the param specs, `ShardingAnalyzer` validates specs
against a mesh and counts bytes, and `barrier_sync` lines up the processes of a
multi-process run::

  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  param_specs = AutoShardingRule(mesh).apply(params)
  state_shapes = jax.eval_shape(tx.init, params)  # allocates nothing
  state_specs = optimizer_state_specs(state_shapes, params, param_specs, mesh=mesh)
  analyzer = ShardingAnalyzer(mesh)
  print(analyzer.estimate_memory(params, param_specs, state_shapes, state_specs))
  opt_state = jax.jit(tx.init, out_shardings=named_shardings(mesh, state_specs))(params)

Every spec a rule or `optimizer_state_specs` returns is trimmed of trailing
`None`s, so a replicated leaf always gets ``PartitionSpec()``.
"""

from pallasopt.pipeline.sharding._common import named_shardings
from pallasopt.pipeline.sharding.analysis import MemoryEstimate, ShardingAnalyzer, barrier_sync
from pallasopt.pipeline.sharding.rules import (
    AutoShardingRule,
    CompositeShardingRule,
    MemoryConstrainedShardingRule,
    ShapeBasedShardingRule,
    ShardingRule,
)
from pallasopt.pipeline.sharding.state_specs import (
    FactorInfo,
    FactorRule,
    optimizer_state_specs,
    replicate_factors,
    shard_factors_like_params,
)

__all__ = [
    "AutoShardingRule",
    "CompositeShardingRule",
    "FactorInfo",
    "FactorRule",
    "MemoryConstrainedShardingRule",
    "MemoryEstimate",
    "ShapeBasedShardingRule",
    "ShardingAnalyzer",
    "ShardingRule",
    "barrier_sync",
    "named_shardings",
    "optimizer_state_specs",
    "replicate_factors",
    "shard_factors_like_params",
]
