"""The chip a computation is lowered for, as its lowering knows it.

`Target` is what a kernel family's dispatch decides on (see `_dispatch`): the
platform of the lowering rule JAX runs (one per platform of the module, so a
multi-platform ``jax.export`` asks once per platform), the device kind when the
lowering has a device of that platform, and whether XLA's automatic
partitioner will split the computation over several devices (no Pallas call
can be split there).

Where the device comes from, first to last:

1. an abstract device of that platform in context:
   ``jax.sharding.use_abstract_mesh(AbstractMesh(..., abstract_device=...))``
   (how a user names the chip of an export), or the abstract mesh of the
   shardings being lowered;
2. the devices of the lowering itself: a mesh's devices inside ``shard_map``,
   the device assignment when JAX passes one, else the devices of the client
   that lowers (the local GPU or TPU, or a ``jax.experimental.topologies``
   compile-only client for AOT compilation);
3. none: an export for a platform this host lacks, with no abstract device.
   The kernels chosen then are those every chip of the platform compiles
   (`BASELINE_DEVICE_KIND`).

Where XLA partitions the computation, a target also says how each operand of
the call arrives (`Layout`), where the lowering shows it: an operand that is
an argument of the jitted function carries the sharding the function
receives it with. That is how an elementwise kernel runs on local shards
under Auto mesh axes, where the operands' types say nothing of their layout.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import jax

from pallasopt import chips
from pallasopt.kernels import _compat

__all__ = [
    "Target",
    "BASELINE_DEVICE_KIND",
    "Layout",
    "local_shape",
    "lowering_target",
    "parse_sdy_sharding",
    "platform_name",
]

# The chips assumed when a lowering has no device of its platform
# (`pallasopt.chips.BASELINE`). JAX >= 0.11's Pallas lowerings read a device
# kind too.
BASELINE_DEVICE_KIND: dict[str, str] = {
    platform: chips.CHIPS[name].device_kind for platform, name in chips.BASELINE.items()
}


def platform_name(platform: str) -> str:
  """A device's or client's platform as `jax.export` spells it (``"gpu"`` -> ``"cuda"``)."""
  platform = platform.lower()
  return "cuda" if platform == "gpu" else platform


def _capability(device, kind: str | None) -> tuple[int, int] | None:
  reported = getattr(device, "compute_capability", None)
  if isinstance(reported, str) and re.fullmatch(r"\d+\.\d+", reported):
    major, minor = reported.split(".")
    return int(major), int(minor)
  return chips.cuda_capability(kind)


@dataclasses.dataclass(frozen=True)
class Layout:
  """The sharding a partitioned computation receives one of its arguments with.

  Attributes:
    spec: the mesh axes each dimension is split over.
    mesh_axes: ``(name, size)`` of every axis of the sharding's mesh, where
      the sharding spells its mesh out; None where it names a mesh defined
      elsewhere in the module.
  """

  spec: jax.sharding.PartitionSpec
  mesh_axes: tuple[tuple[str, int], ...] | None = None

  def fits(self, mesh, shape: tuple[int, ...]) -> bool:
    """Whether this layout is over ``mesh``'s axes and splits ``shape`` evenly."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    if self.mesh_axes is not None and dict(self.mesh_axes) != sizes:
      return False
    if len(self.spec) > len(shape):
      return False
    if any(a not in sizes for entry in self.spec for a in _spec_axes(entry)):
      return False
    return all(d % n == 0 for d, n in zip(shape, _shard_counts(self.spec, len(shape), mesh)))


def _spec_axes(entry) -> tuple[str, ...]:
  """The mesh axes of one `PartitionSpec` entry: None, an axis name or a tuple of them."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _shard_counts(spec: jax.sharding.PartitionSpec, ndim: int, mesh) -> tuple[int, ...]:
  """Into how many shards ``spec`` splits each of ``ndim`` dims over ``mesh``."""
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  padded = (*spec, *(None,) * (ndim - len(spec)))
  return tuple(math.prod(sizes[a] for a in _spec_axes(entry)) for entry in padded)


def local_shape(shape: tuple[int, ...], spec: jax.sharding.PartitionSpec, mesh) -> tuple[int, ...]:
  """The shape of one shard of an array of ``shape`` split evenly as ``spec`` over ``mesh``."""
  return tuple(d // n for d, n in zip(shape, _shard_counts(spec, len(shape), mesh)))


# Shardy's sharding attribute: `#sdy.sharding<MESH, [DIMS]...>`, MESH either
# `@name` or `mesh<["a"=2, "b"=4]...>`, each of DIMS `{"a", "b"}`.
_SDY_SHARDING = re.compile(
    r'#sdy\.sharding<(?:@[\w.$-]+|mesh<\[(?P<axes>[^\]]*)\][^>]*>), \[(?P<dims>[^\]]*)\](?P<rest>.*)>'
)
_SDY_AXIS = re.compile(r'"([^"]+)"=(\d+)')
_SDY_NAME = re.compile(r'"([^"]+)"')


def parse_sdy_sharding(text: str) -> Layout | None:
  """The `Layout` a Shardy sharding attribute spells, or None.

  None too for what a `PartitionSpec` cannot say exactly: an open dimension
  (``?``), sub-axes (``"a":(1)2``), unreduced axes.
  """
  match = _SDY_SHARDING.fullmatch(text.strip())
  if match is None or "unreduced" in match["rest"]:
    return None
  dims = []
  for group in re.findall(r"\{([^}]*)\}", match["dims"]):
    tokens = [t.strip() for t in group.split(",") if t.strip()]
    names = [_SDY_NAME.fullmatch(t) for t in tokens]
    if not all(names):
      return None
    axes = tuple(n[1] for n in names)
    dims.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  mesh_axes = None
  if match["axes"] is not None:
    mesh_axes = tuple((name, int(size)) for name, size in _SDY_AXIS.findall(match["axes"]))
  return Layout(jax.sharding.PartitionSpec(*dims), mesh_axes)


@dataclasses.dataclass(frozen=True)
class Target:
  """The chip one lowering of a kernel call is for.

  Attributes:
    platform: ``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"`` (or another name
      JAX lowers for).
    device_kind: the device's ``device_kind`` (``"TPU v5 lite"``,
      ``"NVIDIA H100 80GB HBM3"``), or None when the lowering has no device of
      this platform (an export; see the module docstring).
    compute_capability: ``(major, minor)`` of an NVIDIA device, when known.
    partitioned: XLA's automatic partitioner splits this computation over
      several devices (``jax.jit`` with shardings, outside ``shard_map``): a
      Pallas call cannot be placed there.
    layouts: where ``partitioned``, the `Layout` of each operand of the call,
      or None for an operand the lowering does not show one for (see the
      module docstring); empty elsewhere.
  """

  platform: str
  device_kind: str | None = None
  compute_capability: tuple[int, int] | None = None
  partitioned: bool = False
  layouts: tuple[Layout | None, ...] = ()

  @property
  def chip(self) -> str:
    """The device kind, or what is assumed without one (for messages)."""
    if self.device_kind is not None:
      return self.device_kind
    baseline = BASELINE_DEVICE_KIND.get(self.platform)
    if baseline is None:
      return f"a {self.platform} device"
    return f"an unnamed {self.platform} device (assumed {baseline})"

  @property
  def cuda_capability(self) -> tuple[int, int]:
    """The compute capability kernels may rely on: the baseline chip's when unknown."""
    if self.compute_capability is not None:
      return self.compute_capability
    return _capability(None, BASELINE_DEVICE_KIND["cuda"])  # type: ignore[return-value]

  @classmethod
  def of_device(cls, device, platform: str | None = None, *, partitioned: bool = False) -> "Target":
    """The target of a concrete or abstract ``device`` (a topology's, a mesh's)."""
    platform = platform or platform_name(device.platform)
    kind = getattr(device, "device_kind", None)
    capability = _capability(device, kind) if platform == "cuda" else None
    return cls(platform, kind, capability, partitioned)


def _same_platform(device, platform: str) -> bool:
  found = platform_name(getattr(device, "platform", "") or "")
  return found == platform or (platform in ("cuda", "rocm") and found in ("cuda", "rocm"))


def _partitioned(axis_context) -> bool:
  """Whether the lowering is under XLA's automatic partitioning of several devices."""
  manual = getattr(axis_context, "manual_axes", None)
  mesh = getattr(axis_context, "mesh", None)
  if manual is not None and mesh is not None:  # inside shard_map
    manual = frozenset(manual) | frozenset(getattr(mesh, "manual_axes", ()))
    return manual != frozenset(mesh.axis_names)
  return getattr(axis_context, "num_devices", 1) > 1


def _candidate_devices(module_context):
  axis_context = module_context.axis_context
  abstract_meshes = (
      jax.sharding.get_abstract_mesh(),
      getattr(axis_context, "abstract_mesh", None),
      getattr(axis_context, "mesh", None),
  )
  for mesh in abstract_meshes:
    device = getattr(mesh, "abstract_device", None)
    if device is not None:
      yield device
  mesh = getattr(axis_context, "mesh", None)
  if isinstance(mesh, jax.sharding.Mesh) and mesh.devices.size:
    yield mesh.devices.flat[0]
  for device in getattr(axis_context, "device_assignment", None) or ():
    yield device
  backend = module_context.backend
  if backend is not None:
    try:
      devices = backend.devices()
    except Exception:  # a client without devices lowers for none.
      devices = ()
    yield from devices[:1]


def lowering_target(ctx, platform: str, operands: Sequence[object] = ()) -> Target:
  """The `Target` of a lowering rule's context for ``platform``, with ``operands`` lowered."""
  module_context = ctx.module_context
  partitioned = _partitioned(module_context.axis_context)
  target = Target(platform, partitioned=partitioned)
  for device in _candidate_devices(module_context):
    if _same_platform(device, platform):
      target = Target.of_device(device, platform, partitioned=partitioned)
      break
  if not partitioned:
    return target
  layouts = []
  for value in operands:
    text = _compat.entry_argument_sharding(value)
    layouts.append(None if text is None else parse_sdy_sharding(text))
  return dataclasses.replace(target, layouts=tuple(layouts))
