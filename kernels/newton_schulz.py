r"""Newton–Schulz orthogonalization (Muon's inner loop) as Pallas kernels.

For a matrix :math:`G` with SVD :math:`U S V^\top`, Muon replaces the update
by an approximation of :math:`U V^\top`. With :math:`X_0 = G / (\|G\|_F +
\epsilon)` (rows <= cols; a tall matrix is transposed first and back after),
step :math:`k` with coefficients :math:`(a_k, b_k, c_k)` is

.. math::

  A_k = X_k X_k^\top, \quad B_k = b_k A_k + c_k A_k^2, \quad
  X_{k+1} = a_k X_k + B_k X_k,

an odd polynomial :math:`p_k(\sigma) = a_k\sigma + b_k\sigma^3 + c_k\sigma^5`
applied to every singular value (Jordan, `Muon
<https://kellerjordan.github.io/posts/muon/>`_, 2024; Amsel et al., `The Polar
Express <https://arxiv.org/abs/2505.16932>`_, 2025). The coefficients are
*data*: a ``(steps, 3)`` table (see `ns_coefficients.coefficient_table` for the ``(3,)``
repeat and the ``cycle`` / ``repeat_last`` rules and `ns_coefficients.PRESETS` for the
published tables), passed to the kernel as an input, so changing them never
recompiles. Optax's preconditionings are supported: ``"frobenius"`` (above),
``"spectral"`` (divide by :math:`\|G\|_2`), ``"aol"`` (Boissin et al., 2025:
no prior scaling; the first step rescales row :math:`i` of :math:`X_0` by
:math:`(\sum_j |A_{ij}|)^{-1/2}`), ``"schatten"`` (the first step divides
:math:`X_0` by :math:`\|A_0\|_F^{1/2}`), and ``"none"``.

Iteration dtype: ``iter_dtype`` (f32 or bf16) is the dtype X, A and B are
held in between matmuls; every matmul accumulates in f32
(``preferred_element_type``) and every epilogue (``b A + c A^2``,
``a X + B X``) runs in f32 before one rounding to ``iter_dtype``.

Regimes (`newton_schulz_kernel`, ``regime="auto"``, `choose_regime`):

* **resident** (TPU; one launch, grid over the stack): X, A and B of one
  matrix stay in VMEM for all steps, so a step costs no HBM traffic at all.
  Chosen when the padded ``m x n`` matrix (``m <= n`` after transposing)
  fits: the f32 working set ``4 (6 m n + 3 m^2)`` bytes (X double-buffered in
  and out, two temporaries, A, B, A²) within `ns_tiled.TPU_RESIDENT_BYTES` (24 MiB,
  within v5e/v6e's 128 MiB and v7's 64 MiB of VMEM, with the VMEM limit
  raised to match).
* **tiled** (TPU; three launches per step): larger matrices. See
  `pallasopt.kernels.ns_tiled`.
* **wgmma** (CUDA, bf16 iterates: the one CUDA regime): both symmetric
  products of a step on the Mosaic GPU upper-tile Gram kernel
  (`gram.gram_kernel`, Hopper ``wgmma`` with TMA pipelining), ``B X`` and
  the epilogues in XLA (cuBLAS). Not yet timed on a GPU.

Dispatch and what was measured. ``impl="auto"`` runs the Mosaic kernel on TPU
where its regime is resident and the reference elsewhere (`policy.TPU_AUTO`: not
timed; compiled for a v5e, the resident kernel moves what XLA does with no
temporary memory, the tiled regime up to 2.3x XLA's bytes), and the XLA
reference on CUDA GPUs and CPUs. On CUDA there is no f32
kernel: the Triton kernels this module had (resident and tiled regimes for
Triton) lost to XLA at every size measured on an H100
(bench/results/nvidia-h100-80gb-hbm3, commit 5e874f6, f32 iterates, 5 steps,
one Muon step each: 1024² 0.86 ms vs 0.26 ms for Optax (XLA), 4096² 29.8 vs
6.1 ms, 4096×11008 63.0 vs 12.6 ms, 64 × (256, 1024) 1.88 vs 1.24 ms) and
were removed; ``impl="pallas"`` there runs the wgmma regime, which takes
bf16 iterates only (a clear error otherwise). The reference computes its
symmetric products by `gram.block_gram` at the levels measured fastest on
each platform (``gram_levels=None``, `gram.gram_levels_for`): on a CPU from
2048 rows (1.13x-1.23x faster than full dots at 2048² and 4096²; fewer rows
ran slower), elsewhere full dots, Optax's op order, until a block split is
timed there. Any ``gram_levels`` can be asked for: 4 levels cost 0.69x of
Optax's Muon step flops on a 4096² matrix and 0.74x on GPT-2 small's Muon
tree (XLA's compiled count, tests/test_gram.py).

Zero padding (to the legal block dims of `_matrix.padded_dims`) is exact:
with :math:`X' = [[X, 0], [0, 0]]`, :math:`A' = X'X'^\top = [[A, 0], [0, 0]]`,
so :math:`B'` and :math:`X'_{k+1} = [[X_{k+1}, 0], [0, 0]]` keep the same
block form at every step; the Frobenius norm and :math:`\|A\|_F` are
unchanged, and the AOL row scaling multiplies only zero rows of the padding.

Cost: 5 steps cost :math:`20 m^2 n + 10 m^3` flops as written; computing only
the upper triangle of the symmetric :math:`A` and :math:`A^2` (tiled and
wgmma regimes) makes it :math:`15 m^2 n + 5 m^3`, and the reference's
``L``-level block recursion :math:`(10 + 5 f) m^2 n + 5 f m^3` with
:math:`f = (2^L+1)/2^L` (`ns_flops`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallasopt.kernels import _compat, _matrix, ns_math, ns_tiled, policy
from pallasopt.kernels._by_target import by_target
from pallasopt.kernels._compat import pl
from pallasopt.kernels._dispatch import CudaRequirement, dispatch
from pallasopt.kernels._elementwise import scalar_input
from pallasopt.kernels.gram import check_levels, gram_kernel, gram_levels_for, gram_reference
from pallasopt.kernels.ns_tiled import choose_regime, resident_bytes

__all__ = [
    "PRECONDITIONINGS",
    "REGIMES",
    "ns_flops",
    "choose_regime",
    "newton_schulz_reference",
    "newton_schulz_kernel",
    "newton_schulz",
]

PRECONDITIONINGS = ("frobenius", "spectral", "aol", "schatten", "none")
REGIMES = ("auto", "resident", "tiled", "wgmma")

_TPU_VMEM_HEADROOM = 8 * 2**20


# ---- Cost. ----


def ns_flops(
    rows: int, cols: int, steps: int, *, symmetric: bool = False, gram_levels: int = 0
) -> int:
  r"""Matmul flops of ``steps`` NS steps on one matrix (``m = min``, ``n = max``).

  ``symmetric``: the tiled kernel's exact upper triangle (half of
  :math:`X X^\top` and of :math:`A^2`); ``gram_levels=L``: the reference's
  block-symmetric products (`block_gram`) on ``m`` padded to a multiple of
  :math:`2^L`, which cost :math:`(2^L+1)/2^{L+1}` of full ones.
  """
  m, n = min(rows, cols), max(rows, cols)
  if symmetric:
    return steps * (3 * m * m * n + m**3)
  if gram_levels:
    m = _matrix.round_up(m, 2**gram_levels)
    blocks = 2**gram_levels
    # One level-l product per 2^l pairs of (m / 2^(l+1))-row halves, plus the
    # 2^L diagonal blocks in full: m^2 k (blocks + 1) / blocks flops in all.
    gram = lambda k: m * m * k * (blocks + 1) // blocks
    return steps * (gram(n) + gram(m) + 2 * m * m * n)
  return steps * (4 * m * m * n + 2 * m**3)


def _check_args(x, coeffs, preconditioning, iter_dtype):
  if x.ndim < 2:
    raise ValueError(f"x must have rank >= 2 (a stack of matrices); got shape {x.shape}.")
  if coeffs.ndim != 2 or coeffs.shape[1] != 3:
    raise ValueError(
        f"coeffs must be a (steps, 3) table (see ns_coefficients.coefficient_table); got {coeffs.shape}."
    )
  if preconditioning not in PRECONDITIONINGS:
    raise ValueError(
        f"preconditioning must be one of {PRECONDITIONINGS}; got {preconditioning!r}."
    )
  dtype = jnp.dtype(x.dtype if iter_dtype is None else iter_dtype)
  if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise TypeError(f"iter_dtype must be float32 or bfloat16; got {dtype}.")
  return dtype


def _wide_stack(x):
  """``x`` as a stack of wide matrices (rows <= cols) and the undo function."""
  stack, lead = _matrix.as_stack(x)
  transposed = stack.shape[1] > stack.shape[2]
  if transposed:
    stack = jnp.swapaxes(stack, 1, 2)

  def restore(out):
    if transposed:
      out = jnp.swapaxes(out, 1, 2)
    return _matrix.from_stack(out, lead).astype(x.dtype)

  return stack, restore


def newton_schulz_reference(
    x: jax.Array,
    coeffs: jax.Array,
    *,
    preconditioning: str = "frobenius",
    eps: float = 1e-8,
    iter_dtype=None,
    gram_levels: int | None = None,
):
  r"""Pure-jnp Newton–Schulz of every matrix in ``x`` (the XLA path).

  Equals `optax.contrib.orthogonalize_via_newton_schulz` for f32 inputs and the
  same coefficients: op for op with ``gram_levels=0``; otherwise the two
  symmetric products of each step (:math:`X X^\top`, :math:`A^2`) are
  computed by `gram.block_gram`, the same sums up to f32 rounding order.

  Args:
    x: ``(..., rows, cols)``; leading axes are a batch of matrices.
    coeffs: ``(steps, 3)`` table (`ns_coefficients.coefficient_table`).
    preconditioning: one of `PRECONDITIONINGS`.
    eps: added to the norm (``frobenius``, ``spectral``); floor of the
      ``aol``/``schatten`` rescaling.
    iter_dtype: f32 or bf16 dtype of the iterates (default: ``x.dtype``).
    gram_levels: `gram.block_gram` levels of the symmetric products; 0
      computes them in full, as Optax does; None: the levels measured fastest
      for the (wide) matrices' row count on each platform the computation is
      traced for (`gram.gram_levels_for`: 2 on a CPU from 2048 rows, else 0).

  Returns:
    The orthogonalized matrices, shape and dtype of ``x``.
  """
  coeffs = jnp.asarray(coeffs, jnp.float32)
  dtype = _check_args(x, coeffs, preconditioning, iter_dtype)
  if gram_levels is None:
    # The levels measured fastest differ per platform: chosen when lowered.
    rows = min(x.shape[-2:])
    with_levels = lambda levels: functools.partial(newton_schulz_reference, gram_levels=levels)

    def choose(target):
      levels = gram_levels_for(rows, target.platform)
      return with_levels(levels) if levels else None

    return by_target(with_levels(0), choose)(
        x, coeffs, preconditioning=preconditioning, eps=eps, iter_dtype=iter_dtype
    )
  gram_levels = check_levels(gram_levels)
  stack, restore = _wide_stack(x)
  if preconditioning == "spectral":
    stack, preconditioning = ns_math.spectral_prescale(stack, eps), "none"
  symmetric = functools.partial(gram_reference, levels=gram_levels) if gram_levels else None
  out = ns_math.ns_iterations(
      stack, lambda k, j: coeffs[k, j], coeffs.shape[0], preconditioning, eps, dtype, symmetric,
      as_loop=True,
  )
  return restore(out)


# ---- Resident regime: one launch, all steps on chip. ----


def _resident_kernel(scalar_ref, x_ref, o_ref, *, steps, preconditioning, dtype):
  # scalar_ref = [eps, a_0, b_0, c_0, a_1, ...]: eps may be traced (e.g. by
  # optax.inject_hyperparams), so it is data like the coefficients.
  x = ns_math.ns_iterations(
      x_ref[...], lambda k, j: scalar_ref[1 + 3 * k + j], steps, preconditioning,
      scalar_ref[0], dtype,
  )
  o_ref[...] = x.astype(o_ref.dtype)


# wgmma is Hopper's (sm_90a): neither an A100 (sm_80) nor a Blackwell (sm_100a)
# compiles it ("Pass pipeline failed" from Mosaic GPU).
WGMMA_REQUIREMENT = CudaRequirement(
    lambda capability: capability == (9, 0),
    "a Hopper GPU (sm_90a: the Mosaic GPU wgmma kernel)",
)


def _check_cuda_regime(regime: str, iter_dtype) -> None:
  """The one CUDA regime is wgmma on bf16 iterates; else an error saying why."""
  if regime != "wgmma":
    raise ValueError(
        f"regime={regime!r} runs on TPU (or in the interpreter) only: on a CUDA GPU the "
        "Newton-Schulz kernel is regime='wgmma' with bfloat16 iterates (the Triton kernels "
        "lost to XLA at every size measured on an H100 and were removed)."
    )
  if jnp.dtype(iter_dtype) != jnp.dtype(jnp.bfloat16):
    raise TypeError(
        f"impl='pallas' on a CUDA GPU runs Newton-Schulz with bfloat16 iterates only (the "
        f"Mosaic GPU wgmma kernel); got iter_dtype {jnp.dtype(iter_dtype)}. The f32 Triton "
        "kernels lost to XLA at every size measured on an H100 (0.20x-0.66x of Optax, "
        "bench/results/nvidia-h100-80gb-hbm3) and were removed: pass iter_dtype=jnp.bfloat16, "
        "or impl='auto' / 'xla' to run f32 iterates in XLA."
    )


def _cost(batch, m, n, steps, itemsize, *, symmetric):
  return pl.CostEstimate(
      flops=batch * ns_flops(m, n, steps, symmetric=symmetric),
      transcendentals=batch,
      bytes_accessed=2 * batch * m * n * itemsize,
  )


def _resident(stack, coeffs, *, preconditioning, eps, dtype, out_dtype, interpret):
  batch, m, n = stack.shape
  steps = coeffs.shape[0]
  dims = _matrix.padded_dims(m, n, "tpu")
  scalars = jnp.concatenate([jnp.reshape(jnp.asarray(eps, jnp.float32), (1,)), coeffs.ravel()])
  scalar_vec, scalar_spec = scalar_input(scalars, "tpu")
  params = _compat.compiler_params(
      "tpu", ("parallel",), vmem_limit_bytes=resident_bytes(dims) + _TPU_VMEM_HEADROOM,
      interpret=interpret,
  )
  kernel = functools.partial(
      _resident_kernel, steps=steps, preconditioning=preconditioning, dtype=dtype
  )
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((batch, *dims), out_dtype),
      grid=(batch,),
      in_specs=[scalar_spec, _matrix.matrix_spec(dims)],
      out_specs=_matrix.matrix_spec(dims),
      compiler_params=params,
      interpret=interpret,
      name="newton_schulz_resident",
      cost_estimate=_cost(batch, m, n, steps, jnp.dtype(stack.dtype).itemsize, symmetric=False),
  )(scalar_vec, _matrix.pad_stack(stack, dims))
  return _matrix.unpad_stack(out, (m, n))


def newton_schulz_kernel(
    x: jax.Array,
    coeffs: jax.Array,
    *,
    preconditioning: str = "frobenius",
    eps: float = 1e-8,
    iter_dtype=None,
    backend: str,
    interpret: bool = False,
    regime: str = "auto",
    tile: int | None = None,
):
  """Pallas Newton–Schulz; same arguments and results as the reference.

  Args:
    backend: ``"tpu"`` (Mosaic TPU; also the interpreter's) or ``"triton"``
      (a CUDA GPU, where the one regime is ``"wgmma"``, bf16 iterates).
    interpret: run in the Pallas interpreter.
    regime: ``"auto"`` (`choose_regime`), ``"resident"`` or ``"tiled"``
      (TPU), or ``"wgmma"`` (CUDA GPUs, bf16 iterates).
    tile: tile edge of the tiled regime (default 256); a multiple of 128
      (a power of two >= 16 in the interpreter).
  """
  coeffs = jnp.asarray(coeffs, jnp.float32)
  dtype = _check_args(x, coeffs, preconditioning, iter_dtype)
  if regime not in REGIMES:
    raise ValueError(f"regime must be one of {REGIMES}; got {regime!r}.")
  stack, restore = _wide_stack(x)
  if preconditioning == "spectral":
    stack, preconditioning = ns_math.spectral_prescale(stack, eps), "none"
  if regime == "auto":
    regime = choose_regime(stack.shape[1], stack.shape[2], backend)
  if backend == "triton":
    _check_cuda_regime(regime, dtype)
  if regime == "wgmma":
    if backend != "triton":
      raise ValueError(f"regime='wgmma' is a CUDA GPU (Hopper) regime; got backend {backend!r}.")
    return restore(
        _wgmma(stack, coeffs, preconditioning=preconditioning, eps=eps, dtype=dtype,
               interpret=interpret)
    )
  kwargs = dict(preconditioning=preconditioning, eps=eps, dtype=dtype, interpret=interpret)
  if regime == "resident":
    out = _resident(stack, coeffs, out_dtype=dtype, **kwargs)
  else:
    out = ns_tiled.tiled(stack, coeffs, tile=tile, **kwargs)
  return restore(out)


def _wgmma(stack, coeffs, *, preconditioning, eps, dtype, interpret):
  """NS with both symmetric products on the Mosaic GPU `gram_kernel`.

  ``B X`` and the f32 epilogues stay XLA (cuBLAS): only the symmetric
  products have flops to save.
  """
  symmetric = functools.partial(gram_kernel, interpret=interpret)
  return ns_math.ns_iterations(
      stack, lambda k, j: coeffs[k, j], coeffs.shape[0], preconditioning, eps, dtype, symmetric
  )


def newton_schulz(
    x: jax.Array,
    coeffs: jax.Array,
    *,
    preconditioning: str = "frobenius",
    eps: float = 1e-8,
    iter_dtype=None,
    impl: str = "auto",
    regime: str = "auto",
    tile: int | None = None,
    gram_levels: int | None = None,
):
  """Orthogonalizes every matrix of ``x`` (``(..., rows, cols)``) in one call.

  Args:
    x: a matrix or a stack of same-shape matrices (f32 or bf16).
    coeffs: ``(steps, 3)`` table (`ns_coefficients.coefficient_table`, `preset_table`).
    preconditioning: one of `PRECONDITIONINGS`.
    eps: see `newton_schulz_reference`.
    iter_dtype: f32 or bf16 iterates (default ``x.dtype``); f32 accumulation.
    impl: ``"auto" | "pallas" | "interpret" | "xla"`` (see `use_impl`);
      ``"auto"`` runs the reference on CUDA GPUs (see the module docstring).
    gram_levels: see `newton_schulz_reference` (the XLA path only; the
      kernels' regimes are symmetric in their own way).
    regime, tile: see `newton_schulz_kernel` (ignored by the reference).
  """
  fn = dispatch(
      functools.partial(newton_schulz_reference, gram_levels=gram_levels),
      functools.partial(newton_schulz_kernel, regime=regime, tile=tile),
      impl,
      family=policy.NEWTON_SCHULZ if regime == "auto" else policy.NEWTON_SCHULZ_NAMED_REGIME,
      cuda_requirement=WGMMA_REQUIREMENT,
  )
  return fn(x, coeffs, preconditioning=preconditioning, eps=eps, iter_dtype=iter_dtype)
