r"""Kron's math on values, shared by its references and kernel bodies, and the kernels' limits.

`pallasopt.kernels.kron` (kernel (a), the preconditioner) and
`pallasopt.kernels.kron_factor` (kernel (b), a factor's update) run these
same functions on whole layers (the references) and on the blocks a kernel
holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from pallasopt.kernels import _compat

__all__ = [
    "RMS_CLIP",
    "PRECISIONS",
    "norm_lower_bound",
    "map_layers",
]

# psgd_jax clips each preconditioned layer to RMS 1.1 (PG has RMS ~1).
RMS_CLIP = 1.1
PRECISIONS = (None, "bfloat16", "tensorfloat32", "float32")
# Per-grid-step working set, in f32 elements of the blocks (TPU: 2^21 takes
# a 512 x 512 layer, at most 9.1 MiB of scoped VMEM on v4, whose 16 MiB are
# the least of the five generations; 512 x 1024 needs 20 MiB there), and the
# Triton caps: a program keeps its tiles in registers, and ptxas spills both
# kernels from 128 per side on (5-10 KB per thread at 4 warps, 0.4-2 KB at 8
# or 16). At 64 per side 8 warps spill nothing on an H100 or B200 (4 warps
# spill the precondition at 64 x 128); on an A100 the dense factor update
# spills about 0.5 KB at any warp count (the compile tier names it).
TPU_MAX_BLOCK_ELEMENTS = 1 << 21
TPU_VMEM_LIMIT = 48 << 20
TRITON_MAX_DIM = 64
TRITON_WARPS = 8
TRITON_CHUNK = 64
TPU_CHUNK = 512


def tiny_add(x):
  return x + jnp.finfo(jnp.float32).tiny


def reduce_all(fn, x):
  """``fn`` over both axes of a 2-D value, as a (1, 1) value (one axis at a time)."""
  return fn(fn(x, axis=1, keepdims=True), axis=0, keepdims=True)


def _first_argmax_onehot(v, axis: int):
  """One-hot (same shape as ``v``) of the first maximum of ``v`` along ``axis``."""
  iota = jax.lax.broadcasted_iota(jnp.int32, v.shape, axis).astype(jnp.float32)
  top = jnp.max(v, axis=axis, keepdims=True)
  first = jnp.min(jnp.where(v == top, iota, float(v.shape[axis])), axis=axis, keepdims=True)
  return iota == first, top


def norm_lower_bound(a):
  """A cheap lower bound of the spectral norm of a square matrix ``a``.

  psgd's estimate: scale by ``max|a|``, take the row or column of largest norm
  (whichever is larger; the first on ties), one power step from it, and return
  the norm of the result. Never above :math:`\\lVert a \\rVert_2`, and in
  practice within a factor :math:`\\sqrt 2` of it. Branch-free (both branches
  computed, one selected) so that the kernels run the same code; returns a
  (1, 1) value. ``0`` for ``a = 0``.
  """
  a = a.astype(jnp.float32)
  max_abs = reduce_all(jnp.max, jnp.abs(a))
  a = a * jnp.where(max_abs > 0, 1.0 / jnp.where(max_abs > 0, max_abs, 1.0), 0.0)
  aa = a * a
  col_sums = jnp.sum(aa, axis=0, keepdims=True)  # (1, n): squared column norms
  row_sums = jnp.sum(aa, axis=1, keepdims=True)  # (n, 1): squared row norms
  col_hot, col_top = _first_argmax_onehot(col_sums, 1)
  row_hot, row_top = _first_argmax_onehot(row_sums, 0)

  def unit(x):
    norm = jnp.sqrt(reduce_all(jnp.sum, x * x))
    return x / jnp.where(norm > 0, norm, 1.0)

  # Largest column c: y = cᵀ a, bound = |a ŷᵀ|.
  c = jnp.sum(jnp.where(col_hot, a, 0.0), axis=1, keepdims=True)  # (n, 1)
  y = unit(jnp.sum(c * a, axis=0, keepdims=True))  # (1, n)
  by_col = jnp.sum(a * y, axis=1, keepdims=True)  # (n, 1)
  # Largest row r: y = a rᵀ, bound = |aᵀ ŷ|.
  r = jnp.sum(jnp.where(row_hot, a, 0.0), axis=0, keepdims=True)  # (1, n)
  y = unit(jnp.sum(a * r, axis=1, keepdims=True))  # (n, 1)
  by_row = jnp.sum(a * y, axis=0, keepdims=True)  # (1, n)
  bound = jnp.where(
      col_top > row_top,
      jnp.sqrt(reduce_all(jnp.sum, by_col * by_col)),
      jnp.sqrt(reduce_all(jnp.sum, by_row * by_row)),
  )
  return jnp.where(max_abs > 0, max_abs * bound, max_abs)


def dense_factor_step(q, t1, t2, lr):
  """``q - lr / |t1 + t2| triu(t1 - t2) q`` (f32 values, (d, d))."""
  rows = jax.lax.broadcasted_iota(jnp.int32, t1.shape, 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, t1.shape, 1)
  step = lr / tiny_add(norm_lower_bound(t1 + t2))
  return q - step * dot(jnp.where(rows <= cols, t1 - t2, 0.0), q)


def diag_factor_step(q, t1, t2, lr):
  """``q - lr / max|t1 + t2| (t1 - t2) q`` (f32 values, (d, 1))."""
  step = lr / tiny_add(jnp.max(jnp.abs(t1 + t2), axis=0, keepdims=True))
  return q - step * (t1 - t2) * q


def dot(a, b, precision=None, trans_a=False, trans_b=False):
  """``a @ b`` (optionally transposed operands) with f32 accumulation.

  ``precision`` (psgd_jax's names): ``"bfloat16"`` rounds the operands to
  bf16; ``"float32"`` asks for full-precision passes; otherwise the backend's
  default f32 dot (tf32 tensor cores on recent GPUs).
  """
  if precision == "bfloat16":
    a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  lax_precision = jax.lax.Precision.HIGHEST if precision == "float32" else None
  return jax.lax.dot_general(
      a, b, dims, precision=lax_precision, preferred_element_type=jnp.float32
  )


def momentum(s, g, mu):
  """Scaled gradient -> (bias-corrected momentum or the gradient, new momentum)."""
  g = g * s.grad_scale
  if mu is None:
    return g, None
  mu = s.b1 * mu + s.one_minus_b1 * g
  return mu / s.bias_correction, mu


def clip_and_finish(
    s, x, sum_sq, count: int, p, *, mode: str, decay: bool, rms_clip: bool = True
):
  """RMS clip of the preconditioned layer, then decay, learning rate, apply."""
  if rms_clip:
    x = x / jnp.maximum(1.0, jnp.sqrt(sum_sq / count) / RMS_CLIP)
  if mode == "precond":
    return x
  u = -s.learning_rate * ((x + s.weight_decay * p) if decay else x)
  return p + u if mode == "apply" else u


def map_layers(fn: Callable, args: Sequence, map_batch_size: int | None):
  """``fn`` over the leading (layer) axis: vmap, or lax.map in chunks."""
  if map_batch_size is None:
    return jax.vmap(fn)(*args)
  return jax.lax.map(lambda xs: fn(*xs), tuple(args), batch_size=max(1, map_batch_size))


def check_precision(precision) -> None:
  if precision not in PRECISIONS:
    raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}.")


def layer_compiler_params(backend: str, interpret: bool):
  """Both Kron kernels: one program per layer, its blocks whole in VMEM/SRAM."""
  return _compat.compiler_params(
      backend, ("parallel",), num_warps=TRITON_WARPS, num_stages=1,
      vmem_limit_bytes=TPU_VMEM_LIMIT, interpret=interpret,
  )
