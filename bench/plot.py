"""``python -m bench.plot``: each case's speed against Optax, as a PNG.

  python -m bench.plot                                  # every JSONL of this device
  python -m bench.plot --in bench/results/nvidia-h100-80gb-hbm3/kernels-full.jsonl

One panel per optimizer family. Each bar is one timed implementation of one
case (``workload label``, e.g. ``leaf f32/1048576/state-int8``: the state
format is in the label, so a family's rows are grouped by it), its length the
ratio of the case's baseline time (jitted Optax, or the family's XLA
reference) to its own: right of the line at 1.0 is faster than Optax, left
is slower. The baseline's own rows (1.0 by definition), failed and
interpreted rows are not drawn. On a CPU the title says what the rows are:
XLA's CPU code for each path, no speed claim for a GPU or TPU.
Needs matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Sequence

from bench import records as bench_records

_FASTER, _SLOWER, _SAME = "#2a9d57", "#c8553d", "#9a9a9a"


def _size_free_label(record: dict) -> str:
  """A record's label without its size, so one series' sizes sort together."""
  size = str(record["params"])
  return "/".join(p for p in record["label"].split("/") if p != size)


def _bar_label(record: dict) -> str:
  return f"{record['workload']} {record['label']} · {record['impl']}[{record['kernel']}]"


def plot(records: Sequence[dict], out: str | pathlib.Path, title: str | None = None) -> pathlib.Path:
  """Draws `records` (see module doc) to a PNG at ``out``; returns its path."""
  import matplotlib  # noqa: PLC0415 - optional dependency, the `bench` extra

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  rows = [
      r for r in records
      if not r.get("error") and r.get("vs_baseline") is not None and r["impl"] != r.get("baseline")
  ]
  if not rows:
    raise ValueError("no timed (non-interpreted, successful) records with a baseline to plot")
  families = list(dict.fromkeys(r["family"] for r in rows))  # in sweep order
  by_family = {f: sorted((r for r in rows if r["family"] == f),
                         key=lambda r: (r["workload"], _size_free_label(r), r["params"], r["impl"]))
                for f in families}
  heights = [len(by_family[f]) for f in families]
  fig, axes = plt.subplots(
      len(families), 1, figsize=(11, 1.0 + 0.24 * sum(heights) + 0.7 * len(families)),
      squeeze=False, constrained_layout=True, gridspec_kw={"height_ratios": heights},
  )
  # A row that measured no difference from its baseline (ranges that overlap,
  # or medians within the case's run-to-run noise): drawn at 1.0, in grey.
  same = lambda r: bool(r.get("same_as_baseline"))
  largest = max(max(1.0 if same(r) else r["vs_baseline"] for r in rows), 1.0)
  for ax, family in zip(axes[:, 0], families):
    mine = by_family[family]
    ratios = [1.0 if same(r) else r["vs_baseline"] for r in mine]
    colors = [_SAME if same(r) else _FASTER if x >= 1 else _SLOWER for r, x in zip(mine, ratios)]
    ys = range(len(mine))
    ax.barh(ys, ratios, color=colors, height=0.7)
    for y, x, r in zip(ys, ratios, mine):
      ax.text(x, y, " same (within noise)" if same(r) else f" {x:.2f}x", va="center", fontsize=7)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(list(ys), [_bar_label(r) for r in mine], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.15 * largest)
    baselines = sorted({r["baseline"] for r in mine})
    ax.set_title(f"{family}: speed vs {', '.join(baselines)} (baseline time / this time)",
                 fontsize=9, loc="left")
    ax.grid(True, axis="x", alpha=0.3)
  axes[-1, 0].set_xlabel("x faster than the baseline (1.0 = same time)")
  first = rows[0]
  where = (
      "CPU: XLA's CPU code for each path, no GPU/TPU speed claim" if first.get("platform") == "cpu"
      else "timing " + "/".join(sorted({r.get("timing", "?") for r in rows}))
  )
  fig.suptitle(title or (
      f"{first['device_kind']} | jax {first.get('jax')} | commit {str(first.get('git_commit'))[:10]}"
      f" | {where}"
  ), fontsize=10)
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return out


def main(argv: Sequence[str] | None = None) -> list[pathlib.Path]:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--in", dest="inputs", nargs="*",
                 help="JSONL files (default: bench/results/<this device>/*.jsonl)")
  p.add_argument("--out", help="PNG path (default: beside each JSONL, same stem)")
  args = p.parse_args(argv)
  if args.inputs:
    paths = [pathlib.Path(x) for x in args.inputs]
  else:
    folder = bench_records.RESULTS_DIR / bench_records.environment().slug
    paths = sorted(folder.glob("*.jsonl"))
  if not paths:
    p.error("no JSONL results found; run `python -m bench` first or pass --in")

  def read(files):
    records = bench_records.latest(r for path in files for r in bench_records.load_records(path))
    bench_records.attach_ratios(records)
    return records

  written = []
  if args.out:
    written.append(plot(read(paths), args.out))
  else:
    for path in paths:
      written.append(plot(read([path]), path.with_suffix(".png")))
  for path in written:
    print(path, file=sys.stderr)
  return written


if __name__ == "__main__":
  main(sys.argv[1:])
