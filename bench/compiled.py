"""``python -m bench.compiled``: what optimizer steps move, compiled for real targets.

Compiles, for a compile-only TPU or GPU target (`pallasopt.compile_check`,
the ``aot`` extra, ``JAX_PLATFORMS=cpu``), one step of Optax's optimizer and
of pallasopt's drop-in (``--optimizer``: AdamW under ``impl="auto"`` in each
mode and state format; Adafactor under ``"auto"`` and ``"pallas"`` in each
mode, with bf16 params and with momentum; Muon under ``"auto"`` and ``"xla"``
in each mode, against ``optax.contrib.muon``), on a 4096 x 4096 leaf and on
GPT-2 small's tree, and prints per parameter the HBM bytes the compiled module
moves and XLA's ``cost_analysis()`` bytes (`pallasopt.compile_check.Traffic`),
each against Optax's step on the same params, with the kernels, the
relayouts of 1 MiB or more and the temporary memory. The compile tier asserts
the same figures (tests/test_aot_compile.py). ``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys

# optimizer: (impls, cases): each case (label, kwargs of the pallasopt drop-in,
# params dtype, fused), measured under each impl against Optax's optimizer
# with the same kwargs but ``state_format`` (Optax keeps f32 state).
OPTIMIZERS = {
    "adamw": (("auto",), (
        ("update f32", {}, "float32", False),
        ("fused f32", {}, "float32", True),
        ("update int8", {"state_format": "int8"}, "float32", False),
        ("fused int8", {"state_format": "int8"}, "float32", True),
        ("fused bf16 params, int8", {"state_format": "int8"}, "bfloat16", True),
        ("fused int4", {"state_format": "int4"}, "float32", True),
    )),
    "adafactor": (("auto", "pallas"), (
        ("update f32", {}, "float32", False),
        ("fused f32", {}, "float32", True),
        ("fused bf16 params", {}, "bfloat16", True),
        ("fused f32, momentum", {"momentum": 0.9}, "float32", True),
    )),
    "muon": (("auto", "xla"), (
        ("update f32", {}, "float32", False),
        ("fused f32", {}, "float32", True),
    )),
}
# Optax's counterpart where it is not `optax.<name>`.
_OPTAX_NAMES = {"muon": "contrib.muon"}


def trees() -> dict:
  import jax
  import jax.numpy as jnp

  from bench import workloads

  return {
      "4096x4096": {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)},
      "gpt2-small": workloads.gpt2(**workloads.GPT2_SMALL).tree,
      # Every leaf shape of GPT-2 small, two blocks of them, for a step that
      # treats each leaf alone: about half the compile time (the embedding's
      # 50257 x 768 stays).
      "gpt2-small-2l": workloads.gpt2(**{**workloads.GPT2_SMALL, "n_layer": 2}).tree,
  }


def measure(target: str, tree, optimizer: str = "adamw", impls=None) -> list[dict]:
  """One row per impl and case of `OPTIMIZERS` (and Optax's steps) on ``tree`` for ``target``.

  Each case is measured against Optax's step with the same arguments on
  params of the same dtype (AdamW's 8-bit cases against Optax's f32 state).
  ``impls``: a subset of the optimizer's impls (default all).
  """
  import jax
  import jax.numpy as jnp
  import optax

  import pallasopt
  from pallasopt import compile_check

  run = functools.partial(compile_check.measure_step, target=target)
  all_impls, cases = OPTIMIZERS[optimizer]
  impls = all_impls if impls is None else impls
  ours = getattr(pallasopt.optim, optimizer)
  theirs = functools.reduce(getattr, _OPTAX_NAMES.get(optimizer, optimizer).split("."), optax)
  as_dtype = lambda dtype: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype)), tree)
  n = sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
  # Optax's step of each case (by its row's name: each distinct one compiled once).
  optax_steps, baselines, rows = {}, [], []
  for _, kwargs, dtype, _ in cases:
    optax_kwargs = {k: v for k, v in kwargs.items() if k != "state_format"}
    name = f"optax.{_OPTAX_NAMES.get(optimizer, optimizer)} {dtype}" + "".join(f" {k}={v}" for k, v in optax_kwargs.items())
    if name not in optax_steps:
      optax_steps[name] = t = run(theirs(1e-3, **optax_kwargs), as_dtype(dtype), fused=False)
      rows.append(dict(case=name, **_row(t, t, n)))
    baselines.append(optax_steps[name])
  for impl in impls:
    for (label, kwargs, dtype, fused), baseline in zip(cases, baselines):
      t = run(ours(1e-3, impl=impl, **kwargs), as_dtype(dtype), fused=fused)
      rows.append(dict(case=f"{impl} {label}", **_row(t, baseline, n)))
  return rows


def _row(t, optax_step, n: int) -> dict:
  return dict(
      hbm_per_param=t.hbm_bytes / n,
      hbm_vs_optax=t.hbm_bytes / optax_step.hbm_bytes,
      xla_per_param=t.xla_bytes / n,
      xla_vs_optax=t.xla_bytes / optax_step.xla_bytes,
      kernels=t.kernels,
      relayouts_1mib=[r for r in t.relayouts if r[1] >= 1 << 20],
      collectives=list(t.collectives),
      temp_bytes=t.temp_bytes,
  )


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m bench.compiled", description=__doc__)
  parser.add_argument("--target", default="v5e")
  parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw")
  parser.add_argument("--tree", choices=["4096x4096", "gpt2-small", "gpt2-small-2l"],
                      action="append")
  parser.add_argument("--json")
  args = parser.parse_args(argv)
  from pallasopt import compile_check

  why = compile_check.missing(args.target)
  if why is not None:
    sys.exit(f"cannot compile for {args.target}: {why}")
  out = {}
  for name, tree in trees().items():
    if args.tree and name not in args.tree:
      continue
    out[name] = measure(args.target, tree, args.optimizer)
    print(f"{name} on {args.target} (per parameter; ratios against Optax's step "
          "on params of the same dtype)")
    for r in out[name]:
      print(f"  {r['case']:32s} HBM {r['hbm_per_param']:6.2f} B ({r['hbm_vs_optax']:.2f}x)  "
            f"cost_analysis {r['xla_per_param']:6.2f} B ({r['xla_vs_optax']:.2f}x)  "
            f"kernels {r['kernels']:3d}  relayouts>=1MiB {len(r['relayouts_1mib'])}  "
            f"temp {r['temp_bytes'] / 2**20:.1f} MiB")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"target": args.target, "optimizer": args.optimizer, **_provenance(),
                 "trees": out}, f, indent=1)


def _provenance() -> dict:
  """The compilers and the commit the figures come from (a compile, not a run)."""
  import importlib.metadata

  import jax

  from bench import records

  versions = {}
  for dist in ("jaxlib", "libtpu", "jax-cuda12-plugin", "nvidia-cuda-nvcc-cu12"):
    try:
      versions[dist] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      pass
  return {"measured_on": "CPU host, compile-only target (no TPU ran this)",
          "jax": jax.__version__, **versions, "commit": records.code_commit()[0][:12]}


if __name__ == "__main__":
  if "jax" not in sys.modules:
    os.environ["JAX_PLATFORMS"] = "cpu"
  main()
