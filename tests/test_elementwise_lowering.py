"""The elementwise transforms lower for TPU (Mosaic) and CUDA (Triton) from this CPU host.

Each family's kernel lowers on every leaf shape (tests/kernel_contract.py);
here whole transforms: one kernel per leaf in both Optax paths, and the TPU
kernels' operands kept in HBM. This proves the Pallas-level rules (block
shapes, dtypes, scalar memory spaces, compiler params), not device
compilation or speed. Arguments are `jax.ShapeDtypeStruct`s, so large leaves
cost nothing to lower.
"""

import functools
import re

import jax
import jax.numpy as jnp
import optax
import pytest

import pallasopt
from helpers import CUSTOM_CALL, lowered_text, sds

_TRANSFORMS = {
    "adamw": lambda mask: pallasopt.optim.adamw(
        optax.cosine_decay_schedule(1e-3, 100), weight_decay=0.1, mask=mask, impl="pallas"),
    "lion": lambda mask: pallasopt.optim.lion(
        optax.cosine_decay_schedule(1e-4, 100), weight_decay=0.1, mu_dtype=jnp.bfloat16,
        mask=mask, impl="pallas"),
}


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("name", list(_TRANSFORMS))
def test_transform_lowers_with_one_kernel_per_leaf(name, platform):
  params = {"w": sds((768, 3072)), "b": sds((3072,)), "ln": sds((7,), jnp.bfloat16), "s": sds(())}
  tx = _TRANSFORMS[name](lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
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
  params = {"w": sds((768, 3072))}
  tx = pallasopt.optim.adamw(1e-3, impl="pallas")
  state = jax.eval_shape(tx.init, params)
  fused = functools.partial(pallasopt.optim.apply_gradients, tx)
  assert _hbm_operands(lowered_text(fused, "tpu", params, params, state)) == [[1, 2, 3, 4]]
  stacked = {"w": sds((4, 256, 512))}
  per_layer = lambda p, g: jax.vmap(
      lambda p, g: fused({"w": p}, {"w": g}, tx.init({"w": p}))[0]["w"])(p["w"], g["w"])
  text = lowered_text(per_layer, "tpu", stacked, stacked)
  assert text.count(CUSTOM_CALL["tpu"]) == 1
