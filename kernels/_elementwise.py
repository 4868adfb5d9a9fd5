"""One `pallas_call` builder for every elementwise optimizer kernel.

A family writes only its math, as a *body* over f32 values::

  def body(scalars, p, g, m, v):   # scalars: tuple of f32 0-d values
    ...
    return new_p, new_m, new_v     # f32 blocks

and `elementwise_call` does the rest, identically for every family:

* views each operand as the 2-D slab `_tiling.plan_tiles` picks (a free
  reshape) and walks it with a 2-D grid;
* passes the per-step scalars (learning rate, bias corrections, ...) as a
  kernel *input*, never as a Python constant, so changing them never
  recompiles: SMEM on TPU, a power-of-two f32 vector with a full block on
  Triton;
* loads every block as f32 and stores each output in its own dtype;
* masks loads and stores of ragged blocks on Triton (Mosaic pads them);
* aliases operands to outputs (`input_output_aliases`) so that, under a jit
  that donates them, the update happens in place;
* attaches a `pl.CostEstimate` from per-element flops and the exact bytes
  moved, so XLA's scheduler and `cost_analysis()` see the kernel's traffic.

Optimizer families whose update is elementwise (AdamW, Lion) share one more
layer, `reference_update` and `kernel_update`: a family writes its *update
math* once, ``math(scalars, p, g, *moments, decay=...) -> (u, *moments)``,
and gets both of its modes from it, with the same dtypes and aliasing:

* ``"apply"``: returns ``(p + u, *moments)``, p and the moments in place;
* ``"updates"``: returns ``(u, *moments)`` (the Optax contract), the moments
  in place, reading p only where weight decay needs it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallasopt.kernels import _compat
from pallasopt.kernels._compat import pl, pltpu, pltriton
from pallasopt.kernels._tiling import TilePlan, plan_tiles

__all__ = [
    "elementwise_call",
    "bytes_moved",
    "scalar_input",
    "UpdateMath",
    "check_update_mode",
    "updates_dtype",
    "reference_update",
    "kernel_update",
]

Body = Callable[..., Sequence[jax.Array]]



def bytes_moved(
    operands: Sequence[jax.Array | jax.ShapeDtypeStruct],
    out_dtypes: Sequence[jnp.dtype],
) -> int:
  """HBM bytes one elementwise pass reads and writes (the roofline floor)."""
  size = math.prod(operands[0].shape)
  read = sum(size * jnp.dtype(x.dtype).itemsize for x in operands)
  written = sum(size * jnp.dtype(d).itemsize for d in out_dtypes)
  return read + written


def _triton_scalar_width(num_scalars: int) -> int:
  # Triton blocks must have a power-of-two element count.
  return max(8, 1 << (num_scalars - 1).bit_length())


def _scalar_vector(scalars: Sequence[jax.typing.ArrayLike], backend: str) -> jax.Array:
  vec = jnp.stack([jnp.asarray(s, jnp.float32).reshape(()) for s in scalars])
  if backend == "triton":
    vec = jnp.pad(vec, (0, _triton_scalar_width(len(scalars)) - len(scalars)))
  return vec


def scalar_input(
    scalars: Sequence[jax.typing.ArrayLike] | jax.Array, backend: str
) -> tuple[jax.Array, pl.BlockSpec]:
  """Per-step scalars as one kernel input, with its spec, for a grid of any rank.

  TPU: an f32 vector in SMEM. Triton: an f32 vector padded to a power-of-two
  length, read as one full block. The kernel reads scalar ``k`` as ``ref[k]``;
  an array (e.g. a table of coefficients) is flattened in row-major order.
  Every kernel builder (`_reduction`, `_matrix` users) passes its scalars this
  way, as `elementwise_call` does.
  """
  if isinstance(scalars, (jax.Array, np.ndarray)):
    scalars = list(jnp.ravel(jnp.asarray(scalars, jnp.float32)))
  vec = _scalar_vector(scalars, backend)
  if backend == "tpu":
    return vec, pl.BlockSpec(memory_space=pltpu.SMEM)
  return vec, pl.BlockSpec(vec.shape, lambda *_: (0,))


def _kernel(
    scalar_ref, *refs, body: Body, num_scalars: int, num_operands: int,
    plan: TilePlan, backend: str
):
  in_refs, out_refs = refs[:num_operands], refs[num_operands:]
  scalars = tuple(scalar_ref[k] for k in range(num_scalars))
  if backend == "triton":
    block = plan.block_shape
    row = pl.program_id(0) * block[0] + jax.lax.broadcasted_iota(jnp.int32, block, 0)
    col = pl.program_id(1) * block[1] + jax.lax.broadcasted_iota(jnp.int32, block, 1)
    mask = (row < plan.view_shape[0]) & (col < plan.view_shape[1])
    load = lambda r: pltriton.load(r, mask=mask, other=0).astype(jnp.float32)
    store = lambda r, x: pltriton.store(r, x.astype(r.dtype), mask=mask)
  else:
    load = lambda r: r[...].astype(jnp.float32)

    def store(r, x):
      r[...] = x.astype(r.dtype)

  results = body(scalars, *(load(r) for r in in_refs))
  for ref, value in zip(out_refs, results, strict=True):
    store(ref, value)


def elementwise_call(
    body: Body,
    operands: Sequence[jax.Array],
    scalars: Sequence[jax.typing.ArrayLike],
    out_dtypes: Sequence[jnp.dtype],
    *,
    backend: str,
    interpret: bool,
    name: str,
    aliases: Mapping[int, int] | None = None,
    flops_per_element: int = 0,
    transcendentals_per_element: int = 0,
) -> tuple[jax.Array, ...]:
  """Runs `body` over same-shaped operands as one fused Pallas kernel.

  Args:
    body: ``body(scalars, *blocks) -> outputs``; all values f32.
    operands: arrays of one shape (any rank, any size), f32 or bf16.
    scalars: per-step 0-d values, passed to the kernel as data.
    out_dtypes: dtype of each output; outputs have the operands' shape.
    backend: ``"tpu"`` (Mosaic TPU) or ``"triton"``.
    interpret: run in the Pallas interpreter instead of compiling.
    name: kernel name, shown in profiles.
    aliases: ``{operand index: output index}`` pairs updated in place.
    flops_per_element: for the cost estimate.
    transcendentals_per_element: for the cost estimate.

  Returns:
    The outputs, shaped like the operands.
  """
  shape = operands[0].shape
  for x in operands:
    if x.shape != shape:
      raise ValueError(
          f"{name}: operands must share one shape; got {[o.shape for o in operands]}."
      )
  size = math.prod(shape)
  if size == 0:
    return tuple(jnp.zeros(shape, d) for d in out_dtypes)

  plan = plan_tiles(size, backend)
  block = pl.BlockSpec(plan.block_shape, lambda i, j: (i, j))
  if backend == "tpu":
    scalar_spec = pl.BlockSpec(memory_space=pltpu.SMEM)
  else:
    scalar_spec = pl.BlockSpec((_triton_scalar_width(len(scalars)),), lambda i, j: (0,))

  kernel = functools.partial(
      _kernel, body=body, num_scalars=len(scalars), num_operands=len(operands),
      plan=plan, backend=backend,
  )
  call = pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct(plan.view_shape, d) for d in out_dtypes],
      grid=plan.grid,
      in_specs=[scalar_spec] + [block] * len(operands),
      out_specs=[block] * len(out_dtypes),
      # Operand i is pallas_call input i + 1: input 0 is the scalar vector.
      input_output_aliases={i + 1: o for i, o in (aliases or {}).items()},
      compiler_params=_compat.compiler_params(
          backend, ("parallel", "parallel"), interpret=interpret
      ),
      interpret=interpret,
      name=name,
      cost_estimate=pl.CostEstimate(
          flops=flops_per_element * size,
          transcendentals=transcendentals_per_element * size,
          bytes_accessed=bytes_moved(operands, out_dtypes),
      ),
  )
  views = [x.reshape(plan.view_shape) for x in operands]
  outs = call(_scalar_vector(scalars, backend), *views)
  return tuple(o.reshape(shape) for o in outs)


# ---- Elementwise optimizer updates: "apply" and "updates" modes. ----

UpdateMath = Callable[..., Sequence[jax.Array]]


def check_update_mode(mode: str, p: jax.Array | None, decay: bool) -> None:
  """``mode`` is ``"apply"`` or ``"updates"`` and ``p`` is there if it is read."""
  if mode not in ("apply", "updates"):
    raise ValueError(f"mode must be 'apply' or 'updates'; got {mode!r}.")
  if p is None and (mode == "apply" or decay):
    raise ValueError(f"p is required in {mode!r} mode{' with decay' if decay else ''}.")


def updates_dtype(p: jax.Array | None, g: jax.Array, *moments: jax.Array) -> jnp.dtype:
  """The dtype of Optax's updates: its inputs' promoted dtype."""
  return jnp.result_type(*(x.dtype for x in (p, g, *moments) if x is not None))


def reference_update(
    math: UpdateMath,
    p: jax.Array | None,
    g: jax.Array,
    moments: Sequence[jax.Array],
    scalars: tuple,
    *,
    mode: str,
    decay: bool,
) -> tuple[jax.Array, ...]:
  """Runs an update ``math`` as plain jnp: the XLA path of a family.

  Args:
    math: ``math(scalars, p, g, *moments, decay=decay) -> (u, *moments)`` on
      f32 values (``p`` is None when it is not read).
    p: params, or None in ``"updates"`` mode without decay.
    g: gradient.
    moments: the optimizer state leaves, each kept in its own dtype.
    scalars: the family's NamedTuple of per-step scalars.
    mode: ``"apply"`` returns ``(p + u, *moments)``; ``"updates"`` returns
      ``(u, *moments)``, ``u`` in `updates_dtype`.
    decay: whether the leaf gets weight decay.
  """
  check_update_mode(mode, p, decay)
  s = type(scalars)(*(jnp.asarray(x, jnp.float32) for x in scalars))
  f32 = lambda x: None if x is None else x.astype(jnp.float32)
  u, *new = math(s, f32(p), f32(g), *map(f32, moments), decay=decay)
  if mode == "apply":
    first = (f32(p) + u).astype(p.dtype)
  else:
    first = u.astype(updates_dtype(p, g, *moments))
  return (first, *(x.astype(m.dtype) for x, m in zip(new, moments, strict=True)))


def kernel_update(
    math: UpdateMath,
    p: jax.Array | None,
    g: jax.Array,
    moments: Sequence[jax.Array],
    scalars: tuple,
    *,
    mode: str,
    decay: bool,
    backend: str,
    interpret: bool,
    name: str,
    flops_per_element: int,
    transcendentals_per_element: int = 0,
) -> tuple[jax.Array, ...]:
  """`reference_update` as one fused Pallas kernel (`elementwise_call`).

  The moments are aliased to their outputs, and in ``"apply"`` mode p too;
  donate them in the enclosing jit to update in place. p is read only in
  ``"apply"`` mode or with decay. The kernel is named ``{name}_{mode}``.
  """
  check_update_mode(mode, p, decay)
  with_p = p is not None and (mode == "apply" or decay)
  k = len(moments)
  # Operands: g, the moments, then p if it is read.
  operands = [g, *moments] + ([p] if with_p else [])

  def body(values, g, *rest):
    p = rest[k] if with_p else None
    u, *new = math(type(scalars)(*values), p, g, *rest[:k], decay=decay)
    return ((p + u) if mode == "apply" else u, *new)

  aliases = {1 + i: 1 + i for i in range(k)}
  if mode == "apply":
    first_dtype, aliases[k + 1] = p.dtype, 0
  else:
    first_dtype = updates_dtype(p, g, *moments)
  return elementwise_call(
      body, operands, tuple(scalars), (first_dtype, *(m.dtype for m in moments)),
      backend=backend, interpret=interpret, name=f"{name}_{mode}", aliases=aliases,
      flops_per_element=flops_per_element,
      transcendentals_per_element=transcendentals_per_element,
  )
