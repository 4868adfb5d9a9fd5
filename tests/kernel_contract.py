"""The contract every elementwise kernel family is tested against.

A family's ``test_<family>_kernel.py`` subclasses `KernelContract`, naming its
kernel, reference and entry points, the options its property test draws
(hyperparameters and the kernel's own keywords) and how a case's moments and
per-step scalars follow from them; pytest then runs every test below for it::

  class TestLionKernel(KernelContract):
    kernel, reference = ..., ...         # and its entry points, cost per element
    options = st.fixed_dictionaries(...)  # what the property test draws
    def moments(self, rng, shape, dtype, moment_dtype, options): ...
    def scalars(self, step, options): ...

(tests/test_lion_kernel.py in full).

The family's kernel takes ``(p, g, *moments, scalars, key=None, *, mode,
decay, backend, interpret, **options)`` (RMSProp: its moments as one tuple,
`call` says how) and its reference the same without ``backend`` and
``interpret``; both return ``(p + u or u, *moments)``.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from helpers import (
    CUSTOM_CALL,
    ELEMENTWISE_KERNEL_CASES,
    LOWERING_SHAPES,
    assert_close,
    lowered_text,
    random_array,
    sds,
    tolerance,
)


def _pallas_call(fn, *args):
  (eqn,) = [e for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "pallas_call"]
  return eqn


def _kernel_equals_reference_over_steps():
  """A fresh copy of the property test for each `KernelContract` subclass.

  Hypothesis refuses one ``@given`` function run from several classes (its
  ``differing_executors`` health check), so every family gets its own.
  """

  @given(**ELEMENTWISE_KERNEL_CASES, data=st.data())
  def test_kernel_equals_reference_over_steps(
      self, shape, param_dtype, grad_dtype, mu_dtype, mode, decay, backend, seed, data
  ):
    rng = np.random.default_rng(seed)
    p = random_array(rng, shape, param_dtype)
    moments, scalars, options = self._case(shape, data.draw(self.options), param_dtype,
                                           mu_dtype, rng)
    config = dict(mode=mode, decay=decay, **options)
    # Jitted once: the step's scalars are kernel inputs, so the steps reuse it.
    kernel = jax.jit(lambda p, g, ms, s: self.call(
        self.kernel, p, g, ms, s, **config, backend=backend, interpret=True))
    for step in range(1, 4):
      g = random_array(rng, shape, grad_dtype)
      want = self.call(self.reference, p, g, moments, scalars(step), **config)
      got = kernel(p, g, moments, scalars(step))
      for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype, i
        assert_close(a, b, tolerance(a.dtype), err_msg=f"step {step}, output {i}", operands=(p,))
      # Chain the reference's own results so each step compares the same inputs.
      moments = tuple(want[1:])
      if mode == "apply":
        p = want[0]

  return test_kernel_equals_reference_over_steps


class KernelContract:
  """Kernel equals reference; modes, aliasing, cost and lowering, for one family."""

  kernel: Callable[..., tuple]
  reference: Callable[..., tuple]
  apply: Callable[..., tuple]
  updates: Callable[..., tuple]
  flops_per_element: int
  transcendentals_per_element: int

  # Options the property test draws: the scalars' hyperparameters and the
  # kernel's keywords (`kernel_keywords`); `simple_options` for the others.
  options: st.SearchStrategy[dict[str, Any]] = st.just({})
  simple_options: dict[str, Any] = {}
  kernel_keywords: tuple[str, ...] = ()

  def moments(self, rng, shape, dtype, moment_dtype, options) -> tuple[jax.Array, ...]:
    """The state a step starts from: the moments in ``moment_dtype`` (or ``dtype``)."""
    raise NotImplementedError

  def scalars(self, step, options) -> tuple:
    """The family's scalars of step ``step`` (from 1)."""
    raise NotImplementedError

  def call(self, fn, p, g, moments, scalars, **kwargs):
    """``fn`` (kernel, reference or entry point) on one leaf."""
    return fn(p, g, *moments, scalars, **kwargs)

  def _case(self, shape, options=None, dtype=jnp.float32, moment_dtype=jnp.float32, rng=None):
    """``(moments, scalars of step t, the kernel's keywords)`` of one case."""
    options = self.simple_options if options is None else options
    rng = np.random.default_rng(0) if rng is None else rng
    moments = self.moments(rng, shape, dtype, moment_dtype, options)
    keywords = {k: options[k] for k in self.kernel_keywords}
    return moments, lambda step: self.scalars(step, options), keywords

  def _abstract_case(self, shape, dtype=jnp.float32):
    """`_case` with the moments as `jax.ShapeDtypeStruct`s of ``shape``, for lowering.

    Drawn on a one-element leaf: a moment has its leaf's shape, whatever the
    leaf, so a million-element leaf costs no random draws.
    """
    moments, scalars, keywords = self._case((1,), dtype=dtype)
    return tuple(sds(shape, m.dtype) for m in moments), scalars, keywords

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    cls.test_kernel_equals_reference_over_steps = _kernel_equals_reference_over_steps()

  @pytest.mark.parametrize("backend", ["tpu", "triton"])
  def test_updates_without_decay_need_no_params(self, backend):
    rng = np.random.default_rng(0)
    g = random_array(rng, (300,), jnp.float32)
    moments, scalars, options = self._case((300,))
    config = dict(mode="updates", decay=False, **options)
    want = self.call(self.reference, None, g, moments, scalars(2), **config)
    got = self.call(self.kernel, None, g, moments, scalars(2), **config, backend=backend,
                    interpret=True)
    for a, b in zip(got, want, strict=True):
      assert_close(a, b, 2e-6)

  def test_missing_params_are_reported(self):
    x = jnp.ones((8,))
    moments, scalars, options = self._case((8,))
    with pytest.raises(ValueError, match="p is required in 'apply' mode"):
      self.call(self.apply, None, x, moments, scalars(1), impl="xla", **options)
    with pytest.raises(ValueError, match="p is required in 'updates' mode with decay"):
      self.call(self.updates, None, x, moments, scalars(1), decay=True, impl="interpret",
                **options)

  def test_empty_leaf_is_a_no_op(self):
    x = jnp.ones((0, 3))
    moments, scalars, options = self._case((0, 3))
    out = self.call(self.apply, x, x, moments, scalars(1), impl="interpret", **options)
    assert all(o.shape == (0, 3) for o in out)

  @pytest.mark.parametrize("mode,decay", [("apply", True), ("updates", True), ("updates", False)])
  def test_cost_estimate_counts_the_bytes_each_mode_moves(self, mode, decay):
    # f32: read p (apply only), g and the moments; write p or u and the
    # moments. With decay in updates mode XLA adds the decay outside the
    # kernel, fused with the apply after it, so the kernel never reads p.
    n = 1024
    p, g = jnp.ones((n,)), jnp.ones((n,))
    moments, scalars, options = self._case((n,))
    eqn = _pallas_call(lambda p, g, ms: self.call(
        self.kernel, p, g, ms, scalars(1), mode=mode, decay=decay, backend="tpu", **options),
        p, g, moments)
    cost = eqn.params["cost_estimate"]
    arrays = 2 * len(moments) + (3 if mode == "apply" else 2)
    assert cost.bytes_accessed == 4 * arrays * n
    assert cost.flops == self.flops_per_element * n
    assert cost.transcendentals == self.transcendentals_per_element * n

  @pytest.mark.parametrize("mode", ["apply", "updates"])
  def test_params_and_moments_are_aliased_in_place(self, mode):
    # Operands: scalars, g, the moments, p (apply) -> outputs: p or u, the moments.
    x = jnp.ones((256,))
    moments, scalars, options = self._case((256,))
    eqn = _pallas_call(lambda p, g, ms: self.call(
        self.kernel, p, g, ms, scalars(1), mode=mode, decay=False, backend="triton", **options),
        x, x, moments)
    k = len(moments)
    want = {2 + i: 1 + i for i in range(k)} | ({2 + k: 0} if mode == "apply" else {})
    assert dict(eqn.params["input_output_aliases"]) == want

  @pytest.mark.parametrize("platform", ["tpu", "cuda"])
  @pytest.mark.parametrize("shape", LOWERING_SHAPES, ids=str)
  @pytest.mark.parametrize("mode,dtype", [("apply", jnp.float32), ("updates", jnp.bfloat16)])
  def test_kernel_lowers_to_one_custom_call(self, platform, shape, mode, dtype):
    moments, scalars, options = self._abstract_case(shape, dtype)
    entry = self.apply if mode == "apply" else self.updates
    fn = lambda p, g, ms, s: self.call(entry, p, g, ms, s, impl="pallas", **options)
    text = lowered_text(fn, platform, sds(shape, dtype), sds(shape, dtype), moments,
                        scalars(jnp.int32(3)))
    assert text.count(CUSTOM_CALL[platform]) == 1

  def test_auto_runs_xla_for_f32_state(self):
    # A train step fuses XLA's update into the gradient's producer on TPU,
    # and XLA's one pass ties the kernel on CUDA (kernels.policy's rows);
    # on a CPU "auto" is plain XLA.
    x = sds((1024, 128))
    moments, scalars, options = self._abstract_case((1024, 128))
    fn = lambda p, g, ms, s: self.call(self.apply, p, g, ms, s, impl="auto", **options)
    for platform in ("tpu", "cuda"):
      assert CUSTOM_CALL[platform] not in lowered_text(fn, platform, x, x, moments, scalars(1))
    assert "custom_call" not in lowered_text(fn, "cpu", x, x, moments, scalars(1))
