r"""Muon as a drop-in for `optax.contrib.muon`, on the Newton–Schulz kernels.

Muon (Jordan, `Muon <https://kellerjordan.github.io/posts/muon/>`_, 2024)
keeps a momentum :math:`\mu` of each weight matrix and steps along an
approximation of its orthogonal polar factor, computed by Newton–Schulz
(`pallasopt.kernels.newton_schulz`). Leaves that are not matrices (and any the
user routes away) get (N)AdamW, on the fused AdamW kernel, exactly as Optax
routes them.

The optimizer state is exactly ``optax.contrib.muon(...).init(params)``'s::

  PartitionState(inner_states={
      'adam': MaskedState((ScaleByAdamState, <decay state>, <lr state>)),
      'muon': MaskedState((MuonState(count, mu, ns_coeffs), EmptyState(),
                           <decay state>, <lr state>)),
  })

so ``state[0]['muon'][0][0].mu`` is the momentum and a checkpoint written with
one optimizer restores into the other. Only the opt-in ``second_moment``
option adds a fifth element to the Muon tuple (`MuonSecondMomentState`).

Sharded matrices. Inside ``jit`` with sharded params, the Newton–Schulz
kernel is an opaque custom call that XLA does not partition: every matrix is
gathered, orthogonalized whole and the result resharded. That is the default,
and it is exact (Megatron's ``"duplicated"`` mode). ``blockwise=(r, c)``
instead orthogonalizes each of the ``r x c`` blocks of a matrix on its own
(with its own shape scale): with blocks equal to the shards, no gather is
needed. It is an approximation (Megatron's ``"blockwise"`` mode), so opt-in.

Distributed Newton–Schulz. On a data-parallel mesh every device would run the
whole Newton–Schulz of every matrix. ``distributed_axes=("data",)`` splits
that work (as Moonlight and Dion distribute it): each batch of same-shape
matrices is padded to a multiple of the N devices of those axes, laid out
along them (one all-to-all from row-sharded params, a local slice from
replicated ones), orthogonalized per device inside ``shard_map``, and
returned to the params' layout (one all-gather per shape group). No
collective runs inside the iterations, and each matrix gets the same math
as without the option. Inside ``shard_map`` over those axes (a pipeline
stage's data axis), where each device holds the same matrices, each
orthogonalizes its slice and one all-gather per shape group shares them.
"""

from pallasopt.optim.muon._options import (
    MUON_STATIC_ARGS,
    OPTAX_PRESETS,
    SCALE_MODES,
    SECOND_MOMENTS,
    MuonSecondMomentState,
    shape_scale,
)
from optax.contrib import MuonDimensionNumbers, MuonState

from pallasopt.optim.muon._transform import muon

__all__ = [
    "muon",
    "MuonDimensionNumbers",
    "MuonState",
    "MuonSecondMomentState",
    "OPTAX_PRESETS",
    "SCALE_MODES",
    "SECOND_MOMENTS",
    "shape_scale",
    "MUON_STATIC_ARGS",
]
