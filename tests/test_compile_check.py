"""`pallasopt.compiled_traffic.traffic` on modules compiled for this CPU host."""

import jax
import jax.numpy as jnp

from pallasopt.compiled_traffic import traffic


def test_traffic_counts_the_costliest_branch_of_a_conditional_apart():
  # Each branch reads x and writes one result of its size; the conditional
  # itself moves nothing, so the step outside the branches moves only the
  # predicate's few bytes (a bool converted to the branch index).
  x = jax.ShapeDtypeStruct((1024, 256), jnp.float32)
  nbytes = 1024 * 256 * 4

  def step(x, p):
    return jax.lax.cond(p, lambda x: jnp.sin(x) * 2, lambda x: jnp.cos(x) + jnp.exp(x) * x, x)

  t = traffic(jax.jit(step).lower(x, jax.ShapeDtypeStruct((), jnp.bool_)).compile())
  assert t.branch_hbm_bytes == 2 * nbytes, t
  assert t.hbm_bytes < 16, t


def test_traffic_splits_its_bytes_by_what_moves_them():
  # A matmul whose output feeds an elementwise update, and a reduction
  # beside it: every byte of hbm_bytes lands in one kind, matmul fusions
  # named as such, the costliest kind first.
  w = jax.ShapeDtypeStruct((256, 512), jnp.float32)
  x = jax.ShapeDtypeStruct((64, 256), jnp.float32)

  def step(w, x):
    g = x.T @ jnp.tanh(x @ w)
    return w - 0.1 * g, jnp.sum(jnp.abs(w))

  t = traffic(jax.jit(step).lower(w, x).compile())
  kinds = dict(t.hbm_by_kind)
  assert sum(kinds.values()) == t.hbm_bytes, t
  assert list(kinds.values()) == sorted(kinds.values(), reverse=True), t
  assert all(kinds.values()), t
  matmuls = [k for k in kinds if k.endswith("+ matmul") or k in ("dot", "convolution")]
  assert matmuls, t
