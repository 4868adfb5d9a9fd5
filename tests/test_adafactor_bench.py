"""The Adafactor bench cases: their bytes models, and that every row runs the same step."""

import jax
import numpy as np
import pytest

from bench import cases_adafactor
from helpers import assert_trees_close


@pytest.fixture(scope="module")
def ci_cases():
  return {c.label: c for c in cases_adafactor.cases("ci")}


def test_bytes_models_per_parameter(ci_cases):
  matrix = ci_cases["f32/128x256"]
  # Factored, Optax's defaults: statistics (g, p) + RMS (g) + update (g, p; p).
  assert matrix.bytes == 24 * matrix.params
  # Unfactored with momentum and decay: RMS pass (g, v, p) + update (g, p, m,
  # v; p, m, v) = 12 + 28; the Optax path writes u (f32) and adds apply_updates.
  vector = ci_cases["f32/1000/momentum"]
  assert vector.bytes == 40 * vector.params
  assert dict((i.name, i.bytes) for i in vector.impls)["pallasopt.update"] == 52 * vector.params


def test_every_row_runs_the_same_step(ci_cases):
  for case in ci_cases.values():
    carry, consts = jax.jit(case.inputs)(jax.random.key(0))
    results = {impl.name: jax.jit(impl.build("xla"))(carry, consts) for impl in case.impls}
    for name in ("pallasopt.update", "pallasopt.fused"):
      assert_trees_close(results[name], results["optax"], rtol=1e-5)
      assert np.all(np.isfinite(jax.tree.leaves(results[name])[0]))
