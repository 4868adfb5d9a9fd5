"""Pipeline-parallel training built on `pallasopt.optim`."""

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
