"""Native GPU runs of the low-bit state kernels (``pytest -m gpu`` on a CUDA machine).

Every test is skipped wherever ``jax.default_backend() != "gpu"`` (conftest.py).
On a GPU the Triton kernel and the XLA reference are compiled by different
compilers, which may contract a multiply-add into an FMA differently, so a
moment can differ by an f32 ulp before it is encoded: the codes of such an
element may then land one code apart, and its stochastic rounding on the
other bf16 neighbour.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import (
    assert_close, assert_nearly_same_codes, blockwise_adam_moments, random_array, tolerance,
)
from pallasopt.kernels import adamw as adamw_k, lion as lion_k, quant, rounding
from pallasopt.optim import adamw, convert_state

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(256,), (40, 256), (4096, 1024), (3, 5, 256)], ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("family", ["adamw", "lion"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_compiled_blockwise_triton_kernel_matches_reference(shape, dtype, family, fmt):
  rng = np.random.default_rng(0)
  p, g = random_array(rng, shape, dtype), random_array(rng, shape, dtype)
  m = random_array(rng, shape, jnp.float32, scale=0.1)
  v = random_array(rng, shape, jnp.float32, positive=True, scale=0.01)
  key = rounding.leaf_key(0, 3, 0)
  config = dict(mode="apply", decay=True, param_rounding="stochastic")
  if family == "lion":
    s, moments = lion_k.lion_scalars(3e-4, 0.9, 0.99, 0.1), (quant.quantize(m, fmt=fmt),)
    kernel, reference = lion_k.lion_kernel, lion_k.lion_reference
  else:
    s = adamw_k.adamw_scalars(3, 3e-4, 0.9, 0.999, 1e-8, 0.0, 0.1)
    moments = blockwise_adam_moments(m, v, fmt)
    kernel = functools.partial(adamw_k.adamw_kernel, nesterov=False)
    reference = functools.partial(adamw_k.adamw_reference, nesterov=False)
  got = jax.jit(functools.partial(kernel, **config, backend="triton"))(p, g, *moments, s, key)
  want = jax.jit(functools.partial(reference, **config))(p, g, *moments, s, key)
  assert_close(got[0], want[0], tolerance(dtype), operands=(p,))
  for a, b in zip(got[1:], want[1:]):
    assert_nearly_same_codes(a, b)


def test_donated_int8_step_under_auto_equals_the_xla_path():
  # "auto" runs the Triton kernel for 8-bit moments on CUDA. One step from
  # the same state: the update reads the f32 moments before they are
  # re-encoded, so the params agree to f32 rounding and the codes nearly.
  rng = np.random.default_rng(1)
  params = {"w": random_array(rng, (1024, 768), jnp.float32),
            "b": random_array(rng, (768,), jnp.float32)}
  grads = jax.tree.map(jnp.cos, params)
  state = optax.adamw(1e-3).init(params)
  _, state = optax.adamw(1e-3).update(grads, state, params)
  results = {}
  for impl in ("auto", "xla"):
    tx = adamw(1e-3, weight_decay=0.1, state_format="int8", impl=impl)
    low_bit = convert_state(jax.tree.map(jnp.copy, state), params, "int8")
    step = jax.jit(tx.apply_gradients, donate_argnums=(0, 2))
    results[impl] = step(jax.tree.map(jnp.copy, params), grads, low_bit)
  (p, s), (q, r) = results["auto"], results["xla"]
  for k in params:
    assert_close(p[k], q[k], tolerance(jnp.float32), operands=(params[k],))
  for name in ("mu", "nu"):
    assert_nearly_same_codes(getattr(s[0], name)["w"], getattr(r[0], name)["w"])
