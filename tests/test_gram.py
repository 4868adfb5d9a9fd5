"""Symmetric Gram matrices: block recursion (XLA) and the Mosaic GPU kernel
(interpreted) equal the full product; Newton–Schulz and Muon on them equal
Optax and cost at most 3/4 of its compiled flops; bf16 iterates keep the
singular values in the promised band and the loss of a real task.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bench import workloads
from helpers import assert_close, digits_mlp, promised_band, random_array, spread_spectrum
from pallasopt.kernels import gram
from pallasopt.kernels import newton_schulz as ns
from pallasopt.kernels import ns_coefficients
from pallasopt.optim.muon import muon

_U32 = float(jnp.finfo(jnp.float32).eps) / 2
_U_BF16 = float(jnp.finfo(jnp.bfloat16).eps) / 2


def _assert_same_sums(got, x):
  """``got`` equals x xᵀ up to f32 summation order.

  Both sides sum the same n exact products (bf16·bf16 and the f32 inputs used
  here are exact in f32) in some order: each is within γ_n Σ|x_ik x_jk| of the
  true value (Higham, Thm. 3.1), so they differ by at most 2 n u |x||x|ᵀ.
  """
  x32 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  want = np.einsum("bik,bjk->bij", x32, x32)
  bound = 2 * x32.shape[-1] * _U32 * np.einsum("bik,bjk->bij", np.abs(x32), np.abs(x32))
  np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - want), bound + 1e-30)


@pytest.mark.parametrize(
    "shape,levels",
    [((2, 64, 40), 1), ((1, 96, 33), 2), ((3, 100, 50), 0), ((1, 512, 70), 4), ((2, 7, 9), 3)],
    ids=str,
)
def test_block_gram_equals_the_full_product(shape, levels):
  x = random_array(np.random.default_rng(0), shape, jnp.float32)
  got = jax.jit(functools.partial(gram.gram_reference, levels=levels))(x)
  assert got.shape == shape[:2] + shape[1:2] and got.dtype == jnp.float32
  _assert_same_sums(got, x)


def test_levels_rule():
  # What was measured fastest (gram._MEASURED_LEVELS): a CPU from 2048 rows.
  rows = (64, 1024, 2047, 2048, 4096)
  assert [gram.gram_levels_for(m, "cpu") for m in rows] == [0, 0, 0, 2, 2]
  for platform in ("cuda", "rocm", "tpu"):
    assert [gram.gram_levels_for(m, platform) for m in rows] == [0] * len(rows)


def test_auto_levels_follow_each_target_platform():
  # gram_levels=None: per step, 2 levels on a CPU (3 dots per symmetric
  # product, + B X), full dots on CUDA; exported for both, both branches. The
  # steps are one loop body (`ns_math.ns_iterations`'s as_loop, unrolled):
  # jax <= 0.11 writes it once in the module and calls it per step, 0.12
  # inlines it per step (5 here); test_compiled_flops_follow_the_model counts
  # all the steps.
  x, t = jax.ShapeDtypeStruct((2048, 2048), jnp.float32), jax.ShapeDtypeStruct((5, 3), jnp.float32)

  def dot_shapes(*platforms):
    exported = jax.export.export(jax.jit(ns.newton_schulz_reference), platforms=platforms)(x, t)
    return re.findall(r"stablehlo.dot_general .*?: \((tensor<\S+>),", exported.mlir_module())

  cpu, cuda = dot_shapes("cpu"), dot_shapes("cuda")
  assert (len(cpu), len(cuda)) in {(2 * 3 + 1, 3), (5 * (2 * 3 + 1), 5 * 3)}
  assert set(cuda) == {"tensor<1x2048x2048xf32>"}
  assert set(dot_shapes("cpu", "cuda")) == set(cpu) | set(cuda) and len(set(cpu)) == 4


@pytest.mark.parametrize("levels", [0, 1, 3])
def test_compiled_flops_follow_the_model(levels):
  # The model counts the dots; the rest is elementwise, a few dozen flops per
  # element of X and A per step (epilogues, casts, XLA's fusion duplicates).
  m, n, steps = 512, 768, 5
  x, t = jax.ShapeDtypeStruct((m, n), jnp.float32), jax.ShapeDtypeStruct((steps, 3), jnp.float32)
  fn = jax.jit(functools.partial(ns.newton_schulz_reference, gram_levels=levels))
  cost = fn.lower(x, t).compile().cost_analysis()
  flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
  model = ns.ns_flops(m, n, steps, gram_levels=levels)
  assert model <= flops <= model + 50 * steps * m * (m + n), (flops, model)


@pytest.mark.parametrize(
    "shape,dtype,tile",
    [((2, 100, 200), jnp.bfloat16, None), ((1, 256, 130), jnp.bfloat16, 128),
     ((3, 64, 64), jnp.float16, 64)],
    ids=str,
)
def test_gram_kernel_interpreted_equals_the_product(shape, dtype, tile):
  x = random_array(np.random.default_rng(1), shape, dtype)
  got = jax.jit(functools.partial(gram.gram_kernel, interpret=True, tile=tile))(x)
  assert np.array_equal(got, jnp.swapaxes(got, 1, 2))
  _assert_same_sums(got, x)


@pytest.mark.parametrize(
    "shape,preconditioning", [((2, 72, 136), "aol"), ((100, 40), "frobenius")], ids=str
)
def test_wgmma_regime_interpreted_equals_the_reference(shape, preconditioning):
  # Same bf16 iterates on both sides; they differ by f32 summation order,
  # which one bf16 rounding per step can turn into one bf16 ulp (2u of 1).
  x = random_array(np.random.default_rng(2), shape, jnp.float32)
  t = jnp.asarray(ns_coefficients.preset_table("quintic"))
  kernel = jax.jit(functools.partial(
      ns.newton_schulz_kernel, preconditioning=preconditioning, iter_dtype=jnp.bfloat16,
      backend="triton", regime="wgmma", interpret=True,
  ))
  reference = jax.jit(functools.partial(
      ns.newton_schulz_reference, preconditioning=preconditioning, iter_dtype=jnp.bfloat16
  ))
  assert_close(kernel(x, t), reference(x, t), 5e-2)


@pytest.mark.parametrize(
    "shape,preconditioning", [((3, 96, 160), "frobenius"), ((200, 130), "aol")], ids=str
)
def test_symmetric_reference_equals_optax(shape, preconditioning):
  x = random_array(np.random.default_rng(3), shape, jnp.float32)
  coeffs = jnp.asarray(optax.contrib._muon._DEFAULT_NS_COEFFS)
  dims = optax.contrib.MuonDimensionNumbers(-2, -1) if len(shape) > 2 else None
  want = jax.jit(lambda x: optax.contrib._muon.orthogonalize_via_newton_schulz(
      x, coeffs, 5, preconditioning, 1e-8, dims))(x)
  got = jax.jit(functools.partial(
      ns.newton_schulz_reference, preconditioning=preconditioning, gram_levels=2))(
      x, ns_coefficients.coefficient_table(coeffs, 5))
  assert_close(got, want, 1e-5)


def _step_flops(tx, params):
  # XLA's cost analysis of the lowered step, before its optimization passes:
  # they fuse and simplify elementwise work, never a matmul away (GPT-2 small
  # at 4 levels: 0.741x lowered, 0.745x compiled; compiling both steps of the
  # 124M-parameter tree took 12 s of the suite's time).
  state = jax.eval_shape(tx.init, params)
  cost = jax.jit(lambda g, s, p: tx.update(g, s, p)).lower(params, state, params).cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)["flops"]


@pytest.mark.parametrize(
    "name,tree",
    [("4096x4096", {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}),
     ("gpt2-small", workloads.gpt2(**workloads.GPT2_SMALL).tree)],
)
def test_muon_step_costs_at_most_three_quarters_of_optax_flops(name, tree):
  # Model: square 4096^2 at 4 levels 0.69x; GPT-2 small (768 rows) 0.74x.
  optax_flops = _step_flops(optax.contrib.muon(1e-3), tree)
  assert _step_flops(muon(1e-3, impl="xla", gram_levels=4), tree) <= 0.75 * optax_flops
  if name == "4096x4096":  # without the Gram levels, Optax's flops (one compile of GPT-2 small less)
    full = _step_flops(muon(1e-3, impl="xla", gram_levels=0), tree)
    assert 0.99 * optax_flops <= full <= 1.01 * optax_flops


@pytest.mark.parametrize("preset,steps", [("simple", 5), ("polar_express", 8), ("cubic5", 5)])
def test_bf16_iterates_keep_singular_values_in_the_band(preset, steps):
  # The last step rounds B and X to bf16 once each; a relative rounding
  # uncorrelated with the singular vectors moves a singular value near 1 by
  # about u, so the band is widened by 2u (u = 2^-8). Measured: at most 1.2u.
  g, scaled = spread_spectrum(np.random.default_rng(4), 128, 384)
  table = jnp.asarray(ns_coefficients.preset_table(preset, steps))
  lo, hi = promised_band(table, scaled.min(), scaled.max())
  out = jax.jit(functools.partial(ns.newton_schulz_reference, iter_dtype=jnp.bfloat16))(g, table)
  sv = np.linalg.svd(np.asarray(out, np.float64), compute_uv=False)
  assert lo - 2 * _U_BF16 <= sv.min() and sv.max() <= hi + 2 * _U_BF16, (lo, hi, sv.min(), sv.max())


def test_bf16_iterates_reach_the_f32_loss_on_digits():
  # scikit-learn's digits (1797 8x8 images, 10 classes), a 64-128-10 tanh MLP,
  # 100 full-batch Muon steps. Acceptance: bf16 Newton-Schulz ends within 1%
  # of the f32 loss (measured: 0.1027 f32, 0.1028 bf16, 0.09%).
  init, loss = digits_mlp(128)

  def final_loss(tx):
    @jax.jit
    def step(p, s):
      g = jax.grad(loss)(p)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    p, s = init, tx.init(init)
    for _ in range(100):
      p, s = step(p, s)
    return float(loss(p))

  f32 = final_loss(muon(0.02))
  bf16 = final_loss(muon(0.02, iter_dtype=jnp.bfloat16))
  assert f32 < 0.5 * float(loss(init))
  assert abs(bf16 - f32) <= 0.01 * f32, (f32, bf16)


@pytest.mark.parametrize(
    "call,error",
    [
        (lambda: gram.gram_kernel(jnp.zeros((1, 64, 64)), interpret=True), TypeError),
        (lambda: gram.gram_kernel(jnp.zeros((64, 64), jnp.bfloat16), interpret=True), ValueError),
        (lambda: gram.gram_kernel(jnp.zeros((1, 64, 64), jnp.bfloat16), tile=32), ValueError),
        (lambda: gram.gram_reference(jnp.zeros((1, 64, 64)), levels=-1), ValueError),
        (lambda: ns.newton_schulz_reference(jnp.zeros((64, 64)), jnp.ones((1, 3)), gram_levels=1.5),
         ValueError),
        (lambda: ns.newton_schulz_kernel(
            jnp.zeros((64, 64)), jnp.ones((1, 3)), backend="tpu", regime="wgmma"), ValueError),
        (lambda: ns.newton_schulz_kernel(
            jnp.zeros((64, 64)), jnp.ones((1, 3)), backend="triton", regime="wgmma"), TypeError),
        (lambda: gram.gram_reference(jnp.zeros((1, 64, 64)), levels=None), ValueError),
        (lambda: muon(1e-3, gram_levels=-1), ValueError),
    ],
)
def test_bad_arguments(call, error):
  with pytest.raises(error):
    call()
