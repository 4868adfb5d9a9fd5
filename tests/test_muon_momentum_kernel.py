"""Muon's blockwise momentum kernel against its reference, and where ``"auto"`` runs it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (
    CHIPS,
    CUSTOM_CALL,
    assert_close,
    assert_nearly_same_codes,
    lowered_text,
    pairwise,
    random_array,
    sds,
    tolerance,
)
from pallasopt import optim
from pallasopt.kernels import muon_momentum as mm
from pallasopt.kernels import quant, rounding

# (nesterov, lerp): Optax's default, the plain bias-corrected momentum, lerp.
_VARIANTS = [(True, False), (False, False), (True, True)]


def _scalars(count, nesterov=True, lerp=False):
  return mm.muon_momentum_scalars(0.95, jnp.int32(count), nesterov=nesterov, lerp=lerp)


# Every pair of backend (block specs), format, shape and gradient dtype (`pairwise`).
@pytest.mark.parametrize("backend,fmt,shape,grad_dtype", pairwise(
    ["tpu", "triton"], quant.FORMATS, [(256, 512), (8, 2048), (3, 64, 256)],
    [jnp.float32, jnp.bfloat16]), ids=lambda v: getattr(v, "__name__", str(v)))
def test_kernel_state_equals_reference_over_steps(backend, fmt, shape, grad_dtype):
  # Both jitted, as the elementwise families' contract: the stored state is
  # the reference's code for code (f32 gradients); m_hat within an f32 ulp
  # of its terms (XLA may contract the multiply-adds differently).
  rng = np.random.default_rng(0)
  reference = jax.jit(mm.muon_momentum_reference)
  kernel = jax.jit(functools.partial(mm.muon_momentum_kernel, backend=backend, interpret=True))
  m = quant.quantize(random_array(rng, shape, jnp.float32), fmt=fmt)
  for count, (nesterov, lerp) in enumerate(_VARIANTS, start=1):
    g = random_array(rng, shape, grad_dtype)
    s, key = _scalars(count, nesterov, lerp), rounding.step_key(7, jnp.int32(count))
    want, got = reference(None, g, m, s, key), kernel(None, g, m, s, key)
    assert got[0].dtype == want[0].dtype == jnp.float32
    assert_close(got[0], want[0], tolerance(jnp.float32), f"step {count}",
                 operands=(quant.dequantize(m), g))
    if grad_dtype == jnp.float32:
      for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"step {count}")
    else:
      assert_nearly_same_codes(got[1], want[1])
    m = want[1]


@pytest.mark.parametrize("backend", ["tpu", "triton"])
def test_grad_scale_is_the_step_on_the_scaled_gradient(backend):
  # A clip factor applied as the kernel loads g is the step on g * scale
  # computed outside: the same f32 product, so the same codes and m_hat.
  rng = np.random.default_rng(2)
  m = quant.quantize(random_array(rng, (8, 1024), jnp.float32), fmt="int8")
  g = random_array(rng, (8, 1024), jnp.float32)
  scale, key = jnp.float32(0.37), rounding.step_key(3, jnp.int32(2))
  scaled = mm.muon_momentum_scalars(0.95, jnp.int32(2), nesterov=True, lerp=False,
                                    grad_scale=scale)
  kernel = jax.jit(functools.partial(mm.muon_momentum_kernel, backend=backend, interpret=True))
  got = kernel(None, g, m, scaled, key)
  want = jax.jit(mm.muon_momentum_reference)(None, g * scale, m, _scalars(2), key)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("nesterov,lerp", _VARIANTS)
def test_reference_is_muons_momentum_on_the_decoded_state(nesterov, lerp):
  # Optax's formulas (optax.contrib.muon; the lerp forms without correction)
  # on the decoded momentum: m_hat within f32 rounding, the new state the
  # codes of m_t.
  rng = np.random.default_rng(1)
  m = quant.quantize(random_array(rng, (16, 256), jnp.float32), fmt="int8")
  g = random_array(rng, (16, 256), jnp.float32)
  count, b = 4, 0.95
  hat, new = mm.muon_momentum_reference(
      None, g, m, _scalars(count, nesterov, lerp), rounding.step_key(0, jnp.int32(count)))
  m_t = (1 - b) * g + b * quant.dequantize(m)
  if lerp:
    want = (1 - b) * g + b * m_t if nesterov else m_t
  elif nesterov:
    want = b * m_t / (1 - b ** (count + 1)) + (1 - b) * g / (1 - b**count)
  else:
    want = m_t / (1 - b**count)
  assert_close(hat, want, 4 * tolerance(jnp.float32), operands=(m_t, g))
  # Stochastic codes: each decodes within one step of the int8 map of m_t.
  assert_close(quant.dequantize(new), m_t, 2.0**-5, operands=(m_t,))


@pytest.mark.parametrize("chip", ["v5e", "h100", "a100", "b200"])
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_auto_runs_the_momentum_kernel_for_blockwise_state(fmt, chip):
  # One more kernel than with an f32 momentum (which XLA fuses into
  # Newton-Schulz's first pass) per blockwise leaf; fp8 conversions need a
  # CUDA compute capability of 8.9: XLA on an A100.
  tree = {"w": sds((256, 512))}
  platform = CHIPS[chip][1]

  def kernels(state_format):
    tx = optim.muon(1e-3, state_format=state_format)
    text = lowered_text(lambda g, s, p: tx.update(g, s, p), platform,
                        tree, jax.eval_shape(tx.init, tree), tree, chip=chip)
    return text.count(CUSTOM_CALL[platform])

  assert kernels(fmt) - kernels(None) == int(not (fmt == "fp8" and chip == "a100"))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(4096, 1024), (3, 64, 256)], ids=str)
def test_compiled_triton_kernel_matches_reference_on_a_gpu(shape, fmt):
  # Natively compiled, Triton and XLA may contract the multiply-adds
  # differently: the codes of an element one apart at most.
  rng = np.random.default_rng(2)
  m = quant.quantize(random_array(rng, shape, jnp.float32), fmt=fmt)
  g = random_array(rng, shape, jnp.float32)
  s, key = _scalars(5), rounding.step_key(0, jnp.int32(5))
  want = jax.jit(mm.muon_momentum_reference)(None, g, m, s, key)
  got = jax.jit(functools.partial(mm.muon_momentum_kernel, backend="triton"))(None, g, m, s, key)
  assert_close(got[0], want[0], tolerance(jnp.float32), operands=(quant.dequantize(m), g))
  assert_nearly_same_codes(got[1], want[1])
