"""Adafactor: matrices (factored), vectors (unfactored) and realistic trees.

Three implementations per case (`harness.optimizer_case`): jitted
``optax.adafactor`` + ``optax.apply_updates``; ``pallasopt.optim.adafactor``'s
Optax path (``update`` + ``apply_updates``); its fused in-place
``apply_gradients``. Hyperparameters are Optax's defaults (clipping by block
RMS 1.0, parameter scale, no momentum, no weight decay) with a learning rate;
the ``momentum`` variant adds ``momentum=0.9`` (f32 accumulator) and weight
decay on matrices.

Bytes model, per pass (`pass_bytes`, the
leaf-sized part of the kernels' ``pl.CostEstimate``). For an f32 factored
leaf with the defaults, the fused apply moves 8 (statistics: read g, p) + 4
(RMS for clipping: read g) + 12 (update: read g, p; write p) = 24 B/param; an
unfactored leaf 12 + 20 = 32. The Optax path adds ``update``'s output and
``optax.apply_updates`` (read p, u; write p): 32 B/param factored. Optax's own
XLA program makes more passes (it materialises g², the update before and
after clipping, ...); its time is measured, not modelled.

Stacked trees give pallasopt ``stacked_axes`` (per-layer RMS); Optax sees the
same leaves unstacked-unaware, which here factors the same axes (the layer
axes are the smallest), so both move the same bytes.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from bench import harness, workloads
from pallasopt.kernels import adafactor as adafactor_k
from pallasopt.optim.adafactor import adafactor

FAMILY = "adafactor"
HYPERPARAMS = dict(learning_rate=1e-2)
VARIANTS = {"defaults": {}, "momentum": dict(momentum=0.9, weight_decay_rate=1e-3)}
MIN_DIM = 128  # Optax's default min_dim_size_to_factor



def pass_bytes(
    shape: tuple[int, ...], factored_dims: tuple[int, int] | None, *, mode: str,
    param_dtype, grad_dtype, state_dtype=None, momentum_dtype=None,
    clipping: bool = True, parameter_scale: bool = True, decay: bool = False,
) -> tuple[int, ...]:
  """HBM bytes of each pass the Pallas path makes over a leaf (the model).

  One number per `pallas_call` of `pallasopt.kernels.adafactor.adafactor_kernel`, counting the leaf-sized
  operands each pass reads and writes once (see that module's docstring); the
  kernels' ``pl.CostEstimate`` adds the row, column and partial-sum vectors,
  a few percent more. ``state_dtype`` (v's dtype; default the params') and
  ``momentum_dtype`` (None: no momentum) as in `adafactor_reference`.
  """
  n = math.prod(shape)
  size = lambda dtype: n * jnp.dtype(dtype).itemsize
  p, g = size(param_dtype), size(grad_dtype)
  v = size(state_dtype or param_dtype)
  m = 0 if momentum_dtype is None else 2 * size(momentum_dtype)
  out = p if mode == "apply" else size(jnp.result_type(
      param_dtype, grad_dtype, state_dtype or param_dtype, *([momentum_dtype] if m else [])))
  update = g + (p if mode == "apply" or decay else 0) + m + out
  if factored_dims is not None:
    return (g + p * parameter_scale,) + ((g,) if clipping else ()) + (update,)
  if clipping:
    before = (g + v + p * parameter_scale,)
  else:
    before = (p,) if parameter_scale else ()
  return before + (update + 2 * v,)

def _leaf_bytes(spec, stacked_axes: int, mode: str, variant: dict, decay: bool) -> int:
  dims = adafactor_k.factored_dims(spec.shape, True, MIN_DIM, stacked_axes)
  momentum = jnp.float32 if variant.get("momentum") is not None else None
  return sum(pass_bytes(
      spec.shape, dims, mode=mode, param_dtype=spec.dtype, grad_dtype=spec.dtype,
      momentum_dtype=momentum, decay=decay and "weight_decay_rate" in variant,
  ))


def _decay_mask(workload: workloads.Workload) -> Any:
  if workload.name in ("leaf", "matrix"):
    return None
  return jax.tree.map(lambda s: workloads.is_matrix(s, workload.stacked_axes), workload.tree)


def fused_bytes(workload: workloads.Workload, variant: dict) -> int:
  """Bytes of the fused apply over the tree (its kernels' leaf-sized traffic)."""
  mask = _decay_mask(workload)
  decays = jax.tree.leaves(mask) if mask is not None else [True] * workload.leaves
  return sum(_leaf_bytes(s, workload.stacked_axes, "apply", variant, d)
             for s, d in zip(jax.tree.leaves(workload.tree), decays, strict=True))


def update_bytes(workload: workloads.Workload, variant: dict) -> int:
  """Bytes of the Optax path: the updates-mode kernels plus ``optax.apply_updates``."""
  mask = _decay_mask(workload)
  decays = jax.tree.leaves(mask) if mask is not None else [True] * workload.leaves
  total = 0
  for spec, decay in zip(jax.tree.leaves(workload.tree), decays, strict=True):
    total += _leaf_bytes(spec, workload.stacked_axes, "updates", variant, decay)
    u = jnp.result_type(spec.dtype, jnp.float32 if variant.get("momentum") else spec.dtype)
    n = math.prod(spec.shape)
    total += n * (2 * jnp.dtype(spec.dtype).itemsize + jnp.dtype(u).itemsize)
  return total


def case(workload: workloads.Workload, variant: str = "defaults") -> harness.Case:
  extra = VARIANTS[variant]
  mask = _decay_mask(workload)
  kwargs = dict(HYPERPARAMS, **extra)
  if "weight_decay_rate" in extra:
    kwargs["weight_decay_mask"] = mask
  label = workload.label if variant == "defaults" else f"{workload.label}/{variant}"
  return harness.optimizer_case(
      family=FAMILY,
      workload=workload,
      label=label,
      optax_tx=optax.adafactor(**kwargs),
      pallasopt_tx=lambda impl: adafactor(**kwargs, stacked_axes=workload.stacked_axes, impl=impl),
      bytes=fused_bytes(workload, extra),
      update_bytes=update_bytes(workload, extra),
  )


def _matrix(shape: tuple[int, ...], dtype: str = "f32") -> workloads.Workload:
  stacked = len(shape) - 2
  spec = jax.ShapeDtypeStruct(shape, {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype])
  return workloads.Workload("matrix", f"{dtype}/{'x'.join(map(str, shape))}", {"w": spec},
                            stacked_axes=stacked)


def cases(tier: str) -> list[harness.Case]:
  """Factored matrices (and one stack), unfactored vectors, then the tier's trees.

  ``ci`` (test suite) and ``quick`` (``python -m bench``, ~10 s on a CPU) run
  one matrix and one vector.
  """
  if tier == "ci":
    return [case(_matrix((128, 256))), case(workloads.leaf(1000, "f32"), "momentum")]
  if tier == "quick":
    return [case(_matrix((1024, 1024))), case(workloads.leaf(1 << 20, "f32"))]
  out = []
  for shape in [(1024, 1024), (4096, 4096), (4096, 11008), (16, 2048, 2048)]:
    out += [case(_matrix(shape)), case(_matrix(shape, "bf16"))]
  out.append(case(_matrix((4096, 4096)), "momentum"))
  out += [case(workloads.leaf(size, "f32")) for size in (1 << 20, 1 << 24, 1_000_003)]
  for w in workloads.for_tier("full", ("f32", "mixed")):
    # stacked_axes covers the stacked layers only (see workloads.stacked_layers).
    w = workloads.stacked_layers(w) if w.stacked_axes else w
    out += [case(w), case(w, "momentum")]
  return out
