"""Threefry-2x32 random bits for the tests' CPU programs, without compiling its rounds.

Every `jax.random` draw, Kron's and White-Kron's probes and the low-bit
states' stochastic rounding bits are Threefry-2x32 (Salmon et al., "Parallel
Random Numbers: As Easy as 1, 2, 3", SC 2011): 20 rounds of 32-bit adds,
rotations and xors per draw, which XLA:CPU compiles into the program like any
other ops. JAX's CPU rule writes them as a while loop per draw; the
straight-line rule every other platform gets compiles faster (an eFormer QUAD
step on three small leaves, 15 draws: 2.3 s -> 1.2 s) but is still most of
a random program: an eFormer skew step (two scans of a White-Kron step on
three leaves) is 22k lines of optimized HLO, 60% of them Threefry rounds,
and compiles in 4.5-5.1 s. With the bits computed by NumPy in a host callback
it is 14k lines and compiles in 2.9-3.2 s. The README's test command went
from 10 min 36 s to 9 min 59 s (user CPU 19:47 -> 18:26, runs an hour apart
on the 2-core host), although JAX writes no program with a host callback to
the run's compilation cache.

The bits are the same (integer arithmetic, the same rounds, checked against
JAX's own Threefry function and the Random123 known answers in
`test_cpu_threefry.py`), so only the tests' compile time changes. The
callback is used only where XLA does not partition the program (one device,
or a `shard_map` body over every mesh axis): elsewhere a host callback would
gather its operands onto one device, changing the collectives the sharding
tests count, so those programs keep the straight-line rule.

This module alone reaches into JAX internals for it; `install` returns False
(and the tests run with JAX's own rule) where a JAX release moves them.
"""

import inspect

import numpy as np

# Per round pair: the rotation distances of the four rounds (Threefry-2x32).
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_KEY_PARITY = np.uint32(0x1BD11BDA)


def threefry2x32(key1, key2, count1, count2):
  """Threefry-2x32 with 20 rounds on broadcast uint32 arrays, as `jax.random`'s primitive."""
  key1, key2, x0, x1 = (np.asarray(a, np.uint32) for a in np.broadcast_arrays(key1, key2, count1,
                                                                               count2))
  keys = (key1, key2, key1 ^ key2 ^ _KEY_PARITY)
  with np.errstate(over="ignore"):  # uint32 arithmetic wraps, as it must
    x0, x1 = x0 + keys[0], x1 + keys[1]
    for i in range(5):
      for r in _ROTATIONS[i % 2]:
        x0 = x0 + x1
        x1 = x0 ^ ((x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r)))
      x0 = x0 + keys[(i + 1) % 3]
      x1 = x1 + keys[(i + 2) % 3] + np.uint32(i + 1)
  return x0, x1


def install() -> bool:
  """Lowers `jax.random`'s Threefry primitive on CPU as described above; False if JAX moved it."""
  try:
    from jax._src import callback, sharding_impls
    from jax._src.random import threefry2x32 as jax_threefry
    from jax.interpreters import mlir
  except ImportError:
    return False
  for name in ("threefry2x32_p", "_threefry2x32_lowering_rule"):
    if not hasattr(jax_threefry, name):
      return False
  for name in ("emit_python_callback", "_callback_op_sharding"):
    if not hasattr(callback, name):
      return False
  if not {"has_side_effect", "returns_token", "sharding"} <= set(
      inspect.signature(callback.emit_python_callback).parameters):
    return False
  straight_line = jax_threefry._threefry2x32_lowering_rule

  def lowering(ctx, key1, key2, count1, count2):
    axis_context = ctx.module_context.axis_context
    unpartitioned = (
        isinstance(axis_context, sharding_impls.ShardingContext)
        and axis_context.num_devices == 1
    ) or (
        isinstance(axis_context, sharding_impls.SPMDAxisContext)
        and axis_context.manual_axes == frozenset(axis_context.mesh.axis_names)
    )
    if not unpartitioned:
      return straight_line(ctx, key1, key2, count1, count2)
    results, _, _ = callback.emit_python_callback(
        ctx, threefry2x32, None, [key1, key2, count1, count2], ctx.avals_in, ctx.avals_out,
        has_side_effect=False, returns_token=False,
        sharding=callback._callback_op_sharding(axis_context, None, ctx.avals_out))
    return results

  mlir.register_lowering(jax_threefry.threefry2x32_p, lowering, platform="cpu", inline=False)
  return True
