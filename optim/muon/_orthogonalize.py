"""Newton-Schulz for a step's matrices: grouped by shape, batched, split over devices."""

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from optax.contrib import MuonDimensionNumbers
from optax.contrib import _muon as _optax_muon  # its orthogonalization, for f64/complex

from pallasopt.kernels import _compat
from pallasopt.kernels import newton_schulz as ns
from pallasopt.kernels import ns_coefficients
from pallasopt.kernels._by_target import by_target
from pallasopt.optim import _validation as v
from pallasopt.optim.muon._options import OWNER, OPTAX_PRESETS


def compute_dtype(x) -> jnp.dtype:
  """The dtype Muon computes a leaf in: f32 for the kernels' dtypes (f32 and
  bf16), the leaf's own otherwise (f16, f64, complex), as Optax does."""
  return jnp.dtype(jnp.float32) if v.kernel_dtypes(x) else jnp.result_type(x)


def check_distributed_axes(axes: tuple[str, ...] | None):
  """The mesh in context for ``distributed_axes``, or a ValueError saying what is wrong."""
  if axes is None:
    return None
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    raise ValueError(
        f"{OWNER}: distributed_axes={axes} needs the mesh in context: call the step "
        "under jax.set_mesh(mesh) (or jax.sharding.use_mesh)."
    )
  unknown = [a for a in axes if a not in mesh.axis_names]
  if unknown:
    raise ValueError(
        f"{OWNER}: distributed_axes names {unknown}, which the mesh in context "
        f"(axes {tuple(mesh.axis_names)}) lacks."
    )
  manual = [a for a in axes if a in mesh.manual_axes]
  if manual and len(manual) != len(axes):
    raise ValueError(
        f"{OWNER}: distributed_axes {axes} mixes axes that are manual here (inside "
        f"shard_map: {manual}) with others; name axes of one kind."
    )
  return mesh


def _split_over_manual_axes(orthogonalize, joined, coeffs, mesh, axes: tuple[str, ...]):
  """`_split_over_axes` inside `shard_map` over ``axes`` (e.g. a pipeline stage).

  Each device holds the same matrices (data-parallel replicas, after the
  gradients' all-reduce): it orthogonalizes its slice of the padded batch and
  one all-gather per shape group returns every result to every device.
  """
  devices = math.prod(mesh.shape[a] for a in axes)
  count = joined.shape[0]
  padded = jnp.pad(joined, ((0, -count % devices), (0, 0), (0, 0)))
  per_device = padded.shape[0] // devices
  mine = jax.lax.dynamic_slice_in_dim(padded, jax.lax.axis_index(axes) * per_device, per_device)
  return jax.lax.all_gather(orthogonalize(mine, coeffs), axes, tiled=True)[:count]


def _split_over_axes(orthogonalize, joined, coeffs, mesh, axes: tuple[str, ...]):
  """``orthogonalize(joined, coeffs)``, the matrices split over the devices of ``axes``.

  The batch of same-shape matrices is padded to a multiple of the devices
  (with zero matrices, which Newton–Schulz maps to zero), laid out along
  ``axes`` (one all-to-all from a row-sharded layout, a slice from a
  replicated one), orthogonalized per device inside `shard_map`, and returned
  to the params' layout (one all-gather or all-to-all per shape group). No
  collective runs inside the iterations.
  """
  devices = math.prod(mesh.shape[a] for a in axes)
  count = joined.shape[0]
  batch, whole = jax.sharding.PartitionSpec(axes, None, None), jax.sharding.PartitionSpec()
  free = jax.sharding.PartitionSpec.UNCONSTRAINED
  explicit = any(
      mesh.axis_types[mesh.axis_names.index(a)] == jax.sharding.AxisType.Explicit for a in axes
  )
  if not explicit:
    # Auto axes: XLA would propagate the batch layout back into each matrix's
    # momentum; the batch of the joined matrices stays whole until the split.
    joined = jax.lax.with_sharding_constraint(joined, jax.sharding.PartitionSpec(None, free, free))
  padded = jnp.pad(joined, ((0, -count % devices), (0, 0), (0, 0)))
  if explicit:
    padded, coeffs = jax.sharding.reshard(padded, batch), jax.sharding.reshard(coeffs, whole)
  else:
    padded = jax.lax.with_sharding_constraint(padded, batch)
  split = _compat.shard_map(
      orthogonalize, mesh=mesh, in_specs=(batch, whole), out_specs=batch,
      axis_names=frozenset(axes), check_vma=False,
  )
  result = split(padded, coeffs)
  # Back to the params' layout (the batch whole) before the padding is cut
  # off: one collective for the group, not one per matrix.
  if explicit:
    result = jax.sharding.reshard(result, _compat.explicit_spec(joined) or whole)
  else:
    result = jax.lax.with_sharding_constraint(result, jax.sharding.PartitionSpec(None, free, free))
  return result[:count]


def orthogonalize_all(
    stacks, table, *, optax_coeffs, preconditioning, eps, iter_dtype, gram_levels, impl,
    distributed_axes=None,
):
  """Newton–Schulz of many stacks: per shape of matrix, one batch or one stack at a time.

  One stack at a time on a TPU, else one batch per shape
  (`_orthogonalize_group`).

  Stacks in float32 or bfloat16 run `newton_schulz` with ``table``; others
  (float64, complex), and all of them when ``table`` is None (a traced step
  count), run Optax's own orthogonalization with ``optax_coeffs`` =
  ``(ns_coeffs, ns_steps)``, in their dtype. With ``distributed_axes`` each
  shape's batch is split over those mesh axes (`_split_over_axes`).
  """
  mesh = check_distributed_axes(distributed_axes)
  coeffs = jnp.asarray(optax_coeffs[0])  # `table` itself when there is one

  def orthogonalize(x, coeffs):
    if table is not None and v.kernel_dtypes(x):
      return ns.newton_schulz(
          x, coeffs, preconditioning=preconditioning, eps=eps, iter_dtype=iter_dtype,
          gram_levels=gram_levels, impl=impl,
      )
    return _optax_muon.orthogonalize_via_newton_schulz(
        x, coeffs, optax_coeffs[1], preconditioning, eps,
        MuonDimensionNumbers(reduction_axis=1, output_axis=2),
    )

  groups: dict[tuple, list[int]] = {}
  for i, s in enumerate(stacks):
    groups.setdefault((s.shape[1:], s.dtype), []).append(i)
  out = [None] * len(stacks)
  for members in groups.values():
    group = [stacks[i] for i in members]
    if mesh is None:
      # Newton–Schulz contracts whole rows and columns: a matrix sharded over
      # Explicit mesh axes is gathered, orthogonalized whole and resharded
      # (exact; `blockwise` avoids the gather).
      results = _orthogonalize_group(orthogonalize, [_compat.gathered(s) for s in group], coeffs)
      results = [_compat.reshard_like(r, s) for r, s in zip(results, group)]
    else:
      joined = jnp.concatenate(group) if len(group) > 1 else group[0]
      if distributed_axes[0] in mesh.manual_axes:
        result = _split_over_manual_axes(orthogonalize, joined, coeffs, mesh, distributed_axes)
      else:
        result = _split_over_axes(orthogonalize, joined, coeffs, mesh, distributed_axes)
      results = _unjoin(_compat.reshard_like(result, joined), group)
    for i, result in zip(members, results):
      out[i] = result
  return out


def _unjoin(joined: jax.Array, group: Sequence[jax.Array]) -> list[jax.Array]:
  """The stacks of ``group`` back from their concatenation ``joined``."""
  offsets = np.cumsum([0] + [s.shape[0] for s in group])
  return [joined[lo:hi] for lo, hi in zip(offsets[:-1], offsets[1:])]


def one_at_a_time(orthogonalize, group: Sequence[jax.Array], coeffs) -> list[jax.Array]:
  return [orthogonalize(s, coeffs) for s in group]


def batched(orthogonalize, group: Sequence[jax.Array], coeffs) -> list[jax.Array]:
  return _unjoin(orthogonalize(jnp.concatenate(group), coeffs), group)


def _orthogonalize_group(orthogonalize, group: Sequence[jax.Array], coeffs) -> list[jax.Array]:
  """``orthogonalize`` of same-shape stacks: one stack at a time on a TPU, else one batch.

  Chosen when lowered (`pallasopt.kernels.by_target`), from what each
  compiled step moves (HBM bytes of XLA's compiled module, from a CPU host;
  GPT-2 small's twelve 768x3072 matrices): on a TPU v5e the batch overflows
  VMEM and XLA keeps the iterates in HBM, 77 B per param against 20 one at a
  time (optax.contrib.muon's 20); on an H100 the batch moves 226 against 253.
  (On a CPU, XLA 0.10.2's compiler crashes on GPT-2 small's 48 matrices one
  at a time with ``gram_levels=4``; batched it compiles.)
  """
  singly = functools.partial(one_at_a_time, orthogonalize)
  together = functools.partial(batched, orthogonalize)
  if len(group) == 1:
    return singly(group, coeffs)
  choose = lambda target: singly if target.platform == "tpu" else None
  return by_target(together, choose)(list(group), coeffs)


def resolve_coeffs(ns_coeffs, ns_steps, ns_rule, custom_ns_coeffs):
  """The coefficients stored in ``MuonState.ns_coeffs`` (numpy), as Optax would."""
  if isinstance(ns_coeffs, str):
    if ns_coeffs in OPTAX_PRESETS:
      coeffs = np.asarray(OPTAX_PRESETS[ns_coeffs], np.float32)
    elif ns_coeffs in ns_coefficients.PRESETS:
      try:
        return ns_coefficients.preset_table(ns_coeffs, ns_steps)
      except ValueError as e:
        raise ValueError(f"{OWNER}: ns_coeffs={ns_coeffs!r}, ns_steps={ns_steps!r}: {e}") from e
    elif ns_coeffs == "custom":
      if custom_ns_coeffs is None:
        raise ValueError(f"{OWNER}: ns_coeffs='custom' needs custom_ns_coeffs.")
      return np.asarray(ns_coefficients.coefficient_table(custom_ns_coeffs, ns_steps, ns_rule or "cycle"))
    else:
      names = sorted(OPTAX_PRESETS) + sorted(ns_coefficients.PRESETS) + ["custom"]
      raise ValueError(f"{OWNER}: unknown ns_coeffs preset {ns_coeffs!r}; expected one of {names}.")
  else:
    coeffs = np.asarray(ns_coeffs, np.float32)
  if coeffs.ndim not in (1, 2) or coeffs.shape[-1] != 3:
    raise ValueError(f"{OWNER}: ns_coeffs must have shape (3,) or (n, 3); got {coeffs.shape}.")
  if ns_rule is not None:
    return np.asarray(ns_coefficients.coefficient_table(coeffs, ns_steps, ns_rule))
  if coeffs.ndim == 2 and coeffs.shape[0] > ns_steps:
    raise ValueError(
        f"{OWNER}: ns_coeffs has {coeffs.shape[0]} rows but ns_steps={ns_steps}; "
        "Optax requires rows <= ns_steps."
    )
  return coeffs
