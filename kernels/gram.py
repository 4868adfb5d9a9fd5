r"""Symmetric Gram matrices :math:`X X^\top` computing only the upper blocks.

Newton–Schulz (`pallasopt.kernels.newton_schulz`) spends its flops on two
symmetric products per step, :math:`A = X X^\top` and :math:`A^2 = A A^\top`
(:math:`A` is symmetric), and one general one, :math:`B X`. Computing only the
diagonal and upper blocks of the symmetric ones and mirroring the rest cuts
them to about half (Flash-Muon does this in one CUDA kernel). Two
implementations of one contract, ``(batch, m, n) -> (batch, m, m)`` f32:

* `gram_reference` (the XLA path, any backend): `block_gram`, a recursion of
  :math:`2 \times 2` block splits in which each level is *one* batched dot,
  so ``levels + 1`` dots in all, costing :math:`(2^L+1)/2^{L+1}` of the full
  product's flops. Fewer flops are not always less time (smaller dots run
  less efficiently): `gram_levels_for` gives the levels measured fastest on
  each platform.
* `gram_kernel` (Pallas Mosaic GPU, Hopper ``wgmma``): one program per upper
  tile ``(i, j), j >= i``, of a grid over ``(batch, tiles, tiles)``; the
  ``k`` loop is a TMA pipeline into shared memory feeding ``wgmma`` with an
  f32 accumulator; lower-tile programs exit at once and XLA mirrors the upper
  triangle (so the result is exactly symmetric). Operands are bf16 (or f16) iterates; the right-hand operand is read
  from :math:`X^\top`, materialized by XLA (one pass over :math:`X`, small next
  to the :math:`m^2 n` flops), so both operands enter ``wgmma`` untransposed.

Zero padding (rows to the block or tile multiple, columns to the ``k`` tile)
is exact: zero rows of :math:`X` give zero rows and columns of the Gram matrix,
zero columns add zero terms.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallasopt.kernels import _compat, _matrix
from pallasopt.kernels._compat import pl, plgpu

__all__ = [
    "gram_levels_for",
    "check_levels",
    "block_gram",
    "gram_reference",
    "gram_kernel",
    "mirror_upper",
]

_KERNEL_TILE_K = 64
_KERNEL_MAX_CONCURRENT_STEPS = 2
_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# `block_gram` levels measured fastest for Newton–Schulz's symmetric products
# on each platform: ``(min_rows, levels)`` pairs, largest ``min_rows`` first;
# fewer rows, or a platform not listed, get 0 (one full dot, Optax's op order).
# CPU, 2-core x86 host, jax 0.10.2, time over 0 levels:
# - 5 f32 Newton–Schulz steps (`newton_schulz_reference`, best of 2-5 calls):
#   768x3072 L1-L4 0.96x-0.77x; 1024^2 0.98x-0.88x; 2048^2 L1 1.07x, L2 1.13x,
#   L3 1.14x, L4 1.12x; 4096^2 L1 1.08x, L2 1.23x, L3 1.21x, L4 1.21x.
# - whole Muon steps (``python -m bench.kernels --tier full --filter
#   'muon/(matrix/(1024x1024|4096x4096)|gpt2-small/f32)'``, commit 7a975a3):
#   1024^2 L2 1.03x, L4 0.89x (a tie at L2: full dots keep Optax's op order);
#   GPT-2 small's tree (768 rows) L2 0.77x, L4 0.66x.
# CUDA: only full dots were timed (H100, bench/results/nvidia-h100-80gb-hbm3:
# Optax's Muon step at 82% of the f32 matmul ceiling at 4096^2, 30% at 1024^2
# and 19% on a stack of 256 x 1024 matrices, so smaller dots are no sure gain
# there); TPU: nothing timed.
_MEASURED_LEVELS: dict[str, tuple[tuple[int, int], ...]] = {"cpu": ((2048, 2),)}


def gram_levels_for(rows: int, platform: str) -> int:
  """The `block_gram` levels measured fastest for ``rows`` rows on ``platform``.

  ``platform`` is a platform name as `jax.export` spells it (``"cpu"``,
  ``"cuda"``, ``"rocm"``, ``"tpu"``). On a CPU, 2 levels (0.75x of a square Newton–Schulz
  step's flops, measured 1.13x-1.23x faster) from 2048 rows; 0 below (measured
  slower or a tie: fewer flops in smaller dots) and on every other platform,
  where no block split was timed yet (``_MEASURED_LEVELS`` has the figures).
  """
  for min_rows, levels in _MEASURED_LEVELS.get(platform, ()):
    if rows >= min_rows:
      return levels
  return 0


def check_levels(levels: object) -> int:
  """``levels`` as an int >= 0, or a ValueError naming it."""
  if isinstance(levels, bool) or not isinstance(levels, (int, np.integer)) or levels < 0:
    raise ValueError(f"gram levels must be None or an int >= 0; got {levels!r}.")
  return int(levels)


def block_gram(x: jax.Array, levels: int) -> jax.Array:
  r"""``x xᵀ`` (f32) of a stack ``(batch, m, n)``, upper blocks only.

  The off-diagonal block :math:`X_1 X_2^\top` of the :math:`2 \times 2` split
  is one batched dot and its mirror its transpose; the two diagonal blocks are
  the Gram matrices of the halves, computed the same way ``levels - 1`` more
  times as one stack of twice the batch (a free reshape). ``m`` must be a
  multiple of :math:`2^L`; ``levels=0`` is one full dot.
  """
  if levels == 0:
    return _matrix.batched_dot(x, x, trans_b=True)
  batch, m, n = x.shape
  if m % 2**levels:
    raise ValueError(f"block_gram: rows {m} are not a multiple of 2**{levels}.")
  half = m // 2
  off = _matrix.batched_dot(x[:, :half], x[:, half:], trans_b=True)
  diag = block_gram(x.reshape(2 * batch, half, n), levels - 1).reshape(batch, 2, half, half)
  top = jnp.concatenate([diag[:, 0], off], axis=2)
  bottom = jnp.concatenate([jnp.swapaxes(off, 1, 2), diag[:, 1]], axis=2)
  return jnp.concatenate([top, bottom], axis=1)


def _check_stack(x):
  if x.ndim != 3:
    raise ValueError(f"x must be a (batch, rows, cols) stack; got shape {x.shape}.")


def gram_reference(x: jax.Array, *, levels: int) -> jax.Array:
  """``x xᵀ`` (f32) of every matrix of a stack ``(batch, m, n)`` by `block_gram`.

  Args:
    x: the stack (any float dtype; products accumulate in f32).
    levels: `block_gram` levels (0: one dot; `gram_levels_for` gives the
      measured choice of a platform).
  """
  _check_stack(x)
  rows = x.shape[1]
  levels = check_levels(levels)
  padded = _matrix.round_up(rows, 2**levels)
  x = jnp.pad(x, ((0, 0), (0, padded - rows), (0, 0)))
  return block_gram(x, levels)[:, :rows, :rows]


def mirror_upper(sym: jax.Array) -> jax.Array:
  """The symmetric matrices whose upper triangles (diagonal included) are ``sym``'s."""
  index = jnp.arange(sym.shape[-1])
  return jnp.where(index[:, None] <= index[None, :], sym, jnp.swapaxes(sym, -1, -2))


def _swizzled(cols: int, dtype) -> tuple:
  """Shared-memory transforms of a tile whose rows hold ``cols`` elements."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(cols * itemsize * 8)
  return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _upper_tiles_kernel(x_gmem, xt_gmem, out_gmem, out_smem, *, tile, num_k):
  """Program ``(b, i, j)``: tile ``(i, j)`` of ``X_b X_bᵀ`` if ``j >= i``."""
  b, i, j = (jax.lax.axis_index(name) for name in ("batch", "i", "j"))
  dtype = x_gmem.dtype

  def accumulate(acc):
    def step(_, lhs, rhs):
      plgpu.wgmma(acc, lhs, rhs)
      plgpu.wgmma_wait(1)

    plgpu.emit_pipeline(
        step,
        grid=(num_k,),
        in_specs=[
            plgpu.BlockSpec(
                (tile, _KERNEL_TILE_K), lambda k: (i, k),
                transforms=_swizzled(_KERNEL_TILE_K, dtype), delay_release=1,
            ),
            plgpu.BlockSpec(
                (_KERNEL_TILE_K, tile), lambda k: (k, j),
                transforms=_swizzled(tile, dtype), delay_release=1,
            ),
        ],
        max_concurrent_steps=_KERNEL_MAX_CONCURRENT_STEPS,
    )(x_gmem.at[b], xt_gmem.at[b])
    out_smem[...] = acc[...]
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[b, pl.ds(i * tile, tile), pl.ds(j * tile, tile)])
    plgpu.wait_smem_to_gmem(0)

  pl.when(j >= i)(lambda: pl.run_scoped(accumulate, plgpu.ACC((tile, tile), jnp.float32)))


def gram_kernel(x: jax.Array, *, interpret: bool = False, tile: int | None = None) -> jax.Array:
  """``x xᵀ`` (f32) of a bf16/f16 stack by the Mosaic GPU upper-tile kernel.

  Same result as `gram_reference` up to f32 summation order.

  Args:
    x: ``(batch, m, n)`` in bfloat16 or float16 (``wgmma`` operands).
    interpret: run in the Mosaic GPU interpreter (any host).
    tile: output tile edge, 64 or 128 (default: 128 from 128 rows, else 64).
  """
  _check_stack(x)
  if jnp.dtype(x.dtype) not in _KERNEL_DTYPES:
    raise TypeError(f"gram_kernel: x must be bfloat16 or float16; got {x.dtype}.")
  batch, rows, cols = x.shape
  tile = (128 if rows >= 128 else 64) if tile is None else tile
  if tile not in (64, 128):
    raise ValueError(f"gram_kernel: tile must be 64 or 128; got {tile}.")
  dims = (_matrix.round_up(rows, tile), _matrix.round_up(cols, _KERNEL_TILE_K))
  x = _matrix.pad_stack(x, dims)
  tiles = dims[0] // tile
  call = plgpu.kernel(
      functools.partial(_upper_tiles_kernel, tile=tile, num_k=dims[1] // _KERNEL_TILE_K),
      out_type=jax.ShapeDtypeStruct((batch, dims[0], dims[0]), jnp.float32),
      scratch_types=[plgpu.SMEM((tile, tile), jnp.float32, transforms=_swizzled(tile, jnp.float32))],
      grid=(batch, tiles, tiles),
      grid_names=("batch", "i", "j"),
      **_compat.mosaic_gpu_interpret(interpret),
  )
  upper = call(x, jnp.swapaxes(x, 1, 2))
  return mirror_upper(upper)[:, :rows, :rows]
