"""Newton–Schulz kernels (every regime) and Muon lower for TPU and CUDA.

Arguments are `jax.ShapeDtypeStruct`s, so large matrices cost nothing.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

import pallasopt
from helpers import CUSTOM_CALL, MOSAIC_GPU_CALL, lowered_text
from pallasopt.kernels import gram
from pallasopt.kernels import newton_schulz as ns
from pallasopt.kernels import ns_coefficients
from pallasopt.optim.muon import muon

PLATFORMS = ["tpu", "cuda"]


def _sds(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


# (shape, dtype, preconditioning, launches per platform). TPU: small stacks
# run resident (one launch), large matrices tiled (3 launches per step, 5
# steps). CUDA: bf16 iterates run the wgmma regime, two Mosaic GPU Gram
# kernels per step (``cuda`` counts (Triton, Mosaic GPU) launches); f32
# iterates have no CUDA kernel (None: a TypeError naming iter_dtype). The
# CUDA exports name an H100: wgmma is Hopper's (see test_wgmma_needs_hopper).
CASES = [
    ((4, 24, 40), jnp.float32, "frobenius", {"tpu": 1, "cuda": None}),
    ((40, 24), jnp.bfloat16, "aol", {"tpu": 1, "cuda": (0, 10)}),
    ((64, 256, 1024), jnp.bfloat16, "schatten", {"tpu": 1, "cuda": (0, 10)}),
    ((1024, 1024), jnp.float32, "frobenius", {"tpu": 15, "cuda": None}),
    ((4096, 1000), jnp.bfloat16, "spectral", {"tpu": 15, "cuda": (0, 10)}),
]


def _launches(text, platform):
  if platform == "tpu":
    return text.count(CUSTOM_CALL["tpu"])
  return text.count(CUSTOM_CALL["cuda"]), text.count(MOSAIC_GPU_CALL)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("shape,dtype,preconditioning,launches", CASES, ids=str)
def test_newton_schulz_lowers(platform, shape, dtype, preconditioning, launches):
  fn = lambda x, t: ns.newton_schulz(x, t, preconditioning=preconditioning, impl="pallas")
  args = _sds(shape, dtype), _sds((5, 3))
  chip = "h100" if platform == "cuda" else None
  if launches[platform] is None:
    with pytest.raises(TypeError, match="iter_dtype"):
      lowered_text(fn, platform, *args, chip=chip)
  else:
    assert _launches(lowered_text(fn, platform, *args, chip=chip), platform) == launches[platform]


def test_f32_input_with_bf16_iterates_runs_wgmma_on_cuda():
  fn = lambda x, t: ns.newton_schulz(x, t, iter_dtype=jnp.bfloat16, impl="pallas")
  text = lowered_text(fn, "cuda", _sds((2, 512, 1536)), _sds((5, 3)), chip="h100")
  assert _launches(text, "cuda") == (0, 10)


@pytest.mark.parametrize("chip", ["a100", "b200", None])
def test_wgmma_needs_hopper(chip):
  # Mosaic GPU's wgmma compiles for sm_90a only; an export naming no chip
  # assumes the oldest supported GPU (an A100).
  args = _sds((2, 512, 1536), jnp.bfloat16), _sds((5, 3))
  pallas = lambda x, t: ns.newton_schulz(x, t, impl="pallas")
  with pytest.raises(ValueError, match=r"newton_schulz GPU kernel cannot run on .*sm_90a.*impl='auto'"):
    lowered_text(pallas, "cuda", *args, chip=chip)
  auto = lambda x, t: ns.newton_schulz(x, t, impl="auto")
  assert _launches(lowered_text(auto, "cuda", *args, chip=chip), "cuda") == (0, 0)


def test_symmetric_gram_kernel_lowers_for_cuda():
  text = lowered_text(gram.gram_kernel, "cuda", _sds((3, 4096, 11008), jnp.bfloat16), chip="h100")
  assert _launches(text, "cuda") == (0, 1)


def test_auto_runs_the_resident_mosaic_kernel_on_tpu_and_xla_on_cuda():
  # On CUDA GPUs cuBLAS beat the (removed) Triton Newton-Schulz kernels; on a
  # TPU the tiled regime moves more bytes than XLA (policy.TPU_AUTO), the
  # resident one (a 512x1024 matrix: 15 MiB of VMEM) what XLA does.
  fn = lambda x, t: ns.newton_schulz(x, t, impl="auto")
  resident, tiled = (_sds((512, 1024)), _sds((5, 3))), (_sds((1024, 1024)), _sds((5, 3)))
  assert ns.choose_regime(1024, 1024, "tpu") == "tiled"
  assert lowered_text(fn, "tpu", *resident).count(CUSTOM_CALL["tpu"]) == 1
  assert CUSTOM_CALL["tpu"] not in lowered_text(fn, "tpu", *tiled)
  assert CUSTOM_CALL["cuda"] not in lowered_text(fn, "cuda", *resident)
  assert MOSAIC_GPU_CALL not in lowered_text(fn, "cuda", *resident)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_muon_transform_lowers(platform):
  params = {"w": _sds((256, 512)), "stack": _sds((3, 64, 128)), "b": _sds((512,))}
  tx = muon(1e-3, stacked_axes=0, impl="pallas", iter_dtype=jnp.bfloat16,
            muon_weight_dimension_numbers={
                "w": pallasopt.optim.MuonDimensionNumbers(),
                "stack": pallasopt.optim.MuonDimensionNumbers(1, 2), "b": None})
  state = jax.eval_shape(tx.init, params)
  fused = functools.partial(pallasopt.optim.apply_gradients, tx)
  text = lowered_text(fused, platform, params, params, state, chip={"tpu": None, "cuda": "h100"}[platform])
  # One AdamW kernel (Triton on CUDA); per Muon shape one resident launch
  # (TPU) or 5 wgmma steps of 2 Mosaic GPU launches (CUDA).
  assert _launches(text, platform) == {"tpu": 3, "cuda": (1, 20)}[platform]


def test_auto_on_cpu_lowers_to_plain_xla():
  fn = jax.jit(lambda x, t: ns.newton_schulz(x, t, impl="auto"))
  assert "custom_call" not in fn.lower(_sds((4, 24, 40)), _sds((5, 3))).as_text()


def test_muon_takes_same_shape_matrices_one_at_a_time_on_tpu_and_batched_elsewhere():
  # On a TPU a batch of large matrices overflows VMEM (optim/muon/_orthogonalize.py,
  # `_orthogonalize_group`): each matrix gets its own resident kernel there;
  # elsewhere the three are one batch.
  tx = muon(1e-3, impl="pallas", iter_dtype=jnp.bfloat16)
  step = lambda g, s, p: tx.update(g, s, p)

  def kernels(platform, count):
    params = {f"w{i}": _sds((256, 512)) for i in range(count)}
    state = jax.eval_shape(tx.init, params)
    chip = {"tpu": None, "cuda": "h100"}[platform]
    text = lowered_text(step, platform, params, state, params, chip=chip)
    return text.count(CUSTOM_CALL["tpu"]) + text.count(MOSAIC_GPU_CALL)

  assert kernels("tpu", 3) == 3 * kernels("tpu", 1) > 0
  assert kernels("cuda", 3) == kernels("cuda", 1) > 0


def test_one_at_a_time_and_batched_orthogonalize_alike():
  import importlib

  muon_module = importlib.import_module("pallasopt.optim.muon._orthogonalize")

  table = jnp.asarray(ns_coefficients.preset_table("simple", 5))
  group = [jax.random.normal(jax.random.key(i), (2, 64, 96)) for i in range(3)]
  orthogonalize = ns.newton_schulz_reference
  one = muon_module.one_at_a_time(orthogonalize, group, table)
  batched = muon_module.batched(orthogonalize, group, table)
  for a, b in zip(one, batched):
    assert a.shape == b.shape
    assert jnp.allclose(a, b, rtol=0, atol=1e-6)
