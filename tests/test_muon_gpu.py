"""Native GPU runs of the Newton–Schulz (Mosaic GPU) kernels and Muon (``pytest -m gpu``).

Skipped wherever ``jax.default_backend() != "gpu"`` (see conftest.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pallasopt
from helpers import assert_close, random_array
from pallasopt.kernels import gram
from pallasopt.kernels import newton_schulz as ns
from pallasopt.kernels import ns_coefficients
from pallasopt.optim.muon import muon

pytestmark = pytest.mark.gpu

_HIGHEST = jax.default_matmul_precision("highest")


@pytest.mark.parametrize("shape", [(2, 100, 200), (1, 1024, 4096), (3, 768, 3072)], ids=str)
def test_mosaic_gpu_gram_equals_reference(shape):
  x = random_array(np.random.default_rng(0), shape, jnp.bfloat16)
  got = jax.jit(gram.gram_kernel)(x)
  with _HIGHEST:
    want = jax.jit(functools.partial(gram.gram_reference, levels=0))(x)
  # Same exact bf16 products, f32 sums in another order: 2 n u of |x||x|ᵀ.
  assert_close(got, want, 2 * shape[-1] * float(jnp.finfo(jnp.float32).eps))


@pytest.mark.parametrize("shape", [(8, 256, 1024), (1024, 1024), (768, 3072)], ids=str)
def test_wgmma_newton_schulz_equals_reference(shape):
  x = random_array(np.random.default_rng(1), shape, jnp.float32)
  table = jnp.asarray(ns_coefficients.preset_table("quintic", 5))
  fn = functools.partial(ns.newton_schulz, iter_dtype=jnp.bfloat16, impl="pallas")
  got = jax.jit(fn)(x, table)
  want = jax.jit(functools.partial(ns.newton_schulz_reference, iter_dtype=jnp.bfloat16))(x, table)
  assert_close(got, want, 5e-2)


@pytest.mark.parametrize("impl,iter_dtype", [("auto", None), ("pallas", jnp.bfloat16)])
def test_fused_muon_on_gpu_matches_the_xla_path_over_steps(impl, iter_dtype):
  # impl="auto" runs XLA on CUDA: Optax's numbers. impl="pallas" runs the
  # wgmma regime (bf16 iterates), judged against XLA's bf16 iterates.
  rng = np.random.default_rng(1)
  params = {"w": random_array(rng, (512, 768), jnp.float32), "b": random_array(rng, (768,), jnp.float32)}
  tx = muon(1e-2, weight_decay=0.1, impl=impl, iter_dtype=iter_dtype)
  if iter_dtype is None:
    ref = optax.contrib.muon(1e-2, weight_decay=0.1)
  else:
    ref = muon(1e-2, weight_decay=0.1, impl="xla", iter_dtype=iter_dtype)
  step = jax.jit(functools.partial(pallasopt.optim.apply_gradients, tx))
  ours, state = params, tx.init(params)
  theirs, ref_state = params, ref.init(params)
  with _HIGHEST:
    for i in range(3):
      grads = jax.tree.map(lambda x: jnp.sin(x * (i + 1)), theirs)
      ours, state = step(ours, grads, state)
      updates, ref_state = jax.jit(ref.update)(grads, ref_state, theirs)
      theirs = optax.apply_updates(theirs, updates)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    assert_close(a, b, 1e-3 if iter_dtype is None else 5e-2)
