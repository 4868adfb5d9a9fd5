"""Parameter trees every optimizer family is benchmarked on, built from shapes.

No weights are downloaded: a workload is a tree of `jax.ShapeDtypeStruct`
with the leaf shapes of a real model, and the harness fills it with random
data on the device. Shared by every ``bench/cases_<family>.py``:

* `leaf` -- a single 1-D array of ``size`` elements (the size sweeps);
* `gpt2` -- GPT-2's tree (Radford et al., 2019; Hugging Face parameter names
  and shapes): `GPT2_SMALL` is the 124M-parameter model, 148 leaves;
* `decoder` -- a Llama-style decoder (RMSNorm, grouped-query attention,
  SwiGLU MLP, tied embeddings): `DECODER_1B` has Llama 3.2 1B's shapes,
  1.24B parameters. ``stacked=(L,)`` stacks the layers into one leaf per
  weight (scan over layers); ``stacked=(repeats, stages)`` is the layout of a
  circular pipeline, with ``stacked_axes = len(stacked)`` leading batch axes;
* dtype policies: ``"f32"``, ``"bf16"``, and ``"mixed"`` (matrices bf16,
  vectors -- norms and biases -- f32).

`for_tier` lists the trees a tier runs; families pick the dtype policies and
state dtypes that matter to them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "Workload",
    "POLICIES",
    "leaf",
    "gpt2",
    "decoder",
    "GPT2_SMALL",
    "DECODER_1B",
    "leaf_sizes",
    "for_tier",
    "is_matrix",
]

POLICIES = ("f32", "bf16", "mixed")


@dataclasses.dataclass(frozen=True)
class Workload:
  """A parameter tree of shapes.

  Attributes:
    name: ``"leaf"`` or the tree's name (``"gpt2-small"``, ...).
    label: dtype policy, and for leaves the size: ``"f32/1048576"``.
    tree: nested dict of `jax.ShapeDtypeStruct`.
    stacked_axes: leading stacked-layer axes of the layer leaves.
  """

  name: str
  label: str
  tree: Any
  stacked_axes: int = 0

  @property
  def params(self) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(self.tree))

  @property
  def leaves(self) -> int:
    return len(jax.tree.leaves(self.tree))


def _dtype(shape: tuple[int, ...], policy: str, stacked_axes: int) -> jnp.dtype:
  if policy not in POLICIES:
    raise ValueError(f"policy must be one of {POLICIES}; got {policy!r}.")
  if policy == "mixed":
    return jnp.bfloat16 if len(shape) - stacked_axes >= 2 else jnp.float32
  return jnp.float32 if policy == "f32" else jnp.bfloat16


def _specs(shapes: dict, policy: str, stacked_axes: int = 0) -> dict:
  def one(shape):
    return jax.ShapeDtypeStruct(shape, _dtype(shape, policy, stacked_axes))

  return jax.tree.map(one, shapes, is_leaf=lambda x: isinstance(x, tuple))


def is_matrix(spec: jax.ShapeDtypeStruct, stacked_axes: int = 0) -> bool:
  """Whether a leaf is a weight matrix (>= 2 dims past the stacked axes)."""
  return len(spec.shape) - stacked_axes >= 2


def leaf(size: int, dtype: str = "f32") -> Workload:
  """One 1-D leaf of ``size`` elements; ``dtype`` is ``"f32"`` or ``"bf16"``."""
  return Workload("leaf", f"{dtype}/{size}", {"x": jax.ShapeDtypeStruct((size,), jnp.dtype(
      {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]))})


def gpt2(
    d_model: int, n_layer: int, vocab: int, n_ctx: int, *, policy: str = "f32", name: str = "gpt2"
) -> Workload:
  """GPT-2's parameter tree (Hugging Face ``GPT2LMHeadModel`` shapes, tied head)."""
  d, ff = d_model, 4 * d_model
  ln = lambda: {"g": (d,), "b": (d,)}
  layer = lambda: {
      "ln_1": ln(),
      "attn": {"c_attn": {"w": (d, 3 * d), "b": (3 * d,)}, "c_proj": {"w": (d, d), "b": (d,)}},
      "ln_2": ln(),
      "mlp": {"c_fc": {"w": (d, ff), "b": (ff,)}, "c_proj": {"w": (ff, d), "b": (d,)}},
  }
  shapes = {
      "wte": (vocab, d),
      "wpe": (n_ctx, d),
      "h": {f"{i:02d}": layer() for i in range(n_layer)},
      "ln_f": ln(),
  }
  return Workload(name, policy, _specs(shapes, policy))


def decoder(
    d_model: int,
    n_layer: int,
    n_heads: int,
    n_kv_heads: int,
    d_ff: int,
    vocab: int,
    *,
    stacked: tuple[int, ...] = (),
    policy: str = "f32",
    name: str = "decoder",
) -> Workload:
  """A Llama-style decoder's tree; ``stacked`` stacks the layers (see module doc)."""
  head = d_model // n_heads
  layer = {
      "attn_norm": (d_model,),
      "wq": (d_model, n_heads * head),
      "wk": (d_model, n_kv_heads * head),
      "wv": (d_model, n_kv_heads * head),
      "wo": (n_heads * head, d_model),
      "mlp_norm": (d_model,),
      "w_gate": (d_model, d_ff),
      "w_up": (d_model, d_ff),
      "w_down": (d_ff, d_model),
  }
  if stacked:
    if math.prod(stacked) != n_layer:
      raise ValueError(f"stacked={stacked} must multiply to n_layer={n_layer}.")
    layers = {k: (*stacked, *s) for k, s in layer.items()}
    tree = _specs({"layers": layers}, policy, len(stacked))
  else:
    tree = _specs({"layers": {f"{i:02d}": dict(layer) for i in range(n_layer)}}, policy)
  tree |= _specs({"embed": (vocab, d_model), "final_norm": (d_model,)}, policy)
  return Workload(name, policy, tree, stacked_axes=len(stacked))


# GPT-2 small: 124M parameters (Radford et al., 2019).
GPT2_SMALL = dict(d_model=768, n_layer=12, vocab=50257, n_ctx=1024)
# Llama 3.2 1B's shapes: 16 layers, d 2048, 32 heads / 8 KV heads, SwiGLU 8192,
# vocab 128256, tied embeddings; 1.24B parameters.
DECODER_1B = dict(d_model=2048, n_layer=16, n_heads=32, n_kv_heads=8, d_ff=8192, vocab=128256)
# The same structures at toy widths, for CPU runs and tests.
_GPT2_MINI = dict(d_model=128, n_layer=4, vocab=8192, n_ctx=256)
_GPT2_TINY = dict(d_model=16, n_layer=2, vocab=64, n_ctx=16)
_DECODER_TINY = dict(d_model=32, n_layer=4, n_heads=4, n_kv_heads=2, d_ff=64, vocab=64)


def leaf_sizes(tier: str) -> list[int]:
  """Single-leaf sizes of a tier (powers of 4, plus a ragged size)."""
  if tier == "ci":
    return [1000, 4096]
  if tier == "quick":
    return [1 << 20]
  return [1 << k for k in range(12, 29, 2)] + [1_000_003]


def stacked_layers(workload: Workload) -> Workload:
  """The stacked ``layers`` subtree of a stacked decoder, as its own workload.

  An optimizer's ``stacked_axes`` applies to every leaf, and the embedding and
  final norm of a stacked decoder are not stacked (a leaf without axes of its
  own after ``stacked_axes`` is an error).
  """
  if not workload.stacked_axes:
    raise ValueError(f"{workload.name} has no stacked layers.")
  return dataclasses.replace(
      workload, name=f"{workload.name}-layers", tree={"layers": workload.tree["layers"]}
  )


def for_tier(tier: str, policies: tuple[str, ...] = ("f32", "mixed")) -> list[Workload]:
  """The trees a tier runs.

  ``ci``: a toy GPT-2 in the first policy and a toy stacked decoder in the
  last (two small trees for the test suite); ``quick``: on an accelerator,
  GPT-2's structure at width 128 with 4 layers (52 leaves, 1.8M parameters) in
  the first policy only; on a CPU host none, so that `python -m bench` stays
  well under a minute (XLA:CPU compiles a tree's input generation and steps at
  ~25 ms per leaf-sized kernel: seconds per tree and implementation, and a
  Kron update step of that tree runs ~10 s); ``full``: GPT-2 small, the 1B
  decoder, and the 1B decoder stacked ``(16,)`` and ``(4, 4)``, in every
  policy.
  """
  if tier == "quick" and jax.default_backend() == "cpu":
    return []
  if tier == "ci":
    return [
        gpt2(**_GPT2_TINY, policy=policies[0], name="gpt2-tiny"),
        decoder(**_DECODER_TINY, stacked=(2, 2), policy=policies[-1], name="decoder-tiny-stacked2x2"),
    ]
  if tier == "quick":
    return [gpt2(**_GPT2_MINI, policy=policies[0], name="gpt2-mini")]
  out = []
  for policy in policies:
    out += [
        gpt2(**GPT2_SMALL, policy=policy, name="gpt2-small"),
        decoder(**DECODER_1B, policy=policy, name="decoder-1b"),
        decoder(**DECODER_1B, stacked=(16,), policy=policy, name="decoder-1b-stacked16"),
        decoder(**DECODER_1B, stacked=(4, 4), policy=policy, name="decoder-1b-stacked4x4"),
    ]
  return out


def _mix32(x: jax.Array) -> jax.Array:
  """A 32-bit integer hash (an avalanche mixer of the "lowbias32" kind)."""
  x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
  x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def random_tree(
    key: jax.Array, specs: Any, *, positive: bool = False, scale: float = 1.0, stream: int = 0
) -> Any:
  """A tree of pseudo-random arrays shaped like ``specs`` (ShapeDtypeStructs).

  Values are uniform with unit variance times ``scale`` and never zero;
  ``positive`` takes ``|x| + 1e-3`` (e.g. second moments). ``key`` and
  ``stream`` pick the sequence: use one stream per tree drawn from one key.
  Each element is a counter-based integer hash of (key, stream, element
  index): a threefry draw per leaf would make XLA compile a large RNG kernel
  per leaf, which takes seconds per tree on a CPU.
  """
  data = jax.random.key_data(key).ravel().astype(jnp.uint32)
  seed = _mix32(jnp.uint32(0x9E3779B9 * (stream + 1) & 0xFFFFFFFF))
  for word in data:
    seed = _mix32(seed ^ word)
  leaves, treedef = jax.tree.flatten(specs)
  out, offset = [], 0
  for spec in leaves:
    n = math.prod(spec.shape)
    bits = _mix32(jax.lax.iota(jnp.uint32, max(n, 1))[:n] + jnp.uint32(offset & 0xFFFFFFFF) + seed)
    # 24 random bits -> an odd multiple of 2**-24 in (-1, 1): never zero.
    u = ((bits >> 8).astype(jnp.float32) * 2.0 - (2**24 - 1)) * 2.0**-24
    x = u * (scale * 3**0.5)
    if positive:
      x = jnp.abs(x) + 1e-3
    out.append(x.reshape(spec.shape).astype(spec.dtype))
    offset += n
  return treedef.unflatten(out)


def randomize_floats(key: jax.Array, tree: Any, *, positive: bool = True, scale: float = 0.1) -> Any:
  """``tree`` with every floating leaf replaced by random data of its shape/dtype.

  Integer leaves (step counters) are kept. The default (small positive values)
  suits moment estimates; a family whose state needs other values (e.g.
  preconditioner matrices) passes its own ``prepare_state`` to `optimizer_case`.
  Uses `random_tree` stream 2 of ``key`` (streams 0 and 1 are the params and
  grads of `optimizer_case`).
  """
  leaves, treedef = jax.tree.flatten(tree)
  where = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)]
  specs = [jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype) for i in where]
  for i, x in zip(where, random_tree(key, specs, positive=positive, scale=scale, stream=2)):
    leaves[i] = x
  return treedef.unflatten(leaves)
