"""The built-in builders eFormer registers: its schedulers, and its optimizers on pallasopt's transforms.

Importing `pallasopt.optim.eformer` registers them (`register_optimizer`,
`register_scheduler`) under eFormer's names.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import optax

from pallasopt.optim.eformer.configs import (
    AdafactorConfig,
    AdamWConfig,
    KronConfig,
    LionConfig,
    MarsConfig,
    MuonConfig,
    RMSPropConfig,
    SchedulerConfig,
    WhiteKronConfig,
)
from pallasopt.optim.eformer.factory import (
    OptimizerBuilder,
    SchedulerBuilder,
    register_optimizer,
    register_scheduler,
)

__all__ = [
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
]

# ---- Built-in schedulers (eFormer's definitions). ----

_WARMUP_START = 1e-8


@register_scheduler("constant")
@dataclasses.dataclass
class ConstantSchedulerBuilder(SchedulerBuilder):
  """``learning_rate`` throughout."""

  config: SchedulerConfig

  def build(self) -> optax.Schedule:
    return optax.constant_schedule(self.config.learning_rate)


@register_scheduler("linear")
@dataclasses.dataclass
class LinearSchedulerBuilder(SchedulerBuilder):
  """From ``learning_rate`` to ``learning_rate_end`` over ``steps - warmup_steps``
  steps, after a linear warmup from 1e-8 when ``warmup_steps`` is set."""

  config: SchedulerConfig

  def build(self) -> optax.Schedule:
    config = self.config
    if config.learning_rate_end is None:
      raise ValueError("pallasopt.optim: the 'linear' scheduler needs learning_rate_end.")
    warmup = config.warmup_steps or 0
    decay = optax.linear_schedule(config.learning_rate, config.learning_rate_end, config.steps - warmup)
    if not warmup:
      return decay
    ramp = optax.linear_schedule(_WARMUP_START, config.learning_rate, warmup)
    return optax.join_schedules([ramp, decay], [warmup])


@register_scheduler("cosine")
@dataclasses.dataclass
class CosineSchedulerBuilder(SchedulerBuilder):
  """With warmup, ``optax.warmup_cosine_decay_schedule`` from 1e-8 to
  ``learning_rate`` and down to ``learning_rate_end`` (0 if unset) by ``steps``;
  without, ``optax.cosine_decay_schedule`` with ``alpha = learning_rate_end /
  learning_rate`` (``exponent`` is used only with warmup, as in eFormer; a
  warning says so when it is not 1)."""

  config: SchedulerConfig

  def build(self) -> optax.Schedule:
    config = self.config
    if config.warmup_steps:
      return optax.warmup_cosine_decay_schedule(
          init_value=_WARMUP_START, peak_value=config.learning_rate,
          warmup_steps=config.warmup_steps, decay_steps=config.steps,
          end_value=config.learning_rate_end or 0.0, exponent=config.exponent,
      )
    if config.learning_rate_end is None:
      alpha = 0.0
    elif config.learning_rate <= 0:
      raise ValueError(
          "pallasopt.optim: the 'cosine' scheduler needs learning_rate > 0 with learning_rate_end."
      )
    else:
      alpha = config.learning_rate_end / config.learning_rate
    if config.exponent != 1.0:
      warnings.warn(
          f"pallasopt.optim: the 'cosine' scheduler without warmup_steps ignores exponent="
          f"{config.exponent} (eFormer's schedule); set warmup_steps to use it.",
          stacklevel=3,
      )
    return optax.cosine_decay_schedule(config.learning_rate, config.steps, alpha)


# ---- Built-in optimizers: eFormer's builders, on pallasopt's transforms. ----
# Each imports its module when built, so importing the factory stays cheap.


def _optimizer(module: str, name: str | None = None):
  import importlib  # noqa: PLC0415 (deferred on purpose)

  return getattr(importlib.import_module(f"pallasopt.optim.{module}"), name or module)


def _build_with_every_field(
    builder: OptimizerBuilder, scheduler: optax.Schedule, module: str, name: str | None = None,
    *, skip_none: bool = False,
) -> optax.GradientTransformation:
  """``pallasopt.optim.<module>.<name>(scheduler, **config fields, stacked_axes, impl)``
  for a builder whose config fields are all keywords of its optimizer (with
  ``skip_none``, fields left at None are not passed)."""
  fields = {f.name: getattr(builder.config, f.name) for f in dataclasses.fields(builder.config)}
  if skip_none:
    fields = {k: value for k, value in fields.items() if value is not None}
  return _optimizer(module, name)(
      scheduler, **fields, stacked_axes=builder.stacked_axes, impl=builder.impl
  )


def _low_bit(config: Any, *names: str) -> dict[str, Any]:
  """pallasopt's extra config fields, passed on by name."""
  return {name: getattr(config, name) for name in names}


@register_optimizer("adamw")
@dataclasses.dataclass
class AdamWOptimizer(OptimizerBuilder):
  """`pallasopt.optim.adamw` with eFormer's arguments: no decay of its own
  (the factory's ``weight_decay`` is the decay link)."""

  config: AdamWConfig

  def build(self, scheduler: optax.Schedule) -> optax.GradientTransformation:
    c = self.config
    return _optimizer("adamw")(
        scheduler, b1=c.b1, b2=c.b2, eps=c.eps, eps_root=c.eps_root, mu_dtype=c.mu_dtype,
        weight_decay=0.0, nesterov=c.nesterov, impl=self.impl,
        **_low_bit(c, "state_format", "param_rounding", "seed"),
    )


@register_optimizer("adafactor")
@dataclasses.dataclass
class AdafactorOptimizer(OptimizerBuilder):
  """`pallasopt.optim.adafactor` with every config field (its own decay is
  ``weight_decay_rate``, not scaled by the learning rate, as in Optax)."""

  config: AdafactorConfig

  def build(self, scheduler: optax.Schedule) -> optax.GradientTransformation:
    return _build_with_every_field(self, scheduler, "adafactor")


@register_optimizer("lion")
@dataclasses.dataclass
class LionOptimizer(OptimizerBuilder):
  """`pallasopt.optim.lion` with its own ``weight_decay`` from the config
  (1e-3 by default: eFormer leaves ``optax.lion``'s default in place)."""

  config: LionConfig

  def build(self, scheduler: optax.Schedule) -> optax.GradientTransformation:
    c = self.config
    return _optimizer("lion")(
        scheduler, b1=c.b1, b2=c.b2, mu_dtype=c.mu_dtype, weight_decay=c.weight_decay,
        impl=self.impl, **_low_bit(c, "state_format", "param_rounding", "seed"),
    )


@register_optimizer("rmsprop")
@dataclasses.dataclass
class RMSPropOptimizer(OptimizerBuilder):
  """`pallasopt.optim.rmsprop` as eFormer builds ``optax.rmsprop`` (``centered``
  is eFormer's False unless the config sets it)."""

  config: RMSPropConfig

  def build(self, scheduler: optax.Schedule) -> optax.GradientTransformation:
    c = self.config
    return _optimizer("rmsprop")(
        scheduler, decay=c.decay, eps=c.eps, initial_scale=c.initial_scale,
        centered=c.centered, momentum=c.momentum, nesterov=c.nesterov, impl=self.impl,
        **_low_bit(c, "state_format", "param_rounding", "seed"),
    )


@register_optimizer("muon")
@dataclasses.dataclass
class MuonOptimizer(OptimizerBuilder):
  """`pallasopt.optim.muon` with every config field (eFormer's builder drops
  ``adam_weight_decay``; ours passes it, default 0 as Optax's)."""

  config: MuonConfig

  def build(self, scheduler: optax.Schedule) -> optax.GradientTransformation:
    return _build_with_every_field(self, scheduler, "muon")


@register_optimizer("mars")
@dataclasses.dataclass
class MarsOptimizer(OptimizerBuilder):
  """`pallasopt.optim.mars` from eFormer's field names (its ``weight_decay``
  field is not read, as in eFormer)."""

  config: MarsConfig

  def build(self, scheduler: optax.Schedule) -> optax.GradientTransformation:
    c = self.config
    return _optimizer("mars")(
        scheduler, b1=c.beta1, b2=c.beta2, gamma=c.gamma, eps=c.epsilon,
        max_grad_norm=c.max_grad_norm, impl=self.impl,
        **_low_bit(c, "state_format", "param_rounding", "seed"),
    )


@register_optimizer("kron")
@dataclasses.dataclass
class KronOptimizer(OptimizerBuilder):
  """`pallasopt.optim.kron` (psgd_jax's PSGD Kron; pallasopt's, not eFormer's):
  fields left at None keep psgd_jax's defaults."""

  config: KronConfig

  def build(self, scheduler: optax.Schedule) -> optax.GradientTransformation:
    return _build_with_every_field(self, scheduler, "kron", skip_none=True)



@register_optimizer("quad")
@dataclasses.dataclass
class QuadOptimizer(OptimizerBuilder):
  """`pallasopt.optim.white_kron.quad` (eFormer's White-Kron, QUAD factor steps)
  with every config field, its own ``weight_decay`` included."""

  config: WhiteKronConfig

  def build(self, scheduler: optax.Schedule) -> optax.GradientTransformation:
    return _build_with_every_field(self, scheduler, "white_kron", "quad")


@register_optimizer("skew")
@dataclasses.dataclass
class SkewOptimizer(OptimizerBuilder):
  """`pallasopt.optim.white_kron.skew` (eFormer's White-Kron, skew factor steps)
  with every config field, its own ``weight_decay`` included."""

  config: WhiteKronConfig

  def build(self, scheduler: optax.Schedule) -> optax.GradientTransformation:
    return _build_with_every_field(self, scheduler, "white_kron", "skew")
