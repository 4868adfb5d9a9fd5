"""Native GPU runs of the Lion Pallas kernel (``pytest -m gpu`` on a CUDA machine).

Every test is skipped wherever ``jax.default_backend() != "gpu"`` (conftest.py).
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import assert_close, assert_trees_close, random_array, run_steps, tolerance, tree_of
from pallasopt.kernels import lion as lion_k
from pallasopt.optim._base import apply_gradients
from pallasopt.optim.lion import lion

pytestmark = pytest.mark.gpu

# (params/grads dtype, momentum dtype) x mode x decay.
CASES = list(itertools.product(
    [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32), (jnp.bfloat16, jnp.bfloat16)],
    ["apply", "updates"],
    [False, True],
))


@pytest.mark.parametrize("shape", [(), (7,), (129,), (37, 128), (3, 5, 7, 11), (1_000_003,), (4096, 1024)], ids=str)
def test_compiled_triton_kernel_equals_reference(shape):
  rng = np.random.default_rng(0)
  s = lion_k.lion_scalars(3e-4, 0.9, 0.99, 0.1, grad_scale=0.5)
  for (dtype, mu_dtype), mode, decay in CASES:
    p, g = random_array(rng, shape, dtype), random_array(rng, shape, dtype)
    m = random_array(rng, shape, mu_dtype, scale=0.1)
    kernel = functools.partial(lion_k.lion_kernel, mode=mode, decay=decay, backend="triton")
    got = jax.jit(kernel)(p, g, m, s)
    want = lion_k.lion_reference(p, g, m, s, mode=mode, decay=decay)
    for a, b in zip(got, want):
      assert a.dtype == b.dtype, (dtype, mu_dtype, mode, decay)
      assert_close(a, b, tolerance(a.dtype), err_msg=f"{dtype} {mu_dtype} {mode} {decay}")


def test_donated_fused_steps_match_optax():
  params = tree_of(np.random.default_rng(1), [((1024, 768), jnp.float32), ((768,), jnp.float32)])
  kwargs = dict(learning_rate=optax.cosine_decay_schedule(1e-3, 10), weight_decay=0.1)
  fused = jax.jit(apply_gradients, static_argnums=0, donate_argnums=(1, 3))
  got = run_steps(lion(**kwargs, impl="pallas"), jax.tree.map(jnp.copy, params), 3, True, fused)
  assert_trees_close(got, run_steps(optax.lion(**kwargs), params, 3, False))


def test_auto_runs_xla_and_pallas_runs_triton_on_gpu():
  x = jnp.ones((4096,))
  s = lion_k.lion_scalars(1e-4, 0.9, 0.99, 0.1)
  lower = lambda impl: jax.jit(functools.partial(lion_k.lion_apply, impl=impl)).lower(x, x, x, s)
  assert "triton" not in lower("auto").as_text()
  assert "triton" in lower("pallas").as_text()
