"""The Adafactor kernels lower for TPU (Mosaic) and CUDA (Triton) from this CPU host.

This proves the Pallas-level rules (block shapes, dtypes, scalar memory
spaces, compiler params), not device compilation or speed. Arguments are
`jax.ShapeDtypeStruct`s, so large leaves cost nothing to lower.
"""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import pallasopt
from helpers import CUSTOM_CALL, lowered_text
from pallasopt.kernels import adafactor as adafactor_k
from pallasopt.optim.adafactor import adafactor

PLATFORMS = ["tpu", "cuda"]


def _sds(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def _leaf_args(shape, dims, dtype, momentum_dtype):
  if dims is None:
    moments = (_sds((1,), dtype), _sds((1,), dtype), _sds(shape, dtype))
  else:
    d1, d0 = dims
    moments = (_sds(shape[:d0] + shape[d0 + 1:], dtype), _sds(shape[:d1] + shape[d1 + 1:], dtype),
               _sds((1,), dtype))
  momentum = None if momentum_dtype is None else _sds(shape, momentum_dtype)
  return (_sds(shape, dtype), _sds(shape, dtype), *moments, momentum)


# (shape, stacked_axes, dtype, momentum dtype, kernels): factored leaves make 3
# passes with clipping, unfactored 2 with clipping and parameter scale.
CASES = [
    ((4096, 1024), 0, jnp.float32, None, 3),  # factored, large
    ((1000, 4100), 0, jnp.bfloat16, jnp.float32, 3),  # ragged blocks both ways
    ((3, 300, 1000), 1, jnp.float32, jnp.bfloat16, 3),  # stacked, ragged
    ((2, 3, 3, 256, 384), 2, jnp.bfloat16, None, 3),  # conv-like, two stacked axes
    ((1_000_003,), 0, jnp.float32, jnp.float32, 2),  # unfactored, ragged flat view
    ((4, 300, 7), 1, jnp.float32, None, 2),  # unfactored per layer
    ((), 0, jnp.bfloat16, None, 2),
]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-stacked{c[1]}")
@pytest.mark.parametrize("mode", ["apply", "updates"])
def test_adafactor_kernel_lowers(platform, case, mode):
  shape, stacked, dtype, momentum_dtype, kernels = case
  dims = adafactor_k.factored_dims(shape, True, 128, stacked)
  args = _leaf_args(shape, dims, dtype, momentum_dtype)
  scalars = adafactor_k.adafactor_scalars(jnp.int32(3), learning_rate=1e-2, momentum=0.9,
                                          weight_decay=0.1)
  entry = adafactor_k.adafactor_apply if mode == "apply" else adafactor_k.adafactor_updates
  fn = functools.partial(entry, factored_dims=dims, stacked_axes=stacked,
                         momentum=momentum_dtype is not None, decay=True, impl="pallas")
  text = lowered_text(fn, platform, *args, scalars)
  assert text.count(CUSTOM_CALL[platform]) == kernels


@pytest.mark.parametrize("platform", PLATFORMS)
def test_auto_runs_the_kernels_on_cuda_and_xla_on_tpu(platform):
  # On a TPU XLA's own passes move fewer bytes (kernels/adafactor.py).
  dims = adafactor_k.factored_dims((4096, 1024), True, 128, 0)
  args = _leaf_args((4096, 1024), dims, jnp.float32, None)
  scalars = adafactor_k.adafactor_scalars(jnp.int32(3), learning_rate=1e-2)
  fn = functools.partial(adafactor_k.adafactor_apply, factored_dims=dims, impl="auto")
  kernels = lowered_text(fn, platform, *args, scalars).count(CUSTOM_CALL[platform])
  assert kernels == (3 if platform == "cuda" else 0)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_adafactor_transform_lowers_with_its_passes_per_leaf(platform):
  params = {"w": _sds((768, 3072)), "stack": _sds((4, 512, 256), jnp.bfloat16),
            "b": _sds((3072,)), "s": _sds(())}
  tx = adafactor(optax.cosine_decay_schedule(1e-2, 100), momentum=0.9, weight_decay_rate=1e-3,
                 weight_decay_mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p),
                 stacked_axes=0, impl="pallas")
  state = jax.eval_shape(tx.init, params)
  # Factored: statistics, RMS, update; unfactored: RMS, update.
  passes = 3 + 3 + 2 + 2
  fused = functools.partial(pallasopt.optim.apply_gradients, tx)
  assert lowered_text(fused, platform, params, params, state).count(CUSTOM_CALL[platform]) == passes
  update = lambda p, g, s: tx.update(g, s, p)
  assert lowered_text(update, platform, params, params, state).count(CUSTOM_CALL[platform]) == passes


def test_auto_on_cpu_lowers_to_plain_xla():
  args = _leaf_args((256, 256), (0, 1), jnp.float32, None)
  scalars = adafactor_k.adafactor_scalars(jnp.int32(1))
  fn = jax.jit(functools.partial(adafactor_k.adafactor_apply, factored_dims=(0, 1), impl="auto"))
  assert "custom_call" not in fn.lower(*args, scalars).as_text()
