"""What a compiled module moves: HBM bytes, relayouts, collectives, kernels.

A kernel's declared `pl.CostEstimate` is what ``cost_analysis()`` reports
for it, so neither proves what a step moves. `traffic` reads the compiled
module's entry computation instead (XLA's HLO after every pass, for the
target it was compiled for), op by op. No compiler is needed to read it: a
module compiled for this host, or by `pallasopt.compile_check` for a GPU or
TPU, reads the same way.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import NamedTuple

__all__ = [
    "COMPILED_CALLS", "INSTRUCTION", "Traffic", "traffic", "relayouts_at_least",
    "relayout_bytes_beyond", "bytes_by_kind_beyond",
]

# What each compiled kernel is called in a compiled module's HLO.
COMPILED_CALLS = {
    "tpu": re.compile(r'custom_call_target="tpu_custom_call"'),
    "triton": re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton"'),
    "mosaic_gpu": re.compile(r'custom_call_target="mosaic_gpu[^"]*"'),
}

# Bytes per element; 4-bit types are stored two to a byte.
_ITEMSIZE = {
    "s4": 0.5, "u4": 0.5,
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_ARRAY = re.compile(r"\b(" + "|".join(_ITEMSIZE) + r")\[([\d,]*)\](\{[^}]*\})?")
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_FREE = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
    "partition-id", "replica-id", "iota", "copy-done", "slice-done",
})
# Ops that only move data between layouts. (XLA's asynchronous copies and
# slices between memory spaces, ``copy-start`` and ``slice-start``, keep the
# layout: they prefetch into VMEM or evict from it.)
_RELAYOUT = frozenset({"copy", "transpose", "reshape"})
# Custom calls that move no data: buffers XLA lays side by side.
_FREE_CALLS = re.compile(r'custom_call_target="ConcatBitcast"')
_MATMUL = re.compile(r"\s(dot|convolution)\(")
_COLLECTIVE = re.compile(r"^(all-gather|all-reduce|all-to-all|reduce-scatter|collective-permute)")


@dataclasses.dataclass(frozen=True)
class Traffic:
  """What one compiled module moves.

  Attributes:
    hbm_bytes: the bytes every top-level op (outside the branches of
      conditionals) reads and writes in HBM: its
      operands' and results' sizes as stored (a TPU's tiled layout pads the
      tiled dims: a (50257, 3) f32 array stored row-major occupies 50264 x
      128 elements), leaving out ops that move nothing (parameters, tuples,
      bitcasts) and arrays in another memory space (a TPU's VMEM, ``S(1)``
      in the layout: an array XLA prefetches into VMEM counts once, at the
      prefetch).
    relayouts: ``(op, bytes)`` of the ops that only move data from one
      layout to another (copies, transposes, non-bitcast reshapes).
    collectives: the opcodes of the collectives.
    collective_bytes: the bytes the collectives produce (their results).
    kernels: Pallas kernels (Mosaic TPU, Triton, Mosaic GPU custom calls).
    branch_hbm_bytes: the HBM bytes of the conditionals' branches, counted
      like ``hbm_bytes`` inside them (the costliest branch of each): what a
      step that takes them moves on top of ``hbm_bytes``, e.g. Kron's
      preconditioner update. Relayouts, collectives and kernels count those
      of every branch.
    xla_bytes: ``cost_analysis()["bytes accessed"]``, XLA's own count, which
      takes each kernel's declared estimate verbatim and counts an array XLA
      prefetches into VMEM twice (at the copy and at its reader).
    temp_bytes: ``memory_analysis()``'s temporary buffers.
    hbm_by_kind: ``hbm_bytes`` split by what moves them, ``(kind, bytes)``
      from the most: a fusion by its kind and whether it fuses a matmul
      (``"fusion kOutput + matmul"``: where XLA fuses an update into a
      weight gradient's producer), a custom call by its target (a kernel),
      any other op by its opcode (``"slice-start"``: prefetches into VMEM).
      Two modules' splits show where one moves more than the other.
  """

  hbm_bytes: int
  relayouts: tuple[tuple[str, int], ...]
  collectives: tuple[str, ...]
  collective_bytes: int
  kernels: int
  xla_bytes: float | None
  temp_bytes: int | None
  branch_hbm_bytes: int = 0
  hbm_by_kind: tuple[tuple[str, int], ...] = ()

  @property
  def relayout_bytes(self) -> int:
    return sum(b for _, b in self.relayouts)


def _stored_elements(dims: list[int], layout: str) -> int:
  """Elements an array of ``dims`` occupies in ``layout``, its tiles' padding included.

  A TPU layout ``{1,0:T(8,128)}`` orders the dims minor to major and tiles
  the minor ones: each tiled dim is padded to a multiple of its tile.
  """
  match = re.match(r"\{([\d,]*)(?::T\(([\d,]+)\))?", layout or "")
  if not dims or match is None or match.group(2) is None:
    return math.prod(dims)
  minor_to_major = [int(d) for d in match.group(1).split(",") if d] or list(range(len(dims)))
  stored = [dims[d] for d in reversed(minor_to_major)]  # major to minor
  tile = [int(t) for t in match.group(2).split(",")]
  for i, t in enumerate(tile[-len(stored):], start=len(stored) - min(len(tile), len(stored))):
    stored[i] = -(-stored[i] // t) * t
  return math.prod(stored)


def _bytes(type_text: str, *, hbm_only: bool = True) -> int:
  """Bytes the arrays of an HLO type occupy (those in HBM, memory space 0, by default)."""
  total = 0
  for dtype, dims, layout in _ARRAY.findall(type_text):
    if hbm_only and layout and re.search(r"\bS\([1-9]", layout):
      continue
    elements = _stored_elements([int(d) for d in dims.split(",") if d], layout)
    total += math.ceil(_ITEMSIZE[dtype] * elements)
  return total


def _in_hbm(type_text: str) -> bool:
  return _bytes(type_text) > 0 or _bytes(type_text, hbm_only=False) == 0


def _tuple_elements(type_text: str) -> list[str]:
  """The top-level elements of an HLO tuple type ``(a, b, ...)``."""
  inner, depth, start, parts = type_text.strip()[1:-1], 0, 0, []
  for i, ch in enumerate(inner):
    depth += ch in "([{"
    depth -= ch in ")]}"
    if ch == "," and depth == 0:
      parts.append(inner[start:i])
      start = i + 1
  return parts + [inner[start:]]


def _async_bytes(opcode: str, type_text: str) -> int:
  """HBM bytes of an asynchronous copy or slice between memory spaces.

  ``copy-start`` returns ``(destination, source, context)``; ``slice-start``
  returns ``((source,), destination, context)``. Each moves the destination's
  bytes, read from the source's memory space and written to its own.
  """
  first, second = _tuple_elements(type_text)[:2]
  source, destination = (second, first) if opcode == "copy-start" else (first, second)
  moved = _bytes(destination, hbm_only=False)
  return moved * (_in_hbm(source) + _in_hbm(destination))


_COMPUTATION = re.compile(r"^(ENTRY\s+)?%(\S+)\s")
_BRANCHES = re.compile(
    r"(?:branch_computations=\{([^}]*)\}|true_computation=(%[\w.\-]+)|false_computation=(%[\w.\-]+))"
)


def _computations(text: str) -> tuple[str, dict[str, list[str]]]:
  """The entry computation's name, and every computation's instruction lines by name."""
  bodies: dict[str, list[str]] = {}
  entry, current = None, None
  for line in text.splitlines():
    header = _COMPUTATION.match(line)
    if header and line.rstrip().endswith("{"):
      current = bodies.setdefault(header.group(2), [])
      entry = header.group(2) if header.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif current is not None:
      current.append(line)
  return entry, bodies


class _Counts(NamedTuple):
  hbm: int
  relayouts: list
  collectives: list
  kernels: int
  branch_hbm: int
  by_kind: collections.Counter


def _kind(opcode: str, rest: str, bodies: dict[str, list[str]]) -> str:
  """An op's kind for `Traffic.hbm_by_kind`."""
  if opcode == "fusion":
    kind = re.search(r"kind=(k\w+)", rest)
    called = re.search(r"calls=%([\w.\-]+)", rest)
    body = bodies.get(called.group(1), []) if called else []
    matmul = any(_MATMUL.search(line) for line in body)
    words = ["fusion"] + ([kind.group(1)] if kind else []) + (["+ matmul"] if matmul else [])
    return " ".join(words)
  if opcode == "custom-call":
    target = re.search(r'custom_call_target="([^"]+)"', rest)
    return f"custom-call {target.group(1)}" if target else opcode
  return opcode


def _computation_traffic(name: str, bodies: dict[str, list[str]]) -> _Counts:
  """HBM bytes (also by kind), relayouts, collectives, kernels, branch bytes of one computation."""
  sizes: dict[str, int] = {}
  hbm, relayouts, collectives, kernels, branch_hbm = 0, [], [], 0, 0
  by_kind = collections.Counter()
  for line in bodies[name]:
    match = INSTRUCTION.match(line)
    if match is None:
      continue
    op, type_text, opcode, rest = match.groups()
    sizes[op] = result = _bytes(type_text)
    if opcode in _FREE or (opcode == "custom-call" and _FREE_CALLS.search(rest)):
      continue
    operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
    if opcode in ("copy-start", "slice-start"):
      moved = _async_bytes(opcode, type_text)
    elif opcode != "conditional":  # its branches move what it moves
      moved = result + sum(sizes.get(o, 0) for o in operands)
    else:
      moved = 0
    hbm += moved
    if moved:
      by_kind[_kind(opcode, rest, bodies)] += moved
    if opcode in _RELAYOUT or (opcode == "fusion" and re.match(r"(copy|transpose)", op)):
      relayouts.append((op, _bytes(type_text, hbm_only=False)))
    if _COLLECTIVE.match(opcode) and not opcode.endswith("-done"):
      collectives.append((opcode.removesuffix("-start"), _bytes(type_text, hbm_only=False)))
    kernels += opcode == "custom-call" and any(p.search(rest) for p in COMPILED_CALLS.values())
    if opcode == "conditional":
      called = [c.lstrip("%") for group in _BRANCHES.findall(rest) for part in group
                for c in re.findall(r"%[\w.\-]+", part)]
      branches = [_computation_traffic(c, bodies) for c in called if c in bodies]
      for b in branches:
        relayouts += b.relayouts
        collectives += b.collectives
        kernels += b.kernels
      branch_hbm += max((b.hbm + b.branch_hbm for b in branches), default=0)
  return _Counts(hbm, relayouts, collectives, kernels, branch_hbm, by_kind)


def traffic(compiled) -> Traffic:
  """Measures a ``jax.stages.Compiled`` (see `Traffic`)."""
  entry, bodies = _computations(compiled.as_text())
  counts = _computation_traffic(entry, bodies)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  try:
    temp = compiled.memory_analysis().temp_size_in_bytes
  except (AttributeError, NotImplementedError):
    temp = None
  return Traffic(
      counts.hbm, tuple(counts.relayouts), tuple(op for op, _ in counts.collectives),
      sum(nbytes for _, nbytes in counts.collectives), counts.kernels,
      (cost or {}).get("bytes accessed"), temp, counts.branch_hbm,
      tuple(counts.by_kind.most_common()),
  )


def relayouts_at_least(t: Traffic, nbytes: int) -> list[tuple[str, int]]:
  """The relayouts of ``t`` that move ``nbytes`` or more."""
  return [(name, b) for name, b in t.relayouts if b >= nbytes]


def relayout_bytes_beyond(t: Traffic, baseline: Traffic, nbytes: int = 1 << 20) -> int:
  """The bytes ``t``'s relayouts of ``nbytes`` or more move beyond ``baseline``'s (a step compiled alike)."""
  moved = lambda traffic: sum(b for _, b in relayouts_at_least(traffic, nbytes))
  return moved(t) - moved(baseline)


def bytes_by_kind_beyond(t: Traffic, baseline: Traffic) -> dict[str, int]:
  """The bytes each kind of op (`Traffic.hbm_by_kind`) moves in ``t`` beyond ``baseline``.

  Kinds that move the same in both are left out; the largest change (either
  sign) comes first. Where a step moves more than its baseline, this says
  which ops do: e.g. a custom call that took an update out of the matmul
  fusions shows as ``+`` kernel bytes and ``-`` ``"fusion kOutput + matmul"``.
  """
  ours, theirs = dict(t.hbm_by_kind), dict(baseline.hbm_by_kind)
  beyond = {k: ours.get(k, 0) - theirs.get(k, 0) for k in ours.keys() | theirs.keys()}
  return dict(sorted(((k, v) for k, v in beyond.items() if v), key=lambda kv: -abs(kv[1])))
