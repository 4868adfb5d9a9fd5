"""``python -m bench.whole_step``: what a whole train step moves, compiled for real targets.

  python -m bench.whole_step --target v5e --model gpt2-small \\
      --json bench/results/compiled/whole-step-v5e.json --plot whole-step-v5e.png

Compiles, for a compile-only TPU or GPU target from this host
(`pallasopt.compile_check`, the ``aot`` extra, ``JAX_PLATFORMS=cpu``), one
train step of a plain-JAX decoder (`pallasopt.whole_step`: loss,
``jax.value_and_grad``, the optimizer; params and state donated; batch 4 x
512, f32 params, bf16 matmuls) in each form users write it (update + apply,
fused ``apply_gradients``, a ``clip_by_global_norm`` chain, ``MultiSteps``),
for Optax's optimizer (the family's XLA reference where Optax has none) and
pallasopt's under ``impl="auto"`` with f32, int8 and int4 state, and prints per
parameter the HBM bytes the compiled module moves and its peak memory, each
against the baseline in the same form. ``--json`` writes the rows (the
compile tier asserts the issue's bounds on a subset: tests/test_aot_whole_step.py);
``--plot`` draws them. Compiles take ~30 s each for a TPU on a 2-core host.
``--model hf-<name>`` compiles that decoder's shape as Hugging Face's Flax
code builds it (`HuggingFaceDecoder`: a decoder written apart from this
project; needs ``transformers<4.50``), ``--state`` picks the state formats,
``--breakdown`` prints where each step moves more or less than the baseline's
(MiB by kind of op: matmul fusions, kernels, loop fusions, VMEM prefetches).

``--time STEPS`` instead runs the steps on this process's device and times
them (median of STEPS after a warm-up; `time_steps`): on a GPU the figures a
user sees (``bench/device.sh step``), on a CPU the XLA paths only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys

# family: (pallasopt factory kwargs, Optax's counterpart or None, state formats)
_SCHEDULE = dict(init_value=0.0, peak_value=1e-3, warmup_steps=100, decay_steps=10_000)
FAMILIES = {
    "adamw": ({"weight_decay": 0.1}, "adamw", (None, "int8", "int4")),
    "lion": ({"weight_decay": 0.1}, "lion", (None, "int8", "int4")),
    "rmsprop": ({}, "rmsprop", (None, "int8", "int4")),
    "mars": ({}, None, (None, "int8", "int4")),
    "adafactor": ({}, "adafactor", (None,)),
    "muon": ({}, "contrib.muon", (None, "int8", "int4")),
    "kron": ({}, None, (None,)),
}


@dataclasses.dataclass(frozen=True)
class HuggingFaceDecoder:
  """A `pallasopt.whole_step.Decoder`'s shape built by Hugging Face's Flax code.

  A decoder written apart from this project (``transformers``' Flax GPT-2
  and Llama, ``transformers<4.50`` with ``flax``; not a dependency of
  pallasopt): its own param layout (GPT-2's projections stored transposed,
  its own names and nesting), attention, masking and init, and its own mixed
  precision (``dtype=bfloat16``: every activation in bf16, params f32), run
  with dropout off. A `pallasopt.whole_step.Model`.
  """

  shape: object  # the pallasopt.whole_step.Decoder whose sizes it takes

  @property
  def vocab(self) -> int:
    return self.shape.vocab

  @functools.cached_property
  def _module(self):
    import jax.numpy as jnp
    import transformers

    d = self.shape
    if d.family == "gpt2":
      config = transformers.GPT2Config(
          n_embd=d.d_model, n_layer=d.n_layer, n_head=d.n_heads, n_inner=d.d_ff,
          vocab_size=d.vocab, n_positions=d.n_ctx)
      make = transformers.FlaxGPT2LMHeadModel
    else:
      config = transformers.LlamaConfig(
          hidden_size=d.d_model, num_hidden_layers=d.n_layer, num_attention_heads=d.n_heads,
          num_key_value_heads=d.n_kv_heads, intermediate_size=d.d_ff, vocab_size=d.vocab,
          tie_word_embeddings=False)
      make = transformers.FlaxLlamaForCausalLM
    return make(config, dtype=jnp.bfloat16, _do_init=False)

  def param_shapes(self):
    import jax

    return jax.eval_shape(lambda key: self._module.init_weights(key, (1, 8)), jax.random.key(0))

  def loss(self, params, tokens):
    from pallasopt import whole_step

    logits = self._module(tokens[:, :-1], params=params, train=False).logits
    return whole_step.next_token_loss(logits, tokens)


def _decoder(model: str):
  """``DECODERS[model]``, or for ``hf-<name>`` the `HuggingFaceDecoder` of that shape."""
  from pallasopt import whole_step

  if model.startswith("hf-"):
    return HuggingFaceDecoder(whole_step.DECODERS[model[3:]])
  return whole_step.DECODERS[model]


def _transforms(family: str, states=None) -> list[tuple[str, object]]:
  """``(case, transform)``: the baseline first, then pallasopt's under ``"auto"``.

  ``states``: the state formats to build pallasopt's in (``"f32"``,
  ``"int8"``, ``"int4"``; default every one the family has).
  """
  import optax

  from pallasopt import optim

  kwargs, optax_name, formats = FAMILIES[family]
  lr = optax.warmup_cosine_decay_schedule(**_SCHEDULE)
  ours = getattr(optim, family)
  if optax_name is None:
    baseline = (f"{family} xla", ours(lr, impl="xla", **kwargs))
  else:
    make = functools.reduce(getattr, optax_name.split("."), optax)
    baseline = (f"optax.{optax_name}", make(lr, **kwargs))
  cases = [baseline]
  for fmt in formats:
    if states is not None and (fmt or "f32") not in states:
      continue
    extra = {} if fmt is None else {"state_format": fmt}
    cases.append((f"auto {fmt or 'f32'}", ours(lr, **kwargs, **extra)))
  return cases


def _in_mib(bytes_by_kind: dict[str, int]) -> dict[str, float]:
  """Bytes by kind of op in MiB, to 0.1 (smaller changes left out)."""
  return {kind: mib for kind, nbytes in bytes_by_kind.items() if (mib := round(nbytes / 2**20, 1))}


def measure(
    target: str, model: str, family: str = "adamw", forms=None, states=None,
    breakdown: bool = False,
) -> list[dict]:
  """One row per form and case of ``family`` on ``model`` for ``target``.

  ``model``: a name of `pallasopt.whole_step.DECODERS`, or ``hf-<name>`` for
  that shape as Hugging Face's Flax code builds it (`HuggingFaceDecoder`);
  ``states``: as `_transforms`.

  Each row holds the HBM bytes per parameter, the peak memory
  (`whole_step.peak_bytes` and the compiler's own,
  `whole_step.compiler_peak_bytes`), the kernels, and their ratios against
  the baseline's step in the same form; the relayouts of 1 MiB or more the
  step has beyond the baseline's; and the MiB
  each kind of op moves beyond the baseline's (``mib_by_kind_beyond_baseline``:
  where a step moves more or less, e.g. the update leaving the matmul
  fusions for kernels), printed too with ``breakdown``.
  """
  import jax

  from pallasopt import compiled_traffic, whole_step

  decoder = _decoder(model)
  n = sum(math.prod(x.shape) for x in jax.tree.leaves(whole_step.param_shapes(decoder)))
  rows, optax_update = [], None
  for form in forms or whole_step.FORMS:
    baseline = None
    for case, tx in _transforms(family, states):
      if baseline is None and form == "fused" and optax_update is not None:
        measured = optax_update  # apply_gradients runs update + apply for Optax's transforms
      else:
        measured = whole_step.measure(decoder, tx, target, form)
      if baseline is None and form == "update" and FAMILIES[family][1] is not None:
        optax_update = measured
      baseline = baseline or measured
      traffic, peak, compiler_peak = measured
      rows.append(dict(
          model=model, family=family, form=form, case=case, params=n,
          baseline=measured is baseline,
          hbm_per_param=traffic.hbm_bytes / n,
          hbm_vs_baseline=traffic.hbm_bytes / baseline.traffic.hbm_bytes,
          peak_mib=peak / 2**20, peak_vs_baseline=peak / baseline.peak,
          compiler_peak_mib=compiler_peak and compiler_peak / 2**20,
          compiler_peak_vs_baseline=(compiler_peak and baseline.compiler_peak
                                     and compiler_peak / baseline.compiler_peak),
          kernels=traffic.kernels,
          extra_relayout_mib=compiled_traffic.relayout_bytes_beyond(
              traffic, baseline.traffic) / 2**20,
          mib_by_kind_beyond_baseline=_in_mib(
              compiled_traffic.bytes_by_kind_beyond(traffic, baseline.traffic)),
      ))
      print(f"{model} {family} {form:10s} {case:22s} {rows[-1]['hbm_per_param']:7.2f} B/param "
            f"({rows[-1]['hbm_vs_baseline']:.3f}x)  peak {rows[-1]['peak_mib']:6.0f} MiB "
            f"({rows[-1]['peak_vs_baseline']:.3f}x; the compiler's "
            f"{rows[-1]['compiler_peak_vs_baseline'] or float('nan'):.3f}x)  kernels {traffic.kernels:3d}  "
            f"extra relayouts {rows[-1]['extra_relayout_mib']:.1f} MiB", flush=True)
      if breakdown and not rows[-1]["baseline"]:
        for kind, mib in rows[-1]["mib_by_kind_beyond_baseline"].items():
          print(f"    {mib:+10.1f} MiB  {kind}")
  return rows


def time_steps(
    model: str, family: str = "adamw", forms=None, steps: int = 10, *,
    decoder=None, batch: tuple[int, int] = (4, 512), states=None,
) -> list[dict]:
  """Times each form and case of ``family`` on ``model`` on this process's first device.

  ``decoder``: the `pallasopt.whole_step.Decoder` or ``Model`` (default:
  ``model`` read as `measure` reads it); ``states``: as `_transforms`.
  Random params (normal, 0.02) and tokens; each step
  jitted with params and state donated, compiled and run once, then timed
  ``steps`` times end to end (``block_until_ready`` on the loss). One row
  per form and case: the median and fastest milliseconds, and the median
  against the baseline's in the same form.
  """
  import time

  import jax

  from pallasopt import whole_step

  decoder = decoder or _decoder(model)
  device = jax.devices()[0]
  tokens = jax.random.randint(jax.random.key(1), (batch[0], batch[1] + 1), 0, decoder.vocab)
  rows = []
  for form in forms or whole_step.FORMS:
    baseline = None
    for case, tx in _transforms(family, states):
      step, tx = whole_step.train_step(decoder, tx, form)
      params = whole_step.init_params(decoder, jax.random.key(0))
      state = tx.init(params)
      step = jax.jit(step, donate_argnums=(0, 1))
      params, state, loss = step(params, state, tokens)
      loss.block_until_ready()
      times = []
      for _ in range(steps):
        start = time.perf_counter()
        params, state, loss = step(params, state, tokens)
        loss.block_until_ready()
        times.append(time.perf_counter() - start)
      median = sorted(times)[len(times) // 2] * 1e3
      baseline = baseline or median
      rows.append(dict(model=model, family=family, form=form, case=case,
                       device=device.device_kind, median_ms=median, min_ms=min(times) * 1e3,
                       vs_baseline=median / baseline, loss=float(loss)))
      print(f"{family} {form:10s} {case:22s} {median:9.2f} ms ({median / baseline:.3f}x) "
            f"on {device.device_kind}", flush=True)
  return rows


def plot(rows: list[dict], out: str, title: str) -> None:
  """Bars of each case's bytes and peak memory against its baseline, one panel per model."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  models = sorted({r["model"] for r in rows})
  fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 0.32 * len(rows) + 2),
                           squeeze=False)
  for ax, model in zip(axes[0], models):
    mine = [r for r in rows if r["model"] == model and not r["baseline"]]
    labels = [f"{r['family']} {r['form']} {r['case']}" for r in mine]
    y = range(len(mine))
    ax.barh([i + 0.2 for i in y], [r["hbm_vs_baseline"] for r in mine], 0.4, label="HBM bytes")
    ax.barh([i - 0.2 for i in y], [r["peak_vs_baseline"] for r in mine], 0.4, label="peak memory")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.set_xlabel("against the baseline's whole step in the same form (<1: less)")
    ax.set_title(model)
    ax.legend(fontsize=8)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(out, dpi=110)


def main(argv=None) -> None:
  from pallasopt import whole_step

  parser = argparse.ArgumentParser(prog="python -m bench.whole_step", description=__doc__)
  parser.add_argument("--target", default="v5e")
  parser.add_argument("--model", action="append",
                      choices=[*whole_step.DECODERS, *(f"hf-{m}" for m in whole_step.DECODERS)],
                      help="hf-<name>: that decoder as Hugging Face's Flax code builds it "
                           "(transformers<4.50 and flax installed)")
  parser.add_argument("--family", choices=list(FAMILIES), action="append")
  parser.add_argument("--form", choices=list(whole_step.FORMS), action="append")
  parser.add_argument("--state", choices=["f32", "int8", "int4"], action="append",
                      help="pallasopt's state formats to measure (default: all the family has)")
  parser.add_argument("--breakdown", action="store_true",
                      help="print under each row the MiB each kind of op moves beyond the "
                           "baseline's")
  parser.add_argument("--json")
  parser.add_argument("--plot")
  parser.add_argument("--time", type=int, metavar="STEPS",
                      help="time STEPS steps of each on this device instead of compiling for --target")
  args = parser.parse_args(argv)
  from bench.compiled import _provenance
  from pallasopt import compile_check

  if args.time:
    rows = []
    for model in args.model or ["llama-1b-2l"]:
      for family in args.family or ["adamw"]:
        rows += time_steps(model, family, args.form, args.time, states=args.state)
    if args.json:
      with open(args.json, "w") as f:
        json.dump({"batch": [4, 512], **_provenance(), "measured_on": rows[0]["device"],
                   "rows": rows}, f, indent=1)
    return
  why = compile_check.missing(args.target)
  if why is not None:
    sys.exit(f"cannot compile for {args.target}: {why}")
  rows = []
  for model in args.model or ["gpt2-small", "llama-1b-2l"]:
    for family in args.family or ["adamw"]:
      rows += measure(args.target, model, family, args.form, args.state, args.breakdown)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"target": args.target, "batch": [4, 512], **_provenance(), "rows": rows},
                f, indent=1)
  if args.plot:
    plot(rows, args.plot, f"whole train step compiled for {args.target} from a CPU host")


if __name__ == "__main__":
  # Compiling for a target needs only the CPU client; timing runs on this machine's device.
  if "jax" not in sys.modules and not any(a.startswith("--time") for a in sys.argv[1:]):
    os.environ["JAX_PLATFORMS"] = "cpu"
  main()
