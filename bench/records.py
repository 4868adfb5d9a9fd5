"""Benchmark records: provenance, the JSONL file, the table.

Output: one JSONL record per configuration, appended and flushed as soon as
it is measured (versions, device kind, commit, timing method, all numbers),
so a long sweep can be resumed: configurations already in the file, measured
at this commit with this jax version on this device kind under this `SCHEMA`,
are reused (the run says how many and from where); others are measured anew.
A Markdown table goes to stdout and beside the JSONL as ``.md``; a plot goes
beside it as ``.png`` where matplotlib is installed (the ``bench`` extra).
Every file written is named on stderr, with the progress. On a CPU the Pallas kernels exist only as an
interpreter, which is not a kernel speed: pallasopt's rows time its XLA
reference path (``impl="auto"`` resolves to it there; the harness asks for
``"xla"`` directly, the same program), and ``--interpret`` (tests only) runs the interpreter with every
speed-derived number suppressed.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import pathlib
import platform as _platform
import re
import subprocess
from collections.abc import Iterable, Sequence

import jax
import numpy as np
import optax

from pallasopt.chips import Peaks, datasheet_peaks

__all__ = [
    "SCHEMA",
    "RESULTS_DIR",
    "Environment",
    "environment",
    "load_records",
    "append_record",
    "banner",
    "format_table",
    "ceiling_label",
    "ratio",
    "overlaps",
    "baselines",
    "attach_ratios",
    "is_current",
]

# 2: per-dtype matmul ceilings (``ceiling``/``ceiling_pct``, were ``copy_*``).
SCHEMA = 2
RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------
# Environment and provenance. The devices' datasheet peaks are
# `pallasopt.chips.DATASHEET`.


@dataclasses.dataclass(frozen=True)
class Environment:
  platform: str  # jax platform: "cpu", "gpu", "tpu"
  device_kind: str
  device_count: int
  versions: dict
  git_commit: str
  git_dirty: bool | None
  peaks: Peaks | None

  @property
  def slug(self) -> str:
    """``device_kind`` as a folder name, e.g. ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", self.device_kind.lower()).strip("-") or "unknown"


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def _git(*args: str) -> str | None:
  try:
    out = subprocess.run(
        ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
    )
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip()


def code_commit() -> tuple[str, bool | None]:
  """The commit this run measures, and whether the tree differed from it (None: unknown).

  ``$PALLASOPT_COMMIT`` wins over git: a device machine's copy of the
  checkout can carry a ``.git`` older than its files.
  """
  named = os.environ.get("PALLASOPT_COMMIT")
  if named:
    return named, None
  status = _git("status", "--porcelain", "--untracked-files=no")
  return _git("rev-parse", "HEAD") or "unknown", None if status is None else bool(status)


def environment() -> Environment:
  """Device, versions and commit of this run (`code_commit`)."""
  dev = jax.devices()[0]
  commit, dirty = code_commit()
  versions = {
      "jax": jax.__version__,
      "jaxlib": _version("jaxlib"),
      "optax": optax.__version__,
      "numpy": np.__version__,
      "pallasopt": _version("pallasopt"),
      "python": _platform.python_version(),
  }
  return Environment(
      platform=dev.platform, device_kind=dev.device_kind, device_count=jax.device_count(),
      versions=versions, git_commit=commit,
      git_dirty=dirty,
      peaks=datasheet_peaks(dev.device_kind),
  )



def load_records(path: str | os.PathLike) -> list[dict]:
  """Every record of a JSONL results file (a torn last line is ignored)."""
  path = pathlib.Path(path)
  if not path.exists():
    return []
  records = []
  for line in path.read_text().splitlines():
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return records


def latest(records: Iterable[dict]) -> list[dict]:
  """The last record of each key, in the order keys first appear (a JSONL appends updates)."""
  by_key: dict = {}
  for r in records:
    by_key[r.get("key", id(r))] = r
  return list(by_key.values())


def append_record(path: pathlib.Path, record: dict) -> None:
  """Appends one record to a JSONL results file, creating its folder."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open("a") as f:
    f.write(json.dumps(record, default=str) + "\n")
    f.flush()
    os.fsync(f.fileno())



def banner(env: Environment, kernel_impls: Sequence[str]) -> str:
  """What the numbers of this run are, in words (printed above the table)."""
  lines = [
      f"device: {env.device_kind} ({env.platform}, {env.device_count} device(s)); "
      f"jax {env.versions['jax']}, jaxlib {env.versions['jaxlib']}, optax {env.versions['optax']}; "
      f"commit {env.git_commit[:12]}{' (dirty)' if env.git_dirty else ''}",
  ]
  if env.peaks:
    lines.append(
        f"datasheet: {env.peaks.name}, {env.peaks.gbps:g} GB/s, {env.peaks.bf16_tflops:g} bf16 TFLOP/s"
    )
  else:
    lines.append("datasheet: no published peak for this device; '% peak' is left empty")
  if env.platform == "cpu":
    if "interpret" in kernel_impls:
      lines.append(
          "CPU: pallasopt rows run the Pallas INTERPRETER. That is a correctness tool, "
          "NOT a kernel speed: no speed or percentage is derived from those rows."
      )
    else:
      lines.append(
          "CPU: every row times XLA's CPU code for its path (pallasopt's XLA reference, what "
          "impl='auto' runs here; Pallas kernels are NOT timed): no speed claim for a GPU or TPU."
      )
  return "\n".join(lines)


def _fmt(x: float | None, spec: str) -> str:
  return "-" if x is None else format(x, spec)


def format_table(records: Sequence[dict]) -> str:
  """A Markdown table of records, grouped by case in record order."""
  unit = lambda r: "TFLOP/s" if r.get("metric") == "compute" else "GB/s"
  header = (
      "| case | impl | kernel | median ms | min-max ms | wall ms | speed | % peak | % ceiling "
      "| vs optax | compile s | footprint MiB |"
  )
  lines = [header, "| " + " | ".join(["---"] * (header.count("|") - 1)) + " |"]
  for r in records:
    if r.get("error"):
      lines.append(f"| {r['case']} | {r['impl']} | {r['kernel']} | ERROR: {r['error'][:80]} |" + " |" * 8)
      continue
    mem = r.get("memory") or {}
    lines.append(
        "| {case} | {impl} | {kernel} | {med} | {rng} | {wall} | {speed} | {peak} | {ceil} | {ratio} "
        "| {comp} | {mem} |".format(
            case=r["case"], impl=r["impl"], kernel=r["kernel"],
            med=_fmt(r["median_ms"], ".4g"),
            rng=f"{r['min_ms']:.4g}-{r['max_ms']:.4g}",
            wall=_fmt(r.get("wall_median_ms"), ".4g"),
            speed="-" if r.get("achieved") is None else f"{r['achieved']:.4g} {unit(r)}",
            peak=_fmt(r.get("peak_pct"), ".1f"),
            ceil=_fmt(r.get("ceiling_pct"), ".1f"),
            ratio=_ratio_cell(r),
            comp=_fmt(r.get("compile_s"), ".2f"),
            mem=_fmt(mem.get("footprint") and mem["footprint"] / 2**20, ".1f"),
        )
    )
  return "\n".join(lines + ["", _legend(records)])


def _ratio_cell(record: dict) -> str:
  if record.get("vs_baseline") is None:
    return "-"
  if record.get("same_as_baseline"):
    return "same (within noise)"
  return f"{record['vs_baseline']:.2f}x"


def _legend(records: Sequence[dict]) -> str:
  """How to read the table, with this run's timing methods and ceilings."""
  timings = sorted({r["timing"] for r in records if r.get("timing")})
  methods = {
      "cupti": "cupti = summed CUPTI kernel time of one step",
      "wall": "wall = wall clock of one blocking call",
      "wall-loop": "wall-loop = wall clock of a jitted loop of steps, per step",
  }
  users: dict[str, list[str]] = {}
  for r in records:
    if (c := r.get("ceiling")) and r.get("ceiling_pct") is not None:
      families = users.setdefault(ceiling_label(c), [])
      if f"{r['family']}/*" not in families:
        families.append(f"{r['family']}/*")
  ceilings = "; ".join(f"{label} for {', '.join(f)}" for label, f in users.items()) or "-"
  return (
      f"median/min-max ms: {'; '.join(methods[t] for t in timings) or '-'}. "
      "wall ms: median wall clock. speed: the case's floor (bytes or flops of the fused "
      "kernel's cost estimate) / median, so the rows of a case compare directly. % peak: of the "
      "datasheet (memory bandwidth for GB/s rows; dense bf16 matmul for bf16 TFLOP/s rows, left "
      "empty for other dtypes). % ceiling: of the ceiling measured in this run for the row's unit "
      "and dtype: GB/s rows against an in-place copy stream far larger than the caches, TFLOP/s "
      "rows against a dense square matmul in the case's compute dtype; "
      f"each ceiling is its best sample ({ceilings}). Either ceiling is a simple kernel, not a bound: a step can pass 100% "
      "where its working set stays in cache (small leaves and matrices on a CPU). "
      "vs optax: the jitted Optax step's median / this "
      "median, > 1 is faster (where Optax has no such optimizer, the case's named baseline); "
      "\"same\" where no difference was measured: the two min-max ranges overlap, or the "
      "medians differ by no more than the baseline moved when timed again after the case's "
      "other rows (the run-to-run noise). "
      "footprint: argument + output - aliased + temp bytes of the "
      "compiled step (memory_analysis)."
  )


def ratio(record: dict, base: dict | None) -> float | None:
  """Baseline time / this time, by the same timing method (else wall clock).

  1.0 where no difference was measured, whatever the medians say (`same`).
  """
  if base is None or record.get("error") or record.get("kernel") == "interpret":
    return None
  if same(record, base):
    return 1.0
  return _median_ratio(record, base)


def _median_ratio(record: dict, base: dict) -> float | None:
  field = "median_ms" if record.get("timing") == base.get("timing") else "wall_median_ms"
  ours, theirs = record.get(field), base.get(field)
  return theirs / ours if ours and theirs else None


def noise(base: dict) -> float:
  """The run-to-run noise of a case: how far its baseline moved when timed again.

  The harness times a case's baseline first and again after the case's other
  rows (``rerun_median_ms``); the relative difference of the two medians is
  what the machine alone changed in that time. 0 where it was timed once.
  """
  first, again = base.get("median_ms"), base.get("rerun_median_ms")
  if not first or not again:
    return 0.0
  return max(first, again) / min(first, again) - 1.0


def same(record: dict, base: dict) -> bool:
  """Whether a row measured no difference from its baseline.

  True where their min-max ranges overlap (`overlaps`) or their medians differ
  by no more than the case's run-to-run noise (`noise`).
  """
  if record is base or record.get("error"):
    return False
  if overlaps(record, base):
    return True
  drift, measured = noise(base), _median_ratio(record, base)
  return measured is not None and drift > 0 and 1 / (1 + drift) <= measured <= 1 + drift


def overlaps(record: dict, base: dict) -> bool:
  """Whether two rows timed the same way have overlapping min-max ranges."""
  if record is base or record.get("timing") != base.get("timing"):
    return False
  lo, hi = record.get("min_ms"), record.get("max_ms")
  base_lo, base_hi = base.get("min_ms"), base.get("max_ms")
  if None in (lo, hi, base_lo, base_hi):
    return False
  return lo <= base_hi and base_lo <= hi


def baselines(records: Iterable[dict]) -> dict[str, dict]:
  return {
      r["case"]: r for r in records
      if not r.get("error") and r["impl"] == r.get("baseline") and r.get("kernel") != "interpret"
  }


def attach_ratios(records: list[dict]) -> None:
  """Sets ``vs_baseline`` (see `ratio`) and ``same_as_baseline`` on every record, within its case."""
  base = baselines(records)
  for r in records:
    b = base.get(r["case"])
    r["vs_baseline"] = ratio(r, b)
    r["same_as_baseline"] = b is not None and r["vs_baseline"] is not None and same(r, b)



def is_current(record: dict, env: Environment) -> bool:
  """Whether ``record`` was measured by this code on this device (resumable)."""
  return (
      record.get("schema") == SCHEMA and record.get("device_kind") == env.device_kind
      and record.get("git_commit") == env.git_commit
      and record.get("jax") == env.versions["jax"]
  )


def ceiling_label(ceiling: dict) -> str:
  """``copy 24.1 GB/s`` or ``float32 matmul 0.12 TFLOP/s``."""
  if "gbps" in ceiling:
    return f"copy {ceiling['gbps']:.1f} GB/s"
  return f"{ceiling['dtype']} matmul {ceiling['tflops']:.3g} TFLOP/s"
