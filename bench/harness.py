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
  `random_tree` (``stream=`` one per tree) is cheap to compile for big trees.
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
datasheet peaks of the device (`DATASHEET`); those give dense bf16 matmul
only, so "% peak" of a compute row is shown for bf16 cases only.

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

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import pathlib
import platform as _platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pallasopt.kernels._dispatch import resolve_impl

__all__ = [
    "TIERS",
    "Impl",
    "Case",
    "Settings",
    "Peaks",
    "DATASHEET",
    "Environment",
    "StepFn",
    "datasheet_peaks",
    "compute_dtype",
    "ceiling_label",
    "environment",
    "kernel_label",
    "optax_step",
    "fused_step",
    "random_tree",
    "randomize_floats",
    "optimizer_case",
    "run",
    "load_records",
    "format_table",
    "main",
]

# 2: per-dtype matmul ceilings (``ceiling``/``ceiling_pct``, were ``copy_*``).
SCHEMA = 2
TIERS = ("ci", "quick", "full")
RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent

StepFn = Callable[[Any, Any], Any]
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


def _mix32(x: jax.Array) -> jax.Array:
  """A 32-bit integer hash (an avalanche mixer of the "lowbias32" kind)."""
  x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
  x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def random_tree(
    key: jax.Array, specs: Any, *, positive: bool = False, scale: float = 1.0, stream: int = 0
) -> Any:
  """A tree of pseudo-random arrays shaped like ``specs`` (ShapeDtypeStructs).

  Values are uniform with unit variance times ``scale`` and never zero;
  ``positive`` takes ``|x| + 1e-3`` (e.g. second moments). ``key`` and
  ``stream`` pick the sequence: use one stream per tree drawn from one key.
  Each element is a counter-based integer hash of (key, stream, element
  index): a threefry draw per leaf would make XLA compile a large RNG kernel
  per leaf, which takes seconds per tree on a CPU.
  """
  data = jax.random.key_data(key).ravel().astype(jnp.uint32)
  seed = _mix32(jnp.uint32(0x9E3779B9 * (stream + 1) & 0xFFFFFFFF))
  for word in data:
    seed = _mix32(seed ^ word)
  leaves, treedef = jax.tree.flatten(specs)
  out, offset = [], 0
  for spec in leaves:
    n = math.prod(spec.shape)
    bits = _mix32(jax.lax.iota(jnp.uint32, max(n, 1))[:n] + jnp.uint32(offset & 0xFFFFFFFF) + seed)
    # 24 random bits -> an odd multiple of 2**-24 in (-1, 1): never zero.
    u = ((bits >> 8).astype(jnp.float32) * 2.0 - (2**24 - 1)) * 2.0**-24
    x = u * (scale * 3**0.5)
    if positive:
      x = jnp.abs(x) + 1e-3
    out.append(x.reshape(spec.shape).astype(spec.dtype))
    offset += n
  return treedef.unflatten(out)


def randomize_floats(key: jax.Array, tree: Any, *, positive: bool = True, scale: float = 0.1) -> Any:
  """``tree`` with every floating leaf replaced by random data of its shape/dtype.

  Integer leaves (step counters) are kept. The default (small positive values)
  suits moment estimates; a family whose state needs other values (e.g.
  preconditioner matrices) passes its own ``prepare_state`` to `optimizer_case`.
  Uses `random_tree` stream 2 of ``key`` (streams 0 and 1 are the params and
  grads of `optimizer_case`).
  """
  leaves, treedef = jax.tree.flatten(tree)
  where = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)]
  specs = [jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype) for i in where]
  for i, x in zip(where, random_tree(key, specs, positive=positive, scale=scale, stream=2)):
    leaves[i] = x
  return treedef.unflatten(leaves)


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
    prepare_state: Callable[[jax.Array, Any], Any] = randomize_floats,
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
    params = random_tree(key, specs, stream=0)
    grads = random_tree(key, specs, stream=1)
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


# ---------------------------------------------------------------------------
# Device limits.


@dataclasses.dataclass(frozen=True)
class Peaks:
  """Datasheet peaks of one device: memory bandwidth and dense bf16 matmul."""

  name: str
  gbps: float
  bf16_tflops: float
  source: str


# Published datasheet numbers (dense bf16, no sparsity), matched against
# `jax.Device.device_kind` in order (first match wins):
# - NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): SXM 4.8 TB/s,
#   989 TFLOP/s; NVL 4.8 TB/s, 835 TFLOP/s.
# - NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): SXM 3.35 TB/s,
#   989 TFLOP/s; PCIe 2.0 TB/s, 756 TFLOP/s; NVL 3.9 TB/s, 835 TFLOP/s.
# - NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100): 312 TFLOP/s;
#   80GB SXM 2039 GB/s, 80GB PCIe 1935 GB/s, 40GB 1555 GB/s.
# - Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v4, v5e,
#   v5p, v6e): v4 1200 GB/s, 275 TFLOP/s; v5e 819 GB/s, 197 TFLOP/s;
#   v5p 2765 GB/s, 459 TFLOP/s; v6e 1638 GB/s, 918 TFLOP/s.
DATASHEET: tuple[tuple[str, Peaks], ...] = (
    (r"h200.*nvl", Peaks("NVIDIA H200 NVL", 4800, 835, "NVIDIA H200 datasheet")),
    (r"h200", Peaks("NVIDIA H200 SXM", 4800, 989, "NVIDIA H200 datasheet")),
    (r"h100.*pcie", Peaks("NVIDIA H100 PCIe", 2000, 756, "NVIDIA H100 datasheet")),
    (r"h100.*nvl", Peaks("NVIDIA H100 NVL", 3900, 835, "NVIDIA H100 datasheet")),
    (r"h100", Peaks("NVIDIA H100 SXM", 3350, 989, "NVIDIA H100 datasheet")),
    (r"a100.*80gb.*pcie|a100.*pcie.*80gb", Peaks("NVIDIA A100 80GB PCIe", 1935, 312, "NVIDIA A100 datasheet")),
    (r"a100.*80gb", Peaks("NVIDIA A100 80GB SXM", 2039, 312, "NVIDIA A100 datasheet")),
    (r"a100", Peaks("NVIDIA A100 40GB", 1555, 312, "NVIDIA A100 datasheet")),
    (r"v6 ?lite|v6e", Peaks("TPU v6e", 1638, 918, "cloud.google.com/tpu/docs/v6e")),
    (r"v5 ?lite|v5e", Peaks("TPU v5e", 819, 197, "cloud.google.com/tpu/docs/v5e")),
    (r"v5p|tpu v5$", Peaks("TPU v5p", 2765, 459, "cloud.google.com/tpu/docs/v5p")),
    (r"tpu v4", Peaks("TPU v4", 1200, 275, "cloud.google.com/tpu/docs/v4")),
)


def datasheet_peaks(device_kind: str) -> Peaks | None:
  """The datasheet peaks for a `device_kind` string, or None if unknown."""
  kind = device_kind.lower().strip()
  for pattern, peaks in DATASHEET:
    if re.search(pattern, kind):
      return peaks
  return None


# ---------------------------------------------------------------------------
# Environment and provenance.


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


def environment() -> Environment:
  """Device, versions and commit of this run (``$PALLASOPT_COMMIT`` where no git)."""
  dev = jax.devices()[0]
  commit = _git("rev-parse", "HEAD") or os.environ.get("PALLASOPT_COMMIT", "unknown")
  status = _git("status", "--porcelain", "--untracked-files=no")
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
      git_dirty=None if status is None else bool(status),
      peaks=datasheet_peaks(dev.device_kind),
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
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


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


def _measure(
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
  t = _measure("copy_ceiling", lambda x, _: x + 1.0, inputs, leaves=1, s=bench, env=env)
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
  t = _measure(f"matmul_ceiling_{dtype}", step, inputs, leaves=1, s=bench, env=env)
  flops = 2 * d**3
  return {"flops": flops, "min_ms": t["min_ms"], "median_ms": t["median_ms"], "timing": t["timing"],
          "dtype": dtype, "tflops": flops / (t["min_ms"] * 1e-3) / 1e12}


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


def _case_ceiling(case: Case, env: Environment, s: Settings) -> dict:
  """The measured ceiling a case's rows are compared with (see the module doc)."""
  if case.metric != "compute":
    return _ceiling("copy", lambda: _ceiling_copy(env, s), env, s)
  dtype = compute_dtype(case)
  return _ceiling(f"matmul-{dtype}", lambda: _ceiling_matmul(env, s, dtype), env, s)


def ceiling_label(ceiling: dict) -> str:
  """``copy 24.1 GB/s`` or ``float32 matmul 0.12 TFLOP/s``."""
  if "gbps" in ceiling:
    return f"copy {ceiling['gbps']:.1f} GB/s"
  return f"{ceiling['dtype']} matmul {ceiling['tflops']:.3g} TFLOP/s"


# ---------------------------------------------------------------------------
# Records, resume and the table.


def config_key(case: Case, impl: Impl, kernel: str) -> str:
  return f"{case.key}/{impl.name}[{kernel}]"


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


def append_record(path: pathlib.Path, record: dict) -> None:
  """Appends one record to a JSONL results file, creating its folder."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open("a") as f:
    f.write(json.dumps(record, default=str) + "\n")
    f.flush()
    os.fsync(f.fileno())


def _speed(case: Case, median_ms: float) -> float:
  seconds = median_ms * 1e-3
  if case.metric == "compute":
    return case.flops / seconds / 1e12
  return case.bytes / seconds / 1e9


def _progress(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


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
            ratio="-" if r.get("vs_baseline") is None else f"{r['vs_baseline']:.2f}x",
            comp=_fmt(r.get("compile_s"), ".2f"),
            mem=_fmt(mem.get("footprint") and mem["footprint"] / 2**20, ".1f"),
        )
    )
  return "\n".join(lines + ["", _legend(records)])


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
      "median, > 1 is faster (where Optax has no such optimizer, the case's named baseline). "
      "footprint: argument + output - aliased + temp bytes of the "
      "compiled step (memory_analysis)."
  )


def _ratio(record: dict, base: dict | None) -> float | None:
  """Baseline time / this time, by the same timing method (else wall clock)."""
  if base is None or record.get("error") or record.get("kernel") == "interpret":
    return None
  field = "median_ms" if record.get("timing") == base.get("timing") else "wall_median_ms"
  ours, theirs = record.get(field), base.get(field)
  return theirs / ours if ours and theirs else None


def _baselines(records: Iterable[dict]) -> dict[str, dict]:
  return {
      r["case"]: r for r in records
      if not r.get("error") and r["impl"] == r.get("baseline") and r.get("kernel") != "interpret"
  }


def _attach_ratios(records: list[dict]) -> None:
  """Sets ``vs_baseline`` (see `_ratio`) on every record, within its case."""
  base = _baselines(records)
  for r in records:
    r["vs_baseline"] = _ratio(r, base.get(r["case"]))


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
      r["key"]: r for r in load_records(out_path)
      if resume and r.get("key") in keys and not r.get("error") and _current(r, env)
  }
  todo = [c for c in configs if c[-1] not in done]
  # The banner heads stdout once (the table follows at the end), as in the .md.
  header = banner(env, kernel_impls)
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
        _progress(f"ceiling: {ceiling_label(c)} ({c['timing']})")
      ceilings[case.key] = c

  base = _baselines(done.values())
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
      timing = _measure(
          f"{case.family}:{impl.name}", impl.build(k), impl.inputs or case.inputs,
          leaves=case.leaves,
          s=settings, env=env, seed=i, profile_key=key,
      )
      record.update(timing)
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
      record["vs_baseline"] = _ratio(record, base.get(case.key))
      _progress(
          f"[{i}/{len(todo)}] {key}: {record['median_ms']:.4g} ms ({record['timing']}, "
          f"x{record['rotations']} sets), compile {record['compile_s']:.2f} s"
      )
    except Exception as e:  # noqa: BLE001 - record the failure, keep sweeping
      record.update(error=f"{type(e).__name__}: {e}")
      _progress(f"[{i}/{len(todo)}] {key}: FAILED {record['error'][:300]}")
    append_record(out_path, record)
    done[key] = record

  records = [done[c[-1]] for c in configs if c[-1] in done]
  _attach_ratios(records)
  table = format_table(records)
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


def _current(record: dict, env: Environment) -> bool:
  """Whether ``record`` was measured by this code on this device (resumable)."""
  return (
      record.get("schema") == SCHEMA and record.get("device_kind") == env.device_kind
      and record.get("git_commit") == env.git_commit
      and record.get("jax") == env.versions["jax"]
  )


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
  out = args.out or RESULTS_DIR / environment().slug / f"{script}-{args.tier}.jsonl"
  return run(
      list(cases_fn(args.tier)), settings, out, filter=args.filter, resume=not args.no_resume
  )
