"""Hypothesis strategies and data builders shared by the tests."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16)

# Shapes that hit every tiling case: 0-d, tiny, non-multiples of 128 (flat
# view), multiples of 128 with ragged row blocks, and ranks up to 4.
SPECIAL_SHAPES = [(), (1,), (7,), (128,), (129,), (37, 128), (3, 5, 7, 11), (2, 3, 128), (1000,)]


def shapes(max_rank: int = 4, max_side: int = 40):
  random = st.lists(st.integers(1, max_side), min_size=0, max_size=max_rank).map(tuple)
  return st.one_of(st.sampled_from(SPECIAL_SHAPES), random)


def random_array(rng: np.random.Generator, shape, dtype, *, positive=False, scale=1.0):
  x = rng.standard_normal(shape).astype(np.float32) * scale
  if positive:
    x = np.abs(x)
  return jnp.asarray(x, dtype)


def tree_of(rng, shapes_and_dtypes, **kwargs):
  return {f"leaf{i}": random_array(rng, s, d, **kwargs) for i, (s, d) in enumerate(shapes_and_dtypes)}


def tolerance(*dtypes) -> float:
  """Relative tolerance for results stored in the narrowest of `dtypes`."""
  return 1e-2 if any(jnp.dtype(d) == jnp.bfloat16 for d in dtypes) else 2e-6


def assert_close(actual, expected, rtol, err_msg=""):
  """|actual - expected| <= rtol * max|expected| elementwise; NaN never passes.

  The tolerance scales with the largest magnitude of `expected`, so values
  that cancel to ~0 are judged at the scale the computation worked at.
  """
  actual = np.asarray(jnp.asarray(actual, jnp.float32))
  expected = np.asarray(jnp.asarray(expected, jnp.float32))
  assert actual.shape == expected.shape, (actual.shape, expected.shape, err_msg)
  assert np.all(np.isfinite(actual)), f"non-finite result {err_msg}"
  assert np.all(np.isfinite(expected)), f"non-finite expectation {err_msg}"
  scale = max(float(np.max(np.abs(expected), initial=0.0)), 1e-30)
  np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * scale, err_msg=err_msg)
