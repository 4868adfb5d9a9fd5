"""The shared kernel machinery: tiling plans and implementation dispatch."""

import math

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, strategies as st

import pallasopt
from pallasopt import kernels
from pallasopt.kernels import _compat, _dispatch, _matrix
from pallasopt.kernels import adamw as adamw_k
from pallasopt.kernels._tiling import LANES, leaf_view, plan_blocks


def _legal_for_tpu(view, block):
  _, rows, cols = view
  rows_ok = block[0] % 32 == 0 or block[0] == rows
  lanes_ok = block[1] % LANES == 0 or block[1] == cols
  return rows_ok and lanes_ok


_SHAPES = st.lists(st.integers(1, 3000), min_size=0, max_size=4).filter(
    lambda s: math.prod(s) <= 10**7
)


@given(shape=_SHAPES, backend=st.sampled_from(["tpu", "triton"]), whole_rows=st.booleans())
def test_plan_is_legal_for_both_targets_and_covers_the_leaf(shape, backend, whole_rows):
  shape = tuple(shape)
  view = leaf_view(shape)
  assert math.prod(view) == math.prod(shape)
  assert view[1:] == ((1,) * 2 + shape)[-2:]  # the last two dims as they are
  plan = plan_blocks(view, backend, whole_rows=whole_rows)
  if backend == "tpu":
    assert _legal_for_tpu(view, plan.block)
  else:
    count = math.prod(plan.block)
    assert count & (count - 1) == 0  # Triton: power of two.
  if whole_rows:
    assert plan.block[1] >= view[2]
  assert all(g * b >= d for g, b, d in zip(plan.grid[1:], plan.block, view[1:]))
  assert all((g - 1) * b < d for g, b, d in zip(plan.grid[1:], plan.block, view[1:]))


def test_leaf_view_keeps_the_last_two_dims_and_merges_the_rest():
  assert leaf_view(()) == (1, 1, 1)
  assert leaf_view((1_000_003,)) == (1, 1, 1_000_003)
  assert leaf_view((4096, 4097)) == (1, 4096, 4097)
  assert leaf_view((2, 3, 40, 128)) == (6, 40, 128)
  assert plan_blocks((1, 4096, 4096), "tpu").block == (64, 2048)
  assert plan_blocks((1, 37, 128), "triton").ragged


@pytest.mark.parametrize("bad", [(1, 0, 3), (0, 1, 1)])
def test_plan_rejects_empty_views(bad):
  with pytest.raises(ValueError, match="empty view"):
    plan_blocks(bad, "tpu")


@pytest.mark.parametrize(
    "plan",
    [
        lambda b: plan_blocks((1, 1, 128), b),
        lambda b: _matrix.padded_dims(16, 16, b),
        lambda b: _compat.compiler_params(b, ("parallel",)),
    ],
)
def test_every_planner_rejects_an_unknown_backend(plan):
  with pytest.raises(ValueError, match="backend must be 'tpu' or 'triton'; got 'rocm'"):
    plan("rocm")


def test_interpreted_calls_get_no_compiler_params():
  for backend in ("tpu", "triton"):
    assert _compat.compiler_params(backend, ("parallel",), interpret=True) is None
    assert _compat.compiler_params(backend, ("parallel",)) is not None
  with pytest.raises(ValueError, match="backend must be"):
    _compat.compiler_params("rocm", ("parallel",), interpret=True)


def test_resolve_impl_precedence(monkeypatch):
  monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
  assert kernels.resolve_impl() == "auto"
  monkeypatch.setenv(_dispatch.ENV_VAR, "xla")
  assert kernels.resolve_impl() == "xla"
  with kernels.use_impl("interpret"):
    assert kernels.resolve_impl() == "interpret"
    assert kernels.resolve_impl("pallas") == "pallas"  # explicit wins
    with kernels.use_impl("xla"):
      assert kernels.resolve_impl() == "xla"
    assert kernels.resolve_impl() == "interpret"
  assert kernels.resolve_impl() == "xla"


def test_bad_impl_values_are_named(monkeypatch):
  with pytest.raises(ValueError, match="impl must be one of"):
    kernels.resolve_impl("cuda")
  with pytest.raises(ValueError, match=r"use_impl\(impl\) must be one of"):
    with kernels.use_impl("fast"):
      pass
  monkeypatch.setenv(_dispatch.ENV_VAR, "triton")
  with pytest.raises(ValueError, match=r"\$PALLASOPT_IMPL must be one of"):
    kernels.resolve_impl()


def test_bad_policy_family_is_named():
  with pytest.raises(ValueError, match="family must be one of .*'elementwise update'"):
    _dispatch.dispatch(adamw_k.adamw_reference, adamw_k.adamw_kernel, family="triton")


def test_use_impl_is_part_of_the_jit_cache_key():
  # The same jitted function, called under two choices, runs each.
  tx = pallasopt.optim.adamw(1e-3)
  params = {"w": jnp.ones((300,))}
  state = tx.init(params)
  step = jax.jit(tx.update)
  lowered = lambda: step.lower(params, state, params).as_text()
  plain = lowered()
  with kernels.use_impl("interpret"):
    interpreted = lowered()
    with kernels.use_impl("xla"):
      xla = lowered()
  assert lowered() == plain
  assert interpreted not in (plain, xla)
  # And the compiled calls: the interpreter's rounding is not required to
  # differ, so compare which jaxpr each call traced.
  traced = []
  counted = jax.jit(lambda g, s, p: (traced.append(kernels.resolve_impl()), tx.update(g, s, p))[1])
  counted(params, state, params)
  with kernels.use_impl("interpret"):
    counted(params, state, params)
  counted(params, state, params)
  assert traced == ["auto", "interpret"]


def test_every_jax_internal_the_project_relies_on_is_there():
  # A JAX release that drops one would otherwise switch per-shard kernels off
  # (or lose the legacy mesh context) with no more than a warning.
  assert _compat.missing_internals() == []


def test_jax_internals_are_imported_by_one_module():
  import pathlib
  import re

  root = pathlib.Path(pallasopt.__file__).parent
  importers = sorted(
      str(path.relative_to(root))
      for folder in ("kernels", "optim", "pipeline", "bench", ".")
      for path in (root / folder).glob("*.py")
      if re.search(r"^\s*(from|import) jax\.(_src|interpreters)\b", path.read_text(), re.M)
  )
  assert importers == ["kernels/_compat.py"]
