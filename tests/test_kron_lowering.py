"""The Kron kernels lower for TPU (Mosaic) and CUDA (Triton) from this CPU host.

Arguments are `jax.ShapeDtypeStruct`s: lowering costs no device memory.
"""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

from helpers import CUSTOM_CALL, lowered_text
from pallasopt.kernels import kron as kk
from pallasopt.kernels import kron_factor as kf
from pallasopt.kernels import policy
from pallasopt.kernels._target import Target
from pallasopt.optim.kron import kron

PLATFORMS = ["tpu", "cuda"]


def _sds(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def _factors(batch, shape, kinds):
  sizes = shape or (1,)
  return [
      _sds((batch, d, d) if k == "dense" else ((batch, d) if k == "diag" else (batch,)))
      for d, k in zip(sizes, kinds)
  ]


def _kernel_runs(platform, *dims):
  """1 where the kernel takes a layer of ``dims``: on Triton at most 64 per side (BUILD.md, the compile tier)."""
  return int(platform == "tpu" or max(dims, default=1) <= 64)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize(
    "shape,kinds,dtype,mode",
    [
        ((), ("scalar",), jnp.float32, "apply"),
        ((7,), ("diag",), jnp.bfloat16, "updates"),
        ((6, 7), ("dense", "dense"), jnp.float32, "apply"),
        ((128, 96), ("dense", "diag"), jnp.bfloat16, "apply"),
        ((3, 4, 5), ("dense", "diag", "dense"), jnp.float32, "precond"),
    ],
    ids=str,
)
def test_precondition_kernel_lowers(platform, shape, kinds, dtype, mode):
  g = _sds((4, *shape), dtype)
  qs = _factors(4, shape, kinds)
  s = kk.kron_scalars(jnp.int32(3), 1e-3, 0.9, 0.1)
  fn = lambda g, mu, p, qs, s: kk.kron_precondition(g, mu, p, qs, s, mode=mode, decay=True, impl="auto")
  text = lowered_text(fn, platform, g, g, g, qs, s)
  assert text.count(CUSTOM_CALL[platform]) == _kernel_runs(platform, *shape)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize(
    "q_shape,r",
    [((3, 16, 16), 300), ((3, 100, 100), 64), ((2, 7), 30), ((5, 1), 1), ((1, 128, 128), 1024)],
    ids=str,
)
def test_factor_update_kernel_lowers(platform, q_shape, r):
  # Under "auto" a TPU runs XLA's factor update (`kron_factor_update`).
  q = _sds(q_shape)
  x = _sds(q_shape[:2] + (r,))
  for impl in ("pallas", "auto"):
    fn = lambda q, x, y: kf.kron_factor_update(q, x, y, 0.1, impl=impl)
    expected = _kernel_runs(platform, q_shape[1]) * (impl == "pallas" or platform != "tpu")
    assert lowered_text(fn, platform, q, x, x).count(CUSTOM_CALL[platform]) == expected, impl


@pytest.mark.parametrize("platform", PLATFORMS)
def test_transform_lowers_with_kernels(platform):
  params = {"w": _sds((2, 48, 64)), "b": _sds((2, 64)), "s": _sds((2, 1))}  # s: a scalar per layer
  tx = kron(optax.cosine_decay_schedule(1e-3, 100), weight_decay=0.1, stacked_axes=1)
  state = jax.eval_shape(tx.init, params)
  fused = lambda p, g, s: tx.apply_gradients(p, g, s)
  text = lowered_text(fused, platform, params, params, state)
  # Kernel (a) per leaf, kernel (b) per factor (w: 2, b: 1, s: 1) but on a
  # TPU, where "auto" runs XLA's factor update.
  assert text.count(CUSTOM_CALL[platform]) == 3 + (4 if platform == "cuda" else 0)


def test_auto_on_cpu_lowers_to_plain_xla():
  g = _sds((2, 6, 7))
  qs = _factors(2, (6, 7), ("dense", "dense"))
  s = kk.kron_scalars(jnp.int32(1))
  fn = jax.jit(functools.partial(kk.kron_precondition, mode="precond", impl="auto"))
  assert "custom_call" not in fn.lower(g, None, None, qs, s).as_text()


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("precision", ["bfloat16", "tensorfloat32", "float32"])
def test_matmul_precisions_lower(platform, precision):
  g, q = _sds((2, 64, 32)), _factors(2, (64, 32), ("dense", "dense"))
  s = kk.kron_scalars(jnp.int32(1))
  precond = lambda g, qs: kk.kron_precondition(g, None, None, qs, s, mode="precond", precision=precision, impl="pallas")
  update = lambda q, x: kf.kron_factor_update(q, x, x, 0.1, precision=precision, impl="pallas")
  assert lowered_text(precond, platform, g, q).count(CUSTOM_CALL[platform]) == 1
  assert lowered_text(update, platform, q[0], g).count(CUSTOM_CALL[platform]) == 1


@pytest.mark.parametrize("layer,kind,kernel", [
    ((64, 64), "TPU v5 lite", True), ((64, 64), "TPU v5", False),
    ((256, 256), "TPU v6 lite", False), ((256, 256), "TPU v5", False),
    ((128, 1024), "TPU v4", True), ((128, 1024), "TPU v5", True),
    ((1024, 64), "TPU v5", False), ((768,), "TPU7x", True), ((768,), "TPU v5", False),
], ids=str)
def test_tpu_auto_takes_kernel_a_where_it_moves_fewer_bytes_on_that_generation(layer, kind, kernel):
  # kernels/policy.py's Kron row: fitted on v5e, holds on v4, v6e and tpu7x;
  # a v5p takes only layers with a side of 1024 and 2^17 elements or more.
  choice = policy.auto_choice(policy.KRON_PRECONDITION, [_sds((2, *layer))], Target("tpu", kind))
  assert choice == ("pallas" if kernel else "xla")
