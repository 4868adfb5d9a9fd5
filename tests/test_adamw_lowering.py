"""Every kernel lowers for TPU (Mosaic) and CUDA (Triton) from this CPU host.

This proves the Pallas-level rules (block shapes, dtypes, scalar memory
spaces, compiler params), not device compilation or speed. Arguments are
`jax.ShapeDtypeStruct`s, so large leaves cost nothing to lower.
"""

import functools
import re

import jax
import jax.numpy as jnp
import optax
import pytest

import pallasopt
from helpers import CUSTOM_CALL, lowered_text
from pallasopt.kernels import adamw as adamw_k

SIZES = [(), (7,), (37, 128), (3, 5, 7, 11), (1_000_003,), (4096, 1024)]
PLATFORMS = ["tpu", "cuda"]


def _sds(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("shape", SIZES, ids=str)
@pytest.mark.parametrize(
    "mode,nesterov,decay,dtypes",
    [
        ("apply", False, True, (jnp.float32,) * 4),
        ("apply", True, True, (jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.bfloat16)),
        ("updates", False, False, (jnp.float32,) * 4),
        ("updates", True, True, (jnp.bfloat16,) * 4),
    ],
)
def test_adamw_kernel_lowers(platform, shape, mode, nesterov, decay, dtypes):
  p, g, m, v = (_sds(shape, d) for d in dtypes)
  scalars = adamw_k.adamw_scalars(jnp.int32(3), 1e-3, 0.9, 0.999, 1e-8, 0.0, 0.1)
  entry = adamw_k.adamw_apply if mode == "apply" else adamw_k.adamw_updates
  fn = lambda p, g, m, v, s: entry(p, g, m, v, s, nesterov=nesterov, decay=decay, impl="pallas")
  text = lowered_text(fn, platform, p, g, m, v, scalars)
  assert text.count(CUSTOM_CALL[platform]) >= 1


@pytest.mark.parametrize("platform", PLATFORMS)
def test_adamw_transform_lowers_with_one_kernel_per_leaf(platform):
  params = {"w": _sds((768, 3072)), "b": _sds((3072,)), "ln": _sds((7,), jnp.bfloat16), "s": _sds(())}
  tx = pallasopt.optim.adamw(optax.cosine_decay_schedule(1e-3, 100), weight_decay=0.1,
                             mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p), impl="pallas")
  state = jax.eval_shape(tx.init, params)
  fused = functools.partial(pallasopt.optim.apply_gradients, tx)
  text = lowered_text(fused, platform, params, params, state)
  assert text.count(CUSTOM_CALL[platform]) == len(params)
  update = lambda p, g, s: tx.update(g, s, p)
  assert lowered_text(update, platform, params, params, state).count(CUSTOM_CALL[platform]) == len(params)


def _hbm_operands(text):
  # The operand indices a Mosaic call asks XLA to keep in HBM (color 0).
  text = text.replace("\\22", '"')  # the config's quotes, as MLIR escapes them
  spans = re.findall(r"input_memory_space_colors(.*?)\]", text)
  return [sorted(int(i) for i, color in re.findall(
      r'"operand_index":(\d+),"color":(\d+)', span) if color == "0") for span in spans]


def test_tpu_kernel_operands_stay_in_hbm():
  # Else XLA stages each operand through VMEM ahead of a kernel that streams
  # it in blocks itself (kernels/_compat.py `kept_in_hbm`): operands 1-4 are
  # p, g, m, v (0 is the scalars, in SMEM). The constraint has no batching
  # rule: under vmap the batched operands go unconstrained, and it lowers.
  params = {"w": _sds((768, 3072))}
  tx = pallasopt.optim.adamw(1e-3, impl="pallas")
  state = jax.eval_shape(tx.init, params)
  fused = functools.partial(pallasopt.optim.apply_gradients, tx)
  assert _hbm_operands(lowered_text(fused, "tpu", params, params, state)) == [[1, 2, 3, 4]]
  stacked = {"w": _sds((4, 256, 512))}
  per_layer = lambda p, g: jax.vmap(
      lambda p, g: fused({"w": p}, {"w": g}, tx.init({"w": p}))[0]["w"])(p["w"], g["w"])
  text = lowered_text(per_layer, "tpu", stacked, stacked)
  assert text.count(CUSTOM_CALL["tpu"]) == 1


def test_auto_runs_xla_for_f32_state_on_tpu_and_cuda():
  # On CUDA GPUs XLA's fused update was never slower than Triton's (module doc).
  x = _sds((1024, 128))
  scalars = adamw_k.adamw_scalars(jnp.int32(1), 1e-3, 0.9, 0.999, 1e-8, 0.0, 0.1)
  fn = lambda *a: adamw_k.adamw_apply(*a, impl="auto")
  # A train step fuses XLA's update into the gradient's producer (policy.TPU_AUTO).
  assert CUSTOM_CALL["tpu"] not in lowered_text(fn, "tpu", x, x, x, x, scalars)
  assert CUSTOM_CALL["cuda"] not in lowered_text(fn, "cuda", x, x, x, x, scalars)


def test_auto_on_cpu_lowers_to_plain_xla():
  x = _sds((256,))
  scalars = adamw_k.adamw_scalars(jnp.int32(1), 1e-3, 0.9, 0.999, 1e-8, 0.0, 0.1)
  fn = jax.jit(lambda *a: adamw_k.adamw_apply(*a, impl="auto"))
  assert "custom_call" not in fn.lower(x, x, x, x, scalars).as_text()
