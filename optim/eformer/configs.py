"""Optimizer and scheduler configs: eFormer's fields, mutable and serializable.

The names, fields (in order) and defaults follow eFormer's
``eformer.optimizers`` (0.0.101), so a config written for eFormer builds the
same optimizer through `pallasopt.optim.eformer.OptimizerFactory`, backed by
pallasopt's fused kernels. pallasopt's own options (low-bit state, ...) are
extra fields after eFormer's.

Configs are mutable dataclasses with eFormer's serialization (`SerializationMixin`:
``to_dict``, ``from_dict``, ``to_json``, ``from_json``): a dict eFormer's
``to_dict()`` writes loads with our ``from_dict`` (keys a config does not have
are ignored with a warning, as eFormer does), and ``to_json`` writes dtypes by
name where eFormer's ``json.dumps`` fails on them.

A config holds the optimizer's own hyperparameters; the learning rate comes
from a `SchedulerConfig`, and the factory's scheduled weight decay, its mask,
gradient clipping, accumulation and ``stacked_axes`` are arguments of
``OptimizerFactory.create``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from pallasopt.optim import _validation as v

__all__ = [
    "SerializationMixin",
    "AdamWConfig",
    "RMSPropConfig",
    "MarsConfig",
    "LionConfig",
    "AdafactorConfig",
    "MuonConfig",
    "KronConfig",
    "WhiteKronConfig",
    "SoapConfig",
    "ScionConfig",
    "SchedulerConfig",
]

_OWNER = "pallasopt.optim.eformer.configs"


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
    state_format: storage of the moments: None, ``"bf16"``, ``"int8"``, ``"fp8"`` or ``"int4"``.
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
    weight_decay: Lion's own decoupled weight decay, scaled by the learning
      rate, on every leaf. eFormer's Lion builder leaves ``optax.lion``'s
      default 1e-3 in place (on top of the factory's ``weight_decay`` link),
      so runs trained with eFormer used it; 1e-3 here reproduces them, 0
      turns it off.
    state_format: storage of the momentum: None, ``"bf16"``, ``"int8"``, ``"fp8"`` or ``"int4"``.
    param_rounding: ``"nearest"`` or ``"stochastic"`` for bf16 params.
    seed: seed of the stochastic roundings (None: 0).
  """

  b1: float = 0.9
  b2: float = 0.99
  mu_dtype: Any = None
  weight_decay: float = 1e-3
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
    state_format: storage of the state: None, ``"bf16"``, ``"int8"``, ``"fp8"`` or ``"int4"``.
    param_rounding: ``"nearest"`` or ``"stochastic"`` for bf16 params.
    seed: seed of the stochastic roundings (None: 0).
  """

  decay: float = 0.9
  initial_scale: float = 0.0
  momentum: float | None = None
  nesterov: bool = False
  eps: float = 1e-8
  centered: bool = False
  state_format: str | None = None
  param_rounding: str = "nearest"
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
    state_format: storage of the moments: None, ``"bf16"``, ``"int8"``, ``"fp8"`` or ``"int4"``.
    param_rounding: ``"nearest"`` or ``"stochastic"`` for bf16 params.
    seed: seed of the stochastic roundings (None: 0).
  """

  weight_decay: float = 0.1
  beta1: float = 0.95
  beta2: float = 0.99
  gamma: float = 0.025
  epsilon: float = 1e-8
  max_grad_norm: float | None = 1.0
  state_format: str | None = None
  param_rounding: str = "nearest"
  seed: int | None = None


@dataclasses.dataclass
class AdafactorConfig(SerializationMixin):
  """Hyperparameters of `pallasopt.optim.adafactor` (as ``optax.adafactor``).

  ``weight_decay_rate`` is Adafactor's own decay (as in ``optax.adafactor``,
  *not* multiplied by the learning rate); the factory's ``weight_decay`` is a
  separate link after it, scaled by the learning rate.

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
    state_format: storage of the momentum: None, ``"bf16"``, ``"int8"``, ``"fp8"`` or ``"int4"``.
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
  matrices Muon orthogonalizes, inside Muon; the factory's ``weight_decay`` is
  a separate link after it, on every leaf it masks. The leaves Muon hands to
  its AdamW fallback decay by ``adam_weight_decay``, unmasked, as in Optax
  (eFormer's builder does not pass this field; its default, 0, is Optax's).

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
    iter_dtype: dtype of the Newton-Schulz iterates (None: the momentum's;
      ``"bfloat16"`` for bf16 matmuls, the one dtype the CUDA kernel takes).
    gram_levels: block levels of Newton-Schulz's symmetric products (None:
      the levels measured fastest on the platform; 0: Optax's full dots).
    distributed_axes: mesh axes over whose devices one step's Newton-Schulz
      work is split (None: every device orthogonalizes every matrix).
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
  iter_dtype: Any = None
  gram_levels: int | None = None
  distributed_axes: tuple[str, ...] | None = None


@dataclasses.dataclass
class KronConfig(SerializationMixin):
  """Hyperparameters of `pallasopt.optim.kron` (as psgd_jax's ``kron``).

  A field left at None is not passed, so the optimizer's own default applies
  (e.g. psgd_jax's annealed preconditioner-update probability). Stacked
  layers are described by ``OptimizerFactory.create``'s ``stacked_axes``, which
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


@dataclasses.dataclass
class WhiteKronConfig(SerializationMixin):
  """eFormer's White-Kron config (its ``quad`` and ``skew`` optimizers), its
  fields and defaults.

  Attributes:
    lr_style: ``"adam"`` scales updates to Adam's RMS; None leaves them.
    b1: momentum decay.
    normalize_grads: normalize each gradient leaf before the momentum.
    max_size_dense: largest dim that gets a dense factor (larger: diagonal).
    preconditioner_lr: step size of the preconditioner update.
    preconditioner_init_scale: initial scale of the factors.
    dtype: dtype of the preconditioner math.
    scanned_layers: which leaves stack layers (a tree of bools).
    block_size: size of the blocks large dims are split into.
    pipeline_axis_name: mesh axis of a pipeline the factors shard over.
    pipeline_axis_size: size of that axis.
    params_partition_specs: the params' partition specs.
    noise_scale: scale of the noise added to the preconditioner update.
    weight_decay: the optimizer's own decoupled weight decay.
    weight_decay_mask: which leaves it decays (None: all).
  """

  lr_style: str | None = "adam"
  b1: float = 0.95
  normalize_grads: bool = False
  max_size_dense: int = 16384
  preconditioner_lr: float = 0.7
  preconditioner_init_scale: float = 1.0
  dtype: Any = jnp.bfloat16
  scanned_layers: Any = None
  block_size: int = 256
  pipeline_axis_name: str | None = None
  pipeline_axis_size: int = 1
  params_partition_specs: Any = None
  noise_scale: float = 1e-9
  weight_decay: float = 0.1
  weight_decay_mask: Any = None


@dataclasses.dataclass
class SoapConfig(SerializationMixin):
  """eFormer's SOAP config, its fields and defaults. A config only: eFormer
  registers no optimizer for it, and neither do we; it round-trips.

  Attributes:
    weight_decay: decoupled weight decay.
    beta1: first-moment decay.
    beta2: second-moment decay.
    shampoo_beta: decay of the Shampoo statistics.
    epsilon: added to the denominator.
    max_grad_norm: global-norm clip (None: off).
    preconditioner_lr: step size of the preconditioner update.
    preconditioner_init_scale: initial scale of the preconditioner.
    mu_dtype: dtype of the momentum.
    precond_dtype: dtype of the preconditioner.
    precond_update_precision: matmul precision of the preconditioner update.
    precond_grads_precision: matmul precision of preconditioning.
    lax_map_scanned_layers: map stacked layers with ``lax.map``.
    lax_map_batch_size: batch size of that map.
    merge_small_dims: merge small dims before preconditioning.
    target_merged_dim_size: target size of merged dims.
    partition_grads_into_blocks: split large dims into blocks.
    block_size: size of those blocks.
  """

  weight_decay: float = 0.0
  beta1: float = 0.95
  beta2: float = 0.95
  shampoo_beta: float = 0.95
  epsilon: float = 1e-8
  max_grad_norm: float | None = 1.0
  preconditioner_lr: float = 0.1
  preconditioner_init_scale: float = 1.0
  mu_dtype: Any = None
  precond_dtype: Any = None
  precond_update_precision: str | None = "tensorfloat32"
  precond_grads_precision: str | None = None
  lax_map_scanned_layers: bool = False
  lax_map_batch_size: int = 8
  merge_small_dims: bool = True
  target_merged_dim_size: int = 8192
  partition_grads_into_blocks: bool = True
  block_size: int = 256


@dataclasses.dataclass
class ScionConfig(SerializationMixin):
  """eFormer's Scion config (Pethick et al., `Training Deep Learning Models with
  Norm-Constrained LMOs <https://arxiv.org/abs/2502.07529>`_, 2025), its fields
  and defaults. A config only: eFormer registers no optimizer for it, and
  neither do we; it round-trips.

  Attributes:
    momentum: momentum of both the spectral and the sign updates.
    backend_steps: Newton-Schulz iterations.
    beta1: first-moment decay of the sign update.
    epsilon: numerical-stability constant.
    unconstrained: the unconstrained variant.
    spectral_radius: scale of the spectral update.
    sign_radius: scale of the sign update.
  """

  momentum: float = 0.95
  backend_steps: int = 10
  beta1: float = 0.9
  epsilon: float = 1e-8
  unconstrained: bool = False
  spectral_radius: float = 50
  sign_radius: float = 3000


# ---- Scheduler config. ----


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
    ``alpha = learning_rate_end / learning_rate``; eFormer ignores
    ``exponent`` there, and so do we, with a warning when it is not 1.

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
    """Raises ValueError for an inconsistent config (run again when a schedule
    is built, since the config is mutable, as eFormer's is)."""
    where = f"{_OWNER}.SchedulerConfig"
    if not isinstance(self.learning_rate, (int, float)) or not math.isfinite(self.learning_rate):
      raise ValueError(
          f"{where}: learning_rate must be a finite number; got {self.learning_rate!r}."
      )
    for name in ("warmup_steps", "steps"):
      value = getattr(self, name)
      if value is not None and (not v.is_int(value) or value < 0):
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
