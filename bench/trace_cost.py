"""Trace + lower time of one optimizer step on a tree of many small leaves.

  python -m bench.trace_cost                # 2,000 leaves, every optimizer vs Optax
  python -m bench.trace_cost --leaves 200 --filter adamw

What a user pays before the first step runs, on any host: `jax.jit(update)`
traced and lowered (not compiled: XLA's CPU compiler on thousands of leaves
measures XLA, not us) on `jax.ShapeDtypeStruct` params, so nothing is
allocated. Each optimizer is timed against its reference in the same process:
Optax's, or for Kron its Optax-built AdamW (psgd_jax is not a dependency).
Records are appended to ``bench/results/<device-kind>/trace-cost.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import re
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax

import pallasopt
from bench import records as bench_records

# name -> (pallasopt transform, the reference it is rated against).
OPTIMIZERS: dict[str, tuple[Callable[[], optax.GradientTransformation], ...]] = {
    "adamw": (lambda: pallasopt.optim.adamw(1e-3), lambda: optax.adamw(1e-3)),
    "lion": (lambda: pallasopt.optim.lion(1e-4), lambda: optax.lion(1e-4)),
    "adafactor": (lambda: pallasopt.optim.adafactor(1e-3), lambda: optax.adafactor(1e-3)),
    "muon": (lambda: pallasopt.optim.muon(1e-3), lambda: optax.contrib.muon(1e-3)),
    "kron": (lambda: pallasopt.optim.kron(1e-3), lambda: optax.adamw(1e-3)),
}


def small_leaf_tree(leaves: int) -> dict[str, jax.ShapeDtypeStruct]:
  """``leaves`` small matrices of a few distinct shapes, as a model's norms and biases."""
  return {
      f"leaf{i:05d}": jax.ShapeDtypeStruct((16 + i % 7, 8 + i % 5), jnp.float32)
      for i in range(leaves)
  }


def trace_and_lower_s(tx: optax.GradientTransformation, params) -> float:
  """Seconds to trace and lower a jitted ``tx.update`` on ``params``."""
  state = jax.eval_shape(tx.init, params)
  start = time.perf_counter()
  jax.jit(lambda g, s, p: tx.update(g, s, p)).trace(params, state, params).lower()
  return time.perf_counter() - start


def run(leaves: int, names: Sequence[str], out: pathlib.Path) -> list[dict]:
  """Times every optimizer in ``names`` and its reference; appends the records."""
  env = bench_records.environment()
  params = small_leaf_tree(leaves)
  records = []
  for name in names:
    ours, reference = OPTIMIZERS[name]
    ours_s = trace_and_lower_s(ours(), params)
    reference_s = trace_and_lower_s(reference(), params)
    record = {
        "schema": "trace-cost/1", "optimizer": name, "leaves": leaves,
        "pallasopt_s": ours_s, "reference_s": reference_s, "ratio": ours_s / reference_s,
        "device_kind": env.device_kind, "platform": env.platform, **env.versions,
        "git_commit": env.git_commit, "git_dirty": env.git_dirty,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    bench_records.append_record(out, record)
    records.append(record)
    print(f"| {name} | {leaves} | {ours_s:.2f} | {reference_s:.2f} | {ours_s / reference_s:.2f}x |",
          flush=True)
  print(f"wrote {out}", file=sys.stderr)
  return records


def main(argv: Sequence[str] | None = None) -> list[dict]:
  p = argparse.ArgumentParser(prog="python -m bench.trace_cost", description=__doc__.splitlines()[0])
  p.add_argument("--leaves", type=int, default=2000, help="leaves in the tree (default 2000)")
  p.add_argument("--filter", help="regex over optimizer names")
  p.add_argument("--out", help="JSONL file (default bench/results/<device-kind>/trace-cost.jsonl)")
  args = p.parse_args(argv)
  names = [n for n in OPTIMIZERS if not args.filter or re.search(args.filter, n)]
  out = pathlib.Path(args.out or bench_records.RESULTS_DIR / bench_records.environment().slug / "trace-cost.jsonl")
  print("| optimizer | leaves | pallasopt trace+lower s | reference s | ratio |")
  print("| --- | --- | --- | --- | --- |")
  return run(args.leaves, names, out)


if __name__ == "__main__":
  main(sys.argv[1:])
