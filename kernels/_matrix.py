"""Shared machinery for kernels over stacks of same-shape matrices.

Matrix-valued optimizer kernels (Newton–Schulz for Muon, the Kron
preconditioner updates) see their operands as a *stack* ``(batch, rows, cols)``
and run one grid step per matrix, or per tile of a matrix. This module holds
what such kernels share, so each family writes only its math:

* `as_stack` / `from_stack`: any ``(..., rows, cols)`` array as a 3-D stack and
  back (free reshapes).
* `padded_dims` / `pad_stack` / `unpad_stack`: zero-padding of the last two
  axes to block shapes that both Pallas targets accept and run well:
  Mosaic TPU wants the last two dims in multiples of ``(8, 128)`` (we pad both
  to 128, because a Gram matrix ``X Xᵀ`` puts the row count on the lane axis);
  Triton wants power-of-two block dims, and its dots need ``M, N, K >= 16``.
  Whether zero padding is exact depends on the math; each kernel says why.
* `matrix_spec`: the `pl.BlockSpec` of one ``(rows, cols)`` block of a stack,
  with the batch axis squeezed.
* `batched_dot`: ``a b`` or ``a bᵀ`` of matrices or stacks with f32
  accumulation, the product both a reference and a kernel body take.
* Per-call scalars (coefficient tables, step sizes) are kernel *inputs*, built
  by `_elementwise.scalar_input` as for every other kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallasopt.kernels._compat import pl
from pallasopt.kernels._tiling import check_backend, pow2_at_least

__all__ = [
    "round_up",
    "pow2_at_least",
    "as_stack",
    "from_stack",
    "padded_dims",
    "pad_stack",
    "unpad_stack",
    "matrix_spec",
    "batched_dot",
]

# Triton dots need every dimension >= 16.
_TRITON_MIN_DIM = 16
_TPU_ALIGN = 128


def round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def as_stack(x: jax.Array) -> tuple[jax.Array, tuple[int, ...]]:
  """``x`` of shape ``(..., rows, cols)`` as ``(batch, rows, cols)``.

  Returns the stack and the leading shape that `from_stack` restores.
  """
  if x.ndim < 2:
    raise ValueError(f"expected an array of rank >= 2; got shape {x.shape}.")
  lead = x.shape[:-2]
  return x.reshape((math.prod(lead),) + x.shape[-2:]), lead


def from_stack(stack: jax.Array, lead: tuple[int, ...]) -> jax.Array:
  return stack.reshape(lead + stack.shape[-2:])


def padded_dims(rows: int, cols: int, backend: str) -> tuple[int, int]:
  """The smallest legal, efficient block dims holding a ``rows x cols`` matrix."""
  check_backend(backend)
  if backend == "tpu":
    return round_up(rows, _TPU_ALIGN), round_up(cols, _TPU_ALIGN)
  return (
      max(_TRITON_MIN_DIM, pow2_at_least(rows)),
      max(_TRITON_MIN_DIM, pow2_at_least(cols)),
  )


def pad_stack(stack: jax.Array, dims: tuple[int, int]) -> jax.Array:
  """Zero-pads the last two axes of a stack to ``dims`` (no-op when equal)."""
  rows, cols = stack.shape[-2:]
  if (rows, cols) == tuple(dims):
    return stack
  return jnp.pad(stack, ((0, 0), (0, dims[0] - rows), (0, dims[1] - cols)))


def unpad_stack(stack: jax.Array, dims: tuple[int, int]) -> jax.Array:
  if stack.shape[-2:] == tuple(dims):
    return stack
  return stack[:, : dims[0], : dims[1]]


def matrix_spec(
    block: tuple[int, int], index_map: Callable[..., tuple] | None = None
) -> pl.BlockSpec:
  """BlockSpec of one ``block`` of a ``(batch, rows, cols)`` stack.

  The batch axis is squeezed, so the kernel sees a 2-D ref. With no
  ``index_map`` the grid is ``(batch,)`` and each step gets a whole matrix;
  otherwise ``index_map(*grid_indices) -> (batch, row_block, col_block)``.
  """
  if index_map is None:
    index_map = lambda b: (b, 0, 0)
  return pl.BlockSpec((None, *block), index_map)


def batched_dot(a: jax.Array, b: jax.Array, *, trans_b: bool = False) -> jax.Array:
  """``a b`` (``a bᵀ`` with ``trans_b``) over the last two axes, in f32.

  Leading axes are a batch (matrices or stacks alike); products accumulate in
  f32 (``preferred_element_type``) whatever the operands' dtype.
  """
  batch = tuple(range(a.ndim - 2))
  contract = (a.ndim - 1,), (b.ndim - 1 if trans_b else b.ndim - 2,)
  return jax.lax.dot_general(a, b, (contract, (batch, batch)), preferred_element_type=jnp.float32)
