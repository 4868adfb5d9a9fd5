"""How Muon sees a leaf: its matrix view (batch, fan-in, fan-out), QKV parts and blocks."""

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers

from pallasopt.optim.muon._options import OWNER


@dataclasses.dataclass(frozen=True)
class Spec:
  """Routing of one leaf: ``dims`` for Muon, None for AdamW."""

  dims: MuonDimensionNumbers | None
  split: tuple[int, ...] | None = None

  @property
  def label(self) -> str:
    return "adam" if self.dims is None else "muon"


def is_spec_leaf(x) -> bool:
  return x is None or isinstance(x, (MuonDimensionNumbers, optax.MaskedNode))


def broadcast_prefix(name: str, prefix: Any, tree: Any, is_leaf) -> list:
  """One value of ``prefix`` (a prefix tree of ``tree``) per leaf of ``tree``."""
  try:
    full = jax.tree.map(
        lambda value, sub: jax.tree.map(lambda _: _Box(value), sub), prefix, tree, is_leaf=is_leaf
    )
  except ValueError as e:
    raise ValueError(
        f"{OWNER}: {name} must have the structure of the params or a prefix of it; {e}"
    ) from None
  return [box.value for box in jax.tree.leaves(full, is_leaf=lambda x: isinstance(x, _Box))]


@dataclasses.dataclass(frozen=True)
class _Box:
  value: Any


def _normalize_axes(axes, ndim: int, path: str) -> tuple[int, ...]:
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  for axis in axes:
    if not -ndim <= axis < ndim:
      raise ValueError(
          f"{OWNER}: muon_weight_dimension_numbers{path} names axis {axis} of a leaf of "
          f"rank {ndim}."
      )
  return tuple(axis % ndim for axis in axes)


@dataclasses.dataclass(frozen=True)
class Layout:
  """A Muon leaf viewed as ``(batch, fan_in, fan_out)`` and back."""

  shape: tuple[int, ...]
  perm: tuple[int, ...]
  flat: tuple[int, int, int]

  @classmethod
  def of(cls, shape, dims: MuonDimensionNumbers, path: str) -> "Layout":
    ndim = len(shape)
    if ndim < 2:
      raise ValueError(f"{OWNER}: Muon leaf{path} must have rank >= 2; got shape {shape}.")
    red = _normalize_axes(dims.reduction_axis, ndim, path)
    out = _normalize_axes(dims.output_axis, ndim, path)
    if set(red) & set(out):
      raise ValueError(
          f"{OWNER}: muon_weight_dimension_numbers{path} has overlapping reduction and "
          f"output axes {red} and {out}."
      )
    batch = tuple(a for a in range(ndim) if a not in red + out)
    size = lambda axes: math.prod(shape[a] for a in axes)
    return cls(tuple(shape), batch + red + out, (size(batch), size(red), size(out)))

  def to_flat(self, x):
    return jnp.transpose(x, self.perm).reshape(self.flat)

  def from_flat(self, x):
    permuted = tuple(self.shape[a] for a in self.perm)
    return jnp.transpose(x.reshape(permuted), np.argsort(self.perm))


def split_parts(flat_shape, split, blockwise, path):
  """Index slices of the sub-matrices orthogonalized separately.

  Returns a function ``(b, r, o) array -> list of stacks`` and its inverse.
  ``split`` splits the output axis, viewed as ``(groups, sum(split))``, into
  one part per entry (a fused QKV matrix, as Megatron lays it out);
  ``blockwise=(rb, cb)`` cuts every part into an ``rb x cb`` grid of blocks.
  """
  batch, fan_in, fan_out = flat_shape
  sizes = (fan_out,) if split is None else tuple(split)
  total = sum(sizes)
  if fan_out % total:
    raise ValueError(
        f"{OWNER}: qkv_split_shapes{path}={split} must divide the output size {fan_out}."
    )
  groups = fan_out // total
  rb, cb = (1, 1) if blockwise is None else blockwise
  for size in sizes:
    if fan_in % rb or (groups * size) % cb:
      raise ValueError(
          f"{OWNER}: blockwise={blockwise} must divide every part of leaf{path} "
          f"(fan_in={fan_in}, part fan_out={groups * size})."
      )
  bounds = np.cumsum((0,) + sizes)

  def to_blocks(m):  # (b, r, o) -> (b * rb * cb, r / rb, o / cb)
    _, r, o = m.shape
    m = m.reshape(batch, rb, r // rb, cb, o // cb).transpose(0, 1, 3, 2, 4)
    return m.reshape(batch * rb * cb, r // rb, o // cb)

  def from_blocks(m, r, o):
    m = m.reshape(batch, rb, cb, r // rb, o // cb).transpose(0, 1, 3, 2, 4)
    return m.reshape(batch, r, o)

  def split_fn(x):
    grouped = x.reshape(batch, fan_in, groups, total)
    return [
        to_blocks(grouped[..., lo:hi].reshape(batch, fan_in, groups * (hi - lo)))
        for lo, hi in zip(bounds[:-1], bounds[1:])
    ]

  def merge_fn(parts):
    pieces = [
        from_blocks(p, fan_in, groups * s).reshape(batch, fan_in, groups, s)
        for p, s in zip(parts, sizes)
    ]
    return jnp.concatenate(pieces, axis=-1).reshape(batch, fan_in, fan_out)

  part_shapes = [(fan_in // rb, groups * s // cb) for s in sizes]
  return split_fn, merge_fn, part_shapes
