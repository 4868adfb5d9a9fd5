"""eFormer's optimizer factory, builders and registries, on pallasopt's fused optimizers.

The calls are ``eformer.optimizers``' (0.0.101)::

  tx, schedule = OptimizerFactory.create(
      "adamw", SchedulerConfig("cosine", 3e-4, warmup_steps=100, steps=10_000),
      AdamWConfig(b2=0.95), weight_decay=0.1, clip_grad=1.0)

builds eFormer's layout, state tree included::

  [MultiSteps(k) of] chain([clip_by_global_norm(clip_grad),]
                           builder.build(schedule),
                           [add_scheduled_weight_decay(-schedule(t) * weight_decay, mask)])

where ``builder`` is the `OptimizerBuilder` registered under the name, here
returning pallasopt's fused transform with eFormer's arguments. ``update`` is
the plain Optax path; ``tx.apply_gradients_stage_local`` (from
``builder.build_mpmd``) computes the same step with the fused kernels.
pallasopt adds keyword-only ``stacked_axes`` and ``impl`` (given to every
builder).

A new optimizer is a dataclass builder registered by name::

  @register_optimizer("sgd")
  @dataclasses.dataclass
  class SGDOptimizer(OptimizerBuilder):
    config: SGDConfig

    def build(self, scheduler):
      return optax.sgd(scheduler, momentum=self.config.momentum)
"""

from __future__ import annotations

import abc
import dataclasses
import difflib
import math
import typing
import warnings
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import optax

from pallasopt.kernels._dispatch import resolve_impl
from pallasopt.optim import _validation as v
from pallasopt.optim._base import fused_update
from pallasopt.optim._types import MaskOrFn
from pallasopt.optim.eformer.configs import SchedulerConfig, SerializationMixin
from pallasopt.optim.eformer.scheduled_decay import add_scheduled_weight_decay
from pallasopt.optim.eformer.stage_local import (
    StageLocalOptimizerMetadata,
    make_stage_local_gradient_transformation,
    make_unsupported_stage_local_gradient_transformation,
)
from pallasopt.optim.eformer.stage_local_apply import fused_stage_local_apply

__all__ = [
    "OptimizerBuilder",
    "SchedulerBuilder",
    "register_optimizer",
    "register_scheduler",
    "OptimizerFactory",
    "SchedulerFactory",
]

_OWNER = "pallasopt.optim.eformer.OptimizerFactory"

# The factory-level options build_mpmd receives as keywords (eFormer's).
_TX_KWARGS = ("weight_decay", "weight_decay_mask", "gradient_accumulation_steps", "clip_grad")


# ---- Builders and registries. ----


@dataclasses.dataclass
class OptimizerBuilder(abc.ABC):
  """Builds one optimizer from its config (eFormer's ``OptimizerBuilder``).

  Subclasses are dataclasses whose ``config`` field is annotated with the
  config class (`OptimizerFactory` reads the annotation to know which config
  the name takes) and that implement `build`.

  Attributes:
    config: the optimizer's config.
    stacked_axes: leading stacked-layer axes of every leaf (pallasopt's;
      keyword-only), for optimizers that are not elementwise.
    impl: kernel implementation (pallasopt's; keyword-only), see
      `pallasopt.kernels.use_impl`.
  """

  config: Any
  stacked_axes: int = dataclasses.field(default=0, kw_only=True)
  impl: str = dataclasses.field(default="auto", kw_only=True)

  @abc.abstractmethod
  def build(self, scheduler: optax.Schedule) -> optax.GradientTransformation:
    """The optimizer transform, with `scheduler` as its learning rate."""

  def build_mpmd(
      self,
      scheduler: optax.Schedule,
      *,
      optimizer: optax.GradientTransformation,
      **tx_kwargs: Any,
  ) -> optax.GradientTransformation:
    """`optimizer` (the factory's whole chain) with a stage-local apply path.

    When `build` returns a `pallasopt.optim.FusedGradientTransformation`, the
    path runs its fused ``apply_gradients`` (`fused_stage_local_apply`), with
    the chain's clip, scheduled decay and accumulation described by the
    metadata built from `tx_kwargs`. Override it for another path.

    Args:
      scheduler: the learning-rate schedule.
      optimizer: the chain `OptimizerFactory.create` assembled.
      **tx_kwargs: the factory's ``weight_decay``, ``weight_decay_mask``,
        ``gradient_accumulation_steps`` and ``clip_grad``; other keys are
        kept in the metadata's ``extra_kwargs``.

    Raises:
      NotImplementedError: `build` does not return a fused transform (the
        factory then installs a stage-local path that explains this).
    """
    base = self.build(scheduler)
    if fused_update(base) is None:
      raise NotImplementedError(
          f"{type(self).__name__}.build returned a {type(base).__name__}, which has no fused "
          "apply_gradients; return a pallasopt FusedGradientTransformation or override "
          "build_mpmd."
      )
    config = self.config
    metadata = StageLocalOptimizerMetadata(
        scheduler=scheduler,
        weight_decay=tx_kwargs.get("weight_decay", 0.0),
        weight_decay_mask=tx_kwargs.get("weight_decay_mask"),
        gradient_accumulation_steps=tx_kwargs.get("gradient_accumulation_steps", 1),
        clip_grad=tx_kwargs.get("clip_grad"),
        # eFormer fills these from any config that has the fields.
        adamw_b1=getattr(config, "b1", None),
        adamw_b2=getattr(config, "b2", None),
        adamw_eps=getattr(config, "eps", None),
        adamw_eps_root=getattr(config, "eps_root", None),
        adamw_mu_dtype=getattr(config, "mu_dtype", None),
        optimizer_config=config,
        extra_kwargs={k: value for k, value in tx_kwargs.items() if k not in _TX_KWARGS},
        stacked_axes=self.stacked_axes,
    )
    return make_stage_local_gradient_transformation(
        optimizer, metadata, fused_stage_local_apply(base)
    )

  def validate(self) -> None:
    """Checks the config before `build`; the built-in optimizers check theirs
    when built, so this does nothing unless overridden."""


@dataclasses.dataclass
class SchedulerBuilder(abc.ABC):
  """Builds a learning-rate schedule from a `SchedulerConfig` (eFormer's).

  Attributes:
    config: the schedule's config.
  """

  config: SchedulerConfig

  @abc.abstractmethod
  def build(self) -> optax.Schedule:
    """The schedule."""


_OPTIMIZER_BUILDERS: dict[str, type[OptimizerBuilder]] = {}
_SCHEDULER_BUILDERS: dict[str, type[SchedulerBuilder]] = {}


def _registrar(kind: str, registry_name: str, base: type) -> Callable[[str], Callable]:
  def register(name: str) -> Callable[[type], type]:
    if not isinstance(name, str) or not name:
      raise TypeError(f"pallasopt.optim.register_{kind}: name must be a non-empty str; got {name!r}.")

    def decorator(cls: type) -> type:
      if not (isinstance(cls, type) and issubclass(cls, base) and dataclasses.is_dataclass(cls)):
        raise TypeError(
            f"pallasopt.optim.register_{kind}({name!r}): the decorated class must be a "
            f"dataclass subclassing {base.__name__}; got {cls!r}."
        )
      registry = globals()[registry_name]  # looked up per call: tests swap the dict
      if name in registry:
        raise ValueError(
            f"pallasopt.optim.register_{kind}: {kind} {name!r} is already registered "
            f"(by {registry[name].__name__}); choose another name."
        )
      registry[name] = cls
      return cls

    return decorator

  return register


register_optimizer = _registrar("optimizer", "_OPTIMIZER_BUILDERS", OptimizerBuilder)
register_optimizer.__doc__ = """Registers an `OptimizerBuilder` dataclass under ``name``.

Used as a class decorator (above ``@dataclasses.dataclass``), as in eFormer.

Raises:
  ValueError: the name is taken.
  TypeError: an empty name, or a class that is not an `OptimizerBuilder` dataclass.
"""
register_scheduler = _registrar("scheduler", "_SCHEDULER_BUILDERS", SchedulerBuilder)
register_scheduler.__doc__ = """Registers a `SchedulerBuilder` dataclass as a ``scheduler_type``.

Raises:
  ValueError: the name is taken.
  TypeError: an empty name, or a class that is not a `SchedulerBuilder` dataclass.
"""


# ---- Factories. ----


class SchedulerFactory:
  """Builds learning-rate schedules from `SchedulerConfig` (eFormer's)."""

  @staticmethod
  def create_scheduler(
      config: SchedulerConfig,
      custom_scheduler: Callable[[int], optax.Schedule] | None = None,
  ) -> optax.Schedule:
    """The schedule `config` describes, or ``custom_scheduler(config.steps)``.

    Args:
      config: the schedule's config; ``scheduler_type`` None means constant,
        other names select a registered `SchedulerBuilder`.
      custom_scheduler: a function of the total step count returning the
        schedule; replaces the registered one.

    Raises:
      TypeError: `config` is not a `SchedulerConfig`.
      ValueError: a custom scheduler without ``config.steps``, an unknown
        ``scheduler_type`` (the message lists the registered ones) or an
        inconsistent config.
    """
    where = "pallasopt.optim.SchedulerFactory.create_scheduler"
    if not isinstance(config, SchedulerConfig):
      raise TypeError(f"{where}: config must be a SchedulerConfig; got {type(config).__name__}.")
    if custom_scheduler is not None:
      if config.steps is None:
        raise ValueError(f"{where}: custom_scheduler is called with config.steps, which is None.")
      return custom_scheduler(config.steps)
    config.check()
    name = config.scheduler_type or "constant"
    if name not in _SCHEDULER_BUILDERS:
      raise ValueError(
          f"{where}: unknown scheduler_type {name!r}; registered schedulers are "
          f"{sorted(_SCHEDULER_BUILDERS)} (add one with register_scheduler)."
      )
    return _SCHEDULER_BUILDERS[name](config=config).build()


class OptimizerFactory:
  """Builds registered optimizers as eFormer's factory does (see the module docstring)."""

  @staticmethod
  def _get_config_class(optimizer_type: str) -> type:
    """The config class a registered builder's ``config`` field is annotated with."""
    if optimizer_type not in _OPTIMIZER_BUILDERS:
      raise ValueError(
          f"{_OWNER}: unknown optimizer_type {optimizer_type!r}; registered optimizers are "
          f"{sorted(_OPTIMIZER_BUILDERS)} (add one with register_optimizer)."
      )
    builder_cls = _OPTIMIZER_BUILDERS[optimizer_type]
    config_cls = typing.get_type_hints(builder_cls).get("config")
    if not isinstance(config_cls, type) or config_cls is Any:
      raise ValueError(
          f"{_OWNER}: {builder_cls.__name__} (optimizer {optimizer_type!r}) must annotate its "
          f"config field with the config class; got {config_cls!r}."
      )
    return config_cls

  @classmethod
  def create(
      cls,
      optimizer_type: str,
      scheduler_config: SchedulerConfig | None = None,
      optimizer_config: Any | None = None,
      *,
      weight_decay: float = 0.0,
      weight_decay_mask: MaskOrFn = None,
      gradient_accumulation_steps: int = 1,
      clip_grad: float | None = None,
      custom_scheduler: Callable[[int], optax.Schedule] | None = None,
      stacked_axes: int = 0,
      impl: str = "auto",
      **kwargs: Any,
  ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Builds a registered optimizer, eFormer's chain around it, and its schedule.

    Args:
      optimizer_type: a registered name: ``"adamw"``, ``"adafactor"``,
        ``"lion"``, ``"rmsprop"``, ``"muon"``, ``"mars"``, ``"quad"``,
        ``"skew"``, ``"kron"`` or one added with `register_optimizer`.
      scheduler_config: the learning-rate schedule (default: constant 5e-5).
      optimizer_config: the optimizer's config (default: its config class
        with its defaults, updated from `kwargs`). String dtypes in fields
        named ``*dtype*`` are converted in place, as eFormer does.
      weight_decay: the rate of the scheduled decay link,
        ``-schedule(t) * weight_decay`` times the params (0: no link).
      weight_decay_mask: which leaves that link decays (None: all).
      gradient_accumulation_steps: ``optax.MultiSteps`` over this many calls.
      clip_grad: ``optax.clip_by_global_norm`` first (None or 0: none).
      custom_scheduler: ``custom_scheduler(scheduler_config.steps)`` is the
        schedule.
      stacked_axes: pallasopt's: leading stacked-layer axes of every leaf.
      impl: pallasopt's: kernel implementation.
      **kwargs: without `optimizer_config`, values of the default config's
        fields. eFormer ignores any other keyword; so do we, with a warning.

    Returns:
      ``(tx, schedule)``; ``tx`` has ``apply_gradients_stage_local``.

    Raises:
      ValueError: an unknown name, a bad argument (named).
      TypeError: a config of the wrong class.
    """
    config_cls = cls._get_config_class(optimizer_type)
    if isinstance(optimizer_config, SchedulerConfig):
      raise TypeError(
          f"{_OWNER}.create: optimizer_config is a SchedulerConfig; the order is "
          "create(optimizer_type, scheduler_config, optimizer_config)."
      )
    field_names = {f.name for f in dataclasses.fields(config_cls)}
    if optimizer_config is None:
      optimizer_config = config_cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in field_names})
    if kwargs:
      hints = {k: difflib.get_close_matches(k, field_names, n=1) for k in kwargs}
      warnings.warn(
          f"{_OWNER}.create ignores {sorted(kwargs)} (as eFormer does): they are not fields "
          f"of {config_cls.__name__}, or optimizer_config was given"
          + "".join(f"; did you mean {m[0]!r} for {k!r}?" for k, m in hints.items() if m),
          stacklevel=2,
      )
    if not isinstance(optimizer_config, config_cls):
      raise TypeError(
          f"{_OWNER}.create: optimizer_config for {optimizer_type!r} must be a "
          f"{config_cls.__name__}; got {type(optimizer_config).__name__}."
      )
    _convert_dtypes(optimizer_config)
    scheduler_config = SchedulerConfig() if scheduler_config is None else scheduler_config
    schedule = SchedulerFactory.create_scheduler(scheduler_config, custom_scheduler)
    _check_tx_options(weight_decay, gradient_accumulation_steps, clip_grad)
    resolve_impl(impl)
    builder = _OPTIMIZER_BUILDERS[optimizer_type](
        config=optimizer_config, stacked_axes=stacked_axes, impl=impl
    )
    builder.validate()
    chain = [
        *([optax.clip_by_global_norm(clip_grad)] if clip_grad else []),
        builder.build(schedule),
        *(
            [add_scheduled_weight_decay(lambda t: -schedule(t) * weight_decay, weight_decay_mask)]
            if weight_decay != 0.0 else []
        ),
    ]
    tx = optax.chain(*chain)
    if gradient_accumulation_steps > 1:
      tx = optax.MultiSteps(tx, gradient_accumulation_steps)
    tx_kwargs = dict(
        weight_decay=weight_decay, weight_decay_mask=weight_decay_mask,
        gradient_accumulation_steps=gradient_accumulation_steps, clip_grad=clip_grad,
    )
    try:
      tx = builder.build_mpmd(schedule, optimizer=tx, **tx_kwargs)
    except NotImplementedError as e:
      tx = make_unsupported_stage_local_gradient_transformation(
          tx, optimizer_type=optimizer_type, reason=str(e)
      )
    return tx, schedule

  @classmethod
  def generate_template(cls, optimizer_type: str) -> str:
    """The config class of `optimizer_type` as text: each field, its type and default."""
    config_cls = cls._get_config_class(optimizer_type)
    hints = typing.get_type_hints(config_cls)
    lines = []
    for f in dataclasses.fields(config_cls):
      kind = hints[f.name]
      default = "" if f.default is dataclasses.MISSING else f" = {f.default}"
      lines.append(f"    {f.name}: {getattr(kind, '__name__', str(kind))}{default}")
    return f"{config_cls.__name__}(\n" + "\n".join(lines) + "\n)"

  @classmethod
  def serialize_config(
      cls, config: SerializationMixin, format: str = "dict"  # noqa: A002 (eFormer's name)
  ) -> dict[str, Any] | str:
    """``config.to_dict()`` (``format="dict"``) or ``config.to_json()`` (``"json"``)."""
    if format not in ("dict", "json"):
      raise ValueError(f"{_OWNER}.serialize_config: format must be 'dict' or 'json'; got {format!r}.")
    return config.to_dict() if format == "dict" else config.to_json()

  @classmethod
  def deserialize_config(
      cls, optimizer_type: str, data: dict[str, Any] | str, format: str = "dict"  # noqa: A002
  ) -> SerializationMixin:
    """The config of `optimizer_type` from `serialize_config`'s output."""
    config_cls = cls._get_config_class(optimizer_type)
    where = f"{_OWNER}.deserialize_config"
    if format == "json":
      if not isinstance(data, str):
        raise TypeError(f"{where}: format='json' needs a str; got {type(data).__name__}.")
      return config_cls.from_json(data)
    if format == "dict":
      if not isinstance(data, dict):
        raise TypeError(f"{where}: format='dict' needs a dict; got {type(data).__name__}.")
      return config_cls.from_dict(data)
    raise ValueError(f"{where}: format must be 'dict' or 'json'; got {format!r}.")


def _convert_dtypes(config: Any) -> None:
  """String values of ``*dtype*`` fields become JAX dtypes, in place (eFormer's rule)."""
  for f in dataclasses.fields(config):
    value = getattr(config, f.name)
    if "dtype" in f.name and isinstance(value, str):
      dtype = getattr(jnp, value, None)
      if dtype is None:
        raise ValueError(
            f"{_OWNER}: {type(config).__name__}.{f.name}={value!r} names no jax.numpy dtype."
        )
      setattr(config, f.name, dtype)


def _check_tx_options(weight_decay: Any, gradient_accumulation_steps: Any, clip_grad: Any) -> None:
  where = f"{_OWNER}.create"
  if not isinstance(weight_decay, (int, float)) or not math.isfinite(weight_decay):
    raise ValueError(f"{where}: weight_decay must be a finite number; got {weight_decay!r}.")
  v.check_accumulation_and_clip(where, gradient_accumulation_steps, clip_grad)
