"""Native GPU runs of the Kron kernels (``pytest -m gpu`` on a CUDA machine).

Skipped wherever ``jax.default_backend() != "gpu"`` (see conftest.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_close, assert_trees_close
from pallasopt.kernels import kron as kk
from pallasopt.kernels import kron_factor as kf
from pallasopt.optim.kron import kron

pytestmark = pytest.mark.gpu


def _factor(rng, batch, d, kind):
  if kind == "dense":
    return jnp.asarray(np.triu(rng.standard_normal((batch, d, d))) * 0.1 + np.eye(d), jnp.float32)
  return jnp.asarray(1.0 + 0.3 * np.abs(rng.standard_normal((batch, d))), jnp.float32)


@pytest.mark.parametrize(
    "shape,kinds",
    [((7,), ("diag",)), ((6, 7), ("dense", "dense")), ((48, 64), ("dense", "dense")),
     ((100, 30), ("dense", "diag")), ((3, 4, 5), ("dense", "diag", "dense"))],
    ids=str,
)
@pytest.mark.parametrize("mode", ["apply", "updates", "precond"])
def test_triton_precondition_equals_reference(shape, kinds, mode):
  rng = np.random.default_rng(0)
  g, mu, p = (jnp.asarray(rng.standard_normal((4, *shape)), jnp.float32) for _ in range(3))
  qs = [_factor(rng, 4, d, k) for d, k in zip(shape, kinds)]
  s = kk.kron_scalars(3, 1e-2, 0.9, 0.1)
  run = lambda impl: jax.jit(functools.partial(kk.kron_precondition, mode=mode, decay=True, impl=impl))
  # tf32 tensor cores: compare against the reference at matching precision.
  with jax.default_matmul_precision("float32"):
    want = run("xla")(g, mu, p, qs, s)
  got = run("pallas")(g, mu, p, qs, s)
  for a, b in zip(got, want):
    assert_close(a, b, 2e-3)


@pytest.mark.parametrize("kind,d,r", [("dense", 16, 300), ("dense", 60, 64), ("diag", 7, 30)])
def test_triton_factor_update_equals_reference(kind, d, r):
  rng = np.random.default_rng(1)
  q = _factor(rng, 3, d, kind)
  x, y = (jnp.asarray(rng.standard_normal((3, d, r)), jnp.float32) for _ in range(2))
  with jax.default_matmul_precision("float32"):
    want = jax.jit(kf.kron_factor_update_reference)(q, x, y, 0.1)
  got = jax.jit(functools.partial(kf.kron_factor_update, impl="pallas"))(q, x, y, 0.1)
  assert_close(got, want, 2e-3)


def test_fused_transform_on_gpu_matches_xla_over_steps():
  rng = np.random.default_rng(2)
  params = {"w": jnp.asarray(rng.standard_normal((2, 48, 64)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)}
  results = []
  for impl in ("pallas", "xla"):
    tx = kron(1e-3, weight_decay=0.1, stacked_axes=1, impl=impl,
              precond_update_precision="float32", precond_grads_precision="float32")
    step = jax.jit(tx.apply_gradients)
    p, state = params, tx.init(params)
    for i in range(3):
      p, state = step(p, jax.tree.map(lambda x: jnp.sin(x * (i + 1)), p), state)
    results.append((p, state))
  assert_trees_close(*results, rtol=2e-3)
