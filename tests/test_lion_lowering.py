"""The Lion kernels and transform lower for TPU (Mosaic) and CUDA (Triton) from this CPU host.

This proves the Pallas-level rules (block shapes, dtypes, scalar memory
spaces, compiler params), not device compilation or speed. Arguments are
`jax.ShapeDtypeStruct`s, so large leaves cost nothing to lower.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import optax
import pytest

from helpers import CUSTOM_CALL, LOWERING_SHAPES, lowered_text, sds
from pallasopt.kernels import lion as lion_k
from pallasopt.optim._base import apply_gradients
from pallasopt.optim.lion import lion

SCALARS = lion_k.lion_scalars(1e-4, 0.9, 0.99, 0.1)
# (mode, decay, dtypes of p, g, m)
KERNEL_CASES = [
    ("apply", True, (jnp.float32,) * 3),
    ("apply", False, (jnp.bfloat16, jnp.bfloat16, jnp.float32)),
    ("updates", False, (jnp.float32,) * 3),
    ("updates", True, (jnp.bfloat16,) * 3),
]


@pytest.mark.parametrize(
    "platform,shape", list(itertools.product(["tpu", "cuda"], LOWERING_SHAPES)), ids=str
)
@pytest.mark.parametrize("mode,decay,dtypes", KERNEL_CASES)
def test_lion_kernel_lowers(platform, shape, mode, decay, dtypes):
  p, g, m = (sds(shape, d) for d in dtypes)
  entry = lion_k.lion_apply if mode == "apply" else lion_k.lion_updates
  fn = lambda p, g, m, s: entry(p, g, m, s, decay=decay, impl="pallas")
  text = lowered_text(fn, platform, p, g, m, SCALARS)
  assert text.count(CUSTOM_CALL[platform]) == 1


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_lion_transform_lowers_with_one_kernel_per_leaf(platform):
  params = {"w": sds((768, 3072)), "b": sds((3072,)), "ln": sds((7,), jnp.bfloat16), "s": sds(())}
  tx = lion(optax.cosine_decay_schedule(1e-4, 100), weight_decay=0.1, mu_dtype=jnp.bfloat16,
            mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p), impl="pallas")
  state = jax.eval_shape(tx.init, params)
  fused = functools.partial(apply_gradients, tx)
  assert lowered_text(fused, platform, params, params, state).count(CUSTOM_CALL[platform]) == len(params)
  update = lambda p, g, s: tx.update(g, s, p)
  assert lowered_text(update, platform, params, params, state).count(CUSTOM_CALL[platform]) == len(params)


def test_auto_runs_xla_for_f32_state_on_tpu_and_cuda():
  x = sds((1024, 128))
  fn = lambda *a: lion_k.lion_apply(*a, impl="auto")
  # A train step fuses XLA's update into the gradient's producer (policy.TPU_AUTO).
  assert CUSTOM_CALL["tpu"] not in lowered_text(fn, "tpu", x, x, x, SCALARS)
  assert CUSTOM_CALL["cuda"] not in lowered_text(fn, "cuda", x, x, x, SCALARS)


def test_auto_on_cpu_lowers_to_plain_xla():
  x = sds((256,))
  fn = jax.jit(lambda *a: lion_k.lion_apply(*a, impl="auto"))
  assert "custom_call" not in fn.lower(x, x, x, SCALARS).as_text()
