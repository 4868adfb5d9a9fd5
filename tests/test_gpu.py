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
from helpers import assert_close, assert_trees_close, random_array, run_steps, tolerance, tree_of
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
  params = tree_of(np.random.default_rng(1), [((1024, 768), jnp.float32), ((768,), jnp.float32)])
  kwargs = dict(learning_rate=1e-3, weight_decay=0.1)
  fused = jax.jit(pallasopt.optim.apply_gradients, static_argnums=0, donate_argnums=(1, 3))
  got = run_steps(pallasopt.optim.adamw(**kwargs, impl="pallas"), jax.tree.map(jnp.copy, params), 3, True, fused)
  assert_trees_close(got, run_steps(optax.adamw(**kwargs), params, 3, False), 2e-6)


def test_auto_runs_xla_and_pallas_runs_triton_on_gpu():
  x = jnp.ones((4096,))
  s = adamw_k.adamw_scalars(jnp.int32(1), 1e-3, 0.9, 0.999, 1e-8, 0.0, 0.1)
  lower = lambda impl: jax.jit(lambda *a: adamw_k.adamw_apply(*a, impl=impl)).lower(x, x, x, x, s)
  assert "triton" not in lower("auto").as_text()
  assert "triton" in lower("pallas").as_text()
