r"""Newton–Schulz's regimes: which one a matrix takes, and the tiled TPU regime.

`choose_regime` picks a matrix's regime (`pallasopt.kernels.newton_schulz`
describes them). The tiled regime, three tiled matmuls per step, symmetric
where possible, is for matrices too large to stay in VMEM
(``regime="tiled"``); `_tiled_step` draws one step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallasopt.kernels import _compat, _matrix, ns_math
from pallasopt.kernels._compat import pl, pltpu
from pallasopt.kernels._elementwise import scalar_input
from pallasopt.kernels.gram import mirror_upper

__all__ = ["TPU_TILE", "TPU_RESIDENT_BYTES", "choose_regime", "resident_bytes", "tiled"]

TPU_TILE = 256
# The VMEM a resident matrix may take: within v5e/v6e's 128 MiB and v7's 64 MiB.
TPU_RESIDENT_BYTES = 24 * 2**20


def resident_bytes(dims: tuple[int, int]) -> int:
  """The f32 VMEM working set of the resident regime on a padded ``m x n`` matrix."""
  m, n = dims
  return 4 * (6 * m * n + 3 * m * m)


def choose_regime(rows: int, cols: int, backend: str) -> str:
  """The regime of one matrix: ``"wgmma"`` on a GPU, else resident where it fits in VMEM."""
  if backend == "triton":
    return "wgmma"
  m, n = min(rows, cols), max(rows, cols)
  dims = _matrix.padded_dims(m, n, backend)
  return "resident" if resident_bytes(dims) <= TPU_RESIDENT_BYTES else "tiled"

# How a kernel operand is read at grid point (i, j) and reduction step k:
# "ik" / "jk" / "kj" / "ij" name the tile; "sym_" operands are symmetric
# matrices of which only the upper triangle of tiles is ever written, so the
# tile below the diagonal is read as the transpose of its mirror image.
_KINDS = ("ik", "jk", "kj", "ij", "sym_ik", "sym_kj")


def _tile_coords(kind: str, i, j, k):
  """(tile row, tile col, transpose?) of operand ``kind`` at ``(i, j, k)``."""
  r, c = {"ik": (i, k), "jk": (j, k), "kj": (k, j), "ij": (i, j)}[kind.removeprefix("sym_")]
  if kind.startswith("sym_"):
    return jnp.minimum(r, c), jnp.maximum(r, c), r > c
  return r, c, None


def _maybe_transpose(tile, flip):
  return tile if flip is None else jnp.where(flip, tile.T, tile)


def _tiled_body(scalar_ref, *refs, kinds, prologue, epilogue, nt, upper_only, num_k):
  """One output tile: ``epilogue(s, sum_k lhs_k · rhs_k, *epilogue_tiles)``.

  ``refs`` are the operand tiles (lhs, rhs, epilogue operands), the output
  tile and the f32 accumulator; the reduction walks k on the innermost grid
  axis.
  """
  num_in = len(kinds)
  in_refs, out_ref, acc_ref = refs[:num_in], refs[num_in], refs[num_in + 1]
  s = tuple(scalar_ref[q] for q in range(3))
  i, j, k = pl.program_id(1), pl.program_id(2), pl.program_id(3)
  dims = (((1,), (1,)), ((), ())) if nt else (((1,), (0,)), ((), ()))

  def load(q):
    return _maybe_transpose(in_refs[q][...], _tile_coords(kinds[q], i, j, k)[2])

  def compute():
    @pl.when(k == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)

    lhs, rhs = prologue(s, load(0), load(1))
    acc_ref[...] += jax.lax.dot_general(lhs, rhs, dims, preferred_element_type=jnp.float32)

    @pl.when(k == num_k - 1)
    def _():
      extra = [load(q).astype(jnp.float32) for q in range(2, num_in)]
      out_ref[...] = epilogue(s, acc_ref[...], *extra).astype(out_ref.dtype)

  if upper_only:
    pl.when(j >= i)(compute)
  else:
    compute()


def _tiled_call(
    operands, kinds, scalars, out_shape, *, prologue, epilogue, nt, upper_only,
    tile, num_k, interpret, name, flops,
):
  """One tiled matmul with a fused prologue/epilogue over a stack."""
  batch, rows, cols = out_shape.shape
  scalar_vec, scalar_spec = scalar_input(scalars, "tpu")

  def spec(kind):
    def index_map(b, i, j, k):
      r, c, _ = _tile_coords(kind, i, j, k if kind != "ij" else 0)
      return b, r, c
    return _matrix.matrix_spec((tile, tile), index_map)

  params = _compat.compiler_params(
      "tpu", ("parallel", "parallel", "parallel", "arbitrary"), interpret=interpret
  )
  kernel = functools.partial(
      _tiled_body, kinds=kinds, prologue=prologue, epilogue=epilogue, nt=nt,
      upper_only=upper_only, num_k=num_k,
  )
  nbytes = sum(x.size * x.dtype.itemsize for x in operands)
  nbytes += out_shape.size * jnp.dtype(out_shape.dtype).itemsize
  return pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(batch, rows // tile, cols // tile, num_k),
      in_specs=[scalar_spec] + [spec(kind) for kind in kinds],
      out_specs=_matrix.matrix_spec((tile, tile), lambda b, i, j, k: (b, i, j)),
      scratch_shapes=[pltpu.VMEM((tile, tile), jnp.float32)],
      compiler_params=params,
      interpret=interpret,
      name=name,
      cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=nbytes),
  )(scalar_vec, *operands)


def _tiled_step(x, a_b_c, *, first_rescale, eps, dtype, tile, interpret):
  r"""One NS step on a padded stack ``x`` (``(batch, M, N)``, ``dtype``).

  Three launches, each a tiled matmul with its epilogue fused:

  1. ``A = X Xᵀ`` (f32): only tiles ``(i, j)`` with ``j >= i`` are computed
     (:math:`M^2 N` instead of :math:`2 M^2 N` flops);
  2. ``B = b A + (c A) A`` (``dtype``): ``A²`` is symmetric too, so again only
     the upper tiles (:math:`M^3` instead of :math:`2 M^3`); tiles of ``A``
     below the diagonal are read as transposes of their mirror tiles, and
     ``b A`` is added in the epilogue;
  3. ``X ← a X + B X``: a full tiled matmul reading ``B`` mirrored, with
     ``a X`` added in the epilogue.

  Lower tiles of ``A`` and ``B`` are never written nor read; the reduction
  walks the innermost grid axis into a VMEM f32 accumulator.
  """
  batch, rows, cols = x.shape
  f32 = jnp.float32
  call = functools.partial(_tiled_call, tile=tile, interpret=interpret)
  gram = call(
      [x, x], ("ik", "jk"), a_b_c, jax.ShapeDtypeStruct((batch, rows, rows), f32),
      prologue=lambda s, l, r: (l, r), epilogue=lambda s, acc: acc, nt=True,
      upper_only=True, num_k=cols // tile, name="newton_schulz_gram",
      flops=batch * rows * rows * cols,
  )
  if first_rescale is not None:
    rescale = functools.partial(ns_math.first_step_rescale, preconditioning=first_rescale, eps=eps)
    x, gram = ns_math.per_matrix(rescale, x, mirror_upper(gram))
    x = x.astype(dtype)
  poly = call(
      [gram, gram, gram], ("sym_ik", "sym_kj", "ij"), a_b_c,
      jax.ShapeDtypeStruct((batch, rows, rows), dtype),
      prologue=lambda s, l, r: ((s[2] * l).astype(dtype), r.astype(dtype)),
      epilogue=lambda s, acc, g: s[1] * g + acc, nt=False, upper_only=True,
      num_k=rows // tile, name="newton_schulz_poly", flops=batch * rows**3,
  )
  return call(
      [poly, x, x], ("sym_ik", "kj", "ij"), a_b_c, jax.ShapeDtypeStruct(x.shape, dtype),
      prologue=lambda s, l, r: (l, r), epilogue=lambda s, acc, xt: s[0] * xt + acc,
      nt=False, upper_only=False, num_k=rows // tile, name="newton_schulz_update",
      flops=2 * batch * rows * rows * cols,
  )


def tiled(stack, coeffs, *, tile, preconditioning, eps, dtype, interpret):
  tile = TPU_TILE if tile is None else tile
  if tile < 16 or tile & (tile - 1) or (not interpret and tile % 128):
    raise ValueError(
        f"tile must be a power of two >= 16 (a multiple of 128 compiled for TPU); got {tile}."
    )
  _, m, n = stack.shape
  if preconditioning == "frobenius":
    stack = ns_math.per_matrix(functools.partial(ns_math.frobenius_scale, eps=eps), stack)
  dims = (_matrix.round_up(m, tile), _matrix.round_up(n, tile))
  x = _matrix.pad_stack(stack.astype(dtype), dims)
  first_rescale = preconditioning if preconditioning in ("aol", "schatten") else None
  for k in range(coeffs.shape[0]):
    x = _tiled_step(
        x, coeffs[k], first_rescale=first_rescale if k == 0 else None, eps=eps,
        dtype=dtype, tile=tile, interpret=interpret,
    )
  return _matrix.unpad_stack(x, (m, n))
