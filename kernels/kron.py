r"""PSGD Kron: applying and updating Kronecker-factored preconditioners.

Xi-Lin Li's preconditioned SGD (`Preconditioned Stochastic Gradient Descent
<https://arxiv.org/abs/1512.04202>`_, 2015; `Black Box Lie Group
Preconditioners for SGD <https://arxiv.org/abs/2211.04422>`_, 2022) keeps, for a
layer :math:`G` of shape :math:`(d_1, \dots, d_N)`, one factor :math:`Q_k` per
axis: dense upper-triangular :math:`d_k \times d_k`, or diagonal. Writing
:math:`X \times_k M` for the product of axis :math:`k` of :math:`X` with the
matrix :math:`M` (``M[a, b] X[..., b, ...]`` summed over ``b``):

* **apply** (every step): :math:`P G = G \times_1 Q_1^\top Q_1 \cdots
  \times_N Q_N^\top Q_N`, i.e. :math:`(Q_1^\top Q_1 \otimes \cdots \otimes
  Q_N^\top Q_N)\,\mathrm{vec}(G)`, then the per-layer RMS clip of psgd_jax,
  :math:`u = PG / \max(1, \mathrm{rms}(PG) / 1.1)`.
* **update** (on the steps the update schedule picks), from the gradient (or
  momentum) :math:`G` and a probe :math:`V \sim \mathcal N(0, I)`:
  :math:`A = G \times_1 Q_1 \cdots \times_N Q_N`,
  :math:`B = V \times_1 Q_1^{-\top} \cdots \times_N Q_N^{-\top}` (triangular
  solves), and per factor the Gram contractions over every other axis,
  :math:`T_1 = A_{(k)} A_{(k)}^\top`, :math:`T_2 = B_{(k)} B_{(k)}^\top`, then
  :math:`Q_k \leftarrow Q_k - \frac{\eta_P}{\lVert T_1 + T_2 \rVert}\,
  \mathrm{triu}(T_1 - T_2)\, Q_k` with :math:`\lVert\cdot\rVert` a cheap lower
  bound of the spectral norm (`norm_lower_bound`); a diagonal factor uses the
  diagonals of :math:`T_1, T_2` and their max-abs norm instead.

Layers come *batched*: every operand has a leading axis ``B`` of independent
layers of one shape (a leaf's stacked / scanned layers), and one launch walks
them with a grid over ``B``. Factor layout (per layer, after the batch axis):
``(d, d)`` dense, ``(d,)`` diagonal, ``()`` for a 0-d layer.

Two kernels, each with a pure-jnp reference of the same signature:

* `kron_precondition` (kernel a): momentum, the chain of small matmuls, the RMS
  clip, and optionally weight decay, the learning rate and the parameter
  update, fused per layer. The kernel sees a layer as a matrix ``(M, N)``:
  axis 1 against the first factor, the other axes merged against the
  Kronecker product of the remaining factors (an exact identity,
  :math:`\mathrm{vec}` being row-major), formed in XLA.
* `pallasopt.kernels.kron_factor.kron_factor_update` (kernel b, its own
  module): the two Gram contractions (accumulated over column chunks), the
  norm lower bound and the ``triu`` update of one factor, fused per layer.

Their shared math on values and the kernels' size limits are
`pallasopt.kernels.kron_math`.

The triangular solves for :math:`B` stay in XLA
(``jax.lax.linalg.triangular_solve``): Pallas has no triangular-solve
primitive, and a hand-written one is a sequence of ``d`` dependent row (or
block) substitutions, each a thin matrix-vector step that leaves the MXU /
tensor cores idle, while XLA already calls a tuned blocked TRSM (cuBLAS on GPU).
They run only on preconditioner-update steps (annealed to 3% of steps).

Zero padding to legal block dims (`_matrix.padded_dims`) is exact: a zero
row/column of a factor or of the gradient stays zero through every product
(``[[Q, 0], [0, 0]]`` acts on ``[[G, 0], [0, 0]]`` as ``Q`` on ``G``), the clip
divides the padded sum of squares by the true element count, the Gram
matrices of zero-padded operands are the true ones padded with zeros, and the
norm bound's maxima and first-index argmax never pick a padded (all-zero) row
while any entry is non-zero. Layers too large for one on-chip block (see
`_fits`) run the reference instead: there the matmuls are large enough for XLA,
and fusion buys little.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallasopt.kernels import _matrix, kron_math, policy
from pallasopt.kernels.kron_math import PRECISIONS, RMS_CLIP, map_layers, norm_lower_bound
from pallasopt.kernels._compat import pl
from pallasopt.kernels._dispatch import dispatch
from pallasopt.kernels._elementwise import scalar_input

__all__ = [
    "RMS_CLIP",
    "PRECISIONS",
    "KronScalars",
    "kron_scalars",
    "norm_lower_bound",
    "apply_factors",
    "conj_probe",
    "matricize",
    "map_layers",
    "kron_precondition",
    "kron_precondition_reference",
    "kron_precondition_kernel",
]

_MODES = ("precond", "updates", "apply")


class KronScalars(NamedTuple):
  """Per-step scalars of kernel (a); every field is a 0-d value."""

  learning_rate: jax.typing.ArrayLike
  weight_decay: jax.typing.ArrayLike
  b1: jax.typing.ArrayLike
  one_minus_b1: jax.typing.ArrayLike
  bias_correction: jax.typing.ArrayLike  # 1 - b1**t
  grad_scale: jax.typing.ArrayLike  # multiplies g on load, e.g. a clip factor


def kron_scalars(
    count: jax.typing.ArrayLike,
    learning_rate: jax.typing.ArrayLike = 0.0,
    b1: jax.typing.ArrayLike = 0.9,
    weight_decay: jax.typing.ArrayLike = 0.0,
    grad_scale: jax.typing.ArrayLike = 1.0,
) -> KronScalars:
  """The scalars of step ``count`` (``t``, counted from 1)."""
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return KronScalars(
      learning_rate=f32(learning_rate),
      weight_decay=f32(weight_decay),
      b1=f32(b1),
      one_minus_b1=f32(1 - b1),
      bias_correction=f32(1 - b1 ** jnp.asarray(count)),
      grad_scale=f32(grad_scale),
  )


# ---- The layer-level reference (no batch axis). ----


def _mode_product(x, q, axis: int, transpose: bool = False):
  """``x ×_axis M``, M the dense ``q`` (or ``qᵀ``), or diagonal ``q``."""
  if q.ndim < 2:
    return x * q.reshape([-1 if a == axis else 1 for a in range(x.ndim)])
  y = jnp.tensordot(q.T if transpose else q, x, axes=([1], [axis]))
  return jnp.moveaxis(y, 0, axis)


def apply_factors(g, qs: Sequence[jax.Array]):
  """``A = G ×_1 Q_1 ⋯ ×_N Q_N`` for one layer (f32)."""
  x = g.astype(jnp.float32)
  if x.ndim == 0:
    return x * qs[0].astype(jnp.float32)
  for axis, q in enumerate(qs):
    x = _mode_product(x, q.astype(jnp.float32), axis)
  return x


def _precondition_layer(g, qs):
  """``P G = G ×_k Q_kᵀ Q_k`` for one layer (f32)."""
  x = g.astype(jnp.float32)
  if x.ndim == 0:
    q = qs[0].astype(jnp.float32)
    return q * q * x
  for axis, q in enumerate(qs):
    q = q.astype(jnp.float32)
    x = _mode_product(_mode_product(x, q, axis), q, axis, transpose=True)
  return x


def conj_probe(v, qs: Sequence[jax.Array]):
  """``B = V ×_1 Q_1^{-T} ⋯ ×_N Q_N^{-T}`` for one layer (f32).

  Each dense factor is a right triangular solve ``X Q^{-1}`` with the layer's
  axis moved last (``jax.lax.linalg.triangular_solve``; see the module
  docstring for why this stays in XLA); a diagonal factor divides.
  """
  x = v.astype(jnp.float32)
  if x.ndim == 0:
    return x / qs[0].astype(jnp.float32)
  for axis, q in enumerate(qs):
    q = q.astype(jnp.float32)
    if q.ndim < 2:
      x = _mode_product(x, 1.0 / q, axis)
      continue
    moved = jnp.moveaxis(x, axis, -1)
    flat = moved.reshape(-1, q.shape[0])
    solved = jax.lax.linalg.triangular_solve(q, flat, left_side=False, lower=False)
    x = jnp.moveaxis(solved.reshape(moved.shape), -1, axis)
  return x


def matricize(x, axis: int):
  """Axis ``axis`` of one layer as rows, the other axes merged as columns."""
  if x.ndim == 0:
    return x.reshape(1, 1)
  return jnp.moveaxis(x, axis, 0).reshape(x.shape[axis], -1)


def _check_mode(mode: str, p, decay: bool) -> None:
  if mode not in _MODES:
    raise ValueError(f"mode must be one of {_MODES}; got {mode!r}.")
  if p is None and (mode == "apply" or (mode == "updates" and decay)):
    raise ValueError(f"p is required in {mode!r} mode{' with decay' if decay else ''}.")


def _out_dtype(mode: str, g, mu, p, qs):
  if mode == "apply":
    return p.dtype
  used = [g, *qs] + ([mu] if mu is not None else [])
  used += [p] if p is not None and mode == "updates" else []
  return jnp.result_type(*(x.dtype for x in used))


def kron_precondition_reference(
    g, mu, p, qs: Sequence[jax.Array], scalars: KronScalars, *, mode: str,
    decay: bool = False, precision: str | None = None, map_batch_size: int | None = None,
    rms_clip: bool = True,
):
  """Kernel (a) in jnp: momentum, preconditioning, RMS clip, decay, lr, apply.

  Args:
    g: gradients of ``B`` layers, ``(B, *layer_shape)``.
    mu: their momentum (same shape, ``mu_dtype``), or None without momentum.
    p: params (same shape), read in ``"apply"`` mode and in ``"updates"``
      mode with decay; else may be None.
    qs: the layers' factors, one per layer axis (``(B, d, d)`` dense or
      ``(B, d)`` diagonal; one ``(B,)`` factor for 0-d layers).
    scalars: `KronScalars` of this step.
    mode: ``"precond"`` returns the clipped :math:`PG` (psgd's
      ``scale_by_kron`` output); ``"updates"`` returns
      :math:`-\\eta (u + \\lambda p)`; ``"apply"`` returns ``p`` plus that.
    decay: add :math:`\\lambda p` (modes ``"updates"``, ``"apply"``).
    precision: matmul precision, as psgd_jax's ``precond_grads_precision``.
    map_batch_size: None vmaps over the layers; an int runs them with
      ``lax.map`` in chunks of that many (psgd's ``lax_map_scanned_layers``).
    rms_clip: clip each layer to RMS `RMS_CLIP` (psgd_jax's); False leaves
      :math:`PG` as it is (White-Kron clips whole leaves of many blocks).

  Returns:
    ``(out, new_mu)``; ``new_mu`` is None without momentum.
  """
  _check_mode(mode, p, decay)
  kron_math.check_precision(precision)
  s = KronScalars(*(jnp.asarray(x, jnp.float32) for x in scalars))
  f32 = lambda x: None if x is None else x.astype(jnp.float32)
  count = math.prod(g.shape[1:])

  def layer(g, mu, p, *qs):
    m_hat, new_mu = kron_math.momentum(s, g, mu)
    with jax.default_matmul_precision(precision):
      x = _precondition_layer(m_hat, qs)
    out = kron_math.clip_and_finish(
        s, x, jnp.sum(x * x), count, p, mode=mode, decay=decay, rms_clip=rms_clip
    )
    return out, new_mu

  out, new_mu = map_layers(layer, (f32(g), f32(mu), f32(p), *qs), map_batch_size)
  out = out.astype(_out_dtype(mode, g, mu, p, qs))
  return out, (None if mu is None else new_mu.astype(mu.dtype))


# ---- Kernel (a): apply the preconditioner, fused per layer. ----


def _kron_right_factor(qs: Sequence[jax.Array]):
  """One factor for the merged trailing axes: the Kronecker product (exact)."""
  if len(qs) == 1:
    return qs[0]
  if all(q.ndim == 2 for q in qs):
    merged = qs[0]
    for q in qs[1:]:
      merged = (merged[:, :, None] * q[:, None, :]).reshape(q.shape[0], -1)
    return merged
  dense = [q if q.ndim == 3 else jax.vmap(jnp.diag)(q) for q in qs]
  return functools.reduce(jax.vmap(jnp.kron), dense)


class _View(NamedTuple):
  """A layer as an (m, n) matrix with a left and a right factor."""

  m: int
  n: int
  left: str  # "none" | "dense" | "diag"
  right: str  # "dense" | "diag"
  rows: int  # padded m
  cols: int  # padded n


def _as_matrix(g, qs):
  """(g as (B, m, n), left factor or None, right factor) for kernel (a)."""
  batch, shape = g.shape[0], g.shape[1:]
  if len(shape) == 0:
    return g.reshape(batch, 1, 1), None, qs[0].reshape(batch, 1)
  if len(shape) == 1:
    return g.reshape(batch, 1, shape[0]), None, qs[0]
  return g.reshape(batch, shape[0], -1), qs[0], _kron_right_factor(qs[1:])


def _kind(q) -> str:
  return "none" if q is None else ("dense" if q.ndim == 3 else "diag")


def _plan_view(m: int, n: int, left: str, right: str, backend: str) -> _View:
  rows, cols = _matrix.padded_dims(m, n, backend)
  if left != "dense" and backend == "tpu":
    rows = _matrix.round_up(m, 8)
  return _View(m, n, left, right, rows, cols)


def _fits(view: _View, backend: str) -> bool:
  """Whether a layer's blocks fit one grid step (else the reference runs)."""
  if backend == "triton":
    return max(view.rows, view.cols) <= kron_math.TRITON_MAX_DIM
  square = lambda kind, d: d * d if kind == "dense" else d
  elements = 5 * view.rows * view.cols + square(view.left, view.rows) + square(view.right, view.cols)
  return elements <= kron_math.TPU_MAX_BLOCK_ELEMENTS


def _factor_block(kind: str, dim: int, side: str) -> tuple[int, int]:
  """Padded block dims of a left/right factor: square, a column or a row."""
  if kind == "dense":
    return (dim, dim)
  return (dim, 1) if side == "left" else (1, dim)


def _factor_stack(q, side: str):
  """A factor as a 3-D stack: dense as is, diagonal as columns (left) or rows."""
  if q.ndim == 3:
    return q
  return q[:, :, None] if side == "left" else q[:, None, :]


def _precondition_body(
    scalar_ref, *refs, names, view: _View, count: int, mode: str, decay: bool,
    precision, num_outputs: int, rms_clip: bool,
):
  ins = dict(zip(names, refs[: len(names)]))
  outs = refs[len(names):]
  s = KronScalars(*(scalar_ref[k] for k in range(len(KronScalars._fields))))
  load = lambda name: ins[name][...].astype(jnp.float32) if name in ins else None
  m_hat, new_mu = kron_math.momentum(s, load("g"), load("mu"))
  x = m_hat
  if view.left == "dense":
    ql = load("ql")
    x = kron_math.dot(ql, kron_math.dot(ql, x, precision), precision, trans_a=True)
  elif view.left == "diag":
    ql = load("ql")
    x = ql * ql * x
  qr = load("qr")
  if view.right == "dense":
    x = kron_math.dot(kron_math.dot(x, qr, precision, trans_b=True), qr, precision)
  else:
    x = x * qr * qr
  out = kron_math.clip_and_finish(
      s, x, kron_math.reduce_all(jnp.sum, x * x), count, load("p"), mode=mode, decay=decay,
      rms_clip=rms_clip,
  )
  outs[0][...] = out.astype(outs[0].dtype)
  if num_outputs == 2:
    outs[1][...] = new_mu.astype(outs[1].dtype)


def kron_precondition_kernel(
    g, mu, p, qs: Sequence[jax.Array], scalars: KronScalars, *, mode: str,
    decay: bool = False, precision: str | None = None, map_batch_size: int | None = None,
    rms_clip: bool = True, backend: str, interpret: bool = False,
):
  """Pallas kernel (a); same signature and results as the reference.

  One grid step per layer reads its gradient, momentum, params and the two
  (possibly Kronecker-merged) factors and writes the output and the new
  momentum; in ``"apply"`` mode params and momentum are aliased in place (when
  no padding was needed). Layers that do not fit one block run the reference.

  Args:
    backend: ``"tpu"`` or ``"triton"``.
    interpret: run in the Pallas interpreter.
  """
  _check_mode(mode, p, decay)
  kron_math.check_precision(precision)
  batch, layer_shape = g.shape[0], g.shape[1:]
  g2, ql, qr = _as_matrix(g, qs)
  view = _plan_view(g2.shape[1], g2.shape[2], _kind(ql), _kind(qr), backend)
  if not _fits(view, backend):
    return kron_precondition_reference(
        g, mu, p, qs, scalars, mode=mode, decay=decay, precision=precision,
        map_batch_size=map_batch_size, rms_clip=rms_clip,
    )
  dims = (view.rows, view.cols)
  as_block = lambda x: _matrix.pad_stack(x.reshape(g2.shape), dims)
  reads_p = p is not None and (mode == "apply" or (mode == "updates" and decay))
  operands = {"g": as_block(g)}
  if mu is not None:
    operands["mu"] = as_block(mu)
  if reads_p:
    operands["p"] = as_block(p)
  for name, q, side, dim in (("ql", ql, "left", view.rows), ("qr", qr, "right", view.cols)):
    if q is not None:
      operands[name] = _matrix.pad_stack(_factor_stack(q, side), _factor_block(_kind(q), dim, side))
  names = tuple(operands)
  out_dtypes = [_out_dtype(mode, g, mu, p, qs)] + ([mu.dtype] if mu is not None else [])
  aliases = {}
  if mu is not None:
    aliases[1 + names.index("mu")] = 1
  if mode == "apply":
    aliases[1 + names.index("p")] = 0

  scalar_vec, scalar_spec = scalar_input(tuple(scalars), backend)
  in_specs = [scalar_spec] + [_matrix.matrix_spec(operands[k].shape[1:]) for k in names]
  flops = 12 * view.m * view.n
  flops += 4 * view.m * view.m * view.n if view.left == "dense" else 0
  flops += 4 * view.m * view.n * view.n if view.right == "dense" else 0
  bytes_accessed = sum(x.size * x.dtype.itemsize for x in operands.values())
  bytes_accessed += sum(batch * view.rows * view.cols * jnp.dtype(d).itemsize for d in out_dtypes)
  kernel = functools.partial(
      _precondition_body, names=names, view=view, count=math.prod(layer_shape),
      mode=mode, decay=decay, precision=precision, num_outputs=len(out_dtypes),
      rms_clip=rms_clip,
  )
  outs = pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct((batch, *dims), d) for d in out_dtypes],
      grid=(batch,),
      in_specs=in_specs,
      out_specs=[_matrix.matrix_spec(dims)] * len(out_dtypes),
      input_output_aliases=aliases,
      compiler_params=kron_math.layer_compiler_params(backend, interpret),
      interpret=interpret,
      name=f"kron_precondition_{mode}",
      cost_estimate=pl.CostEstimate(
          flops=batch * flops, transcendentals=batch, bytes_accessed=bytes_accessed
      ),
  )(scalar_vec, *(operands[k] for k in names))
  restore = lambda x: _matrix.unpad_stack(x, (view.m, view.n)).reshape(g.shape)
  out = restore(outs[0])
  return out, (restore(outs[1]) if mu is not None else None)


def kron_precondition(
    g, mu, p, qs: Sequence[jax.Array], scalars: KronScalars, *, mode: str,
    decay: bool = False, precision: str | None = None,
    map_batch_size: int | None = None, rms_clip: bool = True, impl: str = "auto",
    family: str = policy.KRON_PRECONDITION,
):
  """Kernel (a) as ``impl`` asks; see `kron_precondition_reference`.

  ``family``: its row of the auto policy (`policy.KRON_PRECONDITION`, or
  `policy.SKEW_QUAD_PRECONDITION` for the skew and quad steps).
  """
  fn = dispatch(
      kron_precondition_reference, kron_precondition_kernel, impl, family=family
  )
  return fn(
      g, mu, p, list(qs), scalars, mode=mode, decay=decay, precision=precision,
      map_batch_size=map_batch_size, rms_clip=rms_clip,
  )

