"""Native GPU runs of the Pallas kernels (``pytest -m gpu`` on a CUDA machine).

Skipped wherever ``jax.default_backend() != "gpu"`` (see conftest.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pallasopt
from helpers import assert_close, random_array, tolerance
from pallasopt.kernels import adamw as adamw_k

pytestmark = pytest.mark.gpu

SHAPES = [(), (7,), (129,), (37, 128), (3, 5, 7, 11), (1_000_003,), (4096, 1024)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mode", ["apply", "updates"])
@pytest.mark.parametrize("dtype,mu_dtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32), (jnp.bfloat16, jnp.bfloat16)])
@pytest.mark.parametrize("nesterov", [False, True])
def test_triton_adamw_equals_reference(shape, mode, dtype, mu_dtype, nesterov):
  rng = np.random.default_rng(0)
  p, g = random_array(rng, shape, dtype), random_array(rng, shape, dtype)
  m = random_array(rng, shape, mu_dtype, scale=0.1)
  v = random_array(rng, shape, dtype, positive=True, scale=0.1)
  s = adamw_k.adamw_scalars(jnp.int32(5), 3e-3, 0.9, 0.99, 1e-8, 0.0, 0.1)
  entry = adamw_k.adamw_apply if mode == "apply" else adamw_k.adamw_updates
  got = jax.jit(functools.partial(entry, nesterov=nesterov, impl="pallas"))(p, g, m, v, s)
  want = adamw_k.adamw_reference(p, g, m, v, s, mode=mode, nesterov=nesterov, decay=True)
  for a, b in zip(got, want):
    assert a.dtype == b.dtype
    assert_close(a, b, tolerance(a.dtype))


def test_fused_transform_on_gpu_matches_optax_over_steps():
  rng = np.random.default_rng(1)
  params = {"w": random_array(rng, (1024, 768), jnp.float32), "b": random_array(rng, (768,), jnp.float32)}
  tx = pallasopt.optim.adamw(1e-3, weight_decay=0.1, impl="pallas")
  ref = optax.adamw(1e-3, weight_decay=0.1)
  step = jax.jit(functools.partial(pallasopt.optim.apply_gradients, tx), donate_argnums=(0, 2))
  ours, state = jax.tree.map(jnp.copy, params), tx.init(params)
  theirs, ref_state = params, ref.init(params)
  for i in range(3):
    grads = jax.tree.map(lambda x: jnp.sin(x * (i + 1)), theirs)
    ours, state = step(ours, grads, state)
    updates, ref_state = ref.update(grads, ref_state, theirs)
    theirs = optax.apply_updates(theirs, updates)
  for a, b in zip(jax.tree.leaves((ours, state)), jax.tree.leaves((theirs, ref_state))):
    assert_close(a, b, 2e-6)


def test_auto_uses_the_triton_kernel_on_gpu():
  x = jnp.ones((4096,))
  s = adamw_k.adamw_scalars(jnp.int32(1), 1e-3, 0.9, 0.999, 1e-8, 0.0, 0.1)
  text = jax.jit(lambda *a: adamw_k.adamw_apply(*a, impl="auto")).lower(x, x, x, x, s).as_text()
  assert "triton" in text
