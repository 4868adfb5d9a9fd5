r"""White-Kron: Kronecker-factored preconditioners learned online (eFormer's quad and skew).

A variant of Xi-Lin Li's PSGD (`Preconditioned Stochastic Gradient Descent
<https://arxiv.org/abs/1512.04202>`_; `Stochastic Hessian Fittings with Lie
Groups <https://arxiv.org/abs/2402.11858>`_) as eFormer 0.0.101 implements it
for ``quad`` and ``skew``. A gradient block :math:`G` (at most ``block_size``
square, zero padded) has a left and a right factor, each dense
(``(bs, bs)``) or diagonal; per step, from :math:`G_n = G + \sigma\,\xi`
(tiny noise on the valid entries):

* :math:`P = Q_l^\top Q_l\, G_n\, Q_r^\top Q_r`, the preconditioned gradient
  with the current factors (`precondition`: kernel (a) of `kron` without its
  RMS clip);
* per side, :math:`T_1 = P P^\top` (left) or :math:`P^\top P` (right), the
  diagonal of it for a diagonal factor, and :math:`T_2 = mn / m` (or
  :math:`mn / n`) for a valid block of :math:`m \times n`;
* a Lipschitz estimate :math:`L \leftarrow \max(0.95 L + 0.05 \ell, \ell)`
  with :math:`\ell = \lVert T_1 \rVert + T_2` (randomized power-iteration
  lower bound for dense, max for diagonal);
* the factor step, by style. ``"QUAD"``: :math:`z = \eta_P / 2L`,
  :math:`Q \leftarrow \mathrm{sym}\big((I - z(T_1 - T_2))\,Q\,(I - z(T_1 -
  T_2))\big)` (diagonal: :math:`Q (1 - z (T_1 - T_2))^2`). ``"skew"``:
  :math:`z = \eta_P / L`, :math:`Q \leftarrow Q - z (T_1 - T_2) Q`, then one
  Procrustes rotation step towards a symmetric :math:`Q` (diagonal:
  :math:`Q (1 - z (T_1 - T_2))`);
* the output :math:`Q_l'^\top Q_l'\, G\, Q_r'^\top Q_r'` with the new factors.

Every function here takes a batch of independent blocks (leading axis) and
draws its random numbers exactly as eFormer does, so the optimizer built on
them (`pallasopt.optim.white_kron`) reproduces eFormer's trajectories. The two
preconditioner applications run `kron.kron_precondition` (a Pallas kernel per
block batch where it fits, else its jnp reference); the factor steps, whose
power iterations and rotations are chains of small dependent matmuls, run in
XLA.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallasopt.kernels import kron, policy

__all__ = [
    "STYLES",
    "two_dims",
    "block_extents",
    "padded_identity",
    "to_blocks",
    "from_blocks",
    "pad_rows_to",
    "LIPSCHITZ_DECAY",
    "power_norm_bound",
    "procrustes_step",
    "dense_factor_step",
    "diag_factor_step",
    "balance",
    "precondition",
    "precondition_blocks",
    "precondition_vectors",
]

STYLES = ("QUAD", "skew")
LIPSCHITZ_DECAY = 0.95
_PROBES = 4
_POWER_ITERATIONS = 5
_MAX_ROTATION = 1 / 8


def _lipschitz(L, ell):
  return jnp.maximum(LIPSCHITZ_DECAY * L + (1 - LIPSCHITZ_DECAY) * ell, ell)


def power_norm_bound(key, a, *, max_abs_scale: bool = False):
  """A lower bound of the spectral norm of one square matrix ``a``.

  Scaled by its largest diagonal entry (``max_abs_scale``: largest
  magnitude), the row of largest energy plus 4 Gaussian probes go through 5
  normalized power iterations and one more product; the bound is the largest
  resulting norm, scaled back.
  """
  scale = jnp.max(jnp.abs(a)) if max_abs_scale else jnp.max(jnp.diagonal(a))
  a = a / scale
  energies = jnp.mean(a * a, axis=1)
  top = jnp.argmax(energies)
  start = a[top] * jax.lax.rsqrt(energies[top])
  x = (start + jax.random.normal(key, (_PROBES, a.shape[1]), a.dtype)) @ a
  for _ in range(_POWER_ITERATIONS):
    x = (x / jnp.max(jnp.abs(x))) @ a
  x = (x / jnp.linalg.vector_norm(x, axis=1, keepdims=True)) @ a
  return jnp.max(jnp.linalg.vector_norm(x, axis=1)) * scale


def procrustes_step(key, q):
  """One rotation of ``q`` towards a symmetric matrix (skew's orthogonal Procrustes step).

  With :math:`R = (Q^\\top - Q) / \\max|Q^\\top - Q|` (skew-symmetric), it
  takes :math:`Q + a (RQ + \\tfrac a2 R^2 Q)` when :math:`\\mathrm{tr}(RQ) > 0`,
  the step :math:`a = \\tfrac18 / \\lVert R \\rVert` shortened to the
  minimizer :math:`-\\mathrm{tr}(RQ) / \\mathrm{tr}(R^2 Q)` when that trace
  is negative; else (or for a symmetric ``q``) ``q`` itself.
  """
  r = q.T - q
  max_abs = jnp.max(jnp.abs(r))
  rotates = max_abs > jnp.finfo(q.dtype).tiny
  r = r / jnp.where(rotates, max_abs, 1)
  rq = r @ q
  trace_rq = jnp.trace(rq)
  a = _MAX_ROTATION / power_norm_bound(key, r, max_abs_scale=True)
  rrq = r @ rq
  trace_rrq = jnp.trace(rrq)
  a = jnp.where(trace_rrq < 0, jnp.minimum(a, -trace_rq / trace_rrq), a)
  rotated = q + a * (rq + 0.5 * a * rrq)
  return jnp.where(rotates & (trace_rq > 0), rotated, q)


def dense_factor_step(key, term1, term2, L, q, lr, style: str):
  """One dense factor's step (one block): ``(new q, new L)``; see the module docstring."""
  if style == "QUAD":
    L = _lipschitz(L, power_norm_bound(key, term1) + term2)
    z = (lr / (2.0 * L)).astype(q.dtype)
    p = q - z * (term1 @ q - term2 * q)
    p = p - z * (p @ term1 - p * term2)
    return (p + p.T) / 2.0, L
  norm_key, rotation_key = jax.random.split(key)
  L = _lipschitz(L, power_norm_bound(norm_key, term1) + term2)
  z = (lr / L).astype(q.dtype)
  return procrustes_step(rotation_key, q - z * (term1 @ q - term2 * q)), L


def diag_factor_step(term1, term2, L, q, lr, style: str):
  """One diagonal factor's step (one block): ``(new q, new L)``."""
  L = _lipschitz(L, jnp.max(term1) + term2)
  z = (lr / (2.0 * L if style == "QUAD" else L)).astype(q.dtype)
  gain = 1.0 - z * (term1 - term2)
  return (q * (gain * gain) if style == "QUAD" else q * gain), L


@jax.vmap
def balance(ql, qr):
  """Rescales each block's two factors to the same max magnitude (product kept)."""
  left, right = jnp.max(jnp.abs(ql)), jnp.max(jnp.abs(qr))
  mean = jnp.sqrt(left * right)
  return ql * (mean / left), qr * (mean / right)


def precondition(g, ql, qr, *, impl: str):
  """``Ql^T Ql G Qr^T Qr`` for a batch of blocks (diagonal factors as vectors).

  ``g`` is ``(B, m, n)``; a factor is ``(B, d, d)`` dense or ``(B, d)``
  diagonal. Runs `kron.kron_precondition` (kernel (a), no RMS clip). On a
  TPU ``impl="auto"`` runs XLA. Compiled for TPU v5e and v6e from a CPU host,
  a skew step moved 1.00-1.11x the bytes of its XLA path with the kernel
  (eight shapes from 64x64 to 3072x768), and a quad step on v6e, counting
  the balancing conditional's branches, 1.05-1.07x on seven of seventeen
  layer shapes (64x512 to 256x1024, 896x128: XLA transposes both factors
  for the step's other products instead of one), 0.57-1.00x on the others;
  the blocks the kernel sees do not tell those layers apart.
  """
  scalars = kron.kron_scalars(1)
  out, _ = kron.kron_precondition(
      g, None, None, [ql, qr], scalars, mode="precond", rms_clip=False, impl=impl,
      family=policy.SKEW_QUAD_PRECONDITION,
  )
  return out.astype(jnp.result_type(g, ql, qr))


def precondition_blocks(
    keys, ql, qr, Ll, Lr, g, valid: Sequence[jax.Array], *, diag_left: bool, diag_right: bool,
    lr, noise_scale: float, style: str, impl: str,
):
  """One White-Kron step of a batch of blocks.

  Args:
    keys: one PRNG key per block, ``(B,)``.
    ql, qr: the factors: ``(B, d, d)`` dense or ``(B, d)`` diagonal.
    Ll, Lr: their Lipschitz estimates, ``(B,)`` float32.
    g: the blocks, ``(B, rows, cols)``, zero padded.
    valid: ``(valid_rows, valid_cols)``, each ``(B,)`` int32.
    diag_left, diag_right: which factors are diagonal.
    lr: the preconditioner step size.
    noise_scale: scale of the noise added to the valid entries.
    style: ``"QUAD"`` or ``"skew"``.
    impl: the preconditioner kernel's ``impl``.

  Returns:
    ``(ql, qr, Ll, Lr, preconditioned g)``.
  """
  if style not in STYLES:
    raise ValueError(f"white_kron: style must be one of {STYLES}; got {style!r}.")
  split = jax.vmap(jax.random.split)(keys)
  factor_keys, noise_keys = split[:, 0], split[:, 1]
  shape = g.shape[1:]
  rows = jnp.arange(shape[0], dtype=jnp.int32)[None, :, None] < valid[0][:, None, None]
  cols = jnp.arange(shape[1], dtype=jnp.int32)[None, None, :] < valid[1][:, None, None]
  noise = jax.vmap(lambda k: jax.random.normal(k, shape, g.dtype))(noise_keys) * noise_scale
  noisy = g + noise * (rows & cols)
  m, n = (jnp.asarray(x, g.dtype) for x in valid)
  total = m * n
  p = precondition(noisy, ql, qr, impl=impl)

  if diag_left or diag_right:
    left_keys = right_keys = factor_keys
  else:
    split = jax.vmap(jax.random.split)(factor_keys)
    left_keys, right_keys = split[:, 0], split[:, 1]

  def side(keys, term1_dense, term1_diag, term2, L, q, diagonal):
    if diagonal:
      return jax.vmap(lambda t1, t2, l, q: diag_factor_step(t1, t2, l, q, lr, style))(
          term1_diag(p), term2, L, q)
    return jax.vmap(lambda k, t1, t2, l, q: dense_factor_step(k, t1, t2, l, q, lr, style))(
        keys, term1_dense(p), term2, L, q)

  ql, Ll = side(left_keys, lambda p: p @ jnp.swapaxes(p, 1, 2), lambda p: jnp.sum(p * p, axis=2),
                total / m, Ll, ql, diag_left)
  qr, Lr = side(right_keys, lambda p: jnp.swapaxes(p, 1, 2) @ p, lambda p: jnp.sum(p * p, axis=1),
                total / n, Lr, qr, diag_right)
  return ql, qr, Ll, Lr, precondition(g, ql, qr, impl=impl)


def precondition_vectors(keys, q, L, g, *, lr, noise_scale: float, style: str):
  """One White-Kron step of a batch of vectors (1-D leaves): one diagonal factor.

  Returns ``(q, L, q^2 g)`` with the new ``q``; shapes ``(B, d)``, ``(B,)``,
  ``(B, d)``.
  """
  noise = jax.vmap(lambda k: jax.random.normal(k, g.shape[1:], g.dtype))(keys) * noise_scale
  p = q * q * (g + noise)
  q, L = jax.vmap(lambda t1, l, q: diag_factor_step(t1, 1.0, l, q, lr, style))(p * p, L, q)
  return q, L, q * q * g


# ---- The block layout of a layer. ----


def two_dims(shape: tuple[int, ...]) -> tuple[int, ...]:
  """A layer's shape as the factored ``(m, n)``, or ``(d,)`` for a vector.

  A shape with one non-unit dim is a vector; more than two dims split where
  the two products are closest (the first such split).
  """
  if len(shape) < 2:
    return tuple(shape)
  if math.prod(shape) == max(shape):
    return (max(shape),)
  if len(shape) == 2:
    return tuple(shape)
  ratios = [
      max(math.prod(shape[:s]), math.prod(shape[s:])) / min(math.prod(shape[:s]), math.prod(shape[s:]))
      for s in range(1, len(shape))
  ]
  split = 1 + int(np.argmin(ratios))
  return (math.prod(shape[:split]), math.prod(shape[split:]))


def block_extents(size: int, block: int) -> list[int]:
  """The sizes of ``ceil(size / block)`` blocks covering ``size``."""
  count = -(-size // block)
  return [block] * (count - 1) + [size - block * (count - 1)]


def padded_identity(block: int, valid: int, dtype, scale: float) -> jax.Array:
  """``scale`` times the identity on the first ``valid`` of ``block`` dims."""
  return jnp.diag((jnp.arange(block) < valid).astype(dtype)) * scale


def to_blocks(x, block: int, *, rows: bool, cols: bool):
  """``(B, m, n)`` zero padded and split into blocks along the chosen axes, row-major."""
  batch, m, n = x.shape
  pm = -(-m // block) * block if rows else m
  pn = -(-n // block) * block if cols else n
  x = jnp.pad(x, ((0, 0), (0, pm - m), (0, pn - n)))
  br, bc = (block if rows else m), (block if cols else n)
  x = x.reshape(batch, pm // br, br, pn // bc, bc).transpose(0, 1, 3, 2, 4)
  return x.reshape(-1, br, bc)


def from_blocks(blocks, batch: int, m: int, n: int, block: int, *, rows: bool, cols: bool):
  """The inverse of `to_blocks`: ``(B, m, n)``."""
  br, bc = (block if rows else m), (block if cols else n)
  nr, nc = -(-m // br), -(-n // bc)
  x = blocks.reshape(batch, nr, nc, br, bc).transpose(0, 1, 3, 2, 4)
  return x.reshape(batch, nr * br, nc * bc)[:, :m, :n]


def pad_rows_to(x, count: int, value):
  """``x`` extended along axis 0 to ``count`` entries filled with ``value`` (a row)."""
  extra = count - x.shape[0]
  if extra <= 0:
    return x
  return jnp.concatenate([x, jnp.broadcast_to(jnp.asarray(value, x.dtype), (extra, *x.shape[1:]))])
