"""How the harness times one configuration, and the ceilings it compares with.

How a configuration is measured
===============================

1. ``jax.jit(step, donate_argnums=0).lower(...)`` and ``.compile()`` are timed
   separately from the run; the compiled step's ``memory_analysis()`` gives
   its argument/output/alias/temp bytes and so its footprint (what in-place
   aliasing saves shows in the alias and temp columns), and
   ``cost_analysis()`` XLA's own bytes-accessed and flop counts.
2. ``R`` independent input sets rotate (``R`` grows until they cover
   `Settings.rotate_bytes`), so small sizes are not served from cache.
3. GPU: CUPTI kernel timing (`jax.experimental.mosaic.gpu.profiler`'s
   engine): each sample is the summed device time of the kernels of one call
   of the compiled step. This is the primary number when it works.
4. Everywhere: wall clock, with ``block_until_ready``. A step slower than
   `Settings.loop_below_s` is timed one call per sample (rotating the sets).
   A tiny step would be dominated by dispatch, so each sample runs ``n``
   iterations of a jitted ``lax.fori_loop`` that steps each of the ``R`` sets
   once, divided by ``n * R``; ``n`` is calibrated so a sample lasts at least
   `Settings.sample_s`. An ``optimization_barrier`` ties the consts to the
   loop carry so XLA cannot hoist grad-only math out of the loop.
5. Statistics over the samples: median, min, max, mean, std and spread
   ((max - min) / median). After warm-up, at least 3 and at most
   `Settings.iters` samples, stopping early past `Settings.max_time_s`.

In the same run the harness measures the *ceilings* the "% ceiling" column
divides by: for bandwidth rows a copy stream (an in-place ``x <- x + 1`` over a
buffer far larger than any cache, counting bytes read + written), for compute
rows a dense square matmul in the case's `Case.compute_dtype` (an f32 case is
never compared with a bf16 matmul, whose speed differs by a large factor, and
on a CPU, where bf16 is emulated, the other way round). It also looks up the
datasheet peaks of the device (`pallasopt.chips.DATASHEET`); those give dense bf16 matmul
only, so "% peak" of a compute row is shown for bf16 cases only.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from bench.records import Environment
from bench.workloads import random_tree
from pallasopt.kernels import quant

__all__ = ["TIERS", "Settings", "StepFn", "measure", "ceiling"]

TIERS = ("ci", "quick", "full")
StepFn = Callable[[Any, Any], Any]


# ---------------------------------------------------------------------------
# Settings.


@dataclasses.dataclass(frozen=True)
class Settings:
  """How hard to measure.

  Attributes:
    tier: ``"ci"``, ``"quick"`` or ``"full"`` (which cases, and the defaults).
    warmup: warm-up calls before timing.
    iters: timed samples (at most).
    sample_s: the shortest wall-clock sample; tiny steps loop until it.
    loop_below_s: steps faster than this are timed in a jitted loop (their
      dispatch would dominate single calls); slower ones one call per sample.
    max_time_s: stop sampling a configuration after this long (>= 3 samples).
    rotate_bytes: rotate input sets until they cover this many bytes.
    max_rotations: at most this many input sets...
    max_rotated_leaves: ...and at most this many leaves across them.
    kernel_impls: the ``impl=`` values the pallasopt rows are run with.
    timing: ``"auto"`` (CUPTI where it works, plus wall clock) or ``"wall"``.
    profile_dir: write a `jax.profiler` trace per configuration here.
    profile_steps: steps run inside each trace.
  """

  tier: str = "quick"
  warmup: int = 2
  iters: int = 20
  sample_s: float = 2e-3
  loop_below_s: float = 1e-3
  max_time_s: float = 3.0
  rotate_bytes: int = 256 << 20
  max_rotations: int = 16
  max_rotated_leaves: int = 1024
  kernel_impls: tuple[str, ...] = ("auto",)
  timing: str = "auto"
  profile_dir: str | None = None
  profile_steps: int = 3

  @staticmethod
  def for_tier(tier: str, platform: str, **overrides) -> Settings:
    if tier not in TIERS:
      raise ValueError(f"tier must be one of {TIERS}; got {tier!r}.")
    base: dict[str, Any] = dict(tier=tier)
    if tier == "ci":
      base.update(warmup=1, iters=3, sample_s=5e-4, max_time_s=0.5, rotate_bytes=1 << 20, max_rotations=2)
    elif tier == "quick":
      base.update(warmup=2, iters=10, max_time_s=1.0)
    else:
      base.update(warmup=3, iters=30, max_time_s=5.0)
    if platform == "cpu" and tier != "ci":
      # Past the last-level cache of a typical host; CPU steps are slow anyway.
      base.update(rotate_bytes=64 << 20, sample_s=5e-3)
    if platform == "cpu" and tier == "quick":
      # `python -m bench` on a CPU: a few samples per configuration suffice
      # to read fusion and bytes moved; keep the whole run well under a minute.
      base.update(warmup=1, iters=7, max_time_s=0.25, rotate_bytes=32 << 20, max_rotations=8)
    base.update({k: v for k, v in overrides.items() if v is not None})
    return Settings(**base)


# ---------------------------------------------------------------------------
# Timing.


def _tree_bytes(tree: Any) -> int:
  return sum(quant.stored_bytes(math.prod(x.shape), x.dtype) for x in jax.tree.leaves(tree))


def _rotations(set_bytes: int, leaves: int, s: Settings) -> int:
  by_bytes = max(1, math.ceil(s.rotate_bytes / max(1, set_bytes)))
  by_leaves = max(1, s.max_rotated_leaves // max(1, leaves))
  return max(1, min(by_bytes, s.max_rotations, by_leaves))


def _stats(samples_ms: Sequence[float]) -> dict:
  med = statistics.median(samples_ms)
  return {
      "median_ms": med,
      "min_ms": min(samples_ms),
      "max_ms": max(samples_ms),
      "mean_ms": statistics.fmean(samples_ms),
      "std_ms": statistics.pstdev(samples_ms),
      "spread": (max(samples_ms) - min(samples_ms)) / med if med > 0 else None,
      "samples": len(samples_ms),
  }


def _loop_runner(step: StepFn):
  """jit: ``n`` iterations, each stepping every one of the ``R`` input sets."""

  def run(carries, consts, n):
    def body(_, carries):
      out = []
      for c, k in zip(carries, consts):
        # Tie the consts to the loop carry: otherwise XLA may hoist math that
        # reads only the consts (e.g. g * g) out of the loop.
        c, k = jax.lax.optimization_barrier((c, k))
        out.append(step(c, k))
      return tuple(out)

    return jax.lax.fori_loop(0, n, body, tuple(carries))

  return jax.jit(run, donate_argnums=0)


def _more(samples: list, start: float, s: Settings) -> bool:
  """Whether to take another sample: up to `iters`, at least 3, within time."""
  if len(samples) >= s.iters:
    return False
  return len(samples) < 3 or time.perf_counter() - start < s.max_time_s


def _time_wall(compiled, step: StepFn, carries: list, consts: list, s: Settings) -> tuple[dict, list]:
  """Wall-clock samples: single calls, or a `_loop_runner` for tiny steps."""
  rotations, first = len(carries), []
  for i in range(max(3, s.warmup)):
    r = i % rotations
    t0 = time.perf_counter()
    carries[r] = jax.block_until_ready(compiled(carries[r], consts[r]))
    first.append(time.perf_counter() - t0)
  samples, start = [], time.perf_counter()
  if min(first) >= s.loop_below_s:
    while _more(samples, start, s):
      r = len(samples) % rotations
      t0 = time.perf_counter()
      carries[r] = jax.block_until_ready(compiled(carries[r], consts[r]))
      samples.append((time.perf_counter() - t0) * 1e3)
    return {**_stats(samples), "timing": "wall", "steps_per_sample": 1}, carries

  runner = _loop_runner(step)
  carries = list(jax.block_until_ready(runner(tuple(carries), tuple(consts), 1)))
  t0 = time.perf_counter()
  carries = list(jax.block_until_ready(runner(tuple(carries), tuple(consts), 1)))
  one = time.perf_counter() - t0
  n = int(min(100_000, max(1, math.ceil(s.sample_s / max(one, 1e-9)))))
  start = time.perf_counter()
  while _more(samples, start, s):
    t0 = time.perf_counter()
    carries = list(jax.block_until_ready(runner(tuple(carries), tuple(consts), n)))
    samples.append((time.perf_counter() - t0) * 1e3 / (n * rotations))
  return {**_stats(samples), "timing": "wall-loop", "steps_per_sample": n * rotations}, carries


class _Cupti:
  """The CUPTI kernel-activity engine of `jax.experimental.mosaic.gpu.profiler`.

  `profiler.measure` replays its arguments, which donation forbids, so this
  uses the same engine (``_cupti_init`` / ``_cupti_get_timings``) around calls
  that rotate donated input sets. Private API: every use is guarded, and any
  failure falls back to wall clock with the reason recorded.
  """

  def __init__(self):
    from pallasopt.kernels import _compat  # noqa: PLC0415

    self._ext = _compat.mosaic_gpu_extension()
    if not (hasattr(self._ext, "_cupti_init") and hasattr(self._ext, "_cupti_get_timings")):
      raise RuntimeError("this jaxlib's mosaic_gpu extension has no CUPTI timer")

  def _get(self):
    try:
      return self._ext._cupti_get_timings(True)
    except TypeError:  # older signature: no `finalize` argument
      return self._ext._cupti_get_timings()

  def time(self, compiled, carries: list, consts: list, s: Settings) -> tuple[dict, list]:
    for _ in range(max(1, s.warmup)):
      for r in range(len(carries)):
        carries[r] = compiled(carries[r], consts[r])
    jax.block_until_ready(carries)
    samples_ms: list[float] = []
    start = time.perf_counter()
    while _more(samples_ms, start, s):
      batch = min(len(carries), s.iters - len(samples_ms))
      self._ext._cupti_init()
      try:
        for r in range(batch):
          carries[r] = compiled(carries[r], consts[r])
        jax.block_until_ready(carries)
      finally:
        timings = self._get()
      if not timings or len(timings) % batch:
        raise RuntimeError(f"CUPTI saw {len(timings or [])} kernels for {batch} calls")
      per_call = len(timings) // batch
      for i in range(batch):
        samples_ms.append(sum(t for _, t in timings[i * per_call:(i + 1) * per_call]))
    return {**_stats(samples_ms), "kernels_per_step": per_call}, carries


def _make_sets(inputs: Callable, rotations: int, seed: int) -> tuple[list, list]:
  gen = jax.jit(inputs)
  carries, consts = [], []
  for r in range(rotations):
    c, k = gen(jax.random.key(seed * 1000 + r))
    carries.append(c)
    consts.append(k)
  return carries, consts


def _memory(compiled) -> dict | None:
  try:
    m = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 - not every backend implements it
    return None
  if m is None:
    return None
  fields = ("argument", "output", "alias", "temp")
  out = {f: int(getattr(m, f"{f}_size_in_bytes", 0) or 0) for f in fields}
  out["footprint"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  peak = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
  if peak:
    out["peak"] = peak
  return out


def _xla_cost(compiled) -> dict[str, float | None]:
  """XLA's own count of the compiled step's bytes accessed and flops."""
  try:
    cost = compiled.cost_analysis()
  except Exception:  # noqa: BLE001
    cost = None
  if isinstance(cost, list):
    cost = cost[0] if cost else None
  cost = cost or {}
  return {"xla_bytes_accessed": cost.get("bytes accessed"), "xla_flops": cost.get("flops")}


def _all_finite(tree: Any) -> bool:
  return all(
      bool(jnp.all(jnp.isfinite(x)))
      for x in jax.tree.leaves(tree)
      if jnp.issubdtype(x.dtype, jnp.inexact)
  )


def measure(
    name: str, step: StepFn, inputs: Callable, *, leaves: int, s: Settings, env: Environment,
    seed: int = 0, profile_key: str | None = None,
) -> dict:
  """Compiles and times one step; returns the timing part of a record."""

  def scoped(carry, consts):
    with jax.named_scope(name):
      return step(carry, consts)

  carry_spec, const_spec = jax.eval_shape(jax.jit(inputs), jax.random.key(0))
  set_bytes = _tree_bytes((carry_spec, const_spec))
  t0 = time.perf_counter()
  lowered = jax.jit(scoped, donate_argnums=0).lower(carry_spec, const_spec)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  out: dict[str, Any] = {
      "lower_s": t1 - t0,
      "compile_s": t2 - t1,
      "memory": _memory(compiled),
      **_xla_cost(compiled),
  }
  rotations = _rotations(set_bytes, leaves, s)
  carries, consts = _make_sets(inputs, rotations, seed)
  out["rotations"] = rotations
  out["set_bytes"] = set_bytes

  timing_note = None
  if s.timing == "auto" and env.platform == "gpu":
    try:
      device, carries = _Cupti().time(compiled, carries, consts, s)
      out.update(timing="cupti", **device)
    except Exception as e:  # noqa: BLE001 - fall back, and say why
      timing_note = f"CUPTI unavailable, wall clock used: {type(e).__name__}: {e}"
      del carries, consts  # some may have been donated already: draw afresh
      carries, consts = _make_sets(inputs, rotations, seed)
  wall, carries = _time_wall(compiled, scoped, carries, consts, s)
  if out.get("timing") == "cupti":
    out.update(wall_timing=wall["timing"], wall_median_ms=wall["median_ms"])
  else:
    out.update(wall, wall_timing=wall["timing"], wall_median_ms=wall["median_ms"])
  out["timing_note"] = timing_note
  out["finite"] = _all_finite(carries[0])

  if s.profile_dir and profile_key:
    folder = pathlib.Path(s.profile_dir) / re.sub(r"[^A-Za-z0-9._-]+", "_", profile_key)
    jax.profiler.start_trace(str(folder), create_perfetto_trace=True)
    try:
      for i in range(s.profile_steps):
        with jax.profiler.TraceAnnotation(f"{profile_key} step {i}"):
          carries[0] = jax.block_until_ready(compiled(carries[0], consts[0]))
    finally:
      jax.profiler.stop_trace()
    out["profile"] = str(folder)
  del carries, consts
  return out


# Ceilings measured in this process, by (name, device kind, tier, timing):
# every `run` of one process (e.g. several scripts or resumed sweeps) shares them.
_CEILINGS: dict[tuple, dict] = {}


def _ceiling(name: str, measure: Callable[[], dict], env: Environment, s: Settings) -> dict:
  key = (name, env.device_kind, s.tier, s.timing)
  if key not in _CEILINGS:
    _CEILINGS[key] = {"name": name, **measure()}
  return _CEILINGS[key]


def _ceiling_copy(env: Environment, s: Settings) -> dict:
  """Measured read+write bandwidth: an in-place ``x <- x + 1`` stream (best sample)."""
  mib = {"ci": 4, "quick": 64, "full": 64}[s.tier] if env.platform == "cpu" else 1024
  n = (mib << 20) // 4
  spec = jax.ShapeDtypeStruct((n,), jnp.float32)

  def inputs(key):
    return random_tree(key, spec), ()

  bench = dataclasses.replace(s, rotate_bytes=0, profile_dir=None)
  t = measure("copy_ceiling", lambda x, _: x + 1.0, inputs, leaves=1, s=bench, env=env)
  moved = 2 * n * 4
  return {"bytes": moved, "min_ms": t["min_ms"], "median_ms": t["median_ms"], "timing": t["timing"],
          "gbps": moved / (t["min_ms"] * 1e-3) / 1e9}


def _ceiling_matmul(env: Environment, s: Settings, dtype: str) -> dict:
  """Measured dense ``dtype`` matmul rate (f32 accumulation, default precision;
  best sample: a ceiling, not a typical time)."""
  d = 512 if env.platform == "cpu" else 8192
  spec = jax.ShapeDtypeStruct((d, d), jnp.dtype(dtype))

  def inputs(key):
    draw = lambda stream: random_tree(key, spec, stream=stream)
    return draw(0), (draw(1), draw(2))

  def step(c, ab):
    a, b = ab
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(c.dtype)

  bench = dataclasses.replace(s, rotate_bytes=0, profile_dir=None)
  t = measure(f"matmul_ceiling_{dtype}", step, inputs, leaves=1, s=bench, env=env)
  flops = 2 * d**3
  return {"flops": flops, "min_ms": t["min_ms"], "median_ms": t["median_ms"], "timing": t["timing"],
          "dtype": dtype, "tflops": flops / (t["min_ms"] * 1e-3) / 1e12}


def ceiling(metric: str, dtype: str | None, env: Environment, s: Settings) -> dict:
  """The measured ceiling for rows of ``metric``: a copy stream, or a matmul in ``dtype``."""
  if metric != "compute":
    return _ceiling("copy", lambda: _ceiling_copy(env, s), env, s)
  return _ceiling(f"matmul-{dtype}", lambda: _ceiling_matmul(env, s, dtype), env, s)
