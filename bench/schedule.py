"""``python -m bench.schedule``: the compute side of a step's time, read from its compiled code.

Bytes are a floor, not a time (DESIGN.md §11). A TPU core issues one VLIW
bundle per cycle and its pipelines overlap DMA with compute, so a step takes
about ``max(cycles / clock, HBM bytes / bandwidth)``. libtpu writes the final
bundles of every program it compiles (``LIBTPU_INIT_ARGS="--xla_jf_dump_to=DIR
--xla_jf_dump_llo_text=true"``, files ``*-final_bundles.txt``); a program's
cycles are its bundles, each counted once per trip of the loops around it
(a bundle's loop depth is its count of ``>`` marks, a loop's trips the bound
of its ``loop exit test``).

For each case (one 4096 x 4096 f32 leaf, the fused step ``apply_gradients``
or the ``update`` form, donated) this compiles the step for a compile-only
target from this host (`pallasopt.compile_check`, the ``aot`` extra), reads
the bundles of every program in it, and prints per 1024 elements (one f32
vreg) the cycles, the HBM bytes the compiled step moves (by the same 1024),
the predicted time of each side and of the step, and the step's predicted
time against Optax's step of the same optimizer (update and
``apply_updates``, f32 state) compiled the same way. Every figure is
*predicted*: no TPU ran it. ``--json PATH`` writes the rows with the
compilers' versions and the commit (`bench/results/compiled/schedule-*.json`).

The constants (`CLOCKS`): the bandwidths are the datasheets' (v5e 819 GB/s,
v6e 1638 GB/s, `pallasopt.chips`); a clock is the datasheet's peak bf16
flops over the MXUs' multiply-adds a cycle (v5e: four 128 x 128 MXUs, 1.5 GHz;
v6e: four 256 x 256, 1.75 GHz).

A GPU (``--target h100``): XLA's dump of the compiled step holds each
kernel's PTX and its launch (grid, threads); ptxas (the ``aot`` extra's) makes
the cubin and nvdisasm (the ``nvidia-cuda-nvdisasm`` wheel, also in ``aot``)
its SASS. The elementwise kernels are straight-line, so a thread runs each
instruction once: the step issues ``SASS x programs x warps per program``
warp instructions, at `ISSUE_RATES`'s rate (fitted on the H100 records,
recalibrated whenever a GPU is lent), against its HBM bytes at the copy
ceiling.

Each case compiles in a process of its own: libtpu reads its flags once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence

__all__ = [
    "CLOCKS", "ISSUE_RATES", "OPTIMIZERS", "CASES", "OPTAX", "SHAPE", "program_cycles", "measure",
    "main",
]

# target: (clock in Hz, HBM bytes per second, where the clock comes from).
CLOCKS = {
    "v5e": (1.5e9, 819e9, "197 TFLOP/s / (4 MXUs x 128 x 128 x 2 flops), datasheet peak"),
    "v6e": (1.75e9, 1638e9, "918 TFLOP/s / (4 MXUs x 256 x 256 x 2 flops), datasheet peak; "
            "Google gives Trillium 256 x 256 MXUs and 4.7x v5e's peak (4x from the MXUs, "
            "1.17x from the clock); the MXU count is inferred from those"),
}
# target: (warp instructions per second, HBM bytes per second, where they come from).
ISSUE_RATES = {
    "h100": (6.6e11, 3.0e12, "fitted on the int8 AdamW time of the H100 records "
             "(bench/results/nvidia-h100-80gb-hbm3, jax 0.11.2): 63% of 132 SMs x 4 schedulers x "
             "1.98 GHz; 3.0 TB/s is the copy ceiling Optax's AdamW reached there (97%); the model "
             "reproduced the six measured fused AdamW times within -10%..+7% (DESIGN.md "
             "section 11)"),
}
# The leaf every case steps: 16.8M elements, 16384 f32 vregs.
SHAPE = (4096, 4096)
# The optimizers, each against Optax's with the same arguments.
OPTIMIZERS = ("adamw", "lion")
# label: (optimizer, state_format, fused).
CASES = {
    f"{name} {form} {fmt or 'f32'}": (name, fmt, form == "fused")
    for name in OPTIMIZERS
    for form in ("fused", "update")
    for fmt in (None, "int8", "fp8", "int4")
}
# Optax's step of each optimizer (update + apply_updates, f32 state): the baselines.
OPTAX = {name: f"optax {name} f32" for name in OPTIMIZERS}

_BUNDLE = re.compile(r"^\s*(?:0x[0-9a-f]+|\d+)\s*:\s*(>*)\s*\{")
_LOOP_EXIT = re.compile(r"scmp\.\w+\.s32\.totalorder %s\w+, (\d+) /\* loop exit test \*/")


def program_cycles(text: str) -> int:
  """The cycles of one program's final bundles: each bundle once per trip of its loops.

  A bundle at depth ``d`` (its count of ``>`` marks) runs inside ``d``
  loops; the loop around it at depth ``k`` is the one whose exit test at
  depth ``k`` is nearest to it in the program (the scheduler places an exit
  test anywhere in its loop's body, and may place a bundle of an outer depth
  inside an inner loop's span), and its trips are that test's bound.
  """
  depths, exits = [], {}
  for line in text.splitlines():
    bundle = _BUNDLE.match(line)
    if bundle:
      test = _LOOP_EXIT.search(line)
      if test:
        exits.setdefault(len(bundle.group(1)), []).append((len(depths), int(test.group(1))))
      depths.append(len(bundle.group(1)))
  cycles = 0
  for i, depth in enumerate(depths):
    runs = 1
    for k in range(1, depth + 1):
      if k in exits:
        runs *= min(exits[k], key=lambda exit: abs(exit[0] - i))[1]
    cycles += runs
  return cycles


def _optimizer_of(label: str) -> str:
  """The optimizer a case (or a baseline of `OPTAX`) steps."""
  baselines = {baseline: name for name, baseline in OPTAX.items()}
  return baselines[label] if label in baselines else CASES[label][0]


def _step(label: str):
  """The step of a case (or a baseline) and its abstract (params, grads, state)."""
  import jax
  import jax.numpy as jnp
  import optax

  import pallasopt

  params = {"w": jax.ShapeDtypeStruct(SHAPE, jnp.float32)}
  hyper = {"adamw": (1e-3, 0.1), "lion": (1e-4, 0.1)}
  name = _optimizer_of(label)
  if label == OPTAX[name]:
    tx, fused = getattr(optax, name)(hyper[name][0], weight_decay=hyper[name][1]), False
  else:
    _, fmt, fused = CASES[label]
    tx = getattr(pallasopt.optim, name)(hyper[name][0], weight_decay=hyper[name][1],
                                        impl="pallas", state_format=fmt)

  def update_and_apply(p, g, s):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  step = tx.apply_gradients if fused else update_and_apply
  return step, (params, params, jax.eval_shape(tx.init, params))


def _predicted(compute_s: float, memory_s: float) -> dict:
  """The model's time: the longer of the compute and the bytes, and which one it is."""
  return dict(compute_s=compute_s, memory_s=memory_s, predicted_s=max(compute_s, memory_s),
              bound="compute" if compute_s > memory_s else "memory")


def _compile(label: str, target: str) -> None:
  """Compiles one case for ``target`` and prints the HBM bytes the compiled step moves."""
  from pallasopt import compile_check

  step, args = _step(label)
  compiled = compile_check.compile_for(lambda *a: step(*a), target, *args, donate_argnums=(0, 2))
  print(json.dumps({"hbm_bytes": compile_check.traffic(compiled).hbm_bytes}))


_THUNK = re.compile(r"kCustomKernel .*?\] (\w+) grid: \[(\d+), (\d+), (\d+)\] threads: "
                    r"\[(\d+), (\d+), (\d+)\]")
_SASS = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?!NOP\b)\S", re.M)


def _nvidia_tool(name: str) -> str:
  """The path of a CUDA tool from the ``aot`` extra's NVIDIA wheels."""
  import nvidia

  for root in nvidia.__path__:
    found = sorted(pathlib.Path(root).glob(f"*/bin/{name}"))
    if found:
      return str(found[-1])
  raise RuntimeError(f"{name} is not installed: pip install -e \".[aot]\"")


def _sass_count(ptx: pathlib.Path, arch: str) -> int:
  """The instructions (NOPs left out) of the SASS ptxas makes of one PTX file."""
  with tempfile.TemporaryDirectory() as scratch:
    cubin = pathlib.Path(scratch) / "kernel.cubin"
    subprocess.run([_nvidia_tool("ptxas"), f"-arch={arch}", str(ptx), "-o", str(cubin)],
                   check=True, capture_output=True)
    sass = subprocess.run([_nvidia_tool("nvdisasm"), "-c", str(cubin)], check=True,
                          capture_output=True, text=True).stdout
  return len(_SASS.findall(sass))


def _measure_gpu(label: str, target: str) -> dict:
  """One case compiled for a GPU ``target`` with XLA's dump: its row."""
  import jax

  from pallasopt import compile_check

  step, args = _step(label)
  lowered = jax.jit(lambda *a: step(*a), donate_argnums=(0, 2)).lower(
      *(compile_check.on_device(a, target) for a in args))
  with tempfile.TemporaryDirectory() as dump:
    compiled = lowered.compile(compiler_options=compile_check.ptx_dump_options(dump))
    launches = {}
    for sequence in pathlib.Path(dump).glob("*thunk_sequence.txt"):
      for name, *dims in _THUNK.findall(sequence.read_text()):
        launches[name] = (math.prod(map(int, dims[:3])), math.prod(map(int, dims[3:])))
    kernels = {}
    for ptx in pathlib.Path(dump).glob("*.ptx"):
      text = ptx.read_text()
      entries = re.findall(r"^\.(?:visible\s+)?\.entry\s+(\w+)", text, re.M)
      arch = re.search(r"^\.target\s+(sm_\w+)", text, re.M)
      if len(entries) == 1 and entries[0] in launches and arch:
        programs, threads = launches[entries[0]]
        kernels[entries[0]] = _sass_count(ptx, arch.group(1)) * threads * programs
  rate, bandwidth, _ = ISSUE_RATES[target]
  elements = math.prod(SHAPE)
  hbm = compile_check.traffic(compiled).hbm_bytes
  thread_instructions = sum(kernels.values())
  memory_s = hbm / bandwidth
  return dict(
      case=label, optimizer=_optimizer_of(label),
      sass_per_element=thread_instructions / elements, hbm_bytes_per_element=hbm / elements,
      budget_sass_per_element=memory_s * rate * 32 / elements,
      **_predicted(thread_instructions / 32 / rate, memory_s),
      kernels={k: v / elements for k, v in kernels.items() if v / elements >= 0.05},
  )


def measure(label: str, target: str) -> dict:
  """One case compiled for ``target``: its row.

  On a GPU in this process; on a TPU in a process of its own, its bundles
  dumped.

  A process of its own: libtpu reads its dump flags once, when it starts,
  and writes some programs' bundles after the compile returns.
  """
  if target in ISSUE_RATES:
    return _measure_gpu(label, target)
  with tempfile.TemporaryDirectory(prefix="pallasopt-bundles-") as dump:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "LIBTPU_INIT_ARGS": " ".join(filter(None, [
        os.environ.get("LIBTPU_INIT_ARGS"), f"--xla_jf_dump_to={dump}",
        "--xla_jf_dump_llo_text=true"]))}
    code = f"from bench.schedule import _compile; _compile({label!r}, {target!r})"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=pathlib.Path(__file__).resolve().parent.parent)
    if done.returncode:
      raise RuntimeError(f"compiling {label!r} for {target} failed:\n{done.stderr[-4000:]}")
    hbm = json.loads(done.stdout.strip().splitlines()[-1])["hbm_bytes"]
    programs = {
        path.name.split("-", 1)[1].rsplit("-final_bundles", 1)[0]: program_cycles(path.read_text())
        for path in pathlib.Path(dump).glob("*-final_bundles.txt")
        if "schedule-analysis" not in path.name
    }
  clock, bandwidth, _ = CLOCKS[target]
  vregs = math.prod(SHAPE) / 1024
  cycles = sum(programs.values())
  memory_s = hbm / bandwidth
  return dict(
      case=label, optimizer=_optimizer_of(label), cycles_per_1024=cycles / vregs,
      hbm_bytes_per_1024=hbm / vregs, budget_cycles_per_1024=memory_s * clock / vregs,
      **_predicted(cycles / clock, memory_s),
      programs={k: v / vregs for k, v in programs.items() if v / vregs >= 0.05},
  )


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m bench.schedule", description=__doc__)
  parser.add_argument("--target", choices=[*CLOCKS, *ISSUE_RATES], default="v5e")
  parser.add_argument("--case", choices=list(CASES), action="append",
                      help="a case to measure (default: all); Optax's step of its optimizer "
                      "always runs")
  parser.add_argument("--json", help="write the rows, with the compilers and the commit, here")
  args = parser.parse_args(argv)
  os.environ["JAX_PLATFORMS"] = "cpu"
  from pallasopt import compile_check

  why = compile_check.missing(args.target)
  if why is not None:
    sys.exit(f"cannot compile for {args.target}: {why}")
  labels = args.case or list(CASES)
  names = [name for name in OPTIMIZERS if any(CASES[label][0] == name for label in labels)]
  baselines = {name: measure(OPTAX[name], args.target) for name in names}
  rows = list(baselines.values()) + [measure(label, args.target) for label in labels]
  for row in rows:
    row["predicted_vs_optax"] = row["predicted_s"] / baselines[row["optimizer"]]["predicted_s"]
  gpu = args.target in ISSUE_RATES
  if gpu:
    rate, bandwidth, source = ISSUE_RATES[args.target]
    constants = {"warp_instructions_per_s": rate, "hbm_bytes_per_s": bandwidth}
    unit = "SASS"
    columns = ("sass_per_element", "budget_sass_per_element", "hbm_bytes_per_element")
    print(f"{args.target}: predicted from the compiled SASS (no GPU ran this); "
          f"{rate:.2g} warp instructions/s, {bandwidth / 1e12:.1f} TB/s; per element of {SHAPE}")
  else:
    clock, bandwidth, source = CLOCKS[args.target]
    constants = {"clock_hz": clock, "hbm_bytes_per_s": bandwidth}
    unit, columns = "cycles", ("cycles_per_1024", "budget_cycles_per_1024", "hbm_bytes_per_1024")
    print(f"{args.target}: predicted from the compiled bundles (no TPU ran this); "
          f"{clock / 1e9:.2f} GHz, {bandwidth / 1e9:.0f} GB/s; per 1024 elements of {SHAPE}")
  print(f"  {'case':30s} {unit:>7s} {'budget':>7s} {'HBM B':>7s}  bound    vs Optax")
  for r in rows:
    compute, budget, hbm = (r[c] for c in columns)
    print(f"  {r['case']:30s} {compute:7.1f} {budget:7.1f} {hbm:7.1f}  {r['bound']:7s}  "
          f"{r['predicted_vs_optax']:.2f}x")
  if args.json:
    from bench.compiled import _provenance

    with open(args.json, "w") as f:
      json.dump({"target": args.target, **constants, "constants_source": source,
                 "shape": list(SHAPE), **_provenance(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
