r"""Newton–Schulz math shared by the reference and the kernels (on values, not refs).

The steps `pallasopt.kernels.newton_schulz` documents, written once: its XLA
reference runs them on whole stacks, its kernels on the blocks they hold.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallasopt.kernels import _matrix

__all__ = [
    "dot",
    "gram_matrix",
    "frobenius_scale",
    "first_step_rescale",
    "per_matrix",
    "ns_step",
    "ns_iterations",
    "spectral_prescale",
]


def dot(a, b):
  return _matrix.batched_dot(a, b)


def gram_matrix(x):
  return _matrix.batched_dot(x, x, trans_b=True)


def frobenius_scale(x, eps):
  x = x.astype(jnp.float32)
  return x / (jnp.sqrt(jnp.sum(x * x)) + eps)


def first_step_rescale(x, gram, preconditioning: str, eps: float):
  """AOL / Schatten-4 rescaling of ``x`` and its Gram matrix (first step only)."""
  x = x.astype(jnp.float32)
  if preconditioning == "aol":
    # A is symmetric: its column sums are its row sums, as a row vector.
    col = jax.lax.rsqrt(jnp.maximum(jnp.sum(jnp.abs(gram), axis=1, keepdims=True), eps))
    row = jax.lax.rsqrt(jnp.maximum(jnp.sum(jnp.abs(gram), axis=0, keepdims=True), eps))
    return x * col, gram * col * row
  s = jax.lax.rsqrt(jnp.maximum(jnp.sqrt(jnp.sum(gram * gram)), eps))
  return x * s, gram * (s * s)


def per_matrix(fn, *arrays):
  """``fn`` of one matrix applied to a matrix or to every matrix of a stack."""
  return fn(*arrays) if arrays[0].ndim == 2 else jax.vmap(fn)(*arrays)


def ns_step(x, gram, a, b, c, dtype, symmetric_gram=None):
  r"""``a X + (b A + (c A) A) X`` with f32 epilogues, rounded to ``dtype``.

  ``symmetric_gram`` (a stack's Gram matrices, e.g. `gram.gram_reference`)
  computes the symmetric :math:`A^2 = A A^\top`, then scaled by ``c``; None
  is Optax's ``(c A) @ A``.
  """
  if symmetric_gram is None:
    square = dot((c * gram).astype(dtype), gram.astype(dtype))
  else:
    square = c * symmetric_gram(gram.astype(dtype))
  poly = b * gram + square
  return (a * x.astype(jnp.float32) + dot(poly.astype(dtype), x.astype(dtype))).astype(dtype)


def ns_iterations(
    x, coeff, steps: int, preconditioning: str, eps: float, dtype, symmetric_gram=None,
    *, as_loop: bool = False,
):
  """All steps on one wide matrix or a stack of them.

  ``coeff(k, j)`` reads coefficient j of step k. ``symmetric_gram`` (stacks
  only) computes both symmetric products of a step; None computes them as
  Optax does (one dot each).

  ``as_loop`` traces the steps as Optax does, a ``jax.lax.fori_loop`` unrolled
  at lowering (each step a call of one body, ``k`` traced): the XLA
  reference's form. Otherwise each step's ops are traced inline, as a kernel
  body needs them. The numbers are the same; what XLA makes of the two
  differs inside a train step: compiled for a TPU v5e, a Llama-shaped
  decoder's whole Muon step moved 2.6% more HBM bytes than Optax's with the
  steps inline and exactly Optax's as a loop (bench/results/compiled/whole-step-muon-v5e.json).
  """
  if preconditioning == "frobenius":
    x = per_matrix(functools.partial(frobenius_scale, eps=eps), x)
  x = x.astype(dtype)

  def step(k, x, first=False):
    gram = gram_matrix(x) if symmetric_gram is None else symmetric_gram(x)
    if first:
      rescale = functools.partial(first_step_rescale, preconditioning=preconditioning, eps=eps)
      x, gram = per_matrix(rescale, x, gram)
      x = x.astype(dtype)
    return ns_step(x, gram, coeff(k, 0), coeff(k, 1), coeff(k, 2), dtype, symmetric_gram)

  start = 0
  if steps and preconditioning in ("aol", "schatten"):
    x, start = step(0, x, first=True), 1
  if as_loop:
    return jax.lax.fori_loop(start, steps, step, x, unroll=True)
  for k in range(start, steps):
    x = step(k, x)
  return x


def spectral_prescale(stack, eps):
  norms = jnp.linalg.norm(stack.astype(jnp.float32), ord=2, axis=(-2, -1), keepdims=True)
  return stack.astype(jnp.float32) / (norms + eps)
