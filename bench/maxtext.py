"""``python -m bench.maxtext``: MaxText's own train step with pallasopt's AdamW, compiled for a TPU from this host.

MaxText builds its AdamW in ``maxtext.optimizers.optimizers.get_optimizer``
as ``optax.adamw(learning_rate_schedule, b1=..., b2=..., eps=...,
eps_root=..., weight_decay=..., mu_dtype=..., mask=...)``. The swap a user
makes is that one call, ``pallasopt.optim.adamw(`` with the same arguments
and a ``state_format`` (docs/guides/maxtext.md). This script makes exactly
that swap in a fresh process per case (the module's ``optax`` seen with its
``adamw`` replaced, nothing else changed) and runs MaxText's
``maxtext.trainers.pre_train.train_compile`` for a TPU topology, then reads
the compiled train step: peak memory (`pallasopt.whole_step.peak_bytes`
and the compiler's own), arguments and temporaries, HBM bytes
(`pallasopt.compiled_traffic`), the Pallas kernels, and the param leaves of
two or more dims the optimizer was given.

Needs MaxText, which the project does not depend on (a scratch environment
on Python 3.12: ``pip install "maxtext[tpu]==0.2.5"`` then ``pip install
--no-deps -e .``); ``JAX_PLATFORMS=cpu`` is set for the compiles. ``--json
PATH`` writes the cases with the versions and the commit
(bench/results/maxtext-train-compile.json).
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys
import types
from collections.abc import Sequence
from typing import Any

from bench import records

__all__ = ["MODEL", "CASES", "maxtext_argv", "adamw_kernels", "run_case", "main"]

# A Llama-shaped model MaxText's base.yml builds, small enough to compile on
# a 2-core host in minutes: 2 decoder layers, emb 2048, mlp 5632, vocab 32000,
# 8 sequences of 512 tokens over a v5e-8 in FSDP (one a chip: its flash
# attention shards the batch over every chip).
MODEL = (
    "compile_topology=v5e-8", "compile_topology_num_slices=1", "base_num_decoder_layers=2",
    "base_emb_dim=2048", "base_mlp_dim=5632", "vocab_size=32000",
    "per_device_batch_size=1", "max_target_length=512", "ici_fsdp_parallelism=8",
    "run_name=pallasopt_check",
)
# (optimizer, state_format or None for Optax's, MaxText's param_scan_axis).
CASES = tuple(
    (optimizer, state_format, scan_axis)
    for scan_axis in (1, 0)
    for optimizer, state_format in (("optax", None), ("pallasopt", None), ("pallasopt", "int8"))
)
_RESULT = "BENCH_MAXTEXT_RESULT "
# A Mosaic kernel of pallasopt's AdamW in a compiled module (MaxText's flash
# attention is a Mosaic kernel too).
_ADAMW_KERNEL = re.compile(r'op_name="[^"]*/adamw_(?:apply|updates)/pallas_call"')


_FIRST_RESULT = re.compile(r"= \(?(\w+\[[\d,]*\])")


def adamw_kernels(compiled_text: str) -> list[str]:
  """The Mosaic custom calls of pallasopt's AdamW in a compiled module's text.

  Each as its first result, e.g. ``f32[1,256,32000]``: the kernel's view of
  the leaf on one chip (`pallasopt.kernels._tiling.leaf_view`).
  """
  return [_FIRST_RESULT.search(line).group(1) for line in compiled_text.splitlines()
          if "tpu_custom_call" in line and _ADAMW_KERNEL.search(line)]


def maxtext_argv(scan_axis: int) -> list[str]:
  """``train_compile``'s argv: MaxText's base.yml, `MODEL` and ``param_scan_axis``."""
  import maxtext  # noqa: PLC0415 - this script's environment only

  base = pathlib.Path(maxtext.__file__).parent / "configs" / "base.yml"
  return ["train_compile", str(base), *MODEL, f"param_scan_axis={scan_axis}"]


def _with_adamw(optax_module: types.ModuleType, adamw) -> types.ModuleType:
  """``optax_module`` as MaxText's optimizers module sees it, with ``adamw`` replaced."""
  seen = types.ModuleType(optax_module.__name__)
  seen.__dict__.update(optax_module.__dict__)
  seen.adamw = adamw
  return seen


def run_case(optimizer: str, state_format: str | None, scan_axis: int) -> dict[str, Any]:
  """Compiles MaxText's train step for one case in this process and reads it."""
  import jax  # noqa: PLC0415
  from maxtext.optimizers import optimizers  # noqa: PLC0415
  from maxtext.trainers.pre_train import train_compile  # noqa: PLC0415

  import pallasopt  # noqa: PLC0415
  from pallasopt import compiled_traffic, whole_step  # noqa: PLC0415

  matrices: list[tuple[int, ...]] = []
  if optimizer == "pallasopt":
    extra = {} if state_format is None else {"state_format": state_format}

    def adamw(*args, **kwargs):
      tx = pallasopt.optim.adamw(*args, **kwargs, **extra)

      def init(params):
        matrices[:] = [tuple(x.shape) for x in jax.tree.leaves(params) if x.ndim >= 2]
        return tx.init(params)

      return tx._replace(init=init)

    optimizers.optax = _with_adamw(optimizers.optax, adamw)
  compiled = []
  compile_step = train_compile.jit_and_compile

  @functools.wraps(compile_step)
  def kept(*args, **kwargs):
    compiled.append(compile_step(*args, **kwargs))
    return compiled[-1]

  train_compile.jit_and_compile = kept
  train_compile.main(maxtext_argv(scan_axis))
  (step,) = compiled
  memory = step.memory_analysis()
  traffic = compiled_traffic.traffic(step)
  return {
      "optimizer": optimizer, "state_format": state_format or "float32",
      "param_scan_axis": scan_axis,
      "peak_bytes": whole_step.peak_bytes(step),
      "compiler_peak_bytes": whole_step.compiler_peak_bytes(step),
      "argument_bytes": memory.argument_size_in_bytes,
      "temp_bytes": memory.temp_size_in_bytes,
      "hbm_bytes": traffic.hbm_bytes,
      "relayout_bytes_over_1mib": sum(
          b for _, b in compiled_traffic.relayouts_at_least(traffic, 1 << 20)),
      "adamw_kernels": adamw_kernels(step.as_text()),
      "matrix_leaves": [list(s) for s in matrices] if optimizer == "pallasopt" else None,
  }


def _versions() -> dict[str, str]:
  return {dist: importlib.metadata.version(dist)
          for dist in ("maxtext", "pallasopt", "jax", "jaxlib", "libtpu", "optax")}


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", help="write the cases (with the versions and the commit) here")
  parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in a child process
  args = parser.parse_args(argv)
  if args.case:
    print(_RESULT + json.dumps(run_case(*json.loads(args.case))), flush=True)
    return
  rows = []
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  for case in CASES:
    done = subprocess.run(
        [sys.executable, "-m", "bench.maxtext", "--case", json.dumps(case)],
        env=env, capture_output=True, text=True, check=False)
    results = [line[len(_RESULT):] for line in done.stdout.splitlines()
               if line.startswith(_RESULT)]
    if done.returncode or not results:
      sys.exit(f"case {case} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows.append(json.loads(results[-1]))
    print(rows[-1], flush=True)
  if args.json:
    commit, _ = records.code_commit()
    with open(args.json, "w") as f:
      json.dump({**_versions(), "commit": commit, "compiled_on": "cpu", "target": "TPU v5e-8",
                 "maxtext_args": list(MODEL), "rows": rows}, f, indent=1)
      f.write("\n")


if __name__ == "__main__":
  main()
