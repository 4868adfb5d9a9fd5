"""Compile an optimizer step for a GPU or TPU from a machine that has neither.

``python -m pallasopt.compile_check --target v5e --optimizer adamw
--kwargs '{"learning_rate": 1e-3, "state_format": "int8"}' --shapes
'wte=50257x768,w=768x2304,b=2304'`` compiles one step of the optimizer for a
compile-only device of the target with the target's own compilers (libtpu's
Mosaic for a TPU; Triton, ptxas and Mosaic GPU for an NVIDIA chip), and
prints what the compiled module does: its Pallas kernels, the HBM bytes it
moves per parameter against Optax's AdamW compiled the same way, the
relayouts and collectives XLA put around the kernels, its temporary memory,
and for each leaf shape whether a kernel or XLA updates it. With ``--model
llama-1b-2l`` (a decoder of `pallasopt.whole_step.DECODERS`) instead of
``--shapes`` it compiles a whole train step in the form ``--mode`` names and
prints its bytes and peak memory against Optax's AdamW in the same form.

It needs the ``aot`` extra (``pip install -e ".[aot]"`` from the checkout: libtpu, the
CUDA plugin and ptxas at the versions the compile tier pins) and must run
before any other JAX backend starts: it sets ``JAX_PLATFORMS=cpu`` when run
as a program (set it yourself before importing JAX to use `compile_for`).

Targets (`TARGETS`): TPU v4, v5e, v5p, v6e and tpu7x as libtpu topologies,
and the NVIDIA H100, A100 and B200 from their published device facts (the
`GpuTargetConfigProto` fields a deviceless compile needs): one chip table,
`pallasopt.chips`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from pallasopt import chips
from pallasopt.compiled_traffic import (
    COMPILED_CALLS,
    INSTRUCTION,
    Traffic,
    relayout_bytes_beyond,
    relayouts_at_least,
    traffic,
)

__all__ = [
    "TARGETS",
    "missing",
    "devices",
    "on_device",
    "compile_for",
    "compiled_kernels",
    "KernelResources",
    "compile_with_resources",
    "ptx_dump_options",
    "Traffic",
    "traffic",
    "relayouts_at_least",
    "optimizer_step",
    "measure_step",
    "gpu_target_config",
    "main",
]


# Target -> its platform and libtpu topology (TPUs) or None (GPUs: their
# device facts, `chips.CHIPS`).
TARGETS: dict[str, tuple[str, str | None]] = {
    name: (chip.platform, chip.topology) for name, chip in chips.CHIPS.items()
}


def gpu_target_config(target: str) -> str:
  """The `GpuTargetConfigProto` of an NVIDIA target, in text form."""
  chip = chips.CHIPS[target]
  f = chip.gpu
  major, minor = chip.compute_capability
  dnn = dict(zip(("major", "minor", "patch"), f.dnn_version))
  return "\n".join([
      "gpu_device_info {",
      f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
      "  threads_per_block_limit: 1024",
      "  threads_per_warp: 32",
      "  shared_memory_per_block: 49152",
      f"  shared_memory_per_block_optin: {f.shared_memory_per_block_optin}",
      f"  shared_memory_per_core: {f.shared_memory_per_core}",
      "  threads_per_core_limit: 2048",
      f"  core_count: {f.core_count}",
      f"  fpus_per_core: {f.fpus_per_core}",
      "  block_dim_limit_x: 2147483647",
      "  block_dim_limit_y: 65535",
      "  block_dim_limit_z: 65535",
      f"  memory_bandwidth: {f.memory_bandwidth}",
      f"  l2_cache_size: {f.l2_cache_size}",
      f"  clock_rate_ghz: {f.clock_rate_ghz}",
      f"  device_memory_size: {f.device_memory_size}",
      "  registers_per_core_limit: 65536",
      "  registers_per_block_limit: 65536",
      "}",
      'platform_name: "CUDA"',
      "dnn_version_info { " + " ".join(f"{k}: {v}" for k, v in dnn.items()) + " }",
      f'device_description_str: "{chip.device_kind}"',
  ]) + "\n"


def missing(target: str) -> str | None:
  """Why ``target`` cannot be compiled for in this process, or None."""
  if target not in TARGETS:
    raise ValueError(f"target must be one of {', '.join(TARGETS)}; got {target!r}.")
  if os.environ.get("JAX_PLATFORMS") != "cpu":
    return "compiling for a target needs JAX_PLATFORMS=cpu, set before JAX starts"
  try:
    if TARGETS[target][0] == "tpu":
      import libtpu  # noqa: F401
    else:
      import jax_plugins.xla_cuda12  # noqa: F401
      import nvidia.cuda_nvcc  # noqa: F401
  except ImportError as e:
    return f'needs the aot extra (from the checkout: pip install -e ".[aot]", BUILD.md): {e}'
  return None


def _put_ptxas_on_path() -> None:
  import nvidia.cuda_nvcc

  bin_dir = str(pathlib.Path(next(iter(nvidia.cuda_nvcc.__path__))) / "bin")
  if bin_dir not in os.environ["PATH"].split(os.pathsep):
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ["PATH"]


@functools.cache
def devices(target: str, chips: str | None = None):
  """The compile-only devices of ``target``'s topology (a ValueError if it cannot be had).

  ``chips`` replaces a TPU target's chip grid (``"2x4"``: a v5e of 8 chips).
  """
  why = missing(target)
  if why is not None:
    raise ValueError(f"cannot compile for {target}: {why}.")
  from jax.experimental import topologies

  platform, topology = TARGETS[target]
  if chips is not None:
    if platform != "tpu":
      raise ValueError(f"chips={chips!r}: only a TPU target's chip grid can be chosen, not {target}'s.")
    topology = f"{topology.split(':')[0]}:{chips}"
  if platform == "tpu":
    # libtpu takes a lockfile for the TPU it drives; a compile-only topology
    # drives none, so several processes may each load it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
  _put_ptxas_on_path()
  return topologies.get_topology_desc(
      target, "cuda", target_config=gpu_target_config(target), topology="1x1x1"
  ).devices


def on_device(tree: Any, target: str) -> Any:
  """``tree``'s arrays or ShapeDtypeStructs as ShapeDtypeStructs on ``target``'s first device."""
  import jax

  sharding = jax.sharding.SingleDeviceSharding(devices(target)[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def compile_for(fn: Callable, target: str, *args: Any, donate_argnums: Sequence[int] = ()):
  """``jax.jit(fn)`` compiled for ``target`` on ``args`` (pytrees of ShapeDtypeStructs)."""
  import jax

  placed = [on_device(a, target) for a in args]
  return jax.jit(fn, donate_argnums=tuple(donate_argnums)).lower(*placed).compile()


def compiled_kernels(compiled) -> dict[str, int]:
  """The Pallas kernels of each kind in a compiled module."""
  text = compiled.as_text()
  return {kind: len(pattern.findall(text)) for kind, pattern in COMPILED_CALLS.items()}


# ---- What the target's compiler gave each kernel. ----
#
# A kernel that compiles may still be slow: a Triton or Mosaic GPU program
# whose values outgrow the registers spills them to local memory, one more
# round trip per value. ptxas reports it (`ptxas -v`). XLA compiles the Triton
# kernels with the rest of the module's PTX, so the module is dumped
# (``xla_dump_to``) and ptxas, the one the ``aot`` extra pins, assembles each
# PTX file again with ``-v``; Mosaic GPU runs ptxas itself when it compiles
# its custom call and prints the report with MOSAIC_GPU_DUMP_PTXAS set. A TPU
# kernel's compiled custom call records the VMEM libtpu reserved for it.


class KernelResources(NamedTuple):
  """What the target's compiler gave one Pallas kernel of a compiled step.

  Attributes:
    name: the kernel as the compiled module names it: a TPU custom call's
      instruction (``adamw_apply.1``); a Triton kernel's PTX entry (its Pallas
      name, ``name__1`` for a second variant); ``anonymous_mosaic_gpu_kernel``.
    kind: "tpu", "triton" or "mosaic_gpu".
    registers: registers per thread (GPU); None on a TPU.
    spill_bytes: bytes spilled to local memory and loaded back, stores plus
      loads (GPU); None on a TPU.
    stack_bytes: the stack frame (GPU); None on a TPU.
    scoped_vmem_bytes: the VMEM libtpu's Mosaic reserved for the kernel's
      pipelined blocks and scratch (TPU; operands XLA already placed in VMEM
      are not in it); None on a GPU.
  """

  name: str
  kind: str
  registers: int | None = None
  spill_bytes: int | None = None
  stack_bytes: int | None = None
  scoped_vmem_bytes: int | None = None

  def __str__(self) -> str:
    if self.kind == "tpu":
      return f"{self.name} (tpu): {self.scoped_vmem_bytes:,} B scoped VMEM"
    return (f"{self.name} ({self.kind}): {self.registers} registers, "
            f"{self.spill_bytes} B spilled, {self.stack_bytes} B stack")


_PTXAS_FUNCTION = re.compile(
    r"Function properties for (\S+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
    r"(\d+) bytes spill loads\n(?:.*\n)*?ptxas info\s*: Used (\d+) registers"
)


def _ptxas_report(text: str, kind: str) -> list[KernelResources]:
  """The functions of a ``ptxas -v`` report."""
  return [
      KernelResources(name, kind, int(regs), int(stores) + int(loads), int(stack))
      for name, stack, stores, loads, regs in _PTXAS_FUNCTION.findall(text)
  ]


def ptx_dump_options(dump_dir: str) -> dict[str, str]:
  """Compiler options that make XLA dump a GPU module, each kernel's PTX included, to ``dump_dir``.

  From jax 0.12 XLA writes the PTX of its emitters (Triton's included) only
  where ``xla_dump_emitter_re`` matches them; 0.10 and 0.11 take the option
  and wrote the PTX without it.
  """
  return {"xla_dump_to": dump_dir, "xla_dump_emitter_re": ".*"}


def _triton_resources(dump_dir: str, compiled_text: str) -> list[KernelResources]:
  """``ptxas -v`` of the Triton kernels in the PTX an XLA dump holds."""
  names = set(re.findall(
      r'custom_call_target="__gpu\$xla\.gpu\.triton".*?\bname = "(\w+)"', compiled_text))
  if not names:
    return []
  ptxas = shutil.which("ptxas")
  if ptxas is None:
    raise RuntimeError("ptxas is not on PATH: compile for the target with `devices` first.")
  kernel = re.compile(r"(" + "|".join(map(re.escape, names)) + r")(__\d+)?")
  found = []
  for path in sorted(pathlib.Path(dump_dir).glob("*.ptx")):
    ptx = path.read_text()
    arch = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M)
    entries = re.findall(r"^\.(?:visible\s+)?\.entry\s+(\w+)", ptx, re.M)
    if arch is None or not any(kernel.fullmatch(e) for e in entries):
      continue
    report = subprocess.run(
        [ptxas, "-v", f"--gpu-name={arch.group(1)}", str(path), "-o", os.devnull],
        capture_output=True, text=True, check=True,
    )
    found += [r for r in _ptxas_report(report.stderr + report.stdout, "triton")
              if kernel.fullmatch(r.name)]
  return found


@contextlib.contextmanager
def _process_stdout():
  """Collects what native code writes to file descriptor 1 (``.text`` on exit)."""
  captured = types.SimpleNamespace(text="")
  sys.stdout.flush()
  saved = os.dup(1)
  with tempfile.TemporaryFile() as sink:
    os.dup2(sink.fileno(), 1)
    try:
      yield captured
    finally:
      ctypes.CDLL(None).fflush(None)
      os.dup2(saved, 1)
      os.close(saved)
      sink.seek(0)
      captured.text = sink.read().decode(errors="replace")


@contextlib.contextmanager
def _environment(name: str, value: str):
  before = os.environ.get(name)
  os.environ[name] = value
  try:
    yield
  finally:
    if before is None:
      del os.environ[name]
    else:
      os.environ[name] = before


def _tpu_resources(compiled_text: str) -> list[KernelResources]:
  found = []
  for line in compiled_text.splitlines():  # every computation: kernels under a cond too
    instruction = INSTRUCTION.match(line)
    if instruction is None or COMPILED_CALLS["tpu"].search(line) is None:
      continue
    name = instruction.group(1)
    configs = re.search(r'"used_scoped_memory_configs":\[([^\]]*)\]', line)
    vmem = sum(int(size) for space, size in re.findall(
        r'"memory_space":"(\d+)","offset":"\d+","size":"(\d+)"', configs.group(1) if configs else "")
        if space == "1")
    found.append(KernelResources(name, "tpu", scoped_vmem_bytes=vmem))
  return found


def compile_with_resources(
    fn: Callable, target: str, *args: Any, donate_argnums: Sequence[int] = ()
) -> tuple[Any, tuple[KernelResources, ...]]:
  """`compile_for`, and what the target's compiler gave each Pallas kernel (`KernelResources`).

  On a GPU, every distinct Triton and Mosaic GPU kernel of the module (XLA
  compiles identical kernels once); on a TPU, every kernel custom call.
  """
  import jax

  placed = [on_device(a, target) for a in args]
  lowered = jax.jit(fn, donate_argnums=tuple(donate_argnums)).lower(*placed)
  if TARGETS[target][0] == "tpu":
    compiled = lowered.compile()
    return compiled, tuple(_tpu_resources(compiled.as_text()))
  with tempfile.TemporaryDirectory() as dump:
    with _process_stdout() as mosaic_report, _environment("MOSAIC_GPU_DUMP_PTXAS", "1"):
      compiled = lowered.compile(compiler_options=ptx_dump_options(dump))
    triton = _triton_resources(dump, compiled.as_text())
  return compiled, tuple(triton + _ptxas_report(mosaic_report.text, "mosaic_gpu"))


# ---- The program. ----

_DTYPES = {"f32": "float32", "bf16": "bfloat16"}


def _parse_shapes(text: str, dtype: str):
  import jax
  import jax.numpy as jnp

  tree = {}
  for item in filter(None, (s.strip() for s in text.split(","))):
    name, _, dims = item.partition("=")
    if not dims or not re.fullmatch(r"\d+(x\d+)*", dims):
      raise ValueError(f"--shapes: expected name=AxBxC items; got {item!r}.")
    tree[name] = jax.ShapeDtypeStruct(tuple(int(d) for d in dims.split("x")), jnp.dtype(dtype))
  if not tree:
    raise ValueError("--shapes: no leaves given.")
  return tree


def optimizer_step(tx, fused: bool) -> Callable:
  """One step ``(params, grads, state) -> (params, state)`` of a pallasopt transform.

  ``fused``: `pallasopt.optim.apply_gradients`; else ``tx.update`` and
  ``optax.apply_updates``, as an Optax training loop writes it.
  """
  import optax

  from pallasopt import optim

  if fused:
    return functools.partial(optim.apply_gradients, tx)

  def update_then_apply(params, grads, state):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return update_then_apply


def measure_step(tx, tree: Any, target: str, fused: bool) -> Traffic:
  """`traffic` of one step of ``tx`` on params ``tree``, compiled for ``target``.

  ``fused``: ``pallasopt.optim.apply_gradients``; else ``tx.update`` and
  ``optax.apply_updates``. Params and state are donated, as a training loop does.
  """
  return traffic(_compiled_step(tx, tree, target, fused, compile_for))


def _compiled_step(tx, tree: Any, target: str, fused: bool, compile_fn: Callable):
  import jax

  state = jax.eval_shape(tx.init, tree)
  return compile_fn(optimizer_step(tx, fused), target, tree, tree, state, donate_argnums=(0, 2))


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m pallasopt.compile_check`` (module docstring); returns the exit status."""
  parser = argparse.ArgumentParser(prog="python -m pallasopt.compile_check", description=__doc__.split("\n\n")[0])
  parser.add_argument("--target", required=True, choices=list(TARGETS))
  parser.add_argument("--optimizer", default="adamw", help="a pallasopt.optim transform, e.g. adamw, lion, muon")
  parser.add_argument("--kwargs", default='{"learning_rate": 1e-3}', help="its arguments, as JSON")
  parser.add_argument("--shapes", help="the params: name=AxB items, comma-separated")
  parser.add_argument("--model", help="instead of --shapes, a whole train step of a decoder of "
                      "pallasopt.whole_step.DECODERS (e.g. gpt2-small, llama-1b-2l)")
  parser.add_argument("--dtype", default="f32", choices=list(_DTYPES))
  parser.add_argument("--mode", default="fused",
                      choices=["fused", "update", "clip", "clip-fused", "clipped", "accumulate"],
                      help="pallasopt.optim.apply_gradients, or tx.update + optax.apply_updates; "
                      "with --model also a clip_by_global_norm chain, apply_gradients with "
                      "max_grad_norm, pallasopt.optim.clipped, or optax.MultiSteps "
                      "(pallasopt.whole_step.FORMS)")
  args = parser.parse_args(argv)
  if (args.shapes is None) == (args.model is None):
    parser.error("give one of --shapes and --model")
  if args.shapes is not None and args.mode not in ("fused", "update"):
    parser.error(f"--mode {args.mode} needs --model (a whole train step)")
  why = missing(args.target)
  if why is not None:
    print(f"cannot compile for {args.target}: {why}", file=sys.stderr)
    return 2

  import optax

  from pallasopt import optim

  make = getattr(optim, args.optimizer, None)
  if not callable(make):
    print(f"--optimizer: pallasopt.optim has no transform {args.optimizer!r}", file=sys.stderr)
    return 2
  tx = make(**json.loads(args.kwargs))
  if args.model is not None:
    return _whole_step_report(tx, args)
  tree = _parse_shapes(args.shapes, _DTYPES[args.dtype])
  fused = args.mode == "fused"
  params = sum(math.prod(x.shape) for x in tree.values())
  compiled, kernels = _compiled_step(tx, tree, args.target, fused, compile_with_resources)
  ours = traffic(compiled)
  baseline = measure_step(optax.adamw(1e-3), tree, args.target, fused=False)
  print(f"{args.optimizer} {args.kwargs} on {args.target}, {args.mode} step, {params:,} params")
  print(f"  Pallas kernels: {sum(compiled_kernels(compiled).values())}")
  for kernel in kernels:
    print(f"    {kernel}")
  print(f"  HBM bytes per param: {ours.hbm_bytes / params:.2f} "
        f"(optax.adamw: {baseline.hbm_bytes / params:.2f})")
  if ours.branch_hbm_bytes:
    print(f"  and in conditional branches (e.g. a preconditioner update), when taken: "
          f"{ours.branch_hbm_bytes / params:.2f}")
  print(f"  temporary memory: {ours.temp_bytes} B (optax.adamw: {baseline.temp_bytes} B)")
  print(f"  relayouts of 1 MiB or more: {[r for r in ours.relayouts if r[1] >= 1 << 20]}")
  print(f"  collectives: {list(ours.collectives)}")
  print("  per leaf shape (a one-leaf step):")
  for shape_dtype in sorted({(x.shape, str(x.dtype)) for x in tree.values()}):
    leaf = {"x": next(x for x in tree.values() if (x.shape, str(x.dtype)) == shape_dtype)}
    count = sum(compiled_kernels(_compiled_step(tx, leaf, args.target, fused, compile_for)).values())
    what = f"{count} kernel(s)" if count else "XLA"
    print(f"    {shape_dtype[0]} {shape_dtype[1]}: {what}")
  return 0


def _whole_step_report(tx, args) -> int:
  """Prints what one whole train step of ``--model`` moves against Optax's AdamW in the same form."""
  import jax
  import optax

  from pallasopt import whole_step

  model = whole_step.DECODERS.get(args.model)
  if model is None:
    print(f"--model: one of {', '.join(whole_step.DECODERS)}; got {args.model!r}", file=sys.stderr)
    return 2
  params = sum(math.prod(x.shape) for x in jax.tree.leaves(whole_step.param_shapes(model)))
  ours, peak, compiler_peak = whole_step.measure(model, tx, args.target, args.mode)
  theirs, optax_peak, optax_compiler_peak = whole_step.measure(
      model, optax.adamw(1e-3), args.target, args.mode)
  print(f"{args.optimizer} {args.kwargs} on {args.target}: one {args.model} train step "
        f"({params:,} params, batch 4 x 512), {args.mode} form")
  print(f"  Pallas kernels: {ours.kernels}")
  print(f"  HBM bytes per param: {ours.hbm_bytes / params:.2f} (optax.adamw: "
        f"{theirs.hbm_bytes / params:.2f}, {ours.hbm_bytes / theirs.hbm_bytes:.3f}x)")
  print(f"  peak memory: {peak / 2**20:.0f} MiB (optax.adamw: {optax_peak / 2**20:.0f} MiB, "
        f"{peak / optax_peak:.3f}x)")
  if compiler_peak and optax_compiler_peak:
    print(f"  the compiler's own peak: {compiler_peak / 2**20:.0f} MiB (optax.adamw: "
          f"{optax_compiler_peak / 2**20:.0f} MiB, {compiler_peak / optax_compiler_peak:.3f}x)")
  extra = relayout_bytes_beyond(ours, theirs)
  print(f"  relayouts of 1 MiB or more beyond Optax's step: {extra / 2**20:.1f} MiB")
  return 0


if __name__ == "__main__":
  if "jax" not in sys.modules:
    os.environ["JAX_PLATFORMS"] = "cpu"
  sys.exit(main())
