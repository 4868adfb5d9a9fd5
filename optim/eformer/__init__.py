"""eFormer's optimizer layer on pallasopt's transforms (as ``eformer.optimizers``).

`OptimizerFactory.create` and `SchedulerFactory.create_scheduler` take
eFormer's calls (a name, a `SchedulerConfig`, an optimizer config such as
`AdamWConfig`, and ``weight_decay``, ``clip_grad``,
``gradient_accumulation_steps``, ...) and build eFormer's ``optax.chain``
and state tree around pallasopt's fused transforms (`pallasopt.optim`), with
the stage-local path a pipeline calls on each stage
(``apply_gradients_stage_local``: `fused_stage_local_apply`). The builders
eFormer registers are `pallasopt.optim.eformer.builders`; more register with
`register_optimizer` / `register_scheduler`. eFormer's scheduled weight decay
(`add_scheduled_weight_decay`) is the decay of its chains.
"""

from pallasopt.optim.eformer.configs import (
    AdafactorConfig,
    AdamWConfig,
    KronConfig,
    LionConfig,
    MarsConfig,
    MuonConfig,
    RMSPropConfig,
    SchedulerConfig,
    ScionConfig,
    SerializationMixin,
    SoapConfig,
    WhiteKronConfig,
)
from pallasopt.optim.eformer.factory import (
    OptimizerBuilder,
    OptimizerFactory,
    SchedulerBuilder,
    SchedulerFactory,
    register_optimizer,
    register_scheduler,
)
from pallasopt.optim.eformer.builders import (
    AdafactorOptimizer,
    AdamWOptimizer,
    ConstantSchedulerBuilder,
    CosineSchedulerBuilder,
    KronOptimizer,
    LinearSchedulerBuilder,
    LionOptimizer,
    MarsOptimizer,
    MuonOptimizer,
    QuadOptimizer,
    RMSPropOptimizer,
    SkewOptimizer,
)
from pallasopt.optim.eformer.scheduled_decay import (
    OptaxScheduledWeightDecayState,
    add_scheduled_weight_decay,
    optax_add_scheduled_weight_decay,
)
from pallasopt.optim.eformer.stage_local import (
    StageLocalApplyFn,
    StageLocalGradientTransformation,
    StageLocalOptimizerMetadata,
    make_stage_local_gradient_transformation,
    make_unsupported_stage_local_gradient_transformation,
)
from pallasopt.optim.eformer.stage_local_apply import fused_stage_local_apply, stage_local_grad_norm

__all__ = [
    "OptimizerFactory",
    "SchedulerFactory",
    "OptimizerBuilder",
    "SchedulerBuilder",
    "register_optimizer",
    "register_scheduler",
    "AdamWOptimizer",
    "AdafactorOptimizer",
    "LionOptimizer",
    "RMSPropOptimizer",
    "MuonOptimizer",
    "MarsOptimizer",
    "KronOptimizer",
    "QuadOptimizer",
    "SkewOptimizer",
    "ConstantSchedulerBuilder",
    "LinearSchedulerBuilder",
    "CosineSchedulerBuilder",
    "AdafactorConfig",
    "AdamWConfig",
    "KronConfig",
    "LionConfig",
    "MarsConfig",
    "MuonConfig",
    "RMSPropConfig",
    "WhiteKronConfig",
    "SoapConfig",
    "ScionConfig",
    "SerializationMixin",
    "SchedulerConfig",
    "add_scheduled_weight_decay",
    "optax_add_scheduled_weight_decay",
    "OptaxScheduledWeightDecayState",
    "StageLocalApplyFn",
    "StageLocalGradientTransformation",
    "StageLocalOptimizerMetadata",
    "fused_stage_local_apply",
    "make_stage_local_gradient_transformation",
    "make_unsupported_stage_local_gradient_transformation",
    "stage_local_grad_norm",
]
