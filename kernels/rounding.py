r"""Counter-based random bits, and stochastic rounding to bfloat16.

**Stochastic rounding** to bfloat16 adds 16 random bits below the bf16
mantissa of the f32 value and truncates: the result is one of the two
neighbouring bf16 values, the farther one with probability proportional to
the distance, so it is unbiased. The bits are a counter-based hash
(murmur3's 32-bit finalizer) of a per-leaf key and the
element's flat index: the same bits in the reference, the interpreter and
on hardware, reproducible run to run (the TPU hardware PRNG is not emulated
on CPU). The key mixes (seed, step, leaf), see `leaf_key`; the bits also mix a
stream number, so one leaf's params and moments round independently.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


__all__ = [
    "int32_bits",
    "step_key",
    "leaf_key",
    "split_key",
    "join_key",
    "element_index",
    "random_bits",
    "code_bits",
    "stochastic_round_bf16",
    "round_off_mantissa",
]


def int32_bits(value: int) -> np.int32:
  """A 32-bit pattern as an int32 constant (the hash works on int32 bits)."""
  return np.uint32(value).view(np.int32)



_GOLDEN = 0x9E3779B9


def _times_golden(value: int) -> np.int32:
  return int32_bits((value * _GOLDEN) & 0xFFFFFFFF)


def _fmix32(h):
  """murmur3's 32-bit finalizer on int32 bits (logical shifts, wrapping products)."""
  h = h ^ jax.lax.shift_right_logical(h, np.int32(16))
  h = h * int32_bits(0x85EBCA6B)
  h = h ^ jax.lax.shift_right_logical(h, np.int32(13))
  h = h * int32_bits(0xC2B2AE35)
  return h ^ jax.lax.shift_right_logical(h, np.int32(16))


def step_key(seed, step) -> jax.Array:
  """The int32 random key of one step, for every leaf.

  Enough for blockwise codes, whose bits (`code_bits`) hash the values
  rounded: one key for all leaves lets every kernel of a step share one
  scalar operand (per-leaf operands cost XLA temporary memory on a TPU:
  9.8 MiB in GPT-2 small's int8 AdamW step compiled for a v5e).
  """
  key = _fmix32(jnp.asarray(seed).astype(jnp.int32) ^ _times_golden(1))
  return _fmix32(key + jnp.asarray(step).astype(jnp.int32) * _times_golden(1))


def leaf_key(seed, step, leaf: int) -> jax.Array:
  """The int32 random key of one leaf at one step.

  `random_bits` mixes in the stream (params, first moment, ...) and each
  element's index.

  Args:
    seed: the user's seed (an int or int32 value).
    step: the optimizer step (the state's count; may be traced).
    leaf: the leaf's index in the flattened params.
  """
  return _fmix32(step_key(seed, step) + _times_golden(leaf))


def split_key(key) -> tuple[jax.Array, jax.Array]:
  """A key as two f32 holding its 16-bit halves (exact): kernel scalars are f32."""
  key = jnp.asarray(key, jnp.int32)
  high = jax.lax.shift_right_logical(key, np.int32(16))
  return high.astype(jnp.float32), (key & 0xFFFF).astype(jnp.float32)


def join_key(high, low) -> jax.Array:
  """The int32 key `split_key` split."""
  return (high.astype(jnp.int32) << 16) | low.astype(jnp.int32)


def element_index(shape: tuple[int, ...]) -> jax.Array:
  """The int32 row-major flat index of every element of an array of ``shape``."""
  return jnp.arange(math.prod(shape), dtype=jnp.int32).reshape(shape)


def random_bits(key, index, stream: int = 0):
  """32 random bits (int32) per element from a key and flat element indices."""
  # One finalizer: it avalanches (each input bit flips each output bit with
  # probability ~1/2), and a second cost the low-bit kernels ~2.5 cycles per
  # 1024 elements and draw on a v5e (read from the compiled bundles).
  return _fmix32(index.astype(jnp.int32) ^ (key + _times_golden(stream)))


def code_bits(key, values, stream: int):
  """32 random bits (int32) per element for rounding blockwise codes of f32 ``values``.

  The hash of each value's bit pattern (not of its position, as
  `random_bits` for bf16 rounding): a shard of a leaf draws the bits the
  whole leaf would, however the step is sharded. Over steps the key
  changes, so each element's rounding is unbiased over time; equal values in
  one step round alike.
  """
  return random_bits(key, jax.lax.bitcast_convert_type(values, jnp.int32), stream)


def round_off_mantissa(x, bits, dropped: int):
  """``x`` (f32) cut to ``23 - dropped`` mantissa bits after adding ``dropped`` random bits.

  Stochastic rounding to that precision: the farther neighbour with
  probability proportional to the distance (a carry moves the exponent, as
  rounding up must).
  """
  low = (1 << dropped) - 1
  as_int = jax.lax.bitcast_convert_type(x, jnp.int32)
  kept = (as_int + (bits & low)) & int32_bits(~low & 0xFFFFFFFF)
  return jax.lax.bitcast_convert_type(kept, jnp.float32)


def stochastic_round_bf16(x, bits):
  """``x`` (f32) rounded stochastically to a bfloat16 value (returned as f32).

  Rounds up (away from zero) with probability equal to the fraction of a
  bf16 ulp that truncation drops, using the low 16 of ``bits``; exact on
  bf16 values, NaN stays NaN, and magnitudes past bf16's largest finite
  value may round to infinity, as rounding up must.
  """
  return jnp.where(jnp.isnan(x), x, round_off_mantissa(x, bits, 16))
