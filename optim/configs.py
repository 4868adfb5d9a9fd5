"""Optimizer and scheduler configs, and the registries that build them.

The names and semantics follow eFormer's ``eformer.optimizers`` (``AdamWConfig``,
``SchedulerConfig``, ``register_optimizer``, ...), so a config written for
eFormer builds the same optimizer here, backed by pallasopt's fused kernels.
`pallasopt.optim.stage_local.create_optimizer` turns a registered name and its
config into a (stage-local) Optax transform and its learning-rate schedule.

Configs are mutable dataclasses with eFormer's serialization (`SerializationMixin`:
``to_dict``, ``from_dict``, ``to_json``, ``from_json``): a dict eFormer's
``to_dict()`` writes loads with our ``from_dict`` (keys a config does not have
are ignored with a warning, as eFormer does), and ``to_json`` writes dtypes by
name where eFormer's ``json.dumps`` fails on them.

A config holds only the optimizer's own hyperparameters; the learning rate
comes from a `SchedulerConfig`, and weight decay, its mask, gradient clipping,
accumulation and ``stacked_axes`` are arguments of ``create_optimizer``.
Each field is passed to the optimizer's factory under its own name, so the
fields are those of the Optax (or psgd_jax) signature the factory mirrors.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
import optax

__all__ = [
    "SerializationMixin",
    "AdamWConfig",
    "RMSPropConfig",
    "MarsConfig",
    "LionConfig",
    "AdafactorConfig",
    "MuonConfig",
    "KronConfig",
    "SchedulerConfig",
    "OptimizerBuilder",
    "SchedulerBuilder",
    "register_optimizer",
    "register_scheduler",
    "optimizer_builder",
    "create_scheduler",
]

_OWNER = "pallasopt.optim.configs"


# ---- Serialization (eFormer's SerializationMixin). ----


def _json_value(value: Any) -> Any:
  """A field value JSON can hold: dtypes (classes or objects) by name."""
  if isinstance(value, type) or isinstance(value, np.dtype):
    try:
      return np.dtype(value).name
    except TypeError:
      pass
  raise TypeError(f"{type(value).__name__} {value!r} is not JSON serializable.")


class SerializationMixin:
  """eFormer's config serialization: dicts and JSON.

  ``to_dict`` gives every public field as it is (dtypes stay dtypes);
  ``from_dict`` builds the config from such a dict, ignoring keys the
  config does not have with a warning naming them (eFormer's behaviour);
  ``to_json`` / ``from_json`` go through JSON, dtypes by name
  (``"bfloat16"``), which every dtype field accepts.
  """

  def to_dict(self) -> dict[str, Any]:
    return {
        f.name: getattr(self, f.name) for f in dataclasses.fields(self)
        if not f.name.startswith("_")
    }

  @classmethod
  def from_dict(cls, data: dict[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(data) - names)
    if extra:
      warnings.warn(f"Ignoring unexpected keys {extra} for {cls.__name__}.", stacklevel=2)
    return cls(**{k: v for k, v in data.items() if k in names})

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, default=_json_value)

  @classmethod
  def from_json(cls, text: str):
    return cls.from_dict(json.loads(text))


# ---- Optimizer configs. ----


@dataclasses.dataclass
class AdamWConfig(SerializationMixin):
  """Hyperparameters of `pallasopt.optim.adamw` (as ``optax.adamw``).

  Attributes:
    b1: decay of the first moment.
    b2: decay of the second moment.
    eps: added to the denominator outside the square root.
    eps_root: added inside the square root.
    mu_dtype: dtype of the first moment (None: the params' dtype).
    nesterov: Nesterov momentum (NAdamW); not in eFormer's config.
    state_format: storage of the moments: None, ``"bf16"``, ``"int8"`` or ``"fp8"``.
    param_rounding: ``"nearest"`` or ``"stochastic"`` for bf16 params.
    seed: seed of the stochastic roundings (None: 0).
  """

  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  eps_root: float = 0.0
  mu_dtype: Any = None
  nesterov: bool = False
  state_format: str | None = None
  param_rounding: str = "nearest"
  seed: int | None = None


@dataclasses.dataclass
class LionConfig(SerializationMixin):
  """Hyperparameters of `pallasopt.optim.lion` (as ``optax.lion``).

  Attributes:
    b1: interpolation between momentum and gradient for the update sign.
    b2: decay of the momentum.
    mu_dtype: dtype of the momentum (None: the params' dtype).
    state_format: storage of the momentum: None, ``"bf16"``, ``"int8"`` or ``"fp8"``.
    param_rounding: ``"nearest"`` or ``"stochastic"`` for bf16 params.
    seed: seed of the stochastic roundings (None: 0).
  """

  b1: float = 0.9
  b2: float = 0.99
  mu_dtype: Any = None
  state_format: str | None = None
  param_rounding: str = "nearest"
  seed: int | None = None


@dataclasses.dataclass
class RMSPropConfig(SerializationMixin):
  """Hyperparameters of `pallasopt.optim.rmsprop`, eFormer's fields and defaults.

  eFormer builds ``optax.rmsprop(centered=False)`` from these; the extra
  fields (after eFormer's) are `pallasopt.optim.rmsprop`'s.

  Attributes:
    decay: decay of the moving average of squared gradients.
    initial_scale: initial value of that average.
    momentum: decay of the momentum trace (None: no momentum).
    nesterov: Nesterov momentum.
    eps: added inside the square root.
    centered: subtract the squared mean gradient (not in eFormer's).
    state_format: storage of the state: None, ``"bf16"``, ``"int8"`` or ``"fp8"``.
    seed: seed of the stochastic roundings (None: 0).
  """

  decay: float = 0.9
  initial_scale: float = 0.0
  momentum: float | None = None
  nesterov: bool = False
  eps: float = 1e-8
  centered: bool = False
  state_format: str | None = None
  seed: int | None = None


@dataclasses.dataclass
class MarsConfig(SerializationMixin):
  """Hyperparameters of `pallasopt.optim.mars`, under eFormer's field names.

  eFormer's builder passes ``beta1``, ``beta2``, ``gamma``, ``epsilon`` and
  ``max_grad_norm`` to ``mars`` as ``b1``, ``b2``, ``gamma``, ``eps`` and
  ``max_grad_norm``; its ``weight_decay`` field is not read by that builder.

  Attributes:
    weight_decay: eFormer's field (unused by its builder).
    beta1: decay of the first moment.
    beta2: decay of the second moment.
    gamma: strength of the variance reduction.
    epsilon: added to the denominator.
    max_grad_norm: global-norm clip of the variance-reduced gradient (None
      or 0: off).
  """

  weight_decay: float = 0.1
  beta1: float = 0.95
  beta2: float = 0.99
  gamma: float = 0.025
  epsilon: float = 1e-8
  max_grad_norm: float | None = 1.0


@dataclasses.dataclass
class AdafactorConfig(SerializationMixin):
  """Hyperparameters of `pallasopt.optim.adafactor` (as ``optax.adafactor``).

  ``weight_decay_rate`` is eFormer's field; set it or ``create_optimizer``'s
  ``weight_decay``, not both. As in ``optax.adafactor`` it is *not*
  multiplied by the learning rate.

  Attributes:
    min_dim_size_to_factor: only dims at least this large are factored.
    decay_rate: exponent of the second-moment decay schedule.
    decay_offset: step offset of that schedule.
    multiply_by_parameter_scale: scale updates by the params' RMS.
    clipping_threshold: per-block update-RMS clipping (None: off).
    momentum: first-moment decay (None: no momentum).
    dtype_momentum: dtype of the first moment.
    weight_decay_rate: decoupled weight decay (None: none).
    eps: regulariser of the second moment.
    factored: factor the second moment of matrices.
    state_format: storage of the momentum: None, ``"bf16"``, ``"int8"`` or ``"fp8"``.
    seed: seed of the stochastic roundings (None: 0).
  """

  min_dim_size_to_factor: int = 128
  decay_rate: float = 0.8
  decay_offset: int = 0
  multiply_by_parameter_scale: bool = True
  clipping_threshold: float | None = 1.0
  momentum: float | None = None
  dtype_momentum: Any = jnp.float32
  weight_decay_rate: float | None = None
  eps: float = 1e-30
  factored: bool = True
  state_format: str | None = None
  seed: int | None = None


@dataclasses.dataclass
class MuonConfig(SerializationMixin):
  """Hyperparameters of `pallasopt.optim.muon` (as ``optax.contrib.muon``).

  ``weight_decay`` and ``weight_decay_mask`` (eFormer's fields) decay the
  matrices Muon orthogonalizes; set them here or with ``create_optimizer``'s
  arguments, not both. The leaves Muon hands to its AdamW fallback decay by
  ``adam_weight_decay``, unmasked, as in Optax.

  Attributes:
    ns_coeffs: Newton-Schulz polynomial coefficients (or an Optax preset name).
    ns_steps: Newton-Schulz iterations.
    beta: momentum decay.
    eps: Newton-Schulz normalisation epsilon (and the AdamW fallback's).
    weight_decay: decoupled weight decay of the Muon leaves.
    weight_decay_mask: which Muon leaves decay (None: all).
    mu_dtype: dtype of the momentum.
    nesterov: Nesterov momentum.
    adaptive: scale updates by the dual norm (Optax's ``adaptive``).
    adam_b1: the AdamW fallback's ``b1``.
    adam_b2: the AdamW fallback's ``b2``.
    adam_eps_root: the AdamW fallback's ``eps_root``.
    adam_weight_decay: the AdamW fallback's weight decay.
    state_format: storage of the momentum (both parts): None, ``"bf16"`` or
      ``"int8"``.
    seed: seed of the stochastic roundings (None: 0).
  """

  ns_coeffs: Any = (3.4445, -4.775, 2.0315)
  ns_steps: int = 5
  beta: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.0
  weight_decay_mask: Any = None
  mu_dtype: Any = None
  nesterov: bool = True
  adaptive: bool = False
  adam_b1: float = 0.9
  adam_b2: float = 0.999
  adam_eps_root: float = 0.0
  adam_weight_decay: float = 0.0
  state_format: str | None = None
  seed: int | None = None


@dataclasses.dataclass
class KronConfig(SerializationMixin):
  """Hyperparameters of `pallasopt.optim.kron` (as psgd_jax's ``kron``).

  A field left at None is not passed, so the optimizer's own default applies
  (e.g. psgd_jax's annealed preconditioner-update probability). Stacked
  layers are described by ``create_optimizer``'s ``stacked_axes``, which
  generalises psgd_jax's ``scanned_layers``.

  Attributes:
    b1: momentum decay.
    preconditioner_update_probability: a probability or a schedule of the step.
    max_size_triangular: largest dim that gets a triangular factor.
    min_ndim_triangular: fewest dims a leaf needs for triangular factors.
    memory_save_mode: None, ``"one_diag"``, ``"smart_one_diag"`` or ``"all_diag"``.
    momentum_into_precond_update: update the preconditioner from the momentum
      rather than the gradient.
    preconditioner_lr: step size of the preconditioner update.
    preconditioner_init_scale: initial scale of the factors.
    mu_dtype: dtype of the momentum.
    precond_dtype: dtype of the preconditioner factors.
    precond_update_precision: matmul precision of the factor update.
    precond_grads_precision: matmul precision of preconditioning.
  """

  b1: float = 0.9
  preconditioner_update_probability: float | Callable[[Any], Any] | None = None
  max_size_triangular: int = 8192
  min_ndim_triangular: int = 2
  memory_save_mode: str | None = None
  momentum_into_precond_update: bool | None = None
  preconditioner_lr: float | None = None
  preconditioner_init_scale: float | None = None
  mu_dtype: Any = None
  precond_dtype: Any = None
  precond_update_precision: str | None = None
  precond_grads_precision: str | None = None


# ---- Scheduler config. ----


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass
class SchedulerConfig(SerializationMixin):
  """A learning-rate schedule, as eFormer's ``SchedulerConfig`` describes it.

  ``scheduler_type`` names a registered scheduler: None or ``"constant"``
  (``learning_rate`` throughout), ``"linear"`` or ``"cosine"``, or one added
  with `register_scheduler`. The built-in ones, with :math:`W` =
  ``warmup_steps`` and :math:`S` = ``steps``:

  * ``"linear"``: from ``learning_rate`` to ``learning_rate_end`` over
    :math:`S - W` steps (``optax.linear_schedule``), after a linear warmup
    from 1e-8 over :math:`W` steps when ``warmup_steps`` is set.
  * ``"cosine"``: with warmup, ``optax.warmup_cosine_decay_schedule`` from
    1e-8 up to ``learning_rate`` in :math:`W` steps, then down to
    ``learning_rate_end`` (default 0) by step :math:`S`, with ``exponent``;
    without, ``optax.cosine_decay_schedule`` over :math:`S` steps with
    ``alpha = learning_rate_end / learning_rate`` (``exponent`` applies here
    too; eFormer ignores it in this case).

  Attributes:
    scheduler_type: the registered name, or None for a constant schedule.
    learning_rate: the peak (or constant) learning rate.
    learning_rate_end: the final learning rate (required by ``"linear"``).
    warmup_steps: length of the linear warmup (None or 0: none).
    steps: total steps (required by every schedule but the constant one).
    exponent: the cosine decay's exponent.

  Raises:
    ValueError: negative or non-integer step counts, a missing ``steps``,
      warmup without a decaying schedule or not shorter than ``steps``.
  """

  scheduler_type: str | None = None
  learning_rate: float = 5e-5
  learning_rate_end: float | None = None
  warmup_steps: int | None = None
  steps: int | None = None
  exponent: float = 1.0

  def __post_init__(self):
    self.check()

  def check(self) -> None:
    """Raises ValueError for an inconsistent config (also run by `create_scheduler`,
    since the config is mutable, as eFormer's is)."""
    where = f"{_OWNER}.SchedulerConfig"
    if not isinstance(self.learning_rate, (int, float)) or not math.isfinite(self.learning_rate):
      raise ValueError(
          f"{where}: learning_rate must be a finite number; got {self.learning_rate!r}."
      )
    for name in ("warmup_steps", "steps"):
      value = getattr(self, name)
      if value is not None and (not _is_int(value) or value < 0):
        raise ValueError(f"{where}: {name} must be None or an int >= 0; got {value!r}.")
    constant = self.scheduler_type in (None, "constant")
    if not constant and not self.steps:
      raise ValueError(
          f"{where}: scheduler_type={self.scheduler_type!r} needs steps (the total step count)."
      )
    if self.warmup_steps:
      if constant:
        raise ValueError(
            f"{where}: warmup_steps needs a decaying scheduler_type such as 'linear' or "
            "'cosine'; a constant schedule has no warmup."
        )
      if self.warmup_steps >= self.steps:
        raise ValueError(
            f"{where}: warmup_steps ({self.warmup_steps}) must be less than steps ({self.steps})."
        )


# ---- Registries. ----

OptimizerBuilder = Callable[..., optax.GradientTransformation]
"""``builder(config, learning_rate, *, weight_decay, weight_decay_mask,
stacked_axes, impl) -> optax.GradientTransformation``.

Return a `pallasopt.optim.FusedGradientTransformation` to get the fused
stage-local path; any other transform still works through ``update``.
"""

SchedulerBuilder = Callable[[SchedulerConfig], optax.Schedule]
"""``builder(config) -> optax.Schedule``."""


class _Entry(NamedTuple):
  config_cls: type
  builder: OptimizerBuilder


_OPTIMIZERS: dict[str, _Entry] = {}
_SCHEDULERS: dict[str, SchedulerBuilder] = {}


def _check_name(name: Any) -> None:
  if not isinstance(name, str) or not name:
    raise TypeError(f"{_OWNER}: a registered name must be a non-empty str; got {name!r}.")


def register_optimizer(name: str, config_cls: type, builder: OptimizerBuilder | None = None):
  """Registers (or replaces) the optimizer `name` for ``create_optimizer``.

  Usable directly or as a decorator of the builder::

    @register_optimizer("sgd", SGDConfig)
    def build_sgd(config, learning_rate, *, weight_decay, weight_decay_mask,
                  stacked_axes, impl):
      return optax.sgd(learning_rate, momentum=config.momentum)

  Args:
    name: the ``optimizer_type`` that selects it.
    config_cls: the dataclass of its hyperparameters; ``create_optimizer``
      instantiates it with no arguments when no config is given.
    builder: an `OptimizerBuilder`. It receives the config, the learning-rate
      schedule and ``create_optimizer``'s ``weight_decay``,
      ``weight_decay_mask``, ``stacked_axes`` and ``impl``.

  Returns:
    `builder` (or, without it, a decorator that registers its argument).
  """
  _check_name(name)
  if not (isinstance(config_cls, type) and dataclasses.is_dataclass(config_cls)):
    raise TypeError(
        f"{_OWNER}: config_cls of {name!r} must be a dataclass type; got {config_cls!r}."
    )

  def register(fn: OptimizerBuilder) -> OptimizerBuilder:
    if not callable(fn):
      raise TypeError(f"{_OWNER}: the builder of {name!r} must be callable; got {fn!r}.")
    _OPTIMIZERS[name] = _Entry(config_cls, fn)
    return fn

  return register if builder is None else register(builder)


def register_scheduler(name: str, builder: SchedulerBuilder | None = None):
  """Registers (or replaces) the scheduler `name` (a ``scheduler_type``).

  Args:
    name: the ``SchedulerConfig.scheduler_type`` that selects it.
    builder: ``builder(config: SchedulerConfig) -> optax.Schedule``.

  Returns:
    `builder` (or, without it, a decorator that registers its argument).
  """
  _check_name(name)

  def register(fn: SchedulerBuilder) -> SchedulerBuilder:
    if not callable(fn):
      raise TypeError(f"{_OWNER}: the builder of scheduler {name!r} must be callable; got {fn!r}.")
    _SCHEDULERS[name] = fn
    return fn

  return register if builder is None else register(builder)


def optimizer_builder(optimizer_type: str) -> tuple[type, OptimizerBuilder]:
  """The ``(config_cls, builder)`` registered as `optimizer_type`.

  Raises:
    ValueError: an unknown name; the message lists the registered ones.
  """
  if optimizer_type not in _OPTIMIZERS:
    raise ValueError(
        f"{_OWNER}: unknown optimizer_type {optimizer_type!r}; registered optimizers are "
        f"{sorted(_OPTIMIZERS)} (add one with register_optimizer)."
    )
  return tuple(_OPTIMIZERS[optimizer_type])


def create_scheduler(config: SchedulerConfig) -> optax.Schedule:
  """The learning-rate schedule `config` describes.

  Raises:
    ValueError: an unknown ``scheduler_type`` (the message lists the
      registered ones) or a config its scheduler cannot build.
    TypeError: `config` is not a `SchedulerConfig`.
  """
  if not isinstance(config, SchedulerConfig):
    raise TypeError(
        f"{_OWNER}: scheduler_config must be a SchedulerConfig; got {type(config).__name__}."
    )
  config.check()
  name = config.scheduler_type or "constant"
  if name not in _SCHEDULERS:
    raise ValueError(
        f"{_OWNER}: unknown scheduler_type {name!r}; registered schedulers are "
        f"{sorted(_SCHEDULERS)} (add one with register_scheduler)."
    )
  return _SCHEDULERS[name](config)


# ---- Built-in schedulers (eFormer's definitions). ----

_WARMUP_START = 1e-8


@register_scheduler("constant")
def _constant(config: SchedulerConfig) -> optax.Schedule:
  return optax.constant_schedule(config.learning_rate)


@register_scheduler("linear")
def _linear(config: SchedulerConfig) -> optax.Schedule:
  if config.learning_rate_end is None:
    raise ValueError(f"{_OWNER}: the 'linear' scheduler needs learning_rate_end.")
  warmup = config.warmup_steps or 0
  decay = optax.linear_schedule(
      config.learning_rate, config.learning_rate_end, config.steps - warmup
  )
  if not warmup:
    return decay
  ramp = optax.linear_schedule(_WARMUP_START, config.learning_rate, warmup)
  return optax.join_schedules([ramp, decay], [warmup])


@register_scheduler("cosine")
def _cosine(config: SchedulerConfig) -> optax.Schedule:
  if config.warmup_steps:
    return optax.warmup_cosine_decay_schedule(
        init_value=_WARMUP_START,
        peak_value=config.learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=config.steps,
        end_value=config.learning_rate_end or 0.0,
        exponent=config.exponent,
    )
  if config.learning_rate_end is None:
    alpha = 0.0
  elif config.learning_rate <= 0:
    raise ValueError(
        f"{_OWNER}: the 'cosine' scheduler needs learning_rate > 0 with learning_rate_end."
    )
  else:
    alpha = config.learning_rate_end / config.learning_rate
  return optax.cosine_decay_schedule(config.learning_rate, config.steps, alpha, config.exponent)


# ---- Built-in optimizers: each builder imports its module when first used. ----


def _set_weight_decay(
    kwargs: dict[str, Any], config: Any, rate_key: str, rate: Any, mask_key: str, mask: Any
) -> None:
  """Puts ``create_optimizer``'s decay and mask into the factory's kwargs.

  A config that has its own decay field (eFormer's Muon and Adafactor
  configs) keeps it unless ``create_optimizer`` sets one too, which is an
  error rather than a silent override.
  """
  name = type(config).__name__
  own_rate, own_mask = kwargs.get(rate_key), kwargs.get(mask_key)
  if rate is not None and not (isinstance(rate, (int, float)) and rate == 0):
    if own_rate is not None and not (isinstance(own_rate, (int, float)) and own_rate == 0):
      raise ValueError(
          f"{_OWNER}: weight_decay={rate!r} and {name}.{rate_key}={own_rate!r} both set the "
          "weight decay; set only one."
      )
    kwargs[rate_key] = rate
  else:
    kwargs.setdefault(rate_key, rate)
  if mask is not None:
    if own_mask is not None:
      raise ValueError(
          f"{_OWNER}: weight_decay_mask and {name}.{mask_key} are both set; set only one."
      )
    kwargs[mask_key] = mask
  else:
    kwargs.setdefault(mask_key, None)


def _module_builder(
    module: str, *, rate_key: str, mask_key: str, stacked: bool, omit_none: bool = False
) -> OptimizerBuilder:
  """A builder calling ``pallasopt.optim.<module>.<module>`` with the config's fields."""

  def build(config, learning_rate, *, weight_decay, weight_decay_mask, stacked_axes, impl):
    kwargs = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    if omit_none:
      kwargs = {k: value for k, value in kwargs.items() if value is not None}
    _set_weight_decay(kwargs, config, rate_key, weight_decay, mask_key, weight_decay_mask)
    if stacked:
      kwargs["stacked_axes"] = stacked_axes
    factory = getattr(importlib.import_module(f"pallasopt.optim.{module}"), module)
    return factory(learning_rate, **kwargs, impl=impl)

  build.__name__ = f"build_{module}"
  build.__doc__ = f"Builds `pallasopt.optim.{module}.{module}` from its config."
  return build


register_optimizer(
    "adamw", AdamWConfig,
    _module_builder("adamw", rate_key="weight_decay", mask_key="mask", stacked=False),
)
register_optimizer(
    "lion", LionConfig,
    _module_builder("lion", rate_key="weight_decay", mask_key="mask", stacked=False),
)
register_optimizer(
    "adafactor", AdafactorConfig,
    _module_builder("adafactor", rate_key="weight_decay_rate", mask_key="weight_decay_mask",
                    stacked=True),
)
register_optimizer(
    "muon", MuonConfig,
    _module_builder("muon", rate_key="weight_decay", mask_key="weight_decay_mask", stacked=True),
)
register_optimizer(
    "kron", KronConfig,
    _module_builder("kron", rate_key="weight_decay", mask_key="weight_decay_mask", stacked=True,
                    omit_none=True),
)
