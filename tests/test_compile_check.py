"""`pallasopt.compiled_traffic.traffic` on modules compiled for this CPU host."""

import jax
import jax.numpy as jnp

from pallasopt.compiled_traffic import Traffic, bytes_by_kind_beyond, traffic


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


def test_bytes_by_kind_beyond_names_the_kinds_that_changed_largest_first():
  # A step whose update left the matmul fusions for kernels: the kinds that
  # changed, the largest change (either sign) first; unchanged kinds left out.
  baseline = Traffic(100, (), (), 0, 0, None, None,
                     hbm_by_kind=(("fusion kOutput + matmul", 80), ("copy-start", 20)))
  ours = Traffic(110, (), (), 0, 16, None, None, hbm_by_kind=(
      ("custom-call tpu_custom_call", 60), ("fusion kOutput + matmul", 30), ("copy-start", 20)))
  beyond = bytes_by_kind_beyond(ours, baseline)
  assert list(beyond.items()) == [("custom-call tpu_custom_call", 60), ("fusion kOutput + matmul", -50)]
  assert sum(beyond.values()) == ours.hbm_bytes - baseline.hbm_bytes
