"""PSGD Kron: step time of the kernels against the XLA reference path.

Kron is matmul- and latency-bound, so its cases are ``"compute"`` cases and
the baseline is pallasopt's own XLA path (``impl="xla"``; psgd_jax is not
importable with current Optax). Each workload gives two cases, timed apart:

* ``update-step``: ``preconditioner_update_probability=1``, every step
  updates the factors (kernel b per factor, triangular solves in XLA) and
  applies them (kernel a);
* ``apply-only``: probability 0, the steady state between updates (kernel a
  per leaf: momentum, the ``Qᵀ Q`` chain, RMS clip, decay, lr, in place).

Workloads: stacked small layers (one leaf of many layers: where the kernels'
batching pays) and GPT-2 trees (model shapes; factors wider than one kernel
block run the reference, see `pallasopt.kernels.kron`). The ``quick`` tier on
a CPU host runs the stack only: an update step of even the 4-layer GPT-2 tree
takes ~10 s there, with a ~10 s compile. The matmuls run in the parameters'
dtype (default precision), so that is the case's ``compute_dtype``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from bench import harness, workloads
from pallasopt.optim.kron import kron

FAMILY = "kron"
HYPERPARAMS = dict(learning_rate=3e-4, b1=0.9, weight_decay=0.1)
PROBABILITY = {"update-step": 1.0, "apply-only": 0.0}


def _layers(workload: workloads.Workload, stacked_axes: int):
  """Per leaf: (number of layers, layer shape)."""
  for x in jax.tree.leaves(workload.tree):
    n = min(stacked_axes, x.ndim)
    yield math.prod(x.shape[:n]), x.shape[n:]


def _dense(shape, max_size=8192) -> list[bool]:
  return [1 < d <= max_size and len(shape) >= 2 for d in shape]


def flops(workload: workloads.Workload, stacked_axes: int, step: str) -> int:
  """Matmul flops of one step: ``Qᵀ(Q G)`` per dense factor, and on update
  steps ``A``, the solve and the two Grams per dense factor."""
  total = 0
  for layers, shape in _layers(workload, stacked_axes):
    size = math.prod(shape)
    for d, dense in zip(shape, _dense(shape)):
      if dense:
        total += layers * 4 * d * size
        if step == "update-step":
          total += layers * (2 * d * size + d * size + 4 * d * size + 2 * d**3)
  return total


def fused_bytes(workload: workloads.Workload, stacked_axes: int) -> int:
  """Kernel (a)'s traffic: read p, g, mu and the factors; write p and mu."""
  total = 0
  for (layers, shape), x in zip(_layers(workload, stacked_axes), jax.tree.leaves(workload.tree)):
    size = math.prod(x.shape)
    factors = sum(d * d if dense else d for d, dense in zip(shape, _dense(shape))) or 1
    total += 5 * size * jnp.dtype(x.dtype).itemsize + layers * factors * 4
  return total


def case(workload: workloads.Workload, step: str, stacked_axes: int = 0) -> harness.Case:
  def make(impl):
    return kron(**HYPERPARAMS, preconditioner_update_probability=PROBABILITY[step],
                stacked_axes=stacked_axes, impl=impl)

  def inputs(key):
    kp, kg, km = jax.random.split(key, 3)
    params = workloads.random_tree(kp, workload.tree)
    grads = workloads.random_tree(kg, workload.tree)
    state = make("xla").init(params)
    state[0]["mu"] = workloads.random_tree(km, workload.tree, scale=0.1)
    return (params, state), grads

  impls = harness.xla_and_kernel_impls(make)
  return harness.Case(
      family=FAMILY, workload=workload.name, label=f"{workload.label}/{step}",
      params=workload.params, leaves=workload.leaves, inputs=inputs, impls=impls,
      bytes=fused_bytes(workload, stacked_axes), flops=flops(workload, stacked_axes, step),
      metric="compute", baseline="xla",
      compute_dtype=jax.tree.leaves(workload.tree)[0].dtype.name,
  )


def _stack(layers: int, rows: int, cols: int) -> workloads.Workload:
  tree = {"w": jax.ShapeDtypeStruct((layers, rows, cols), jnp.float32)}
  return workloads.Workload(f"stack{layers}x{rows}x{cols}", "f32", tree, stacked_axes=1)


def cases(tier: str) -> list[harness.Case]:
  if tier == "ci":
    stacks = [_stack(4, 16, 16)]
  elif tier == "quick":
    stacks = [_stack(48, 64, 64)]
  else:
    stacks = [_stack(48, 64, 64), _stack(96, 128, 128), _stack(24, 128, 512)]
  # The ci tier stays small: a Kron step over a whole tree compiles slowly on a
  # CPU (quick on a CPU has no trees, see `workloads.for_tier`).
  trees = [] if tier == "ci" else workloads.for_tier(tier, ("f32",))[:1]
  out = []
  for step in PROBABILITY:
    out += [case(w, step, stacked_axes=w.stacked_axes) for w in stacks]
    out += [case(w, step) for w in trees]
  return out
