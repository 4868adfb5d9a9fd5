"""Whole train steps of plain-JAX decoders: what a user compiles, forward to optimizer.

An optimizer step measured alone (params, grads and state in; params and
state out) cannot show what happens to the gradient: in a train step XLA
may fuse an elementwise update into the op that produces the gradient (on a
TPU, the output fusion of each weight-gradient matmul), so that the gradient
never reaches HBM, while a Pallas kernel, a custom call, needs it written and
read back. This module builds the step users jit: loss, ``jax.value_and_grad``
and the optimizer, params and state donated, in the forms users write it
(`FORMS`), on two decoder families written in plain JAX (`DECODERS`), or
on any `Model` (``bench.whole_step`` measures Hugging Face's Flax decoders,
written apart from this project, through it):

* GPT-2 (Radford et al., 2019): learned positions, LayerNorm with biases,
  GELU MLP of 4 d, biases everywhere, the head tied to the embedding;
* Llama (Touvron et al., 2023): RMSNorm, rotary positions, grouped-query
  attention, a SwiGLU MLP, no biases, an untied head.

Params are f32; matmuls take bf16 operands and accumulate in f32, as mixed
precision training does. `measure` compiles a step for a target of
`pallasopt.compile_check` and reads what it moves (`compile_check.traffic`)
and its peak memory (`peak_bytes`, and the compiler's own figure,
`compiler_peak_bytes`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import optax

from pallasopt.compiled_traffic import Traffic

__all__ = [
    "Decoder",
    "Model",
    "DECODERS",
    "FORMS",
    "param_shapes",
    "init_params",
    "loss",
    "next_token_loss",
    "train_step",
    "measure",
    "Measured",
    "peak_bytes",
    "compiler_peak_bytes",
]


@dataclasses.dataclass(frozen=True)
class Decoder:
  """A decoder-only transformer's shape.

  Attributes:
    family: ``"gpt2"`` or ``"llama"`` (module docstring).
    d_model: the residual width.
    n_layer: the number of blocks.
    n_heads: attention heads.
    n_kv_heads: key/value heads (grouped-query attention; GPT-2: ``n_heads``).
    d_ff: the MLP's hidden width.
    vocab: the vocabulary size (the embedding's and the head's rows).
    n_ctx: the longest sequence (GPT-2's learned positions).
  """

  family: str
  d_model: int
  n_layer: int
  n_heads: int
  n_kv_heads: int
  d_ff: int
  vocab: int
  n_ctx: int = 1024


@runtime_checkable
class Model(Protocol):
  """A decoder written elsewhere, as the step functions here take it beside a `Decoder`.

  Attributes:
    vocab: the vocabulary size (tokens are drawn below it).
  """

  vocab: int

  def param_shapes(self) -> Any:
    """The params as ``jax.ShapeDtypeStruct``s (a pytree)."""

  def loss(self, params: Any, tokens: jax.Array) -> jax.Array:
    """The mean next-token loss of ``tokens`` (batch, time + 1) under ``params``."""


# The decoders the whole-step tier and bench compile: GPT-2 small (124M), and
# Llama shapes whose MLP and vocabulary rows are wider than a kernel's row
# block (5632, 11008, 32000, 128256 columns), at 2 layers so that a compile
# from a CPU host stays short; the layers repeat, so per-parameter figures of
# a deeper model differ only by the embedding's and head's share.
DECODERS: dict[str, Decoder] = {
    "gpt2-small": Decoder("gpt2", 768, 12, 12, 12, 3072, 50257),
    "gpt2-2l": Decoder("gpt2", 768, 2, 12, 12, 3072, 50257),
    "llama-1b-2l": Decoder("llama", 2048, 2, 16, 16, 5632, 32000),
    "llama-7b-2l": Decoder("llama", 4096, 2, 32, 32, 11008, 32000),
    "llama3-1b-2l": Decoder("llama", 2048, 2, 32, 8, 8192, 128256),
}

# How users write the optimizer into their step:
#   update: ``tx.update`` then ``optax.apply_updates`` (every Optax loop);
#   fused: `pallasopt.optim.apply_gradients` (the same for a plain transform);
#   clip: ``optax.chain(optax.clip_by_global_norm(1.0), tx)``, update form;
#   clip-fused: the same clip as ``apply_gradients(..., max_grad_norm=1.0)``;
#   clipped: `pallasopt.optim.clipped` (the clip chain's step and state, its
#     factor inside the kernels), update form;
#   accumulate: ``optax.MultiSteps(tx, every_k_schedule=4)``, update form;
#   multi-steps: `pallasopt.optim.multi_steps` (the same step), update form;
#   multi-steps-fused: the same with ``apply_gradients``;
#   multi-steps-clipped: ``multi_steps(clipped(tx, 1.0), 4)``, i.e.
#     ``optax.MultiSteps(optax.chain(clip, tx), 4)``, update form;
#   multi-steps-clipped-fused: the same with ``apply_gradients``.
FORMS = ("update", "fused", "clip", "clip-fused", "clipped", "accumulate", "multi-steps",
         "multi-steps-fused", "multi-steps-clipped", "multi-steps-clipped-fused")


def param_shapes(model: Decoder | Model) -> Any:
  """The model's params as ``jax.ShapeDtypeStruct``s (a `Decoder`'s: f32)."""
  if isinstance(model, Model):
    return model.param_shapes()
  d, f = model.d_model, model.d_ff
  head = d // model.n_heads
  if model.family == "gpt2":
    norm = lambda: {"g": (d,), "b": (d,)}
    layer = lambda: {
        "ln_1": norm(),
        "attn": {"c_attn": {"w": (d, 3 * d), "b": (3 * d,)}, "c_proj": {"w": (d, d), "b": (d,)}},
        "ln_2": norm(),
        "mlp": {"c_fc": {"w": (d, f), "b": (f,)}, "c_proj": {"w": (f, d), "b": (d,)}},
    }
    shapes = {"wte": (model.vocab, d), "wpe": (model.n_ctx, d), "ln_f": norm()}
  elif model.family == "llama":
    kv = model.n_kv_heads * head
    layer = lambda: {
        "attn_norm": (d,), "wq": (d, d), "wk": (d, kv), "wv": (d, kv), "wo": (d, d),
        "mlp_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d),
    }
    shapes = {"embed": (model.vocab, d), "final_norm": (d,), "head": (d, model.vocab)}
  else:
    raise ValueError(f"Decoder.family must be 'gpt2' or 'llama'; got {model.family!r}.")
  shapes["layers"] = {f"{i:02d}": layer() for i in range(model.n_layer)}
  return jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes, is_leaf=lambda s: isinstance(s, tuple)
  )


@functools.partial(jax.jit, static_argnums=0)
def init_params(model: Decoder | Model, key: jax.Array) -> dict[str, Any]:
  """Params drawn from N(0, 0.02^2) (GPT-2's init), one key per leaf; one compiled program."""
  shapes = param_shapes(model)
  keys = iter(jax.random.split(key, len(jax.tree.leaves(shapes))))
  return jax.tree.map(lambda s: 0.02 * jax.random.normal(next(keys), s.shape, s.dtype), shapes)


def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """``x @ w`` on bf16 operands, accumulated and returned in f32."""
  return jnp.einsum("...i,io->...o", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                    preferred_element_type=jnp.float32)


def _layer_norm(x, g, b, eps=1e-5):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * g + b


def _rms_norm(x, g, eps=1e-6):
  return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps) * g


def _rotary(x: jax.Array) -> jax.Array:
  """Rotary position embedding (Su et al., 2021) of ``x``: (batch, time, heads, head_dim)."""
  half = x.shape[-1] // 2
  freq = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freq
  cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _attention(q, k, v):
  """Causal attention of (batch, time, heads, head_dim) queries over grouped keys and values."""
  groups = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                      preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
  t = q.shape[1]
  logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e30)
  probs = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                    preferred_element_type=jnp.float32)


def _heads(x, n):
  return x.reshape(*x.shape[:-1], n, x.shape[-1] // n)


def _gpt2_logits(model: Decoder, params, tokens):
  t = tokens.shape[1]
  x = params["wte"][tokens] + params["wpe"][:t]
  for layer in params["layers"].values():
    h = _layer_norm(x, layer["ln_1"]["g"], layer["ln_1"]["b"])
    qkv = _matmul(h, layer["attn"]["c_attn"]["w"]) + layer["attn"]["c_attn"]["b"]
    q, k, v = (_heads(y, model.n_heads) for y in jnp.split(qkv, 3, axis=-1))
    a = _attention(q, k, v).reshape(h.shape)
    x = x + _matmul(a, layer["attn"]["c_proj"]["w"]) + layer["attn"]["c_proj"]["b"]
    h = _layer_norm(x, layer["ln_2"]["g"], layer["ln_2"]["b"])
    h = jax.nn.gelu(_matmul(h, layer["mlp"]["c_fc"]["w"]) + layer["mlp"]["c_fc"]["b"])
    x = x + _matmul(h, layer["mlp"]["c_proj"]["w"]) + layer["mlp"]["c_proj"]["b"]
  x = _layer_norm(x, params["ln_f"]["g"], params["ln_f"]["b"])
  return _matmul(x, params["wte"].T)


def _llama_logits(model: Decoder, params, tokens):
  x = params["embed"][tokens]
  for layer in params["layers"].values():
    h = _rms_norm(x, layer["attn_norm"])
    q = _rotary(_heads(_matmul(h, layer["wq"]), model.n_heads))
    k = _rotary(_heads(_matmul(h, layer["wk"]), model.n_kv_heads))
    v = _heads(_matmul(h, layer["wv"]), model.n_kv_heads)
    x = x + _matmul(_attention(q, k, v).reshape(h.shape), layer["wo"])
    h = _rms_norm(x, layer["mlp_norm"])
    x = x + _matmul(jax.nn.silu(_matmul(h, layer["w_gate"])) * _matmul(h, layer["w_up"]),
                    layer["w_down"])
  return _matmul(_rms_norm(x, params["final_norm"]), params["head"])


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """Mean cross-entropy, in f32, of ``tokens[:, 1:]`` under ``logits`` of ``tokens[:, :-1]``."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1).mean()


def loss(model: Decoder | Model, params, tokens: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy of ``tokens`` (batch, time + 1) under ``params``."""
  if isinstance(model, Model):
    return model.loss(params, tokens)
  logits_of = _gpt2_logits if model.family == "gpt2" else _llama_logits
  return next_token_loss(logits_of(model, params, tokens[:, :-1]), tokens)


def _in_form(tx: optax.GradientTransformation, form: str) -> optax.GradientTransformation:
  from pallasopt import optim

  if form == "clip":
    return optax.chain(optax.clip_by_global_norm(1.0), tx)
  if form == "clipped":
    return optim.clipped(tx, 1.0)
  if form == "accumulate":
    return optax.MultiSteps(tx, every_k_schedule=4).gradient_transformation()
  if form in ("multi-steps", "multi-steps-fused"):
    return optim.multi_steps(tx, every_k_schedule=4)
  if form in ("multi-steps-clipped", "multi-steps-clipped-fused"):
    return optim.multi_steps(optim.clipped(tx, 1.0), every_k_schedule=4)
  if form in ("update", "fused", "clip-fused"):
    return tx
  raise ValueError(f"form must be one of {', '.join(FORMS)}; got {form!r}.")


def train_step(
    model: Decoder | Model, tx: optax.GradientTransformation, form: str = "update"
) -> tuple[Callable, optax.GradientTransformation]:
  """One train step ``(params, opt_state, tokens) -> (params, opt_state, loss)``.

  Args:
    model: the decoder.
    tx: the optimizer, as the user builds it.
    form: how the step applies it (`FORMS`): the transform the step runs is
      returned beside the step (``tx`` wrapped in the clip chain or
      ``optax.MultiSteps`` for those forms), to build the state with.
  """
  from pallasopt import optim

  tx = _in_form(tx, form)

  def step(params, opt_state, tokens):
    value, grads = jax.value_and_grad(functools.partial(loss, model))(params, tokens)
    if form in ("fused", "clip-fused", "multi-steps-fused", "multi-steps-clipped-fused"):
      clip = 1.0 if form == "clip-fused" else None
      params, opt_state = optim.apply_gradients(tx, params, grads, opt_state, max_grad_norm=clip)
    else:
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
    return params, opt_state, value

  return step, tx


def peak_bytes(compiled) -> int:
  """Peak device memory of a compiled step: arguments + outputs - aliased + temporaries."""
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)


def compiler_peak_bytes(compiled) -> int | None:
  """The peak the target's compiler reports for a compiled step, or None where it reports none.

  ``memory_analysis().peak_memory_in_bytes``: XLA's peak over the step's
  schedule of the buffers live at once (arguments, outputs and temporaries),
  where `peak_bytes` counts every temporary as live at the peak. For a GPU
  target the two agreed to the MiB on the whole steps measured; for a TPU target
  libtpu's ``temp_size_in_bytes`` can exceed the temporary allocation of the
  module's own buffer assignment (``xla_dump_to``), and the two differ
  (docs/guides/whole_step.md, "Peak memory, two ways").
  """
  peak = getattr(compiled.memory_analysis(), "peak_memory_in_bytes", None)
  return peak or None


class Measured(NamedTuple):
  """What `measure` reads in one compiled train step.

  Attributes:
    traffic: `compile_check.traffic` of the compiled step.
    peak: its `peak_bytes`.
    compiler_peak: its `compiler_peak_bytes` (None where the compiler reports none).
  """

  traffic: Traffic
  peak: int
  compiler_peak: int | None


def measure(
    model: Decoder | Model,
    tx: optax.GradientTransformation,
    target: str,
    form: str = "update",
    batch: tuple[int, int] = (4, 512),
) -> Measured:
  """Compiles one train step for a `pallasopt.compile_check` target from this host.

  Params and optimizer state are donated, as a training loop does.
  """
  from pallasopt import compile_check

  step, tx = train_step(model, tx, form)
  params = param_shapes(model)
  state = jax.eval_shape(tx.init, params)
  tokens = jax.ShapeDtypeStruct((batch[0], batch[1] + 1), jnp.int32)
  compiled = compile_check.compile_for(step, target, params, state, tokens, donate_argnums=(0, 1))
  return Measured(compile_check.traffic(compiled), peak_bytes(compiled),
                  compiler_peak_bytes(compiled))
