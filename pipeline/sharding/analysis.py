"""Validating specs against a mesh, counting bytes per device, and lining up processes."""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, PartitionSpec

from pallasopt.pipeline.sharding._common import (
    PyTree,
    _as_struct,
    _nbytes,
    _axes,
    _shard_factor,
    _context_mesh,
)


class MemoryEstimate(NamedTuple):
  """Bytes of params and optimizer state, logical and per device.

  ``*_bytes`` count one copy of every leaf; ``*_bytes_per_device`` what each
  device of the mesh holds (valid specs shard evenly, so every device holds the
  same amount; replicated leaves count in full on each).
  """

  param_bytes: int
  state_bytes: int
  param_bytes_per_device: int
  state_bytes_per_device: int

  @property
  def total_bytes(self) -> int:
    return self.param_bytes + self.state_bytes

  @property
  def bytes_per_device(self) -> int:
    return self.param_bytes_per_device + self.state_bytes_per_device


class ShardingAnalyzer:
  """Checks partition specs against a mesh and counts bytes per device.

  ``mesh=None`` takes the mesh in context. `validate_partition_specs` and
  `estimate_memory_usage` are eFormer's (escale's) names and return types for
  `validate` and `estimate_memory`, with our checks.
  """

  def __init__(self, mesh: Mesh | None = None):
    self.mesh = _context_mesh("ShardingAnalyzer", mesh)

  def validate_partition_specs(self, pytree: PyTree, partition_specs: PyTree) -> list[str]:
    """Every problem `validate` would raise for, as a list (empty: all valid)."""
    try:
      self.validate(pytree, partition_specs)
    except ValueError as e:
      first, *problems = str(e).split("\n  ")
      return problems or [first]
    return []

  def estimate_memory_usage(self, pytree: PyTree, partition_specs: PyTree) -> dict[str, int]:
    """``{"total_size": bytes, "size_per_device": bytes}`` of ``pytree`` so sharded.

    Raises ValueError for invalid specs, as `validate` does.
    """
    total, per_device = self._bytes(self._checked(pytree, partition_specs, "tree"))
    return {"total_size": total, "size_per_device": per_device}

  def validate(self, shapes: PyTree, specs: PyTree, *, name: str = "tree") -> None:
    """Raises ValueError listing every spec that does not fit its leaf.

    A spec fits when it is a `PartitionSpec` with no more entries than the
    leaf has dims, names only axes of the mesh, uses each axis once, and every
    sharded dim is divisible by the product of its axes' sizes.

    Args:
      shapes: arrays or `jax.ShapeDtypeStruct`s.
      specs: a `PartitionSpec` per leaf of `shapes`, same structure.
      name: what the tree is, for the messages (e.g. "params").
    """
    self._checked(shapes, specs, name)

  def estimate_memory(
      self,
      params: PyTree,
      param_specs: PyTree,
      opt_state: PyTree = None,
      opt_state_specs: PyTree = None,
  ) -> MemoryEstimate:
    """Validates the specs and counts the bytes of params and state.

    Args:
      params: arrays or `jax.ShapeDtypeStruct`s.
      param_specs: their specs.
      opt_state: the optimizer state or its shapes (``jax.eval_shape``), or
        None to count params only.
      opt_state_specs: its specs (`optimizer_state_specs`).
    """
    if (opt_state is None) != (opt_state_specs is None):
      raise ValueError("opt_state and opt_state_specs must be given together.")
    param_bytes, param_per_device = self._bytes(self._checked(params, param_specs, "params"))
    state_bytes, state_per_device = self._bytes(
        self._checked(opt_state, opt_state_specs, "opt_state")
    )
    return MemoryEstimate(param_bytes, state_bytes, param_per_device, state_per_device)

  def _bytes(self, leaves: list[tuple[jax.ShapeDtypeStruct, PartitionSpec]]) -> tuple[int, int]:
    total = sum(_nbytes(leaf) for leaf, _ in leaves)
    per_device = sum(_nbytes(leaf) // _shard_factor(self.mesh.shape, spec) for leaf, spec in leaves)
    return total, per_device

  def _checked(self, shapes: PyTree, specs: PyTree, name: str):
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    try:
      spec_leaves = treedef.flatten_up_to(specs)
    except (ValueError, TypeError) as e:
      raise ValueError(f"the specs of {name} must have its structure {treedef}: {e}") from e
    errors, leaves = [], []
    for (path, leaf), spec in zip(flat, spec_leaves):
      struct = _as_struct(path, leaf, name)
      where = f"{name}{jax.tree_util.keystr(path)} (shape {struct.shape})"
      if not isinstance(spec, PartitionSpec):
        errors.append(f"{where}: expected a PartitionSpec, got {type(spec).__name__}")
        continue
      errors.extend(f"{where}: {problem}" for problem in self._spec_problems(struct.shape, spec))
      leaves.append((struct, spec))
    if errors:
      raise ValueError(
          f"{len(errors)} invalid partition spec(s) for mesh {dict(self.mesh.shape)}:\n  "
          + "\n  ".join(errors)
      )
    return leaves

  def _spec_problems(self, shape: tuple[int, ...], spec: PartitionSpec) -> list[str]:
    if len(spec) > len(shape):
      return [f"spec {spec} has {len(spec)} entries for {len(shape)} dims"]
    problems, seen = [], set()
    for dim, entry in enumerate(spec):
      if not (entry is None or isinstance(entry, str) or (
          isinstance(entry, tuple) and all(isinstance(a, str) for a in entry))):
        problems.append(f"dim {dim}: entry {entry!r} is not None, an axis name or a tuple of them")
        continue
      axes = _axes(entry)
      unknown = [a for a in axes if a not in self.mesh.shape]
      if unknown:
        problems.append(
            f"dim {dim}: mesh axis {unknown[0]!r} is not one of {tuple(self.mesh.axis_names)}"
        )
        continue
      repeated = [a for i, a in enumerate(axes) if a in seen or a in axes[:i]]
      if repeated:
        problems.append(f"dim {dim}: mesh axis {repeated[0]!r} is used twice in {spec}")
      seen.update(axes)
      factor = math.prod(self.mesh.shape[a] for a in axes)
      if shape[dim] % factor:
        problems.append(
            f"dim {dim} of size {shape[dim]} is not divisible by mesh axis"
            f" {entry!r} of size {factor}"
        )
    return problems


def barrier_sync(name: str = "pallasopt_barrier", *, timeout: float | None = None) -> None:
  """Blocks until every process of the run has reached this barrier.

  With one process it returns at once. Otherwise it calls
  `jax.experimental.multihost_utils.sync_global_devices`, which has no timeout
  of its own; with `timeout`, the sync runs in a daemon thread and TimeoutError
  is raised if it has not finished after `timeout` seconds. The pending sync
  cannot be cancelled and stays in flight, so after a TimeoutError the run is
  out of step and should be aborted rather than retried.

  Args:
    name: the barrier's name; every process must pass the same one.
    timeout: seconds to wait, or None to wait forever.
  """
  if timeout is not None and not timeout > 0:
    raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout}.")
  if jax.process_count() == 1:
    return
  if timeout is None:
    multihost_utils.sync_global_devices(name)
    return
  failure: list[BaseException] = []

  def sync():
    try:
      multihost_utils.sync_global_devices(name)
    except BaseException as e:  # re-raised in the caller's thread
      failure.append(e)

  thread = threading.Thread(target=sync, name=f"barrier_sync:{name}", daemon=True)
  thread.start()
  thread.join(timeout)
  if thread.is_alive():
    raise TimeoutError(
        f"barrier_sync({name!r}): not every one of the {jax.process_count()} processes"
        f" arrived within {timeout} s."
    )
  if failure:
    raise failure[0]
