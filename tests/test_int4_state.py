"""4-bit optimizer state (``state_format="int4"``).

The kernels (the TPU body and the Triton body, interpret mode) store the
reference's codes and scales bit for bit; the state holds at most 1.1 bytes
per parameter; the transforms agree in every impl and convert between
formats. The largest-update and digits bounds are
tests/test_low_bit_updates.py's, the maps' tests/test_quant.py's;
checkpoints and sharded steps tests/test_low_bit_state.py's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pallasopt
from helpers import assert_close, random_array, tolerance
from pallasopt.kernels import adamw as adamw_k, lion as lion_k, quant, rounding
from pallasopt.optim import Int4Blockwise, RatioBlockwise, RootBlockwise


def _same(got, want, what):
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=what)


# One block; rows of whole blocks (in place), with a ragged row block and a
# ragged run of a wide row; rows of one block (a vector). (A ragged last block
# runs the reference: test_transforms_agree_in_every_impl.)
@pytest.mark.parametrize("shape", [(40, 256), (16, 1024), (9, 2304), (4096,)], ids=str)
@pytest.mark.parametrize("backend", ["tpu", "triton"])
def test_kernels_store_the_references_codes_bit_for_bit(backend, shape):
  # Three steps, each from the last one's state: AdamW (ratio and root,
  # stochastically rounded params) and Lion (its momentum as itself).
  rng = np.random.default_rng(3)
  p = random_array(rng, shape, jnp.float32)
  m = random_array(rng, shape, jnp.float32, scale=0.1)
  v = random_array(rng, shape, jnp.float32, positive=True, scale=0.01)
  moments = (quant.quantize(m, role=quant.RATIO, fmt="int4", root=jnp.sqrt(v)),
             quant.quantize(v, role=quant.ROOT, fmt="int4"))
  momentum = (quant.quantize(m, fmt="int4"),)
  config = dict(mode="apply", decay=True, nesterov=False, param_rounding="stochastic")
  reference = jax.jit(functools.partial(adamw_k.adamw_reference, **config))
  kernel = jax.jit(functools.partial(adamw_k.adamw_kernel, **config, backend=backend,
                                     interpret=True))
  lion = dict(mode="updates", decay=False)
  lion_reference = jax.jit(functools.partial(lion_k.lion_reference, **lion))
  lion_kernel = jax.jit(functools.partial(lion_k.lion_kernel, **lion, backend=backend,
                                          interpret=True))
  for step in range(1, 4):
    g = random_array(rng, shape, jnp.float32)
    key = rounding.leaf_key(0, step, 3)
    scalars = adamw_k.adamw_scalars(step, 3e-3, 0.9, 0.999, 1e-8, 0.0, 0.1)
    want, got = reference(p, g, *moments, scalars, key), kernel(p, g, *moments, scalars, key)
    assert_close(got[0], want[0], tolerance(jnp.float32), f"step {step}", operands=(p,))
    _same(got[1:], want[1:], f"AdamW step {step}")
    lion_scalars = lion_k.lion_scalars(3e-3, 0.9, 0.99, 0.1)
    lion_want = lion_reference(p, g, *momentum, lion_scalars, key)
    _same(lion_kernel(p, g, *momentum, lion_scalars, key), lion_want, f"Lion step {step}")
    p, moments, momentum = want[0], want[1:], lion_want[1:]
  assert all(x.codes.dtype == jnp.int4 for x in (*moments, *momentum))


def _stored_bytes(tree) -> int:
  return sum(quant.stored_bytes(x.size, x.dtype) for x in jax.tree.leaves(tree))


def test_state_layout_and_bytes_per_param():
  # AdamW: the ratio and the root, 4-bit codes of the param's shape (XLA
  # stores uint4 two to a byte) and f32 scales per 256 elements: at most 1.1
  # bytes per parameter for both moments on a 4096 x 4096 leaf (1.03).
  big = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
  state = jax.eval_shape(pallasopt.optim.adamw(1e-3, state_format="int4").init, big)
  mu, nu = state[0].mu["w"], state[0].nu["w"]
  assert isinstance(mu, RatioBlockwise) and isinstance(nu, RootBlockwise)
  assert mu.codes.dtype == nu.codes.dtype == jnp.int4 and mu.codes.shape == (4096, 4096)
  per_param = _stored_bytes(state[0][1:]) / 4096**2
  assert per_param <= 1.1, per_param
  assert per_param == 2 * (0.5 + 4 / quant.BLOCK)
  small = {"b": jnp.zeros(512), "h": jnp.zeros(3, jnp.float16)}
  lion = pallasopt.optim.lion(1e-3, state_format="int4").init({**small, "w": jnp.zeros((64, 256))})
  assert isinstance(lion[0].mu["w"], Int4Blockwise)
  assert lion[0].mu["b"].dtype == jnp.float32 and lion[0].mu["h"].dtype == jnp.float16


def _params():
  rng = np.random.default_rng(1)
  return {
      "w": random_array(rng, (48, 256), jnp.float32),    # rows of whole blocks
      "e": random_array(rng, (100, 48), jnp.bfloat16),   # ragged last block
      "b": random_array(rng, (256,), jnp.float32),       # small: f32 state
  }


def _grads(params, step):
  return jax.tree.map(lambda p: jnp.cos(p * (step + 1)).astype(p.dtype), params)


_FAMILIES = {
    "adamw": lambda impl: pallasopt.optim.adamw(1e-2, state_format="int4", impl=impl,
                                                param_rounding="stochastic"),
    "lion": lambda impl: pallasopt.optim.lion(1e-3, state_format="int4", impl=impl),
    "rmsprop": lambda impl: pallasopt.optim.rmsprop(1e-3, state_format="int4", impl=impl,
                                                    centered=True, momentum=0.9),
    "muon": lambda impl: pallasopt.optim.muon(0.02, state_format="int4", impl=impl),
}


@pytest.mark.parametrize("family", list(_FAMILIES))
def test_transforms_agree_in_every_impl(family):
  # The same state bit for bit from the XLA reference and the kernels run by
  # the interpreter, over steps that feed each state to the next.
  params = _params()
  states = {}
  for impl in ("xla", "interpret"):
    tx = _FAMILIES[family](impl)
    p, s = params, tx.init(params)
    for step in range(3):
      p, s = jax.jit(tx.apply_gradients)(p, _grads(params, step), s)
    states[impl] = s
  _same(states["interpret"], states["xla"], family)
  assert any(isinstance(x, (Int4Blockwise, RatioBlockwise))
             for x in jax.tree.leaves(states["xla"], is_leaf=quant.is_blockwise))


def test_convert_state_between_every_format():
  # Optax's state -> int4 -> int8 -> fp8 -> int4 -> f32: each conversion rounds
  # to nearest, so the f32 moments end within the 4-bit maps' error of
  # Optax's (a ratio within half a gap, 1/14 of its block's largest, of its
  # value; a root within half a relative step, 1/8, of its own); and the
  # converted state steps like one the int4 transform built.
  params = _params()
  ref = optax.adamw(1e-2)
  state = ref.init(params)
  for step in range(2):
    _, state = ref.update(_grads(params, step), state, params)
  converted = state
  for fmt in ("int4", "int8", "fp8", "int4"):
    converted = pallasopt.optim.convert_state(converted, params, fmt)
  tx = pallasopt.optim.adamw(1e-2, state_format="int4")
  assert jax.tree.structure(converted) == jax.tree.structure(tx.init(params))
  jax.jit(tx.update)(_grads(params, 2), converted, params)
  back = pallasopt.optim.convert_state(converted, params, None)
  np.testing.assert_array_equal(back[0].mu["b"], state[0].mu["b"])  # small leaves stay f32
  v, got_v = np.asarray(state[0].nu["w"], np.float64), np.asarray(back[0].nu["w"], np.float64)
  w, got_w = np.sqrt(v), np.sqrt(got_v)
  # Four roundings of the root to nearest (int8's and fp8's on the 8-bit
  # map), each within half a step of the value it rounds.
  assert np.all(np.abs(got_w - w) <= ((1 + 2**-3) * (1 + 2**-5)**2 * (1 + 2**-3) - 1) * w + 1e-12)
  # The ratio m / w: within two int4 half gaps (1/14 each), int8's and fp8's
  # of the block's largest ratio, and a few f32 roundings of it. Measured:
  # 0.071 of it (the roots: 0.11 of theirs).
  m, got_m = np.asarray(state[0].mu["w"], np.float64), np.asarray(back[0].mu["w"], np.float64)
  r, got_r = m / w, got_m / got_w
  r_max = np.abs(r).reshape(-1, 256).max(axis=1).repeat(256).reshape(r.shape)
  assert np.all(np.abs(got_r - r) <= (2 / 14 + 2 * 0.9 / 128 + 2**-4 + 2**-20) * r_max)
