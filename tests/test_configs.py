"""Configs: eFormer's fields, mutability and serialization (`SerializationMixin`)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import optax
import pytest

from pallasopt import optim
from pallasopt.optim import eformer

CONFIGS = [
    eformer.AdamWConfig, eformer.LionConfig, eformer.AdafactorConfig, eformer.MuonConfig,
    eformer.KronConfig, eformer.RMSPropConfig, eformer.MarsConfig, eformer.SchedulerConfig,
    eformer.WhiteKronConfig, eformer.SoapConfig, eformer.ScionConfig,
]

# eFormer 0.0.101's fields, in order, with their defaults (eformer/optimizers/_config.py);
# ours may only add fields after them.
EFORMER_FIELDS = {
    eformer.AdamWConfig: dict(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None),
    eformer.LionConfig: dict(b1=0.9, b2=0.99, mu_dtype=None),
    eformer.RMSPropConfig: dict(decay=0.9, initial_scale=0.0, momentum=None, nesterov=False,
                              eps=1e-8),
    eformer.MarsConfig: dict(weight_decay=0.1, beta1=0.95, beta2=0.99, gamma=0.025, epsilon=1e-8,
                           max_grad_norm=1.0),
    eformer.AdafactorConfig: dict(
        min_dim_size_to_factor=128, decay_rate=0.8, decay_offset=0,
        multiply_by_parameter_scale=True, clipping_threshold=1.0, momentum=None,
        dtype_momentum=jnp.float32, weight_decay_rate=None, eps=1e-30, factored=True),
    eformer.SchedulerConfig: dict(scheduler_type=None, learning_rate=5e-5, learning_rate_end=None,
                                warmup_steps=None, steps=None, exponent=1.0),
    eformer.MuonConfig: dict(
        ns_coeffs=(3.4445, -4.775, 2.0315), ns_steps=5, beta=0.95, eps=1e-8, weight_decay=0.0,
        weight_decay_mask=None, mu_dtype=None, nesterov=True, adaptive=False, adam_b1=0.9,
        adam_b2=0.999, adam_eps_root=0.0, adam_weight_decay=0.0),
    eformer.WhiteKronConfig: dict(
        lr_style="adam", b1=0.95, normalize_grads=False, max_size_dense=16384,
        preconditioner_lr=0.7, preconditioner_init_scale=1.0, dtype=jnp.bfloat16,
        scanned_layers=None, block_size=256, pipeline_axis_name=None, pipeline_axis_size=1,
        params_partition_specs=None, noise_scale=1e-9, weight_decay=0.1, weight_decay_mask=None),
    eformer.SoapConfig: dict(
        weight_decay=0.0, beta1=0.95, beta2=0.95, shampoo_beta=0.95, epsilon=1e-8,
        max_grad_norm=1.0, preconditioner_lr=0.1, preconditioner_init_scale=1.0, mu_dtype=None,
        precond_dtype=None, precond_update_precision="tensorfloat32",
        precond_grads_precision=None, lax_map_scanned_layers=False, lax_map_batch_size=8,
        merge_small_dims=True, target_merged_dim_size=8192, partition_grads_into_blocks=True,
        block_size=256),
    eformer.ScionConfig: dict(momentum=0.95, backend_steps=10, beta1=0.9, epsilon=1e-8,
                            unconstrained=False, spectral_radius=50, sign_radius=3000),
}


@pytest.mark.parametrize("cls", list(EFORMER_FIELDS), ids=lambda c: c.__name__)
def test_eformer_fields_come_first_with_its_defaults(cls):
  fields = dataclasses.fields(cls)
  want = EFORMER_FIELDS[cls]
  assert [f.name for f in fields[: len(want)]] == list(want)
  assert {f.name: f.default for f in fields[: len(want)]} == want


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_dict_and_json_round_trips(cls):
  config = cls() if cls is not eformer.SchedulerConfig else cls("cosine", 1e-3, steps=100)
  assert cls.from_dict(config.to_dict()) == config
  text = config.to_json()
  json.loads(text)  # plain JSON: dtypes are written by name
  again = cls.from_json(text)
  assert again.to_json() == text


def test_eformer_dicts_load_and_unknown_keys_warn():
  # What eFormer's to_dict() gives: dtype classes as they are, maybe keys we lack.
  theirs = {"b1": 0.8, "b2": 0.95, "eps": 1e-6, "eps_root": 0.0, "mu_dtype": jnp.bfloat16}
  assert eformer.AdamWConfig.from_dict(theirs) == eformer.AdamWConfig(
      b1=0.8, b2=0.95, eps=1e-6, mu_dtype=jnp.bfloat16)
  with pytest.warns(UserWarning, match=r"Ignoring unexpected keys \['foo'\] for LionConfig"):
    assert eformer.LionConfig.from_dict({"b1": 0.5, "foo": 1}) == eformer.LionConfig(b1=0.5)
  adafactor = eformer.AdafactorConfig(momentum=0.9, dtype_momentum=jnp.bfloat16)
  assert json.loads(adafactor.to_json())["dtype_momentum"] == "bfloat16"
  # A JSON dtype name builds the same optimizer state as the dtype.
  params = {"w": jnp.ones((4, 4))}
  from_json = eformer.AdafactorConfig.from_json(adafactor.to_json())
  build = lambda c: optim.adafactor(1e-3, momentum=c.momentum, dtype_momentum=c.dtype_momentum)
  assert build(from_json).init(params)[-2].ema["w"].dtype == jnp.bfloat16


def test_configs_are_mutable_and_rechecked_when_used():
  config = eformer.AdamWConfig()
  config.b2 = 0.95
  tx, _ = eformer.OptimizerFactory.create("adamw", None, config, impl="xla")
  assert tx.metadata.optimizer_config.b2 == 0.95
  schedule = eformer.SchedulerConfig("linear", 1e-3, learning_rate_end=0.0, steps=10)
  schedule.warmup_steps = 20
  with pytest.raises(ValueError, match=r"warmup_steps \(20\) must be less than steps \(10\)"):
    eformer.SchedulerFactory.create_scheduler(schedule)


def test_muon_config_carries_the_newton_schulz_options_through_json():
  # pallasopt's extra fields: bf16 iterates and block levels reach muon().
  config = eformer.MuonConfig(iter_dtype="bfloat16", gram_levels=1)
  config = eformer.MuonConfig.from_json(config.to_json())
  schedule = eformer.SchedulerConfig("linear", 1e-2, learning_rate_end=0.0, steps=10)
  tx, _ = eformer.OptimizerFactory.create("muon", schedule, config, impl="xla")
  params = {"w": jnp.linspace(-1.0, 1.0, 64 * 96).reshape(64, 96)}
  grads = {"w": jnp.cos(params["w"] * 7.0)}
  # Jitted: one compile per update (the first two are the same program), not one per op.
  got, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  want_tx = optim.muon(optax.linear_schedule(1e-2, 0.0, 10), iter_dtype=jnp.bfloat16,
                       gram_levels=1, impl="xla")
  want, _ = jax.jit(want_tx.update)(grads, want_tx.init(params), params)
  f32_tx = optim.muon(optax.linear_schedule(1e-2, 0.0, 10), impl="xla")
  f32, _ = jax.jit(f32_tx.update)(grads, f32_tx.init(params), params)
  assert jnp.array_equal(got["w"], want["w"]) and not jnp.array_equal(got["w"], f32["w"])
