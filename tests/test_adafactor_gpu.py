"""Native GPU runs of the Adafactor Triton kernels (``pytest -m gpu`` on a CUDA machine).

Skipped wherever ``jax.default_backend() != "gpu"`` (see conftest.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pallasopt
from helpers import assert_close, assert_trees_close, random_array, run_steps, tolerance, tree_of
from pallasopt.kernels import adafactor as adafactor_k
from pallasopt.optim.adafactor import adafactor
from test_adafactor_kernel import state_for

pytestmark = pytest.mark.gpu

# (shape, stacked_axes): factored (square, tall, wide, ragged, stacked, conv-like)
# and unfactored leaves.
CASES = [((), 0), ((7,), 0), ((1_000_003,), 0), ((37, 129), 0), ((4096, 1024), 0),
         ((1000, 4100), 0), ((3, 300, 1000), 1), ((3, 3, 256, 384), 0), ((4, 300, 7), 1)]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("mode", ["apply", "updates"])
@pytest.mark.parametrize("dtype,momentum_dtype", [(jnp.float32, jnp.float32),
                                                  (jnp.bfloat16, None),
                                                  (jnp.bfloat16, jnp.bfloat16)])
def test_triton_adafactor_equals_reference(case, mode, dtype, momentum_dtype):
  shape, stacked = case
  dims = adafactor_k.factored_dims(shape, True, 128, stacked)
  rng = np.random.default_rng(0)
  p, g = random_array(rng, shape, dtype), random_array(rng, shape, dtype)
  state = state_for(shape, dims, dtype, momentum_dtype)
  config = dict(factored_dims=dims, stacked_axes=stacked, momentum=momentum_dtype is not None,
                decay=True)
  s = adafactor_k.adafactor_scalars(jnp.int32(5), learning_rate=3e-2, momentum=0.9,
                                    weight_decay=0.1)
  entry = adafactor_k.adafactor_apply if mode == "apply" else adafactor_k.adafactor_updates
  got = jax.jit(functools.partial(entry, **config, impl="pallas"))(p, g, *state, s)
  want = adafactor_k.adafactor_reference(p, g, *state, s, mode=mode, **config)
  for a, b in zip(got, want):
    if b is None:
      assert a is None
      continue
    assert a.dtype == b.dtype
    assert_close(a, b, tolerance(a.dtype))


def test_fused_transform_on_gpu_matches_optax_over_steps():
  params = tree_of(np.random.default_rng(1), [((1024, 768), jnp.float32), ((768,), jnp.float32)])
  kwargs = dict(learning_rate=1e-2, momentum=0.9, weight_decay_rate=1e-3)
  fused = jax.jit(pallasopt.optim.apply_gradients, static_argnums=0, donate_argnums=(1, 3))
  got = run_steps(adafactor(**kwargs, impl="pallas"), jax.tree.map(jnp.copy, params), 3, True, fused)
  assert_trees_close(got, run_steps(optax.adafactor(**kwargs), params, 3, False), 1e-5)


def test_auto_uses_the_triton_kernels_on_gpu():
  shape, dims = (512, 256), (1, 0)
  args = (jnp.ones(shape), jnp.ones(shape), *state_for(shape, dims, jnp.float32))
  s = adafactor_k.adafactor_scalars(jnp.int32(1))
  fn = jax.jit(functools.partial(adafactor_k.adafactor_apply, factored_dims=dims, impl="auto"))
  assert "triton" in fn.lower(*args, s).as_text()
