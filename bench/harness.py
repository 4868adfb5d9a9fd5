"""The one benchmark harness every pallasopt bench script uses.

A *case* is one optimizer step on one workload (a single leaf of some size, or
a realistic parameter tree), with several *implementations* of that same step
(jitted Optax ``update`` + ``apply_updates``, pallasopt's Optax path,
pallasopt's fused apply). The harness measures every (case, implementation,
kernel) *configuration* the same way, in one run, and reports each against
the device's limits and against Optax.

Plugging in an optimizer family
===============================

A family is one module ``bench/cases_<family>.py`` that exposes::

  FAMILY = "lion"

  def cases(tier: str) -> list[harness.Case]:
    '''tier is "ci" (tiny, CPU test suite), "quick" (small; `python -m bench`)
    or "full" (the accelerator sweep).'''

and its name in the ``FAMILIES`` tuple of ``bench/kernels.py``. Most families
need only `optimizer_case`, which builds the standard three implementations
from an Optax transform and a pallasopt factory::

  def cases(tier):
    out = []
    for w in workloads.for_tier(tier):            # shared shapes (workloads.py)
      out.append(harness.optimizer_case(
          family=FAMILY, workload=w,
          optax_tx=optax.lion(1e-4, weight_decay=0.1),
          pallasopt_tx=lambda impl: pallasopt.optim.lion(1e-4, weight_decay=0.1, impl=impl),
          bytes=fused_bytes(w.tree),              # == the kernels' pl.CostEstimate
          update_bytes=update_bytes(w.tree),      # what update + apply_updates move
      ))
    return out

For anything else build `Case` directly. The contract:

* ``Case.inputs(key) -> (carry, consts)`` builds one input set on the device
  from a PRNG key: random, non-zero data (never zeros: they hide unwritten
  outputs and can run faster than real data). It is jitted by the harness.
  `workloads.random_tree` (``stream=`` one per tree) is cheap to compile for big trees.
* ``Impl.build(kernel_impl) -> step`` returns a pure, un-jitted
  ``step(carry, consts) -> carry`` for one optimizer step. ``kernel_impl`` is
  the ``impl=`` to pass to pallasopt (``"auto"``, ``"xla"``, ``"pallas"`` or
  ``"interpret"``); implementations that run no pallasopt code ignore it and
  set ``pallas=False``. The harness jits the step with ``carry`` donated, so
  write the state that a training step would update in place (params,
  optimizer state; for a stateless kernel such as Newton-Schulz, an output
  buffer) into ``carry``, and what it only reads (grads) into ``consts``.
* ``Case.bytes`` / ``Case.flops`` model the *floor* of the step (the fused
  kernel's ``pl.CostEstimate``: every input read once, every output written
  once). Every implementation's achieved GB/s (``metric="bandwidth"``) or
  TFLOP/s (``metric="compute"``) is that floor over its time, so the rows of a
  case are directly comparable and "% of peak" is the distance from the
  roofline. ``Impl.bytes`` (optional) records what that implementation's own
  model moves (e.g. 40 B/param for AdamW ``update`` + ``apply_updates``).
* ``Case.baseline`` names the implementation the "vs optax" ratio divides by.
* ``Case.compute_dtype`` (compute cases): the dtype the step's matmuls run
  in; it picks the measured matmul ceiling the row is compared with (default:
  the dtype of the largest floating leaf of the consts, i.e. the grads).
* ``Case.key`` (``family/workload/label``) must be unique. For single leaves
  (``workload="leaf"``) put the size in the label as its own ``/`` part
  (``"f32/1048576"``): `bench.plot` orders a series' rows by it.
* Tiers: ``ci`` runs in the test suite (seconds); ``quick`` is
  ``python -m bench``, whose whole run must stay well under a minute on a
  2-core CPU, so keep it to a few small cases (a few seconds of CPU, compiles
  included) per family: model-shaped trees whose step or compile takes
  seconds on a CPU belong in quick only on an accelerator
  (``jax.default_backend() != "cpu"``); ``full`` is the accelerator sweep
  (resumable, so it may be long).

The harness runs them: `bench.timing` measures each configuration (and the
ceilings), `bench.records` keeps the records and writes the table, and
`bench.plot` draws them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import math
import os
import pathlib
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax

from bench import records as rec
from bench import timing, workloads
from bench.records import SCHEMA, environment
from bench.timing import Settings, StepFn
from pallasopt.kernels._dispatch import resolve_impl

__all__ = [
    "TIERS",
    "Impl",
    "Case",
    "compute_dtype",
    "kernel_label",
    "optax_step",
    "fused_step",
    "optimizer_case",
    "run",
    "main",
]

TIERS = timing.TIERS
Metric = Literal["bandwidth", "compute"]


# ---------------------------------------------------------------------------
# The case interface.


@dataclasses.dataclass(frozen=True)
class Impl:
  """One implementation of a case's step.

  Attributes:
    name: row label, e.g. ``"optax"``, ``"pallasopt.update"``,
      ``"pallasopt.fused"``.
    build: ``build(kernel_impl) -> step(carry, consts) -> carry`` (pure,
      un-jitted; the harness jits it with ``carry`` donated).
    pallas: whether the step runs pallasopt kernels, i.e. whether
      ``kernel_impl`` matters (it is swept over `Settings.kernel_impls`).
    bytes: HBM bytes this implementation's own model moves per step (for the
      record; speeds use the case's floor).
    inputs: this implementation's own ``inputs(key) -> (carry, consts)``
      when its carry differs from the case's (a low-bit optimizer state);
      None: `Case.inputs`.
  """

  name: str
  build: Callable[[str], StepFn]
  pallas: bool = True
  bytes: int | None = None
  inputs: Callable[[jax.Array], tuple[Any, Any]] | None = None


@dataclasses.dataclass(frozen=True)
class Case:
  """One step on one workload, with the implementations to compare.

  Attributes:
    family: optimizer family, e.g. ``"adamw"``.
    workload: ``"leaf"`` for a single array, else the tree's name.
    label: what distinguishes cases of one workload (dtypes, size).
    params: number of parameters (the x-axis of plots).
    leaves: number of leaves of the parameter tree.
    inputs: ``inputs(key) -> (carry, consts)``, one random input set.
    impls: the implementations; order is the row order.
    bytes: floor bytes of one step (the fused kernel's cost estimate).
    flops: floor flops of one step.
    metric: ``"bandwidth"`` (GB/s vs bytes) or ``"compute"`` (TFLOP/s vs flops).
    baseline: name of the implementation ratios divide by.
    compute_dtype: dtype of the step's matmuls (compute cases; picks the
      matmul ceiling). None: the largest floating leaf of the consts.
    auto_on_cuda: what the family's ``impl="auto"`` runs on a CUDA GPU,
      ``"pallas"`` (its kernel) or ``"xla"`` (`kernels._dispatch.dispatch`).
    cuda_kernel: the row label of the kernel ``impl="pallas"`` runs on a
      CUDA GPU (``"triton"``, ``"mosaic-gpu"``); None where the case has no
      CUDA kernel (its kernel rows are left out there).
  """

  family: str
  workload: str
  label: str
  params: int
  leaves: int
  inputs: Callable[[jax.Array], tuple[Any, Any]]
  impls: tuple[Impl, ...]
  bytes: int
  flops: int = 0
  metric: Metric = "bandwidth"
  baseline: str = "optax"
  compute_dtype: str | None = None
  auto_on_cuda: str = "pallas"
  cuda_kernel: str | None = "triton"

  @property
  def key(self) -> str:
    return f"{self.family}/{self.workload}/{self.label}"


def optax_step(tx: optax.GradientTransformation) -> StepFn:
  """``((params, state), grads) -> (params, state)`` via update + apply_updates."""

  def step(carry, grads):
    params, state = carry
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def fused_step(tx) -> StepFn:
  """``((params, state), grads) -> (params, state)`` via ``tx.apply_gradients``."""

  def step(carry, grads):
    params, state = carry
    return tx.apply_gradients(params, grads, state)

  return step


def xla_and_kernel_impls(make: Callable[[str], Any]) -> tuple[Impl, Impl]:
  """The rows of a family without an Optax counterpart: its XLA path
  (``make("xla")``, the baseline) and its kernels (``make(kernel_impl)``),
  each through ``apply_gradients``."""
  return (
      Impl("xla", lambda _: fused_step(make("xla")), pallas=False),
      Impl("pallasopt", lambda k: fused_step(make(k))),
  )


def optimizer_case(
    *,
    family: str,
    workload: Any,
    optax_tx: optax.GradientTransformation,
    pallasopt_tx: Callable[[str], Any],
    bytes: int,
    update_bytes: int | None = None,
    fused_bytes: int | None = None,
    flops: int = 0,
    metric: Metric = "bandwidth",
    label: str | None = None,
    compute_dtype: str | None = None,
    prepare_state: Callable[[jax.Array, Any], Any] = workloads.randomize_floats,
    auto_on_cuda: str = "pallas",
    cuda_kernel: str | None = "triton",
    baseline: str = "optax",
) -> Case:
  """The standard three-way comparison for an optimizer on a workload.

  Implementations: ``optax`` (jitted ``optax_tx.update`` + ``apply_updates``),
  ``pallasopt.update`` (the same through ``pallasopt_tx(impl)``) and
  ``pallasopt.fused`` (``pallasopt_tx(impl).apply_gradients``, in place).
  Inputs: random params and grads shaped like ``workload.tree``, and
  ``optax_tx.init(params)`` with its float leaves randomized by
  ``prepare_state`` (the drop-ins share Optax's state tree).

  Args:
    family: optimizer family name.
    workload: a `bench.workloads.Workload` (``name``, ``label``, ``tree`` of
      ShapeDtypeStructs, ``params``, ``leaves``).
    optax_tx: the Optax reference transform.
    pallasopt_tx: ``impl -> FusedGradientTransformation``.
    bytes: floor bytes per step (the fused kernels' cost estimate).
    update_bytes: bytes ``update`` + ``apply_updates`` move, for the record.
    fused_bytes: bytes the fused path moves (default: ``bytes``).
    flops: floor flops per step.
    metric: ``"bandwidth"`` or ``"compute"``.
    label: case label (default: the workload's).
    compute_dtype: see `Case.compute_dtype`.
    prepare_state: ``(key, state) -> state`` making the initial state.
    auto_on_cuda, cuda_kernel: see `Case.auto_on_cuda`, `Case.cuda_kernel`.
    baseline: the name of the ``optax_tx`` rows, ``"optax"`` unless the
      reference is not Optax's (e.g. eFormer's math in XLA).
  """
  specs = workload.tree

  def inputs(key):
    params = workloads.random_tree(key, specs, stream=0)
    grads = workloads.random_tree(key, specs, stream=1)
    state = prepare_state(key, optax_tx.init(params))
    return (params, state), grads

  impls = (
      Impl(baseline, lambda kernel_impl: optax_step(optax_tx), pallas=False, bytes=update_bytes),
      Impl("pallasopt.update", lambda k: optax_step(pallasopt_tx(k)), bytes=update_bytes),
      Impl("pallasopt.fused", lambda k: fused_step(pallasopt_tx(k)), bytes=fused_bytes or bytes),
  )
  return Case(
      family=family, workload=workload.name, label=label or workload.label,
      params=workload.params, leaves=workload.leaves, inputs=inputs, impls=impls,
      bytes=bytes, flops=flops, metric=metric, compute_dtype=compute_dtype,
      auto_on_cuda=auto_on_cuda, cuda_kernel=cuda_kernel, baseline=baseline,
  )


def kernel_label(
    kernel_impl: str, platform: str, auto_on_cuda: str = "pallas",
    cuda_kernel: str | None = "triton",
) -> str | None:
  """What runs under ``impl=kernel_impl`` here: mosaic, triton, mosaic-gpu, xla or interpret.

  ``auto_on_cuda``, ``cuda_kernel``: what the case runs on CUDA
  (`Case.auto_on_cuda`, `Case.cuda_kernel`); None: no kernel to run there.
  """
  if kernel_impl in ("xla", "interpret"):
    return kernel_impl
  if platform == "tpu":
    return "mosaic"
  if platform == "gpu" and kernel_impl == "pallas":
    return cuda_kernel
  if platform == "gpu":
    # "auto" picks the XLA reference on other GPUs (ROCm).
    version = getattr(jax.devices()[0].client, "platform_version", "")
    rocm = "rocm" in str(version).lower()
    return "xla" if rocm or auto_on_cuda == "xla" else cuda_kernel
  if kernel_impl == "pallas":
    raise ValueError(
        f"impl='pallas' cannot compile on {platform!r}; use --interpret (tests) or 'xla'."
    )
  return "xla"


def compute_dtype(case: Case) -> str:
  """The dtype of a compute case's matmuls (`Case.compute_dtype`, else the
  largest floating leaf of its consts, else of its carry)."""
  if case.compute_dtype is not None:
    return jnp.dtype(case.compute_dtype).name
  carry, consts = jax.eval_shape(case.inputs, jax.random.key(0))
  for tree in (consts, carry):
    floats = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    if floats:
      return max(floats, key=lambda x: math.prod(x.shape)).dtype.name
  raise ValueError(f"case {case.key}: no floating input; set Case.compute_dtype.")


def _case_ceiling(case: Case, env: rec.Environment, s: Settings) -> dict:
  """The measured ceiling a case's rows are compared with (`bench.timing`)."""
  dtype = compute_dtype(case) if case.metric == "compute" else None
  return timing.ceiling(case.metric, dtype, env, s)


# ---------------------------------------------------------------------------
# Records, resume and the table.


def config_key(case: Case, impl: Impl, kernel: str) -> str:
  return f"{case.key}/{impl.name}[{kernel}]"


def _speed(case: Case, median_ms: float) -> float:
  seconds = median_ms * 1e-3
  if case.metric == "compute":
    return case.flops / seconds / 1e12
  return case.bytes / seconds / 1e9


def _progress(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def run(
    cases: Sequence[Case],
    settings: Settings,
    out_path: str | os.PathLike,
    *,
    filter: str | None = None,
    resume: bool = True,
    stream=None,
) -> list[dict]:
  """Measures every selected configuration; returns its records (old and new).

  Args:
    cases: the cases to run.
    settings: see `Settings`.
    out_path: the JSONL file; records are appended and flushed one by one.
    filter: a regex searched in ``family/workload/label/impl[kernel]``.
    resume: skip configurations whose record is already in ``out_path``.
    stream: where the table goes (default stdout).
  """
  stream = stream or sys.stdout
  out_path = pathlib.Path(out_path)
  env = environment()
  kernel_impls = tuple(settings.kernel_impls)
  pattern = re.compile(filter) if filter else None

  configs, seen = [], set()
  for case in cases:
    for impl in case.impls:
      for k in kernel_impls if impl.pallas else ("xla",):
        kernel = kernel_label(resolve_impl(k), env.platform, case.auto_on_cuda, case.cuda_kernel)
        if kernel is None:
          continue
        key = config_key(case, impl, kernel)
        # Two --kernel-impls can run the same kernel ("auto" is "pallas" on
        # most GPU families); time it once.
        if key not in seen and (pattern is None or pattern.search(key)):
          seen.add(key)
          configs.append((case, impl, k, kernel, key))
  keys = {c[-1] for c in configs}
  done = {
      r["key"]: r for r in rec.load_records(out_path)
      if resume and r.get("key") in keys and not r.get("error") and rec.is_current(r, env)
  }
  todo = [c for c in configs if c[-1] not in done]
  # The banner heads stdout once (the table follows at the end), as in the .md.
  header = rec.banner(env, kernel_impls)
  print(header + "\n", file=stream, flush=True)
  _progress(
      f"{len(configs)} configuration(s) selected, {len(configs) - len(todo)} already in {out_path} "
      f"(reused: measured at commit {env.git_commit[:12]} with jax {env.versions['jax']} on "
      f"{env.device_kind}), {len(todo)} to measure"
      + (f"; {_FRESH_HINT}" if done else "")
  )

  ceilings: dict[str, dict] = {}
  for case, *_ in todo:
    if case.key not in ceilings:
      c = _case_ceiling(case, env, settings)
      if c["name"] not in {x["name"] for x in ceilings.values()}:
        _progress(f"ceiling: {rec.ceiling_label(c)} ({c['timing']})")
      ceilings[case.key] = c

  base = rec.baselines(done.values())
  timed_baseline: dict[str, Callable[..., dict]] = {}  # case -> its baseline's timing, again
  for i, (case, impl, k, kernel, key) in enumerate(todo, 1):
    record = {
        "schema": SCHEMA, "key": key, "case": case.key, "family": case.family,
        "workload": case.workload, "label": case.label, "impl": impl.name, "kernel": kernel,
        "kernel_impl": k if impl.pallas else None, "baseline": case.baseline,
        "params": case.params, "leaves": case.leaves, "metric": case.metric,
        "model_bytes": case.bytes, "model_flops": case.flops, "impl_bytes": impl.bytes,
        "tier": settings.tier, "device_kind": env.device_kind, "platform": env.platform,
        "device_count": env.device_count, "datasheet": dataclasses.asdict(env.peaks) if env.peaks else None,
        **env.versions, "git_commit": env.git_commit, "git_dirty": env.git_dirty,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
      measure = functools.partial(
          timing.measure, f"{case.family}:{impl.name}", impl.build(k),
          impl.inputs or case.inputs, leaves=case.leaves, s=settings, env=env, seed=i)
      record.update(measure(profile_key=key))
      interpreted = kernel == "interpret"
      speed = None if interpreted else _speed(case, record["median_ms"])
      ceiling = ceilings[case.key]
      compute = case.metric == "compute"
      peak = None if env.peaks is None else (
          (env.peaks.bf16_tflops if ceiling["dtype"] == "bfloat16" else None)
          if compute else env.peaks.gbps
      )
      record.update(
          achieved=speed,
          compute_dtype=ceiling.get("dtype"),
          peak_pct=None if speed is None or peak is None else 100 * speed / peak,
          ceiling=ceiling,
          ceiling_pct=None if speed is None else 100 * speed / (
              ceiling["tflops"] if compute else ceiling["gbps"]
          ),
          note="Pallas interpreter: not a kernel speed" if interpreted else None,
      )
      if impl.name == case.baseline and not interpreted:
        base[case.key] = record
        timed_baseline[case.key] = measure
      record["vs_baseline"] = rec.ratio(record, base.get(case.key))
      record["same_as_baseline"] = bool(
          base.get(case.key) is not None and rec.same(record, base[case.key]))
      _progress(
          f"[{i}/{len(todo)}] {key}: {record['median_ms']:.4g} ms ({record['timing']}, "
          f"x{record['rotations']} sets), compile {record['compile_s']:.2f} s"
      )
    except Exception as e:  # noqa: BLE001 - record the failure, keep sweeping
      record.update(error=f"{type(e).__name__}: {e}")
      _progress(f"[{i}/{len(todo)}] {key}: FAILED {record['error'][:300]}")
    rec.append_record(out_path, record)
    done[key] = record
    last_of_case = i == len(todo) or todo[i][0].key != case.key
    if last_of_case and case.key in timed_baseline and base[case.key] is not record:
      _time_baseline_again(base[case.key], timed_baseline.pop(case.key), out_path)

  records = [done[c[-1]] for c in configs if c[-1] in done]
  rec.attach_ratios(records)
  table = rec.format_table(records)
  print(table, file=stream, flush=True)
  out_path.with_suffix(".md").write_text(header + "\n\n" + table + "\n")
  reused = len(records) - len(todo)
  _progress(
      f"wrote {out_path} ({len(todo)} new record(s)"
      + (f", {reused} reused from an earlier run; {_FRESH_HINT})" if reused else ")")
  )
  _progress(f"wrote {out_path.with_suffix('.md')}")
  _progress(_write_plot(records, out_path.with_suffix(".png")))
  return records


_FRESH_HINT = "--no-resume measures them again"


def _time_baseline_again(record: dict, measure: Callable[..., dict], out_path: pathlib.Path) -> None:
  """Times a case's baseline again after its other rows: the run-to-run noise (`rec.noise`).

  A difference from the baseline within what the baseline itself moved is
  not a speed-up: the table and the plot call it "same".
  """
  try:
    again = measure()
  except Exception as e:  # noqa: BLE001 - the first timing stands; say why there is no second
    _progress(f"{record['key']}: timing it again failed ({type(e).__name__}: {e}); noise unknown")
    return
  record.update(rerun_median_ms=again["median_ms"], rerun_min_ms=again.get("min_ms"),
                rerun_max_ms=again.get("max_ms"))
  _progress(f"{record['key']} again: {again['median_ms']:.4g} ms "
            f"(run-to-run noise {100 * rec.noise(record):.1f}%)")
  rec.append_record(out_path, record)  # the JSONL's last record of a key is the one read


def _write_plot(records: Sequence[dict], path: pathlib.Path) -> str:
  """Draws ``records`` to ``path``; returns the line saying what was done."""
  from bench import plot  # noqa: PLC0415 - plot imports this module

  try:
    return f"wrote {plot.plot(records, path)}"
  except ImportError:
    return "no plot: matplotlib is not installed (pip install -e '.[bench]')"
  except ValueError as e:  # nothing timed, e.g. only interpreted rows
    return f"no plot: {e}"


# ---------------------------------------------------------------------------
# Command line.


def parser(description: str, default_tier: str, prog: str | None = None) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog=prog, description=description)
  p.add_argument("--tier", choices=TIERS, default=default_tier,
                 help=f"which sizes to run (default {default_tier})")
  p.add_argument("--quick", dest="tier", action="store_const", const="quick",
                 help="same as --tier quick")
  p.add_argument("--filter", help="regex over family/workload/label/impl[kernel]")
  p.add_argument("--out", help="JSONL file (default bench/results/<device-kind>/<script>-<tier>.jsonl)")
  p.add_argument("--no-resume", action="store_true", help="re-measure configurations already in --out")
  p.add_argument("--iters", type=int, help="timed samples per configuration")
  p.add_argument("--warmup", type=int, help="warm-up steps")
  p.add_argument("--max-time", type=float, dest="max_time_s", help="seconds of sampling per configuration")
  p.add_argument("--kernel-impls", default="auto",
                 help="comma-separated impl= values for the pallasopt rows (auto,pallas,xla); "
                 "on a CPU, auto means xla")
  p.add_argument("--interpret", action="store_true",
                 help="run the pallasopt rows in the Pallas interpreter (tests; not a speed)")
  p.add_argument("--timing", choices=("auto", "wall"), default="auto",
                 help="auto: CUPTI device time on GPU where it works, else wall clock")
  p.add_argument("--profile", dest="profile_dir",
                 help="write a jax.profiler trace (Perfetto/XProf) per configuration here")
  return p


def main(
    argv: Sequence[str] | None,
    cases_fn: Callable[[str], Iterable[Case]],
    *,
    script: str,
    description: str,
    default_tier: str,
    prog: str | None = None,
) -> list[dict]:
  """The command line every bench script shares.

  Args:
    argv: arguments (None: ``sys.argv[1:]``).
    cases_fn: ``tier -> cases``.
    script: short name, used in the default output file name.
    description: ``--help`` text.
    default_tier: tier without ``--tier``/``--quick``.
    prog: program name shown by ``--help``.
  """
  p = parser(description, default_tier, prog)
  args = p.parse_args(argv)
  env_platform = jax.devices()[0].platform
  kernel_impls = ("interpret",) if args.interpret else tuple(
      k.strip() for k in args.kernel_impls.split(",") if k.strip()
  )
  for k in kernel_impls:
    try:
      kernel_label(resolve_impl(k), env_platform)
    except ValueError as e:
      p.error(f"--kernel-impls: {e}")
  if env_platform == "cpu" and kernel_impls == ("auto",):
    # "auto" lowers to the XLA reference on a CPU; asking for it directly
    # compiles the same program without tracing the TPU and Triton branches.
    kernel_impls = ("xla",)
  settings = Settings.for_tier(
      args.tier, env_platform, iters=args.iters, warmup=args.warmup, max_time_s=args.max_time_s,
      kernel_impls=kernel_impls, timing=args.timing, profile_dir=args.profile_dir,
  )
  out = args.out or rec.RESULTS_DIR / environment().slug / f"{script}-{args.tier}.jsonl"
  return run(
      list(cases_fn(args.tier)), settings, out, filter=args.filter, resume=not args.no_resume
  )

