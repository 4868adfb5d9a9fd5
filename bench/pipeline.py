"""``python -m bench.pipeline``: pipeline step time, measured bubble, optimizer share.

A small transformer-like stack (pre-norm causal self-attention + MLP blocks)
runs through `pallasopt.pipeline.make_train_step` on the local devices, for
several microbatch counts ``M`` at a fixed microbatch size. Per ``M`` it
reports:

* the median and minimum time of the whole train step and of forward +
  backward alone (the same pipelined loss, no optimizer); the optimizer's
  share is ``1 - fwd+bwd / step`` (minimum times, the least disturbed by
  other load on the host);
* the measured bubble: the per-iteration time ``tau`` is the slope of the
  minimum forward + backward time over ``M R`` (least squares over the ``M``
  values), and the bubble is ``1 - M R tau / T(M)``, against the schedule's
  formula ``(S - 1) / (M R + S - 1)``.

On a CPU the stages are fake devices (``--xla_force_host_platform_device_count``,
set here when absent) that share the host's cores, so the numbers only show
that the pipeline runs and scales plausibly: correctness-scale, not
performance. Records go to ``bench/results/<device-kind>/pipeline.jsonl``
with `bench.records.environment`'s provenance.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from bench import records  # noqa: E402
from pallasopt.optim.eformer import AdamWConfig, OptimizerFactory, SchedulerConfig  # noqa: E402
from pallasopt.pipeline.circular import circular_pipeline  # noqa: E402
from pallasopt.pipeline.layout import layers_to_stages  # noqa: E402
from pallasopt.pipeline.schedule import CircularSchedule  # noqa: E402
from pallasopt.pipeline.train import make_train_step  # noqa: E402


def _rms_norm(x, scale):
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6) * scale


def block(p, x):
  """One pre-norm transformer block on ``x [batch, seq, d]`` (single head)."""
  h = _rms_norm(x, p["norm1"])
  q, k, v = (h @ p[name] for name in ("wq", "wk", "wv"))
  scores = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(x.shape[-1])
  causal = jnp.tril(jnp.ones(scores.shape[-2:], bool))
  attn = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
  x = x + jnp.einsum("bqk,bkd->bqd", attn, v) @ p["wo"]
  h = _rms_norm(x, p["norm2"])
  return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]


def init_layers(key, num_layers: int, d: int):
  shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d),
            "w1": (d, 4 * d), "w2": (4 * d, d)}
  keys = jax.random.split(key, len(shapes))
  layers = {name: jax.random.normal(k, (num_layers, *s)) / np.sqrt(s[0])
            for k, (name, s) in zip(keys, shapes.items())}
  layers.update(norm1=jnp.ones((num_layers, d)), norm2=jnp.ones((num_layers, d)))
  return layers


def mse(outputs, targets):
  return jnp.mean(jnp.square(outputs - targets))


def _time_ms(fn, args, iters: int) -> tuple[float, float]:
  """(median, min) wall-clock milliseconds over `iters` calls after one warm-up."""
  jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(samples), min(samples)


@dataclasses.dataclass(frozen=True)
class Config:
  stages: int
  repeats: int
  microbatches: tuple[int, ...]
  microbatch: int
  seq: int
  hidden: int
  iters: int
  streamed_io: bool


def measure(cfg: Config) -> list[dict]:
  devices = jax.devices()
  if len(devices) < cfg.stages:
    raise SystemExit(f"--stages {cfg.stages} needs that many devices; {len(devices)} here.")
  mesh = Mesh(np.array(devices[: cfg.stages]), ("stage",))
  rows = []
  for m in cfg.microbatches:
    schedule = CircularSchedule(cfg.stages, m, cfg.repeats, streamed_io=cfg.streamed_io)
    tx, _ = OptimizerFactory.create("adamw", SchedulerConfig(learning_rate=1e-3), AdamWConfig(),
                                    clip_grad=1.0, stacked_axes=schedule.stacked_axes)
    step = make_train_step(block, mse, tx, mesh=mesh, schedule=schedule)
    key = jax.random.PRNGKey(0)
    layers = init_layers(key, schedule.num_layers, cfg.hidden)
    params = step.shard_params(layers_to_stages(layers, schedule))
    opt_state = step.init(params)
    shape = (m, cfg.microbatch, cfg.seq, cfg.hidden)
    inputs, targets = step.shard_batch(jax.random.normal(key, shape),
                                       jax.random.normal(jax.random.fold_in(key, 1), shape))
    t0 = time.perf_counter()
    compiled = step.lower(params, opt_state, inputs, targets).compile()
    compile_s = time.perf_counter() - t0

    def train(params, opt_state):
      return compiled(params, opt_state, inputs, targets)[:2]

    # Donated arguments are consumed: thread params and state through the calls.
    state = [params, opt_state]

    def run_step():
      state[:] = train(*state)
      return state

    step_ms, step_min_ms = _time_ms(run_step, (), cfg.iters)
    forward_backward = jax.jit(jax.value_and_grad(
        lambda p: mse(circular_pipeline(block, p, inputs, mesh=mesh, schedule=schedule), targets)
    ))
    fb_ms, fb_min_ms = _time_ms(forward_backward, (state[0],), cfg.iters)
    rows.append(dict(
        stages=cfg.stages, repeats=cfg.repeats, microbatches=m, microbatch=cfg.microbatch,
        seq=cfg.seq, hidden=cfg.hidden, streamed_io=cfg.streamed_io,
        iterations=schedule.num_iterations, bubble_formula=schedule.bubble_fraction,
        step_ms=step_ms, step_min_ms=step_min_ms, forward_backward_ms=fb_ms,
        forward_backward_min_ms=fb_min_ms, optimizer_share=max(0.0, 1 - fb_min_ms / step_min_ms),
        compile_s=compile_s,
    ))
  # tau: least-squares slope of forward + backward time over M R.
  work = np.array([r["microbatches"] * cfg.repeats for r in rows], float)
  times = np.array([r["forward_backward_min_ms"] for r in rows])
  tau = float(np.polyfit(work, times, 1)[0]) if len(rows) > 1 else float("nan")
  for r, w, t in zip(rows, work, times):
    r["iteration_ms"] = tau
    r["bubble_measured"] = 1 - w * tau / t
  return rows


def format_table(rows: Sequence[dict]) -> str:
  lines = [
      "| S | R | M | iterations | step ms (median / min) | fwd+bwd ms (median / min) |"
      " optimizer share | bubble measured | bubble formula |",
      "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for r in rows:
    lines.append(
        f"| {r['stages']} | {r['repeats']} | {r['microbatches']} | {r['iterations']} |"
        f" {r['step_ms']:.2f} / {r['step_min_ms']:.2f} |"
        f" {r['forward_backward_ms']:.2f} / {r['forward_backward_min_ms']:.2f} |"
        f" {r['optimizer_share']:.1%} |"
        f" {r['bubble_measured']:.1%} | {r['bubble_formula']:.1%} |"
    )
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--stages", type=int, default=min(4, jax.device_count()))
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--microbatches", default="4,8,16", help="comma-separated M values (each >= S)")
  p.add_argument("--microbatch", type=int, default=4)
  p.add_argument("--seq", type=int, default=32)
  p.add_argument("--hidden", type=int, default=64)
  p.add_argument("--iters", type=int, default=10, help="timed calls per configuration")
  p.add_argument("--streamed-io", action="store_true", help="shard inputs/outputs over stages")
  p.add_argument("--out", help="JSONL file (default bench/results/<device-kind>/pipeline.jsonl)")
  args = p.parse_args(argv)
  cfg = Config(args.stages, args.repeats, tuple(int(m) for m in args.microbatches.split(",")),
               args.microbatch, args.seq, args.hidden, args.iters, args.streamed_io)
  env = records.environment()
  print(f"device: {env.device_kind} ({env.platform}, {env.device_count} device(s)); "
        f"jax {env.versions['jax']}; commit {env.git_commit[:12]}")
  if env.platform == "cpu":
    print("CPU: the stages are fake devices sharing the host's cores; these are"
          " correctness-scale numbers, not pipeline performance.")
  rows = measure(cfg)
  print(format_table(rows))
  out = args.out or records.RESULTS_DIR / env.slug / "pipeline.jsonl"
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "a") as f:
    for r in rows:
      f.write(json.dumps({**r, "device_kind": env.device_kind, "platform": env.platform,
                          "versions": env.versions, "git_commit": env.git_commit}) + "\n")
  print(f"wrote {out}")
  return rows


if __name__ == "__main__":
  main()
