"""MARS: the kernel-family contract, the drop-in against eFormer's numbers.

``tests/data/eformer_mars.json`` holds a trajectory recorded with eFormer
0.0.101's ``eformer.optimizers._tx.mars`` (5 steps of ``mars`` on a two-leaf
tree, with and without its global-norm clip; eFormer's module loaded on its
own, with ``jax.tree_map`` aliased to ``jax.tree.map``, which eFormer 0.0.101
still calls when clipping). CI does not install eFormer.
"""

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import strategies as st

from helpers import assert_close, assert_nearly_same_codes, assert_trees_close, random_array
from kernel_contract import KernelContract
from pallasopt.kernels import mars as mars_k
from pallasopt.kernels import quant
from pallasopt.optim import Int8Blockwise, Int8RatioBlockwise, RootBlockwise
from pallasopt.optim.mars import ScaleByMarsState, mars, scale_by_mars

_RECORDED = json.loads((pathlib.Path(__file__).parent / "data" / "eformer_mars.json").read_text())


class TestMarsKernel(KernelContract):
  kernel = staticmethod(mars_k.mars_kernel)
  reference = staticmethod(mars_k.mars_reference)
  apply = staticmethod(mars_k.mars_apply)
  updates = staticmethod(mars_k.mars_updates)
  flops_per_element, transcendentals_per_element = mars_k.FLOPS_PER_ELEMENT, 1
  options = st.fixed_dictionaries({"clip": st.sampled_from([1.0, 0.25])})
  simple_options = {"clip": 1.0}

  def moments(self, rng, shape, dtype, moment_dtype, options):
    return (random_array(rng, shape, moment_dtype, scale=0.1),
            random_array(rng, shape, dtype, positive=True, scale=0.1),
            random_array(rng, shape, moment_dtype))

  def scalars(self, step, options):
    # decay: a weight-decay link folded after MARS (u + r p).
    return mars_k.mars_scalars(step, 1e-2, 0.95, 0.99, 0.025, 1e-8, 0.0,
                               clip_scale=options["clip"], grad_scale=0.5, decay_rate=-1e-3)


def _params():
  return {"w": jnp.linspace(-1.0, 1.0, 8 * 32, dtype=jnp.float32).reshape(8, 32),
          "b": jnp.linspace(0.5, 1.5, 8, dtype=jnp.float32)}


@pytest.mark.parametrize("impl", ["xla", "interpret"])
@pytest.mark.parametrize("case", _RECORDED["cases"], ids=lambda c: f"clip={c['kwargs']['max_grad_norm']}")
def test_drop_in_reproduces_eformers_recorded_trajectory(case, impl):
  tx = mars(optax.linear_schedule(1e-2, 1e-3, 10), **case["kwargs"], impl=impl)
  params, state = _params(), tx.init(_params())
  for i in range(5):
    grads = jax.tree.map(lambda x, i=i: jnp.cos(3.0 * x * (i + 1)), params)
    params, state = jax.jit(tx.apply_gradients)(params, grads, state)
  # f32 over five steps: a few ulps of the values the steps combine.
  recorded = lambda tree: {k: jnp.asarray(x, jnp.float32) for k, x in tree.items()}
  assert_trees_close(params, recorded(case["params"]), rtol=1e-6)
  assert_trees_close(state[0].mu, recorded(case["mu"]), rtol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5])
def test_fused_paths_equal_the_optax_style_chain(max_grad_norm, impl):
  # `mars` = chain(scale_by_mars, scale_by_learning_rate), same state tree;
  # its update and apply paths both; a float16 leaf runs the chain's math.
  params = {**_params(), "h": jnp.ones((3,), jnp.float16)}
  kwargs = dict(b1=0.9, b2=0.99, gamma=0.05, max_grad_norm=max_grad_norm)
  schedule = optax.cosine_decay_schedule(1e-2, 10)
  tx = mars(schedule, **kwargs, impl=impl)
  ref = optax.chain(scale_by_mars(**kwargs), optax.scale_by_learning_rate(schedule))
  s, r, t = tx.init(params), ref.init(params), tx.init(params)
  assert jax.tree.structure(s) == jax.tree.structure(r)
  p = q = o = params
  for i in range(3):
    grads = jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 2)).astype(x.dtype), p)
    p, s = jax.jit(tx.apply_gradients)(p, grads, s)
    u, r = jax.jit(ref.update)(grads, r, q)
    q = optax.apply_updates(q, u)
    v, t = jax.jit(tx.update)(grads, t, o)
    o = optax.apply_updates(o, v)
  assert_trees_close((p, s), (q, r), rtol=2e-6)
  assert_trees_close((o, t), (q, r), rtol=2e-6)


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_low_bit_state(fmt):
  params = {"w": random_array(np.random.default_rng(0), (48, 256), jnp.float32),
            "b": jnp.ones((64,), jnp.float32)}
  grads = jax.tree.map(jnp.cos, params)
  states = {}
  for impl in ("xla", "interpret"):
    tx = mars(1e-2, max_grad_norm=1.0, state_format=fmt, impl=impl)
    p, s = params, tx.init(params)
    for _ in range(2):
      p, s = jax.jit(tx.apply_gradients)(p, grads, s)
    states[impl] = s
  # The interpreter's body and XLA's fused reference are compiled apart: the
  # f32 moments may differ by an ulp before they are stored (helpers).
  blockwise = quant.is_blockwise
  for a, b in zip(jax.tree.leaves(states["interpret"], is_leaf=blockwise),
                  jax.tree.leaves(states["xla"], is_leaf=blockwise)):
    if blockwise(a):
      assert_nearly_same_codes(a, b)
    else:
      assert_close(a, b, 2**-8 if a.dtype == jnp.bfloat16 else 4 * 2**-24)
  state = states["xla"][0]
  assert isinstance(state, ScaleByMarsState)
  # mu as its ratio to nu's root, nu as its root, the previous gradient as itself.
  kinds = (Int8RatioBlockwise, RootBlockwise, Int8Blockwise)
  for tree, kind in zip((state.mu, state.nu, state.mog), kinds):
    if fmt == "int8":
      assert isinstance(tree["w"], kind) and tree["b"].dtype == jnp.float32
    else:
      assert tree["w"].dtype == tree["b"].dtype == jnp.bfloat16


@pytest.mark.parametrize("call,match", [
    (functools.partial(mars, 1e-3, b1=1.0), "b1"),
    (functools.partial(mars, 1e-3, gamma=-0.1), "gamma"),
    (functools.partial(scale_by_mars, max_grad_norm=-1.0), "max_grad_norm"),
])
def test_bad_arguments(call, match):
  with pytest.raises(ValueError, match=match):
    call()
