"""RMSProp: the kernel-family contract, the drop-in against `optax.rmsprop`.

Optax's own alias tests run against the drop-in in tests/test_optax_suites.py.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import strategies as st

import pallasopt
from helpers import assert_trees_close, pairwise, random_array
from kernel_contract import KernelContract
from pallasopt.kernels import rmsprop as rmsprop_k
from pallasopt.optim import Int8Blockwise, RootBlockwise


def _moments(rng, shape, dtype, *, centered, momentum):
  mu = random_array(rng, shape, dtype, scale=0.1)
  # A centered state has nu >= mu^2 (an EMA of g^2 bounds the square of g's).
  nu = (mu.astype(jnp.float32) ** 2 + 0.01 + random_array(
      rng, shape, jnp.float32, positive=True, scale=0.1)).astype(dtype)
  trace = random_array(rng, shape, dtype, scale=0.01)
  return (mu,) * centered + (nu,) + (trace,) * momentum


class TestRMSPropKernel(KernelContract):
  kernel = staticmethod(rmsprop_k.rmsprop_kernel)
  reference = staticmethod(rmsprop_k.rmsprop_reference)
  apply = staticmethod(rmsprop_k.rmsprop_apply)
  updates = staticmethod(rmsprop_k.rmsprop_updates)
  flops_per_element, transcendentals_per_element = rmsprop_k.FLOPS_PER_ELEMENT, 1
  # Bias correction is exact only from the zero state (step 1 divides by
  # 1 - decay); centered, it then meets g^2 - g^2 = 0 under the root, which
  # rounding may make negative: NaN in Optax too unless eps is inside.
  options = st.fixed_dictionaries({
      "centered": st.booleans(), "momentum": st.booleans(), "nesterov": st.booleans(),
      "eps_in_sqrt": st.booleans(), "bias_correction": st.booleans(),
  }).filter(lambda o: not (o["bias_correction"] and o["centered"] and not o["eps_in_sqrt"]))
  simple_options = dict(centered=True, momentum=True, nesterov=False, eps_in_sqrt=True,
                        bias_correction=False)
  kernel_keywords = ("centered", "eps_in_sqrt", "nesterov")

  def moments(self, rng, shape, dtype, moment_dtype, options):
    moments = _moments(rng, shape, moment_dtype, centered=options["centered"],
                       momentum=options["momentum"])
    if options["bias_correction"]:
      return tuple(jnp.zeros_like(m) for m in moments)
    return moments

  def scalars(self, step, options):
    # decay: a weight-decay link folded after RMSProp (u + r p).
    return rmsprop_k.rmsprop_scalars(
        1e-2, 0.9, 1e-2, count=step if options["bias_correction"] else None,
        momentum=0.9 if options["momentum"] else None, grad_scale=0.5, decay_rate=-1e-3,
    )

  def call(self, fn, p, g, moments, scalars, **kwargs):
    return fn(p, g, tuple(moments), scalars, **kwargs)


_OPTIONS = dict(centered=[False, True], momentum=[None, 0.9], nesterov=[False, True],
                bias_correction=[False, True], eps_in_sqrt=[True, False])


def _valid(centered, momentum, nesterov, bias_correction, eps_in_sqrt):
  return momentum is not None or not nesterov


CONFIGS = [dict(zip(_OPTIONS, row)) for row in itertools.product(*_OPTIONS.values())
           if _valid(*row)]
# Under "interpret", every value of every pair of options in some config: the
# kernel equals the reference in every combination
# (test_kernel_equals_reference_over_steps draws them all), and the reference
# equals Optax in every config under "xla".
_PAIRWISE = [dict(zip(_OPTIONS, row)) for row in pairwise(*_OPTIONS.values(), allowed=_valid)]


@pytest.mark.parametrize("config,impl", [(c, "xla") for c in CONFIGS] + [
    (c, "interpret") for c in _PAIRWISE
], ids=lambda x: x if isinstance(x, str) else "-".join(
    f"{k}={v}" for k, v in x.items() if v not in (None, False)) or "plain")
def test_drop_in_equals_optax(config, impl):
  # Same state tree and, over steps of a schedule, the same params and state
  # (the float16 leaf runs Optax's own math, as any dtype no kernel takes).
  params = {"w": random_array(np.random.default_rng(0), (64, 256), jnp.float32),
            "b": jnp.ones((64,)), "h": jnp.ones((3,), jnp.float16)}
  kwargs = dict(config, learning_rate=optax.linear_schedule(1e-2, 1e-3, 10), decay=0.9,
                eps=1e-8 if config["eps_in_sqrt"] else 1e-3, initial_scale=0.1)
  tx, ref = pallasopt.optim.rmsprop(**kwargs, impl=impl), optax.rmsprop(**kwargs)
  s, r = tx.init(params), ref.init(params)
  assert jax.tree.structure(s) == jax.tree.structure(r)
  p = q = params
  for i in range(3):
    grads = jax.tree.map(lambda x, i=i: jnp.cos(x * (i + 1)).astype(x.dtype), p)
    p, s = jax.jit(tx.apply_gradients)(p, grads, s)
    # Jitted both: XLA computes float16 chains in f32 under jit, not eagerly.
    u, r = jax.jit(ref.update)(grads, r, q)
    q = optax.apply_updates(q, u)
  assert_trees_close((p, s), (q, r), rtol=2e-6)


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_low_bit_state(fmt):
  # nu as its root, mu and the trace as themselves; every impl
  # stores the same state, bit for bit (the grads do not depend on the params).
  params = {"w": random_array(np.random.default_rng(0), (48, 256), jnp.float32),
            "b": jnp.ones((64,), jnp.bfloat16)}
  grads = jax.tree.map(lambda x: jnp.cos(x).astype(x.dtype), params)
  states = {}
  for impl in ("xla", "interpret"):
    tx = pallasopt.optim.rmsprop(1e-2, centered=True, momentum=0.9, state_format=fmt,
                                 param_rounding="stochastic", impl=impl)
    p, s = params, tx.init(params)
    for _ in range(2):
      p, s = jax.jit(tx.apply_gradients)(p, grads, s)
    states[impl] = s
  for a, b in zip(jax.tree.leaves(states["interpret"]), jax.tree.leaves(states["xla"])):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  rms, _, trace = states["xla"]
  assert int(rms.count) == 2  # stochastic rounding keeps a step count
  if fmt == "int8":
    # nu as its root; the centered mean and the trace as themselves.
    assert isinstance(rms.nu["w"], RootBlockwise)
    assert all(isinstance(x["w"], Int8Blockwise) for x in (rms.mu, trace.trace))
    assert rms.nu["b"].dtype == jnp.float32  # under 4096 elements
  else:
    assert all(x[k].dtype == jnp.bfloat16 for x in (rms.mu, rms.nu, trace.trace) for k in "wb")


def test_bad_arguments():
  with pytest.raises(ValueError, match="decay"):
    pallasopt.optim.rmsprop(1e-3, decay=1.5)
  with pytest.raises(ValueError, match="momentum"):
    pallasopt.optim.rmsprop(1e-3, momentum=-0.1)
  with pytest.raises(ValueError, match="state_format"):
    pallasopt.optim.rmsprop(1e-3, state_format="int2")
