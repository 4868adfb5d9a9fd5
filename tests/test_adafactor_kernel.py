"""The Adafactor Pallas kernels equal their reference (interpret mode, both flavours)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from optax._src import factorized

from bench import cases_adafactor
from helpers import FLOAT_DTYPES, SPECIAL_SHAPES, assert_close, random_array, tolerance
from pallasopt.kernels import adafactor as adafactor_k

# Leading dims stay small (each is a grid axis of P matrices in interpret
# mode); trailing dims reach past a block and the default threshold.
_LEAD = st.lists(st.integers(1, 4), max_size=2)
_TRAIL = st.lists(st.integers(1, 40), max_size=2)
SHAPES = st.one_of(
    st.sampled_from(SPECIAL_SHAPES + [(4, 2, 3), (40, 3, 33), (130, 9)]),
    st.tuples(_LEAD, _TRAIL).map(lambda parts: tuple(parts[0] + parts[1])),
)
MIN_DIMS = st.sampled_from([1, 3, 8, 128])

hyperparams = st.fixed_dictionaries({
    "learning_rate": st.floats(1e-3, 1.0),
    "decay_rate": st.floats(0.3, 1.0),
    "decay_offset": st.sampled_from([0, -3]),
    "eps": st.sampled_from([1e-30, 1e-8, 1e-3]),
    "clipping_threshold": st.floats(0.05, 2.0),
    "momentum": st.floats(0.0, 0.99),
    "weight_decay": st.floats(0.0, 0.5),
    "grad_scale": st.sampled_from([1.0, 0.5]),
})


def state_for(shape, dims, dtype, momentum_dtype=None):
  """Zero (v_row, v_col, v, m) shaped as `optax.adafactor` initialises them."""
  one = jnp.zeros((1,), dtype)
  if dims is None:
    moments = (one, one, jnp.zeros(shape, dtype))
  else:
    d1, d0 = dims
    moments = (jnp.zeros(shape[:d0] + shape[d0 + 1:], dtype),
               jnp.zeros(shape[:d1] + shape[d1 + 1:], dtype), one)
  return (*moments, None if momentum_dtype is None else jnp.zeros(shape, momentum_dtype))


def _step_fns(config, backend):
  kernel = jax.jit(functools.partial(
      adafactor_k.adafactor_kernel, **config, backend=backend, interpret=True))
  reference = jax.jit(functools.partial(adafactor_k.adafactor_reference, **config))
  return kernel, reference


@given(
    shape=SHAPES,
    min_dim=MIN_DIMS,
    factored=st.booleans(),
    stacked_axes=st.integers(0, 2),
    param_dtype=st.sampled_from(FLOAT_DTYPES),
    grad_dtype=st.sampled_from(FLOAT_DTYPES),
    momentum_dtype=st.sampled_from([None, *FLOAT_DTYPES]),
    mode=st.sampled_from(["apply", "updates"]),
    clipping=st.booleans(),
    parameter_scale=st.booleans(),
    decay=st.booleans(),
    backend=st.sampled_from(["tpu", "triton"]),
    hp=hyperparams,
    seed=st.integers(0, 2**16),
)
def test_kernel_equals_reference_over_steps(
    shape, min_dim, factored, stacked_axes, param_dtype, grad_dtype, momentum_dtype, mode,
    clipping, parameter_scale, decay, backend, hp, seed,
):
  dims = adafactor_k.factored_dims(shape, factored, min_dim, stacked_axes)
  if stacked_axes == 0:
    assert dims == factorized._factored_dims(shape, factored, min_dim)
  rng = np.random.default_rng(seed)
  config = dict(mode=mode, factored_dims=dims, stacked_axes=stacked_axes, clipping=clipping,
                parameter_scale=parameter_scale, momentum=momentum_dtype is not None,
                decay=decay)
  kernel, reference = _step_fns(config, backend)
  state = (random_array(rng, shape, param_dtype),
           *state_for(shape, dims, param_dtype, momentum_dtype))
  for step in range(3):
    g = random_array(rng, shape, grad_dtype)
    s = adafactor_k.adafactor_scalars(step, **hp)
    want = reference(state[0], g, *state[1:], s)
    got = kernel(state[0], g, *state[1:], s)
    for name, a, b in zip(("p/u", "v_row", "v_col", "v", "m"), got, want):
      if b is None:
        assert a is None, name
        continue
      assert a.dtype == b.dtype and a.shape == b.shape, name
      # p + u can cancel to 0 (a 0-d leaf clipped to |u| = lr * threshold *
      # |p|): judge it at the scale of p, which u's rounding error follows.
      operands = (state[0],) if name == "p/u" and mode == "apply" else ()
      assert_close(a, b, tolerance(a.dtype, grad_dtype), err_msg=f"step {step} {name}",
                   operands=operands)
    # Chain the reference's own results so each step compares the same inputs.
    state = ((want[0] if mode == "apply" else state[0]), *want[1:])


@given(shape=st.lists(st.integers(1, 300), max_size=5).map(tuple), min_dim=st.integers(0, 200),
       factored=st.booleans())
def test_factored_dims_is_optax_rule(shape, min_dim, factored):
  assert adafactor_k.factored_dims(shape, factored, min_dim) == factorized._factored_dims(
      shape, factored, min_dim)


@pytest.mark.parametrize(
    "shape,stacked,expected",
    [
        ((256, 512), 0, (0, 1)),
        ((512, 256), 0, (1, 0)),
        ((4, 256, 512), 0, (1, 2)),  # layers smallest: Optax factors d_in, d_out
        ((300, 256, 512), 0, (0, 2)),  # layers among the two largest: Optax factors it
        ((300, 256, 512), 1, (1, 2)),  # stacked: never factored
        ((2, 3, 256, 512), 2, (2, 3)),
        ((2, 256), 1, None),  # one axis left
        ((256,), 2, None),  # ndim <= stacked_axes: unfactored
    ],
)
def test_factored_dims_with_stacked_axes(shape, stacked, expected):
  assert adafactor_k.factored_dims(shape, True, 128, stacked) == expected


@pytest.mark.parametrize(
    "shape,dims,view",
    [
        ((37, 20), (1, 0), (1, 37, 20)),
        ((3, 20, 37), (1, 2), (3, 20, 37)),
        ((2, 3, 9, 1, 12), (2, 4), (6, 9, 12)),  # unit axes between and after
        ((9, 12, 1), (0, 1), (1, 9, 12)),
        ((12, 3, 9), (2, 0), None),  # an axis of 3 between the factored axes
        ((12, 9, 3), (1, 0), None),  # an axis of 3 after them
    ],
)
def test_matrix_view(shape, dims, view):
  assert adafactor_k.matrix_view(shape, dims) == view


def _pallas_calls(fn, *args):
  return [e for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "pallas_call"]


@pytest.mark.parametrize(
    "dims,clipping,parameter_scale,mode,decay,bytes_per_param",
    [
        # Factored: statistics (+ RMS with clipping) + update. Optax's defaults
        # in apply mode: read g, p | read g | read g, p, write p = 24 B/param.
        ((0, 1), True, True, "apply", False, (8, 4, 12)),
        ((0, 1), False, True, "apply", False, (8, 12)),
        ((0, 1), True, True, "updates", False, (8, 4, 8)),  # update: read g, write u
        ((0, 1), True, False, "updates", True, (4, 4, 12)),  # decay reads p
        # Unfactored: one pass, plus one before it for clipping or param scale.
        (None, False, False, "apply", False, (20,)),  # read g, v, p; write p, v
        (None, False, True, "apply", False, (4, 20)),  # parameter scale reads only p
        (None, True, True, "apply", False, (12, 20)),  # read g, v, p | update
        (None, True, False, "updates", False, (8, 16)),  # read g, v | write u, v
    ],
)
def test_passes_and_bytes_per_configuration(dims, clipping, parameter_scale, mode, decay,
                                            bytes_per_param):
  shape = (64, 256)
  n = math.prod(shape)
  x = jnp.ones(shape)
  state = state_for(shape, dims, jnp.float32)
  s = adafactor_k.adafactor_scalars(1)
  config = dict(mode=mode, clipping=clipping, parameter_scale=parameter_scale, decay=decay)
  fn = functools.partial(adafactor_k.adafactor_kernel, factored_dims=dims, **config,
                         backend="tpu")
  calls = _pallas_calls(lambda *a: fn(*a, s), x, x, *state)
  model = cases_adafactor.pass_bytes(shape, dims, param_dtype=jnp.float32, grad_dtype=jnp.float32,
                                 **config)
  assert model == tuple(b * n for b in bytes_per_param)
  # The cost estimates add the row, column and partial-sum vectors.
  estimates = [c.params["cost_estimate"].bytes_accessed for c in calls]
  assert len(estimates) == len(model)
  for estimate, floor in zip(estimates, model):
    assert floor <= estimate <= floor * 1.05


def test_apply_aliases_params_momentum_and_v_in_place():
  shape = (8, 128)
  x = jnp.ones(shape)
  state = state_for(shape, None, jnp.float32, jnp.float32)
  s = adafactor_k.adafactor_scalars(1)
  fn = functools.partial(adafactor_k.adafactor_kernel, mode="apply", factored_dims=None,
                         momentum=True, backend="triton")
  update = _pallas_calls(lambda *a: fn(*a, s), x, x, *state)[-1]
  # Inputs: scalars, g, v, per-block scale, p, m -> outputs p, v, m.
  assert dict(update.params["input_output_aliases"]) == {2: 1, 4: 0, 5: 2}


def test_non_canonical_layout_runs_the_reference():
  shape, dims = (12, 3, 9), (2, 0)
  x = jnp.ones(shape)
  state = state_for(shape, dims, jnp.float32)
  s = adafactor_k.adafactor_scalars(1)
  kernel, reference = _step_fns(dict(mode="apply", factored_dims=dims), "tpu")
  assert not _pallas_calls(kernel, x, x, *state, s)
  for a, b in zip(kernel(x, x, *state, s), reference(x, x, *state, s)):
    if b is not None:
      assert_close(a, b, 0.0)


def test_empty_leaf_runs_the_reference():
  x = jnp.ones((0, 3))
  state = state_for(x.shape, None, jnp.float32)
  kernel, _ = _step_fns(dict(mode="apply", factored_dims=None), "triton")
  assert not _pallas_calls(kernel, x, x, *state, adafactor_k.adafactor_scalars(0))
  assert kernel(x, x, *state, adafactor_k.adafactor_scalars(0))[0].shape == (0, 3)


def test_missing_operands_are_reported():
  x = jnp.ones((8,))
  state = state_for((8,), None, jnp.float32)
  s = adafactor_k.adafactor_scalars(0)
  with pytest.raises(ValueError, match="p is required in 'apply' mode"):
    adafactor_k.adafactor_apply(None, x, *state, s, factored_dims=None, impl="xla")
  with pytest.raises(ValueError, match="p is required with parameter scale and with decay"):
    adafactor_k.adafactor_updates(None, x, *state, s, factored_dims=None, decay=True, impl="xla")
  with pytest.raises(ValueError, match="m must be given exactly when momentum is on"):
    adafactor_k.adafactor_apply(x, x, *state, s, factored_dims=None, momentum=True, impl="xla")
  with pytest.raises(ValueError, match="mode must be"):
    adafactor_k.adafactor_reference(x, x, *state, s, mode="fused", factored_dims=None)
