"""``python -m bench.plot``: achieved bandwidth (or compute) against size, as a PNG.

  python -m bench.plot                                  # every JSONL of this device
  python -m bench.plot --in bench/results/nvidia-h100-80gb-hbm3/kernels-full.jsonl

One panel per optimizer family. The y-axis is the % of the datasheet peak
when the device has one, else GB/s (TFLOP/s for compute-bound families). Each
implementation (``impl[kernel]``) has its own colour; single-leaf sweeps are
lines over the parameter count, one line style and marker per dtype series; realistic
trees are single markers at their parameter count. The grey lines are the
ceilings measured in the same run (copy stream; matmul per compute dtype).
Interpreted rows are never drawn.
Needs matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections import defaultdict
from collections.abc import Sequence

from bench import harness

_STYLES = ("-", "--", ":", "-.")
_LEAF_MARKERS = (".", "x", "+", "1")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def series(record: dict) -> str:
  """A record's label without its size: one line per dtype series."""
  size = str(record["params"])
  return "/".join(p for p in record["label"].split("/") if p != size) or "-"


def _y(record: dict, use_peak: bool) -> float | None:
  return record.get("peak_pct") if use_peak else record.get("achieved")


def plot(records: Sequence[dict], out: str | pathlib.Path, title: str | None = None) -> pathlib.Path:
  """Draws `records` (see module doc) to a PNG at ``out``; returns its path."""
  import matplotlib  # noqa: PLC0415 - optional dependency, the `bench` extra

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  rows = [r for r in records if not r.get("error") and r.get("achieved") is not None]
  if not rows:
    raise ValueError("no timed (non-interpreted, successful) records to plot")
  families = sorted({r["family"] for r in rows})
  use_peak = all(r.get("peak_pct") is not None for r in rows)
  fig, axes = plt.subplots(
      len(families), 1, figsize=(13, 4.6 * len(families)), squeeze=False, constrained_layout=True
  )
  impls = sorted({f"{r['impl']}[{r['kernel']}]" for r in rows})
  colour = {name: f"C{i % 10}" for i, name in enumerate(impls)}
  for ax, family in zip(axes[:, 0], families):
    mine = [r for r in rows if r["family"] == family]
    metric = mine[0].get("metric", "bandwidth")
    unit = "TFLOP/s" if metric == "compute" else "GB/s"
    leaf_lines: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    trees: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    for r in mine:
      name = f"{r['impl']}[{r['kernel']}]"
      target = leaf_lines if r["workload"] == "leaf" else trees
      sub = series(r) if r["workload"] == "leaf" else f"{r['workload']} {series(r)}"
      target[(name, sub)].append((r["params"], _y(r, use_peak)))
    leaf_series = sorted({s for _, s in leaf_lines})
    for (name, sub), points in sorted(leaf_lines.items()):
      xs, ys = zip(*sorted(points))
      i = leaf_series.index(sub)
      ax.plot(xs, ys, _STYLES[i % len(_STYLES)], color=colour[name],
              marker=_LEAF_MARKERS[i % len(_LEAF_MARKERS)], label=f"{name} leaf {sub}")
    tree_names = sorted({s for _, s in trees})
    for (name, sub), points in sorted(trees.items()):
      xs, ys = zip(*points)
      ax.scatter(xs, ys, color=colour[name], marker=_MARKERS[tree_names.index(sub) % len(_MARKERS)],
                 s=60, edgecolors="black", linewidths=0.5, label=f"{name} {sub}", zorder=3)
    ceilings = {c["name"]: c for r in mine if (c := r.get("ceiling"))}
    for i, ceiling in enumerate(ceilings.values()):
      value = ceiling.get("tflops" if metric == "compute" else "gbps")
      peak = (mine[0].get("datasheet") or {}).get("bf16_tflops" if metric == "compute" else "gbps")
      if use_peak and peak:
        value = 100 * value / peak
      ax.axhline(value, color="grey", linestyle=_STYLES[i % len(_STYLES)], linewidth=1,
                 label=f"measured {harness.ceiling_label(ceiling)}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("parameters")
    ax.set_ylabel(f"% of datasheet peak ({unit})" if use_peak else f"achieved {unit} (floor bytes / time)")
    if use_peak:
      ax.set_ylim(0, 105)
    else:
      ax.set_ylim(bottom=0)
    ax.set_title(f"{family}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  first = rows[0]
  timings = "/".join(sorted({r.get("timing", "?") for r in rows}))
  where = (
      "CPU: XLA paths only, not Pallas kernel speeds" if first.get("platform") == "cpu"
      else f"timing {timings}"
  )
  fig.suptitle(title or (
      f"{first['device_kind']} | jax {first.get('jax')} | commit {str(first.get('git_commit'))[:10]} | "
      f"{where}"
  ), fontsize=10)
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=120)
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
    folder = harness.RESULTS_DIR / harness.environment().slug
    paths = sorted(folder.glob("*.jsonl"))
  if not paths:
    p.error("no JSONL results found; run `python -m bench` first or pass --in")
  written = []
  if args.out:
    records = [r for path in paths for r in harness.load_records(path)]
    written.append(plot(records, args.out))
  else:
    for path in paths:
      written.append(plot(harness.load_records(path), path.with_suffix(".png")))
  for path in written:
    print(path, file=sys.stderr)
  return written


if __name__ == "__main__":
  main(sys.argv[1:])
