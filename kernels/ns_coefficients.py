r"""Newton–Schulz coefficient tables: the published presets and how a table covers the steps.

A table is ``(steps, 3)`` rows of ``(a, b, c)``, step ``k`` applying
:math:`p_k(\sigma) = a_k\sigma + b_k\sigma^3 + c_k\sigma^5` to every singular
value (`pallasopt.kernels.newton_schulz`). It is data, passed to the kernels as
an input, so changing it never recompiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "PRESETS",
    "REPEAT_LAST_PRESETS",
    "FIXED_STEP_PRESETS",
    "coefficient_table",
    "preset_table",
]

#: Newton–Schulz coefficient tables by name, one ``(a, b, c)`` row per step (expanded
#: to more steps by `preset_table`), as NVIDIA Emerging-Optimizers
#: (``orthogonalized_optimizers/muon_utils.py``) and Megatron-Core publish them.
PRESETS: dict[str, tuple[tuple[float, float, float], ...]] = {
    # Jordan's Muon (modded-nanogpt), repeated every step.
    "simple": ((3.4445, -4.7750, 2.0315),),
    # Per-step quintic coefficients (Cesista, modded-nanogpt train_gpt_medium).
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    # Amsel et al., The Polar Express (arXiv:2505.16932), with the 1.01 safety
    # factor; the last row repeats for more steps.
    "polar_express": (
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ),
    # Grishina et al., CANS (arXiv:2506.10935).
    "cans": (
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ),
    # Boissin et al., Turbo-Muon (arXiv:2512.04632), for AOL preconditioning.
    "aol": (
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ),
    # DeepSeek-V4: 8 fast steps, then 2 stabilizing steps towards exactly 1.
    "deepseekv4": ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2,
    # Five cubic steps (c = 0), as NVIDIA's 2026 MuOwn code ships them beside
    # the tables above. Each polynomial peaks at 1.3; composed, they map
    # singular values in [0.01, 1] into [0.77, 1.3]. Defined for 5 steps only.
    "cubic5": (
        (3.3656576, -3.3420992, 0.0),
        (2.5744352, -1.4957376, 0.0),
        (2.5368962, -1.4312570, 0.0),
        (2.4418906, -1.2764040, 0.0),
        (2.2230472, -0.9630650, 0.0),
    ),
}
# Tables whose last row repeats when more steps are asked for; others cycle.
REPEAT_LAST_PRESETS = ("polar_express", "cans", "deepseekv4")
# Tables designed as a whole for one step count: neither cycled nor extended.
FIXED_STEP_PRESETS = ("cubic5",)


def coefficient_table(
    coeffs: jax.typing.ArrayLike, steps: int | None = None, rule: str = "cycle"
) -> jax.Array:
  """The ``(steps, 3)`` f32 table of per-step ``(a, b, c)``.

  Args:
    coeffs: a ``(3,)`` triple, used for every step (``steps`` then required),
      or an ``(n, 3)`` table (may be traced, e.g. read from optimizer state).
    steps: number of steps; None for an ``(n, 3)`` table means ``n``.
    rule: for a table with fewer rows than ``steps``: ``"cycle"`` restarts
      from the first row, ``"repeat_last"`` repeats the last row.
  """
  coeffs = jnp.asarray(coeffs, jnp.float32)
  if coeffs.ndim not in (1, 2) or coeffs.shape[-1] != 3:
    raise ValueError(f"coeffs must have shape (3,) or (n, 3); got {coeffs.shape}.")
  if rule not in ("cycle", "repeat_last"):
    raise ValueError(f"rule must be 'cycle' or 'repeat_last'; got {rule!r}.")
  if coeffs.ndim == 1:
    if steps is None:
      raise ValueError("steps is required with a (3,) coefficient triple.")
    coeffs = coeffs[None]
  rows = coeffs.shape[0]
  steps = rows if steps is None else steps
  if not isinstance(steps, (int, np.integer)) or steps < 1:
    raise ValueError(f"steps must be a positive int; got {steps!r}.")
  index = np.arange(steps)
  index = index % rows if rule == "cycle" else np.minimum(index, rows - 1)
  return coeffs[index]


def preset_table(name: str, steps: int | None = None) -> np.ndarray:
  """A published table (`PRESETS`) expanded to ``steps`` rows by its rule.

  ``steps=None`` gives the table as published. A `FIXED_STEP_PRESETS` table
  takes only its own length.
  """
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}.")
  rows = len(PRESETS[name])
  if name in FIXED_STEP_PRESETS and steps not in (None, rows):
    raise ValueError(f"preset {name!r} is defined for exactly {rows} steps; got steps={steps!r}.")
  rule = "repeat_last" if name in REPEAT_LAST_PRESETS else "cycle"
  return np.asarray(coefficient_table(np.asarray(PRESETS[name]), steps, rule))
