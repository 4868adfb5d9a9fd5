"""The shared row/column reduction and broadcasting kernels (`kernels._reduction`)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import CUSTOM_CALL, assert_close, lowered_text, random_array
from pallasopt.kernels import _reduction as red
from pallasopt.kernels._tiling import plan_blocks


def _operands(rng, shape):
  p, r, c = shape
  return [
      (red.FULL, random_array(rng, shape, jnp.float32)),
      (red.FULL, random_array(rng, shape, jnp.bfloat16)),
      (red.ROWS, random_array(rng, (p, r), jnp.float32)),
      (red.COLS, random_array(rng, (p, c), jnp.float32)),
      (red.MATRIX, random_array(rng, (p,), jnp.float32)),
  ]


def _reduce_body(scalars, x, y, rows, cols, per_matrix):
  squares = x * x * scalars[0] + scalars[1]  # + a constant: padding must not count
  return squares, squares, y * rows * cols * per_matrix


def _broadcast_body(scalars, x, y, rows, cols, per_matrix):
  return x * rows * cols * per_matrix + scalars[0] * y, x + scalars[1]


@pytest.mark.parametrize(
    "backend,shape",
    [
        ("tpu", (2, 70, 2100)),  # (64, 2048) blocks, ragged both ways; rows accumulate
        ("triton", (2, 37, 300)),  # (32, 128) blocks, ragged both ways
    ],
    ids=str,
)
def test_reductions_and_broadcasts_equal_numpy(backend, shape):
  plan = plan_blocks(shape, backend)
  ops = _operands(np.random.default_rng(0), shape)
  x, y, rows, cols, per_matrix = (np.asarray(a, np.float32) for _, a in ops)
  call = dict(backend=backend, interpret=True)
  got_rows, got_cols, got_total = jax.jit(lambda *a: red.reduce_call(
      _reduce_body, list(zip([k for k, _ in ops], a)), [2.0, 0.5], ["rows", "cols", "total"],
      plan, name="test_reduce", **call))(*(a for _, a in ops))
  squares = x * x * 2 + 0.5
  assert_close(got_rows, squares.sum(2), 1e-6)
  assert_close(got_cols, squares.sum(1), 1e-6)
  weighted = y * rows[:, :, None] * cols[:, None, :] * per_matrix[:, None, None]
  assert_close(got_total, weighted.sum((1, 2)), 1e-5)

  first, second = jax.jit(lambda *a: red.broadcast_call(
      _broadcast_body, list(zip([k for k, _ in ops], a)), [2.0, 0.5],
      [jnp.float32, jnp.bfloat16], plan, name="test_broadcast", aliases={0: 0}, **call,
  ))(*(a for _, a in ops))
  assert_close(first, x * rows[:, :, None] * cols[:, None, :] * per_matrix[:, None, None] + 2 * y, 1e-6)
  assert second.dtype == jnp.bfloat16
  assert_close(second, x + 0.5, 1e-2)


@pytest.mark.parametrize("backend", ["tpu", "triton"])
def test_flat_plan_sums_each_slice(backend):
  plan = red.plan_flat(3, 1000, backend)
  x = random_array(np.random.default_rng(1), plan.shape, jnp.float32)
  (total,) = jax.jit(lambda x: red.reduce_call(
      lambda s, x: (x * x,), [(red.FULL, x)], [0.0], ["total"], plan,
      backend=backend, interpret=True, name="test_flat"))(x)
  assert_close(total, np.square(np.asarray(x)).reshape(3, -1).sum(1), 1e-6)


def test_bad_operands_are_reported():
  plan = plan_blocks((1, 4, 4), "tpu")
  with pytest.raises(ValueError, match="a 'rows' operand must have shape"):
    red.reduce_call(_reduce_body, [(red.ROWS, jnp.ones((1, 5)))], [1.0], ["rows"], plan,
                    backend="tpu", interpret=True, name="bad")
  with pytest.raises(ValueError, match="reductions must be in"):
    red.reduce_call(_reduce_body, [(red.FULL, jnp.ones((1, 4, 4)))], [1.0], ["diag"], plan,
                    backend="tpu", interpret=True, name="bad")
  with pytest.raises(ValueError, match="only full operands can be aliased"):
    red.broadcast_call(_broadcast_body, [(red.COLS, jnp.ones((1, 4)))], [1.0], [jnp.float32],
                       plan, backend="tpu", interpret=True, name="bad", aliases={0: 0})


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_lowers_for_both_targets(platform):
  backend = "tpu" if platform == "tpu" else "triton"
  shape = (3, 4096, 5000)
  plan = plan_blocks(shape, backend)
  sds = jax.ShapeDtypeStruct
  args = [sds(shape, jnp.float32), sds(shape, jnp.bfloat16), sds(shape[:2], jnp.float32),
          sds(shape[::2], jnp.float32), sds(shape[:1], jnp.float32)]
  kinds = [red.FULL, red.FULL, red.ROWS, red.COLS, red.MATRIX]
  call = dict(backend=backend, interpret=False)

  def fn(*a):
    ops = list(zip(kinds, a))
    sums = red.reduce_call(_reduce_body, ops, [2.0, 0.5], ["rows", "cols", "total"], plan,
                           name="r", **call)
    return sums, red.broadcast_call(_broadcast_body, ops, [2.0, 0.5],
                                    [jnp.float32, jnp.bfloat16], plan, name="b",
                                    aliases={0: 0}, **call)

  # A raw kernel call names its chip: Triton's lowering on jax 0.12 reads the
  # GPU from the abstract mesh, which the library's dispatch sets
  # (`_by_target`) and this test bypasses.
  chip = "h100" if platform == "cuda" else None
  assert lowered_text(fn, platform, *args, chip=chip).count(CUSTOM_CALL[platform]) == 2
