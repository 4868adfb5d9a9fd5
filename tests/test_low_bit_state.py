"""Low-bit optimizer state (``state_format``) and stochastic rounding of params.

Kernels (interpret mode) against the jitted reference, bit for bit; lowering
for TPU and CUDA; the transforms' state layout, bytes, sharding specs,
conversion and checkpointing; convergence on a real task.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import pallasopt
from helpers import (
    CUSTOM_CALL,
    assert_close,
    assert_nearly_same_codes,
    blockwise_adam_moments,
    digits_mlp,
    frozen_at,
    lowered_text,
    random_array,
    sds,
    tolerance,
)
from pallasopt.kernels import (
    _elementwise, _tiling, adamw as adamw_k, codecs, lion as lion_k, quant, rounding,
)
from pallasopt.optim import (
    DynamicInt8Blockwise, Fp8Blockwise, Int8Blockwise, Int8RatioBlockwise, RatioBlockwise,
    RootBlockwise,
)
from pallasopt.pipeline.sharding import optimizer_state_specs

# Leaves that exercise the 8-bit kernel's tiling: one block, whole rows of
# blocks with a ragged row block, blocks spanning rows, several grid steps,
# and sizes with a ragged last block (which the kernel refuses: the
# dispatch runs the reference there).
# The f32 unit roundoff: one rounding moves a value v by at most U |v|.
_U = 2.0**-24
# The e3m4 map's largest half gap, as a fraction of the block absmax A: half
# a step of its top binade, 2^-4 / (2 T) with T = 31/16.
_HALF_GAP = float(np.diff(codecs.e3m4_map_values()).max()) / 2
# Rounding inside encode and decode, in roundings of at most U A each: the
# normalisation x / A (1) and the product T x (1) before the code is cut
# from its bits; decode's 1/T (1), the product by it (1) and by A (1).
_CODEC_ROUNDINGS = 5


# The root map: neighbouring values at most 2^-4 apart relative to the smaller
# (a stochastic rounding lands on one of the two around the value); roots
# below its least value (2^-15 / (31/16) of the block's absmax) decode to it.
_ROOT_STEP = 2.0**-4
_LEAST_ROOT = 2.0**-15 * 16 / 31


def _root_bound(w, absmax):
  """The largest |decoded root - w| of a stochastically rounded root ``w`` (f32 roundings aside)."""
  return _ROOT_STEP * np.maximum(w, _LEAST_ROOT * absmax) + _LEAST_ROOT * absmax


def _pair_error(got_m, got_v, m, v):
  """Per element, whether stored (m, v) decode within the bounds of a ratio and a root.

  The root ``w' `` of ``v`` is within `_root_bound` of ``w = sqrt(v)``; the
  ratio ``r' `` within one gap of the e3m4 map (twice `_HALF_GAP`, times
  the block's absmax of ``r = m / w``) of ``r``, so ``|r' w' - m| <= |r' -
  r| w' + |r| |w' - w|``. Both moments carry f32 roundings of a few ulps.
  """
  block = lambda x: np.repeat(np.abs(x).reshape(-1, 256).max(axis=1), 256).reshape(x.shape)
  w, w_got = np.sqrt(v.astype(np.float64)), np.sqrt(got_v.astype(np.float64))
  root_ok = np.abs(w_got - w) <= _root_bound(w, block(w)) + 8 * _U * block(w)
  r = np.where(w > 0, m / np.where(w > 0, w, 1), 0)
  ratio_error = 2 * _HALF_GAP * block(r) + 8 * _U * block(r)
  m_bound = ratio_error * w_got + np.abs(r) * np.abs(w_got - w) + 8 * _U * block(m)
  m_ok = np.abs(got_m - m) <= m_bound
  return root_ok & m_ok


def _int8_bound(absmax, delta=0.0):
  """The largest |decoded - x| of an int8-stored moment, per element.

  A moment ``m`` is stored, its code rounded stochastically to one of the two
  map values around it, at most one gap (twice `_HALF_GAP`) apart; the test
  knows ``x`` with ``|m - x| <= delta`` (0 when ``m`` is ``x``; else the f32
  rounding by which two computations of the same moment differ). ``absmax``
  is ``x``'s block absmax, so ``m``'s is at most ``absmax + delta``, and

    |decode(encode(m)) - x| <= |decode(encode(m)) - m| + |m - x|
                             <= (2 _HALF_GAP + _CODEC_ROUNDINGS U) (absmax + delta) + delta.
  """
  return (2 * _HALF_GAP + _CODEC_ROUNDINGS * _U) * (absmax + delta) + delta


QUANT_SHAPES = [(256,), (40, 256), (3, 5, 256), (2, 3, 128), (16, 1024), (300,), (7, 700)]


def _state(rng, shape, fmt, n_moments):
  """Lion's momentum (one moment, signed) or AdamW's (m, v) in ``fmt``."""
  m = random_array(rng, shape, jnp.float32, scale=0.1)
  v = random_array(rng, shape, jnp.float32, positive=True, scale=0.01)
  if fmt not in quant.FORMATS:
    return (m.astype(jnp.bfloat16), v.astype(jnp.bfloat16))[:n_moments]
  if n_moments == 1:
    return (quant.quantize(m, fmt=fmt),)
  return blockwise_adam_moments(m, v, fmt)


def _assert_same(got, want, what):
  got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for a, b in zip(got_leaves, want_leaves):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=what)


@settings(deadline=None)
@given(
    shape=st.sampled_from(QUANT_SHAPES),
    family=st.sampled_from(["adamw", "nadamw", "lion"]),
    fmt=st.sampled_from(["int8", "fp8", "bf16"]),
    param_dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    grad_dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    mode=st.sampled_from(["apply", "updates"]),
    param_rounding=st.sampled_from(["nearest", "stochastic"]),
    decay=st.booleans(),
    backend=st.sampled_from(["tpu", "triton"]),
    seed=st.integers(0, 2**16),
)
def test_kernel_state_equals_reference_bit_for_bit(
    shape, family, fmt, param_dtype, grad_dtype, mode, param_rounding, decay, backend, seed
):
  # Same codes, scales and stochastically rounded moments, over steps that feed
  # each one's state to the next. Both are jitted, so the kernel body and
  # the reference compile the same f32 ops alike (eager op-by-op execution
  # may round a fused multiply-add differently).
  rng = np.random.default_rng(seed)
  p = random_array(rng, shape, param_dtype)
  if family == "lion":
    n_moments, kernel, reference = 1, lion_k.lion_kernel, lion_k.lion_reference
    config = dict(mode=mode, decay=decay)
  else:
    n_moments, kernel, reference = 2, adamw_k.adamw_kernel, adamw_k.adamw_reference
    config = dict(mode=mode, decay=decay, nesterov=family == "nadamw")
  config["state_rounding"] = "stochastic" if fmt == "bf16" else "nearest"
  if mode == "apply":
    config["param_rounding"] = param_rounding
  reference = jax.jit(functools.partial(reference, **config))
  kernel = jax.jit(functools.partial(kernel, **config, backend=backend, interpret=True))
  moments = _state(rng, shape, fmt, n_moments)
  if fmt in quant.FORMATS and math.prod(shape) % quant.BLOCK:
    # A ragged last block: the dispatch runs the reference (the transforms'
    # test below); the kernel itself refuses, saying why.
    g, key = random_array(rng, shape, grad_dtype), rounding.leaf_key(seed, 1, 3)
    scalars = (lion_k.lion_scalars(3e-3, 0.9, 0.99, 0.1) if family == "lion"
               else adamw_k.adamw_scalars(1, 3e-3, 0.9, 0.999, 1e-8, 0.0, 0.1))
    with pytest.raises(ValueError, match="blockwise state needs whole blocks of 256"):
      kernel(p, g, *moments, scalars, key)
    return
  for step in range(1, 4):
    g = random_array(rng, shape, grad_dtype)
    if family == "lion":
      scalars = lion_k.lion_scalars(3e-3, 0.9, 0.99, 0.1)
    else:
      scalars = adamw_k.adamw_scalars(step, 3e-3, 0.9, 0.999, 1e-8, 0.0, 0.1)
    key = rounding.leaf_key(seed, step, 3)
    want = reference(p, g, *moments, scalars, key)
    got = kernel(p, g, *moments, scalars, key)
    # p + u (or u) may differ by an f32 ulp where XLA fuses the division
    # differently, as for the f32 kernels; the stored state is exact.
    assert got[0].dtype == want[0].dtype
    assert_close(got[0], want[0], tolerance(got[0].dtype), f"step {step}", operands=(p,))
    if grad_dtype == jnp.float32:
      _assert_same(got[1:], want[1:], f"step {step}")
    else:
      # The kernel widens bf16 gradients in its body, the reference before:
      # XLA's CPU compiler may then contract their multiply-adds differently
      # (seen at (40, 256): scales 1.2 f32 ulps apart, codes one apart).
      for a, b in zip(got[1:], want[1:], strict=True):
        if quant.is_blockwise(a):
          assert_nearly_same_codes(a, b)
        else:  # bf16 moments: one bf16 ulp (2**-7 of the value at most)
          np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                     rtol=2**-7, err_msg=f"step {step}")
    moments = want[1:]
    if mode == "apply":
      p = want[0]


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize(
    "shape, scales_row_major", [((9, 2304), True), ((3, 5632), True), ((136, 2304), False)],
    ids=str)
def test_wide_rows_run_in_place_with_a_ragged_last_block(shape, scales_row_major, fmt):
  # Rows of 9 and 22 blocks: the TPU kernel reads them in place in runs of 8
  # blocks, the last run cut by the row's end (kernels._elementwise), as the
  # reference computes them; their scales in either order XLA stores them
  # in, the rows' whole scales or a (blocks, rows) view (136 rows: a ragged
  # last block of rows too).
  assert _elementwise.blocks_in_place(shape)
  assert _tiling.tiled_in_place(quant.scales_shape(shape)) == scales_row_major
  rng = np.random.default_rng(7)
  p, g = random_array(rng, shape, jnp.float32), random_array(rng, shape, jnp.float32)
  moments = _state(rng, shape, fmt, 2)
  scalars = adamw_k.adamw_scalars(2, 3e-3, 0.9, 0.999, 1e-8, 0.0, 0.1)
  config = dict(mode="apply", decay=True, nesterov=False)
  key = rounding.step_key(0, 2)
  want = jax.jit(functools.partial(adamw_k.adamw_reference, **config))(p, g, *moments, scalars, key)
  got = jax.jit(functools.partial(adamw_k.adamw_kernel, **config, backend="tpu", interpret=True))(
      p, g, *moments, scalars, key)
  assert_close(got[0], want[0], tolerance(got[0].dtype), operands=(p,))
  _assert_same(got[1:], want[1:], "ragged wide rows")


@pytest.mark.parametrize("family", ["adamw", "lion"])
@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_stacks_with_the_layer_axis_second_run_layer_by_layer(family, fmt, param_dtype):
  # MaxText's stacked layers (param_scan_axis=1): 128 rows x 2 layers x 5
  # blocks, the TPU kernel reading each operand in XLA's order (codes layer
  # first, scales rows last) in runs of 4 blocks, the last cut by the row's
  # end; bf16 params round stochastically with each element's flat index.
  shape = (128, 2, 1280)
  assert _elementwise.layers_inside(shape) and not _tiling.tiled_in_place(shape)
  rng = np.random.default_rng(11)
  p, g = random_array(rng, shape, param_dtype), random_array(rng, shape, jnp.float32)
  config = dict(mode="apply", decay=True, param_rounding="stochastic")
  if family == "lion":
    kernel, reference = lion_k.lion_kernel, lion_k.lion_reference
    moments = _state(rng, shape, fmt, 1)
    scalars = lion_k.lion_scalars(3e-3, 0.9, 0.99, 0.1)
  else:
    kernel, reference = adamw_k.adamw_kernel, adamw_k.adamw_reference
    moments = _state(rng, shape, fmt, 2)
    scalars = adamw_k.adamw_scalars(2, 3e-3, 0.9, 0.999, 1e-8, 0.0, 0.1)
    config["nesterov"] = False
  key = rounding.step_key(0, 2)
  want = jax.jit(functools.partial(reference, **config))(p, g, *moments, scalars, key)
  got = jax.jit(functools.partial(kernel, **config, backend="tpu", interpret=True))(
      p, g, *moments, scalars, key)
  assert_close(got[0], want[0], tolerance(got[0].dtype), operands=(p,))
  _assert_same(got[1:], want[1:], "stacked layers")


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("shape", [(4096, 1024), (40, 256), (3, 5, 256)], ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_blockwise_and_stochastic_kernels_lower(platform, shape, dtype, fmt):
  # On CUDA for an H100: Triton's fp8 conversions need sm_89 or newer
  # (test_lowering_dispatch covers the A100).
  chip = "h100" if platform == "cuda" else None
  p = sds(shape, dtype)
  m, mv = _abstract_moments(shape, fmt)
  key = sds((), jnp.int32)
  scalars = adamw_k.adamw_scalars(jnp.int32(3), 1e-3, 0.9, 0.999, 1e-8, 0.0, 0.1)
  adamw = lambda p, g, m, v, s, k: adamw_k.adamw_apply(
      p, g, m, v, s, k, impl="pallas", param_rounding="stochastic"
  )
  text = lowered_text(adamw, platform, p, p, *mv, scalars, key, chip=chip)
  assert text.count(CUSTOM_CALL[platform]) == 1
  lion = lambda p, g, m, k: lion_k.lion_updates(
      p, g, m, lion_k.lion_scalars(1e-3, 0.9, 0.99, 0.1), k, impl="pallas"
  )
  assert lowered_text(lion, platform, p, p, m, key, chip=chip).count(CUSTOM_CALL[platform]) == 1
  bf16 = sds(shape, jnp.bfloat16)
  sr = lambda p, g, m, v, s, k: adamw_k.adamw_apply(
      p, g, m, v, s, k, impl="pallas", state_rounding="stochastic", param_rounding="stochastic"
  )
  assert lowered_text(sr, platform, p, p, bf16, bf16, scalars, key, chip=chip).count(CUSTOM_CALL[platform]) == 1


def _abstract_moments(shape, fmt):
  """Abstract Lion momentum and AdamW (m, v) of ``fmt`` for a leaf of ``shape``."""
  scales = sds(quant.scales_shape(shape))
  codes = lambda role: sds(shape, quant.code_dtype(role, fmt))
  moment = lambda role: quant.blockwise_class(role, fmt)(codes(role), scales)
  return moment(quant.SIGNED), (moment(quant.RATIO), moment(quant.ROOT))


def test_auto_runs_the_triton_kernel_for_8_bit_moments_on_cuda():
  # XLA cannot fuse the blockwise re-encoding into one pass (kernels.policy.CUDA_AUTO).
  p, key = sds((4096, 1024)), sds((), jnp.int32)
  _, mv = _abstract_moments((4096, 1024), "int8")
  scalars = adamw_k.adamw_scalars(jnp.int32(3), 1e-3, 0.9, 0.999, 1e-8, 0.0, 0.1)
  auto = lambda p, g, m, v, s, k: adamw_k.adamw_apply(p, g, m, v, s, k, impl="auto")
  assert lowered_text(auto, "cuda", p, p, *mv, scalars, key).count(CUSTOM_CALL["cuda"]) == 1
  bf16 = sds((4096, 1024), jnp.bfloat16)
  sr = lambda p, g, m, v, s, k: adamw_k.adamw_apply(
      p, g, m, v, s, k, impl="auto", state_rounding="stochastic")
  assert lowered_text(sr, "cuda", p, p, bf16, bf16, scalars, key).count(CUSTOM_CALL["cuda"]) == 0


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_int8_transform_lowers_with_one_kernel_per_leaf(platform):
  params = {"w": sds((768, 3072)), "e": sds((1000, 768), jnp.bfloat16), "b": sds((3072,)),
            "ln": sds((7,))}
  tx = pallasopt.optim.adamw(1e-3, state_format="int8", param_rounding="stochastic", impl="pallas")
  state = jax.eval_shape(tx.init, params)
  fused = functools.partial(pallasopt.optim.apply_gradients, tx)
  assert lowered_text(fused, platform, params, params, state).count(CUSTOM_CALL[platform]) == 4


def _params():
  rng = np.random.default_rng(1)
  return {
      "w": random_array(rng, (48, 256), jnp.float32),      # 12288: 8-bit state
      "e": random_array(rng, (100, 48), jnp.bfloat16),     # 4800, ragged last block
      "b": random_array(rng, (256,), jnp.float32),         # small: f32 state
      "h": random_array(rng, (3,), jnp.float16),           # Optax's own leaf
  }


def _grads(params, step):
  return jax.tree.map(lambda p: jnp.cos(p * (step + 1)).astype(p.dtype), params)


def _state_bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("make", [pallasopt.optim.adamw, pallasopt.optim.lion], ids=["adamw", "lion"])
def test_state_layout_and_bytes_per_param(make):
  params = _params()
  moments = make(1e-3, state_format="int8").init(params)[0][1:]
  # AdamW: the first moment as its ratio to the second's root, the second as
  # its root; Lion: its momentum as itself.
  kinds = (Int8RatioBlockwise, RootBlockwise) if len(moments) == 2 else (Int8Blockwise,)
  for moment, kind in zip(moments, kinds, strict=True):
    assert isinstance(moment["w"], kind) and isinstance(moment["e"], kind)
    code_dtype = jnp.uint8 if kind is RootBlockwise else jnp.int8
    assert moment["w"].codes.dtype == code_dtype and moment["w"].scales.shape == (48, 1)
    assert moment["b"].dtype == jnp.float32 and moment["h"].dtype == jnp.float16
  big = {k: params[k] for k in ("w", "e")}
  per_param = _state_bytes(make(1e-3, state_format="int8").init(big)[0][1:]) / sum(
      x.size for x in big.values())
  assert per_param <= 2.1 * len(moments) / 2, per_param
  fp8 = make(1e-3, state_format="fp8").init(params)[0][1:]
  # fp8: float8 codes but for the second moment's root (the root map's uint8).
  fp8_kinds = (RatioBlockwise, RootBlockwise) if len(moments) == 2 else (Fp8Blockwise,)
  for m, kind in zip(fp8, fp8_kinds, strict=True):
    assert isinstance(m["w"], kind)
    assert m["w"].codes.dtype == (jnp.uint8 if kind is RootBlockwise else jnp.float8_e4m3fn)
  assert _state_bytes(make(1e-3, state_format="fp8").init(big)[0][1:]) == _state_bytes(
      make(1e-3, state_format="int8").init(big)[0][1:])
  bf16 = make(1e-3, state_format="bf16").init(params)[0][1:]
  assert all(m[k].dtype == jnp.bfloat16 for m in bf16 for k in ("w", "e", "b"))
  assert _state_bytes(make(1e-3, state_format="bf16").init(big)[0][1:]) / sum(
      x.size for x in big.values()) == 2 * len(moments)


# NAdamW is AdamW's kernel and transform with nesterov=True; every format's
# codec is the same code, run here with AdamW and Lion, so NAdamW runs int8.
_PATH_CASES = {
    f"{name}-{fmt}": (getattr(pallasopt.optim, name), fmt)
    for name, fmts in (("adamw", ("int8", "fp8", "bf16")), ("lion", ("int8", "fp8", "bf16")),
                       ("nadamw", ("int8",)))
    for fmt in fmts
}


@pytest.mark.parametrize("make,fmt", list(_PATH_CASES.values()), ids=list(_PATH_CASES))
def test_transform_paths_agree_in_every_impl(make, fmt):
  # The grads do not depend on the params, so the states must agree bit for
  # bit; params within an ulp where XLA fuses p + u differently (f32), or one
  # rounding apart (bf16, stochastic). The update path rounds no params (it
  # refuses param_rounding="stochastic" for bf16 ones), and its state rounds
  # with the same seed.
  params = _params()
  results = {}
  for impl in ("xla", "interpret"):
    tx = make(1e-2, state_format=fmt, param_rounding="stochastic", seed=11, impl=impl)
    apply = jax.jit(tx.apply_gradients)
    update = jax.jit(make(1e-2, state_format=fmt, seed=11, impl=impl).update)
    p, s = params, tx.init(params)
    q, r = params, s
    for step in range(3):
      p, s = apply(p, _grads(params, step), s)
      u, r = update(_grads(params, step), r, q)
      q = optax.apply_updates(q, u)
      if step == 0 and impl == "xla":
        first_step = p
    results[impl] = (p, s, q, r)
  (p, s, q, r), (p_ref, s_ref, q_ref, r_ref) = results["interpret"], results["xla"]
  _assert_same((s, r), (s_ref, r_ref), "state: interpret vs xla")
  for got, want in ((p, p_ref), (q, q_ref)):
    for k in got:
      assert got[k].dtype == want[k].dtype
      assert_close(got[k], want[k], tolerance(got[k].dtype), k)
  if fmt == "int8":
    # A different seed draws different roundings (of the params: the same
    # code whatever the state format, so checked once per family).
    tx = make(1e-2, state_format=fmt, param_rounding="stochastic", seed=12, impl="xla")
    other = jax.jit(tx.apply_gradients)(params, _grads(params, 0), tx.init(params))
    assert not np.array_equal(np.asarray(other[0]["e"], np.float32),
                              np.asarray(first_step["e"], np.float32))


def test_int8_steps_track_the_f32_optimizer():
  # One step from the same moments: the only difference is the 8-bit
  # storage of the new moments, so p moves as Optax's does, and the stored
  # moments decode within `_pair_error`'s bounds of Optax's (from zero
  # moments ours and Optax's are one and two roundings of the same values).
  params = _params()
  tx8 = pallasopt.optim.adamw(1e-2, state_format="int8", impl="xla")
  ref = optax.adamw(1e-2)
  s8, sref = tx8.init(params), ref.init(params)
  grads = _grads(params, 0)
  p8, s8 = jax.jit(tx8.apply_gradients)(params, grads, s8)
  u, sref = ref.update(grads, sref, params)
  pref = optax.apply_updates(params, u)
  for k in ("w", "b"):
    np.testing.assert_allclose(p8[k], pref[k], rtol=1e-6, atol=1e-7)
  root = quant.stored_values(s8[0].nu["w"])
  got_m = np.asarray(quant.dequantize(s8[0].mu["w"], root=root), np.float64)
  got_v = np.asarray(quant.dequantize(s8[0].nu["w"]), np.float64)
  ok = _pair_error(got_m, got_v, np.asarray(sref[0].mu["w"]), np.asarray(sref[0].nu["w"]))
  assert ok.all(), np.argwhere(~ok)[:5]


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_muon_momentum_in_low_bit_formats(fmt):
  # Muon's momentum (and its AdamW part's moments) take the same formats;
  # its orthogonalization reads the dequantized f32 momentum, so every impl
  # stores the same state, and one step moves the params as Optax's Muon
  # does up to the momentum's storage error (here: none yet, zero momentum).
  params = {"w": _params()["w"], "b": _params()["b"], "m": _params()["e"][:16, :32]}
  grads = _grads(params, 0)
  states = {}
  for impl in ("xla", "interpret"):
    tx = pallasopt.optim.muon(0.02, state_format=fmt, seed=5, impl=impl)
    p, s = params, tx.init(params)
    for step in range(2):
      p, s = jax.jit(tx.apply_gradients)(p, grads, s)
    states[impl] = s
  _assert_same(states["interpret"], states["xla"], "muon state")
  mu = states["xla"].inner_states["muon"].inner_state[0].mu
  assert isinstance(mu["w"], Int8Blockwise) if fmt == "int8" else mu["w"].dtype == jnp.bfloat16
  assert mu["m"].dtype == (jnp.float32 if fmt == "int8" else jnp.bfloat16)  # 512 elements
  ref = optax.contrib.muon(0.02)
  u, _ = ref.update(grads, ref.init(params), params)
  tx = pallasopt.optim.muon(0.02, state_format=fmt, impl="xla")
  got, _ = jax.jit(tx.apply_gradients)(params, grads, tx.init(params))
  want = optax.apply_updates(params, u)
  for k in params:
    assert_close(got[k], want[k], 1e-5 if params[k].dtype == jnp.float32 else tolerance(jnp.bfloat16), k)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_adafactor_momentum_in_low_bit_formats(fmt, impl):
  # One step from zero momentum: the params move as Optax's (the update reads
  # the f32 momentum), and the stored momentum is Optax's EMA within its
  # format's bound. Our f32 EMA m and Optax's r are two computations of the
  # same Adafactor update (factored statistics reduced in another order, the
  # clip's RMS over the leaf), which the f32 drop-in tests hold to
  # `tolerance(f32)` of the leaf's scale: |m - r| <= delta = tol max|r|. The
  # stored m is then within `_int8_bound(absmax, delta)` of r (int8), or,
  # stochastically rounded to bf16 (less than one bf16 ulp, 2^-7 |m|, from m),
  # within 2^-7 (|r| + delta) + delta.
  params = {k: v for k, v in _params().items() if k != "h"}
  grads = _grads(params, 0)
  ref = optax.adafactor(1e-2, momentum=0.9)
  u, ref_state = ref.update(grads, ref.init(params), params)
  tx = pallasopt.optim.adafactor(1e-2, momentum=0.9, state_format=fmt, impl=impl)
  got, state = jax.jit(tx.apply_gradients)(params, grads, tx.init(params))
  want = optax.apply_updates(params, u)
  for k in params:
    assert_close(got[k], want[k], tolerance(params[k].dtype), k, operands=(params[k],))
  ema = next(x for x in state if hasattr(x, "ema")).ema
  ref_ema = next(x for x in ref_state if hasattr(x, "ema")).ema
  assert isinstance(ema["e"], Int8Blockwise) if fmt == "int8" else ema["e"].dtype == jnp.bfloat16
  # The f32 leaf (Optax's EMA of a bf16 leaf is bf16 math).
  m, r = ema["w"], np.asarray(ref_ema["w"], np.float32)
  delta = tolerance(jnp.float32) * np.abs(r).max()
  if fmt == "int8":
    absmax = np.repeat(np.abs(r).reshape(-1, 256).max(axis=1), 256).reshape(r.shape)
    err = np.abs(np.asarray(quant.dequantize(m)) - r)
    assert np.all(err <= _int8_bound(absmax, delta))
  else:
    err = np.abs(np.asarray(m, np.float32) - r)
    assert np.all(err <= 2**-7 * (np.abs(r) + delta) + delta)
  assert ema["b"].dtype == (jnp.float32 if fmt == "int8" else jnp.bfloat16)
  # A second step runs from the stored format.
  jax.jit(tx.apply_gradients)(got, grads, state)


def test_a_state_saved_in_the_old_scales_layout_converts_or_fails_clearly():
  # From 2026-11-25 until 2026-12-07 rows of whole blocks kept their scales as
  # (blocks, rows).
  params = _params()
  tx = pallasopt.optim.adamw(1e-3, state_format="int8")
  state = tx.init(params)
  _, state = jax.jit(tx.apply_gradients)(params, _grads(params, 0), state)
  old = jax.tree.map(
      lambda m: type(m)(m.codes, jnp.swapaxes(m.scales, -1, -2))
      if quant.is_blockwise(m) and quant.rows_hold_blocks(m.codes.shape) else m,
      state, is_leaf=quant.is_blockwise)
  with pytest.raises(ValueError, match=r"legacy_scales=True"):
    tx.update(_grads(params, 1), old, params)
  converted = pallasopt.optim.convert_state(old, params, "int8", legacy_scales=True)
  _assert_same(converted, state, "converted")


def test_convert_state_round_trips_through_low_bit_formats():
  params = _params()
  ref = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  state = ref.init(params)
  for step in range(2):
    u, state = ref.update(_grads(params, step), state, params)
  as_int8 = pallasopt.optim.convert_state(state, params, "int8")
  tx8 = optax.chain(optax.clip_by_global_norm(1.0),
                    pallasopt.optim.adamw(1e-2, state_format="int8"))
  assert jax.tree.structure(as_int8) == jax.tree.structure(tx8.init(params))
  back = pallasopt.optim.convert_state(as_int8, params, None)
  assert jax.tree.structure(back) == jax.tree.structure(state)
  for name in ("mu", "nu"):
    want, got = getattr(state[1][0], name), getattr(back[1][0], name)
    assert got["h"].dtype == jnp.float16 and got["e"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(got["b"], want["b"])  # small leaves stay f32
  # Converted to nearest, within the stochastic bounds a fortiori.
  ok = _pair_error(*(np.asarray(x["w"], np.float64) for x in (back[1][0].mu, back[1][0].nu)),
                   *(np.asarray(x["w"], np.float64) for x in (state[1][0].mu, state[1][0].nu)))
  assert ok.all()
  # The converted state steps like one the low-bit transform built.
  jax.jit(tx8.update)(_grads(params, 2), as_int8, params)
  as_bf16 = pallasopt.optim.convert_state(state, params, "bf16")
  assert as_bf16[1][0].mu["w"].dtype == jnp.bfloat16
  lion_state = optax.lion(1e-3).init(params)
  assert isinstance(pallasopt.optim.convert_state(lion_state, params, "int8")[0].mu["w"],
                    Int8Blockwise)
  # Optax's Muon state (partitioned: MaskedNodes where AdamW owns the params).
  matrices = {k: params[k] for k in ("w", "b")}
  muon_state = optax.contrib.muon(0.02).init(matrices)
  as_int8 = pallasopt.optim.convert_state(muon_state, matrices, "int8")
  assert jax.tree.structure(as_int8) == jax.tree.structure(
      pallasopt.optim.muon(0.02, state_format="int8").init(matrices))
  assert jax.tree.structure(pallasopt.optim.convert_state(as_int8, matrices, None)) == (
      jax.tree.structure(muon_state))


@pytest.mark.parametrize("make,fmt", [(pallasopt.optim.lion, "int8"),
                                      (pallasopt.optim.adamw, "int4")], ids=["lion-int8", "adamw-int4"])
def test_low_bit_state_checkpoints_with_orbax(tmp_path, make, fmt):
  # int4 codes are int4 arrays: TensorStore, under orbax, has no uint4.
  ocp = pytest.importorskip("orbax.checkpoint")
  params = _params()
  tx = make(1e-3, state_format=fmt)
  state = tx.init(params)
  _, state = jax.jit(tx.apply_gradients)(params, _grads(params, 0), state)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", state)
  checkpointer.wait_until_finished()
  restored = checkpointer.restore(tmp_path / "state", jax.eval_shape(tx.init, params))
  _assert_same(restored, state, "restored")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_sharding_specs_and_a_sharded_step(fmt):
  # int4 codes have their param's shape, as int8's: the same specs.
  params = {"w": jnp.zeros((64, 256)), "v": jnp.zeros((8, 1024, 12)), "b": jnp.zeros(64),
            "c": jnp.zeros((64, 1024))}
  specs = {"w": P("data"), "v": P(None, "data"), "b": P(), "c": P(None, "data")}
  tx = pallasopt.optim.adamw(1e-3, state_format=fmt)
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  shapes = jax.eval_shape(tx.init, params)
  state_specs = optimizer_state_specs(shapes, params, specs, mesh=mesh)
  mu, nu = state_specs[0].mu, state_specs[0].nu
  ratio = quant.blockwise_class(quant.RATIO, fmt)
  # The scales keep their param's dims (the last counted in blocks), so they
  # take its spec wherever each shard holds whole blocks.
  assert mu["w"] == ratio(P("data"), P("data"))  # scales (64, 1)
  assert nu["w"] == RootBlockwise(P("data"), P("data"))
  assert mu["v"] == ratio(P(None, "data"), P())  # scales (8, 48): blocks across rows
  assert mu["b"] == P()
  # Scales (64, 4): each shard of 256 columns holds one block per row.
  assert mu["c"] == ratio(P(None, "data"), P(None, "data"))
  # Without a mesh no one knows whether a shard holds whole blocks.
  unknown = optimizer_state_specs(shapes, params, specs)[0].mu["c"]
  assert unknown == ratio(P(None, "data"), P())
  with jax.set_mesh(mesh):
    assert optimizer_state_specs(shapes, params, specs)[0].mu["c"] == mu["c"]
  shard = lambda tree, spec: jax.tree.map(
      lambda x, s: jax.device_put(x, jax.sharding.NamedSharding(mesh, s)), tree, spec)
  params = jax.tree.map(lambda x: x + 1.0, params)
  grads = _grads(params, 0)
  want = jax.jit(tx.apply_gradients)(params, grads, tx.init(params))
  # Initialised from params whose types carry their layout (the mesh's axes
  # are Explicit), the state is laid out as the specs declare, and a step
  # keeps that layout (so compiles once); the step count is a scalar, as Optax's.
  assert mesh.axis_types == (jax.sharding.AxisType.Explicit,)
  sharded_state = tx.init(shard(params, specs))
  laid_out = lambda tree: jax.tree.leaves(jax.tree.map(
      lambda x, s: x.ndim == 0 or x.sharding.is_equivalent_to(NamedSharding(mesh, s), x.ndim),
      tree, state_specs))
  assert all(laid_out(sharded_state))
  got = jax.jit(tx.apply_gradients)(shard(params, specs), shard(grads, specs), sharded_state)
  assert all(laid_out(got[1]))
  _assert_same(jax.device_get(got), jax.device_get(want), "sharded")


@pytest.mark.parametrize("impl", ["auto", "interpret"])
def test_every_array_of_a_moment_takes_its_params_spec(impl):
  # Trainers (MaxText) shard a state by giving every array of a params-shaped
  # subtree its param's spec. Here the MLP output of two scanned layers with
  # the layer axis second, split over its columns (256 a shard: whole blocks).
  params = {"wo": jnp.ones((64, 2, 1024)), "b": jnp.ones(64)}
  specs = {"wo": P(None, None, "data"), "b": P()}
  tx = pallasopt.optim.adamw(1e-3, state_format="int8", impl=impl)
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  state_specs = optimizer_state_specs(jax.eval_shape(tx.init, params), params, specs, mesh=mesh)
  for moment in (state_specs[0].mu["wo"], state_specs[0].nu["wo"]):
    assert moment.codes == specs["wo"] and moment.scales == specs["wo"]
  grads = _grads(params, 0)
  want = jax.jit(tx.apply_gradients)(params, grads, tx.init(params))
  with_param_specs = lambda state: jax.tree.map(
      lambda m, p: jax.tree.map(
          lambda x: jax.device_put(x, NamedSharding(mesh, specs[p])), m)
      if quant.is_blockwise(m) else m, state, {"wo": "wo", "b": "b"},
      is_leaf=quant.is_blockwise)
  state = tx.init(params)
  state = (state[0]._replace(mu=with_param_specs(state[0].mu), nu=with_param_specs(state[0].nu)),
           *state[1:])
  shard = lambda tree: jax.tree.map(
      lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)
  got = jax.jit(tx.apply_gradients)(shard(params), shard(grads), state)
  _assert_same(jax.device_get(got), jax.device_get(want), "sharded by the params' specs")


@pytest.mark.parametrize("name,config", [
    ("adamw", pallasopt.optim.eformer.AdamWConfig(state_format="int8", seed=3)),
    ("lion", pallasopt.optim.eformer.LionConfig(state_format="bf16", param_rounding="stochastic")),
    ("muon", pallasopt.optim.eformer.MuonConfig(state_format="int8")),
    ("adafactor", pallasopt.optim.eformer.AdafactorConfig(momentum=0.9, state_format="bf16")),
])
def test_stage_local_path_runs_low_bit_state(name, config):
  # The configs carry the format through the factory; the stage-local fused
  # apply equals the same transform's update, and a None grad freezes its
  # leaf (its params and moments come back untouched).
  tx, _ = pallasopt.optim.eformer.OptimizerFactory.create(name, None, config, impl="xla")
  params = {k: v for k, v in _params().items() if k != "h"}
  grads = _grads(params, 0)
  state = tx.init(params)
  got_params, got_state = jax.jit(
      lambda p, g, s: tx.apply_gradients_stage_local(params=p, grads=g, opt_state=s)
  )(params, {**grads, "b": None}, state)
  # The update path rounds bf16 params to nearest (so it refuses "stochastic").
  ref, _ = pallasopt.optim.eformer.OptimizerFactory.create(
      name, None, dataclasses.replace(config, param_rounding="nearest")
      if hasattr(config, "param_rounding") else config, impl="xla")
  u, want_state = jax.jit(ref.update)({**grads, "b": jnp.zeros_like(grads["b"])}, state, params)
  _assert_same(got_state, frozen_at(want_state, state, ("b",)), "state")
  want_params = frozen_at(optax.apply_updates(params, u), params, ("b",))
  for k in params:
    assert_close(got_params[k], want_params[k], tolerance(params[k].dtype), k)


def test_digits_convergence_with_bf16_params_and_int8_state():
  # scikit-learn's digits (1797 8x8 images), a 64-256-10 tanh MLP, 150
  # full-batch AdamW steps: bf16 params rounded stochastically with int8
  # state reach Optax's f32 loss within 2% (not above 1.02x it). Measured
  # (jax 0.10.2, CPU): f32 0.04168, bf16 params + int8 0.04005. (Every state
  # format with f32 params: tests/test_low_bit_updates.py, step by step.)
  init, loss = digits_mlp(256)

  def final_loss(tx, params):
    @jax.jit
    def step(p, s):
      return pallasopt.optim.apply_gradients(tx, p, jax.grad(loss)(p), s)

    p, s = params, tx.init(params)
    for _ in range(150):
      p, s = step(p, s)
    return float(loss(p))

  f32 = final_loss(optax.adamw(3e-3), init)
  bf16_params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), init)
  pure_bf16 = final_loss(
      pallasopt.optim.adamw(3e-3, state_format="int8", param_rounding="stochastic"), bf16_params)
  assert f32 < 0.2 * float(loss(init))
  assert pure_bf16 <= 1.02 * f32, (f32, pure_bf16)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda: pallasopt.optim.adamw(1e-3, state_format="int2"), ValueError, "state_format"),
        (lambda: pallasopt.optim.adamw(1e-3, param_rounding="up"), ValueError, "param_rounding"),
        (lambda: pallasopt.optim.adamw(1e-3, seed=1.5), ValueError, "seed"),
        (lambda: pallasopt.optim.convert_state((), {}, "fp4"), ValueError, "state_format"),
        (lambda: pallasopt.optim.adafactor(1e-3, state_format="int8"), ValueError, "momentum"),
        (lambda: pallasopt.optim.adafactor(1e-3, momentum=0.9, dtype_momentum=jnp.bfloat16,
                                           state_format="int8"), ValueError, "dtype_momentum"),
    ],
)
def test_bad_arguments(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_low_bit_state_needs_float32_or_bfloat16_grads():
  params = {"w": jnp.zeros((64, 128))}
  tx = pallasopt.optim.adamw(1e-3, state_format="int8")
  grads = {"w": jnp.zeros((64, 128), jnp.float16)}
  with pytest.raises(TypeError, match=r"grads\['w'\] has dtype float16"):
    tx.update(grads, tx.init(params), params)
  # Optax's own state (bf16 with mu_dtype) is still accepted alongside.
  assert pallasopt.optim.adamw(1e-3, state_format="bf16", mu_dtype=jnp.bfloat16)


@pytest.mark.parametrize("fmt", ["bf16", *quant.FORMATS])
@pytest.mark.parametrize("family", ["adamw", "lion", "mars", "muon"])
def test_mu_dtype_sets_the_first_moment_wherever_the_format_keeps_an_array(family, fmt):
  # Trainers built on Optax's signature (MaxText) always pass mu_dtype. With
  # a state_format it is the first moment's dtype where the format keeps an
  # array: every leaf in "bf16", leaves under 4096 elements otherwise. The
  # blockwise leaves, and their steps, are as without it.
  params = {"w": jnp.full((64, 128), 0.5), "v": jnp.full((8, 16), 0.5)}
  grads = jax.tree.map(lambda p: jnp.linspace(-1e-2, 1e-2, p.size).reshape(p.shape), params)
  make = functools.partial(getattr(pallasopt.optim, family), 1e-3, state_format=fmt)
  step = lambda tx: jax.jit(functools.partial(pallasopt.optim.apply_gradients, tx))(
      params, grads, tx.init(params))
  # Muon's: the state of its part that holds the matrices.
  first_moment = lambda state: next(
      node.mu for node in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "mu"))
      if not isinstance(node.mu["v"], optax.MaskedNode))
  for mu_dtype in (jnp.float32, jnp.bfloat16):
    tx = make(mu_dtype=mu_dtype)
    state = tx.init(params)
    mu = first_moment(state)
    assert mu["v"].dtype == mu_dtype
    assert mu["w"].dtype == mu_dtype if fmt == "bf16" else quant.is_blockwise(mu["w"])
    stepped, new_state = step(tx)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    assert [a.dtype for a in jax.tree.leaves(new_state)] == [
        a.dtype for a in jax.tree.leaves(state)]
    if fmt != "bf16":
      np.testing.assert_array_equal(stepped["w"], step(make())[0]["w"])


@pytest.mark.parametrize("name", ["multisteps", "inject", "masked", "chain", "apply_if_finite"])
def test_low_bit_state_composes_like_optax_state(name):
  # Optax's wrappers treat an Int8Blockwise as any other state subtree: the
  # wrapped step equals the bare one where the wrapper is transparent.
  params = {"w": _params()["w"], "b": _params()["b"]}
  grads = _grads(params, 0)
  bare = pallasopt.optim.adamw(1e-3, state_format="int8", param_rounding="stochastic", seed=3)
  wrapped = {
      "multisteps": lambda: optax.MultiSteps(bare, 1),
      "inject": lambda: optax.inject_hyperparams(pallasopt.optim.adamw)(
          learning_rate=1e-3, state_format="int8", param_rounding="stochastic", seed=3),
      "masked": lambda: optax.masked(bare, {"w": True, "b": True}),
      "chain": lambda: optax.chain(optax.identity(), bare),
      "apply_if_finite": lambda: optax.apply_if_finite(bare, 3),
  }[name]()
  want, _ = jax.jit(bare.update)(grads, bare.init(params), params)
  state = wrapped.init(params)
  got, state = jax.jit(wrapped.update)(grads, state, params)
  if name == "inject":
    # Injected b1, b2 are f32 arrays, so 1 - b2 is rounded after b2 (as in
    # Optax): up to ulp(1) / (1 - b2) = 6e-5 relative in nu, half in u.
    for k in params:
      assert_close(got[k], want[k], 1e-4, k)
  else:
    _assert_same(got, want, name)
  jax.jit(wrapped.update)(grads, state, params)  # the stepped state steps again


def test_convert_state_handles_rmsprop_and_mars():
  # Their moments convert (nu as its root; MARS's mu as its ratio to it; the
  # centered mean and the previous gradient as themselves) and step; Optax's
  # trace state (RMSProp's momentum, also SGD's) keeps its storage.
  params = {"w": _params()["w"], "b": _params()["b"]}
  grads = _grads(params, 0)
  cases = [
      (optax.rmsprop(1e-3, centered=True, momentum=0.9, bias_correction=True),
       lambda fmt: pallasopt.optim.rmsprop(1e-3, centered=True, momentum=0.9,
                                           bias_correction=True, state_format=fmt)),
      (pallasopt.optim.mars(1e-3), lambda fmt: pallasopt.optim.mars(1e-3, state_format=fmt)),
  ]
  for ref, make in cases:
    _, state = ref.update(grads, ref.init(params), params)
    as_int8 = pallasopt.optim.convert_state(state, params, "int8")
    assert isinstance(as_int8[0].nu["w"], RootBlockwise)
    assert jax.tree.structure(pallasopt.optim.convert_state(as_int8, params, None)) == (
        jax.tree.structure(state))
    jax.jit(make("int8").update)(grads, as_int8, params)


def _saved_before_2026_11_26(state):
  """An int8 AdamW state as pallasopt stored it before 2026-11-26: both moments as themselves.

  Each moment an `Int8Blockwise`, the second on the unsigned dynamic map,
  which decodes its small entries to zero (a (48, 256) leaf: a block a row).
  """
  adam = state[0]
  mu = {**adam.mu, "w": _on_the_dynamic_map(adam.mu["w"], True)}
  nu = {**adam.nu, "w": _on_the_dynamic_map(adam.nu["w"], False)}
  return (adam._replace(mu=mu, nu=nu), *state[1:])


def _on_the_dynamic_map(x, signed, cls=DynamicInt8Blockwise):
  """A (48, 256) moment on the dynamic map (a block a row), codes to nearest, as ``cls``.

  Its scales are laid out (blocks per row, rows), as every state saved before
  2026-12-07 held them.
  """
  absmax = np.abs(np.asarray(x)).max(axis=1, keepdims=True)
  codes = codecs.encode(jnp.asarray(np.asarray(x) / absmax), signed)
  return cls(codes.astype(jnp.uint8), jnp.asarray(absmax.T))


def _saved_before_2026_12_07(state):
  """An int8 AdamW state as pallasopt stored it before 2026-12-07: the root on the
  root map (as now), the ratio as uint8 codes on the signed dynamic map."""
  adam = state[0]
  root = jnp.sqrt(adam.nu["w"])
  ratio = quant.to_stored(adam.mu["w"], quant.RATIO, root)
  mu = {**adam.mu, "w": _on_the_dynamic_map(ratio, True, RatioBlockwise)}
  root_codes = quant.quantize(adam.nu["w"], role=quant.ROOT)
  nu = {**adam.nu, "w": quant.RootBlockwise(root_codes.codes, root_codes.scales.T)}
  return (adam._replace(mu=mu, nu=nu), *state[1:])


def _two_optax_adamw_steps(params):
  """Optax's AdamW(1e-2) state after two steps on ``params``."""
  ref = optax.adamw(1e-2)
  f32 = ref.init(params)
  for step in range(2):
    _, f32 = ref.update(_grads(params, step), f32, params)
  return f32


def _restores_only_into_its_own_tree(old, path, abstract, missing, saved_before):
  """Saves ``old`` with orbax; restoring it into today's ``abstract`` names the ``missing``
  field, into `legacy_state_structure`'s tree gives it back. Returns that restored state."""
  ocp = pytest.importorskip("orbax.checkpoint")
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, old)
  checkpointer.wait_until_finished()
  with pytest.raises(ValueError, match=missing):
    checkpointer.restore(path, abstract)
  restored = checkpointer.restore(path, pallasopt.optim.legacy_state_structure(
      abstract, "int8", saved_before=saved_before))
  _assert_same(restored, old, "restored")
  return restored


def test_an_int8_state_saved_on_the_dynamic_map_converts_or_fails_clearly(tmp_path):
  pytest.importorskip("orbax.checkpoint")
  params = {"w": _params()["w"], "b": _params()["b"]}
  old = _saved_before_2026_12_07(_two_optax_adamw_steps(params))
  tx = pallasopt.optim.adamw(1e-2, state_format="int8")
  with pytest.raises(ValueError, match=r"RatioBlockwise.*before 2026-12-07.*convert_state"):
    tx.update(_grads(params, 2), old, params)
  # Saved, it restores only into its own tree: into today's, orbax would cast
  # its uint8 codes to int8 silently; the renamed field is missing instead.
  abstract = jax.eval_shape(tx.init, params)
  restored = _restores_only_into_its_own_tree(
      old, tmp_path / "old", abstract, "e3m4_ratio_codes", "2026-12-07")
  converted = pallasopt.optim.convert_state(restored, params, "int8", legacy_scales=True)
  assert jax.tree.structure(converted) == jax.tree.structure(abstract)
  np.testing.assert_array_equal(converted[0].nu["w"].codes, old[0].nu["w"].codes)  # kept
  # The first moment the old codes held, re-encoded to nearest on the e3m4 map.
  old_mu, old_nu = (quant.from_transposed_scales(old[0].mu["w"]),
                    quant.from_transposed_scales(old[0].nu["w"]))
  want_m = np.asarray(quant.dequantize(old_mu, root=quant.stored_values(old_nu)), np.float64)
  back = pallasopt.optim.convert_state(converted, params, None)[0]
  want_v = np.asarray(back.nu["w"], np.float64)  # the root, decoded as it was
  assert _pair_error(np.asarray(back.mu["w"]), want_v, want_m, want_v).all()
  jax.jit(tx.update)(_grads(params, 2), converted, params)


def test_a_state_saved_on_the_old_second_moment_map_converts_or_fails_clearly(tmp_path):
  pytest.importorskip("orbax.checkpoint")
  params = {"w": _params()["w"], "b": _params()["b"]}
  old = _saved_before_2026_11_26(_two_optax_adamw_steps(params))
  tx = pallasopt.optim.adamw(1e-2, state_format="int8")
  with pytest.raises(ValueError, match=r"Int8Blockwise.*before 2026-11-26.*convert_state"):
    tx.update(_grads(params, 2), old, params)
  # Saved, it restores only into its own tree (orbax names the missing path).
  abstract = jax.eval_shape(tx.init, params)
  restored = _restores_only_into_its_own_tree(
      old, tmp_path / "old", abstract, "ratio_codes", "2026-11-26")
  converted = pallasopt.optim.convert_state(restored, params, "int8", legacy_scales=True)
  assert jax.tree.structure(converted) == jax.tree.structure(abstract)
  # The converted moments hold what the old codes did (both to nearest).
  back = pallasopt.optim.convert_state(converted, params, None)[0]
  want_m = np.asarray(quant.dequantize(quant.from_transposed_scales(old[0].mu["w"])), np.float64)
  want_v = np.asarray(
      quant.legacy_second_moment(quant.from_transposed_scales(old[0].nu["w"])), np.float64)
  assert _pair_error(np.asarray(back.mu["w"]), np.asarray(back.nu["w"]), want_m, want_v).all()
  jax.jit(tx.update)(_grads(params, 2), converted, params)
  with pytest.raises(ValueError, match="state_format"):
    pallasopt.optim.legacy_state_structure(abstract, "bf16")
