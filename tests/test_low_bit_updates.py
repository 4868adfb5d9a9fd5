"""The largest single update with low-bit state, against the reference's.

A final loss cannot show a low-bit state that decodes its second moment to
zero: single weights then move hundreds of times further than the learning
rate allows while the loss looks fine. These tests bound the largest
per-step update of the blockwise formats (and, on the spike test and
digits, bf16) against the same optimizer with f32 state (Optax's, or Muon in
f32) on the same gradients. The sequences and the digits task are
`bench.low_bit`'s, which prints the figures.

The bounds, from the maps (`pallasopt.kernels.quant`). AdamW's update is
:math:`m / \\sqrt v`; its state keeps the root :math:`w` of :math:`v`
(stochastically rounded on a map whose neighbours are at most
:math:`\\epsilon_w = 2^{-4}` apart, relative) and the ratio :math:`r = m / w`
(one gap of its map at most, :math:`\\epsilon_r` of the block's largest
ratio: :math:`2^{-4}/T = 1/31` on int8's e3m4 map, :math:`2^{-3}` for e4m3). A
decoded root below the true one by up to one step scales an update up by
:math:`1 / (1 - \\epsilon_w)`; the ratio's error moves the first moment
:math:`\\beta_1 m` by up to :math:`\\epsilon_r` of the largest, so no update
exceeds :math:`(1 + \\beta_1\\epsilon_r) / (1 - \\epsilon_w)` of the largest
reference update seen so far. RMSProp's update :math:`g / \\sqrt v` carries
the root's factor only.
"""

import functools

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pallasopt
from bench.low_bit import (
    LR,
    SPIKE_PARAMS,
    digits_run,
    largest_update,
    largest_updates,
    random_signs,
    sparse_bursts,
    spike_gradients,
    step_updates,
    vanishing,
)

_ROOT_STEP = {"int8": 2.0**-4, "fp8": 2.0**-4, "int4": 2.0**-2}
_RATIO_GAP = {"int8": 1 / 31, "fp8": 2.0**-3, "int4": 1 / 7}
_ADAM_BOUND = {fmt: (1 + 0.9 * gap) / (1 - _ROOT_STEP[fmt]) for fmt, gap in _RATIO_GAP.items()}
FORMATS = ["int8", "fp8", "int4"]
# The spike test's bound: Optax's largest update plus 5% (the 8-bit formats
# and bf16 measure 1.00-1.03x); int4 is held to its maps' bound (1.50x) and
# measures 1.065x (`bench.low_bit`): its root map's steps of up to 1/4.
_SPIKE_BOUND = {"int8": 1.05, "fp8": 1.05, "bf16": 1.05, "int4": _ADAM_BOUND["int4"]}
_SEQUENCES = {sequence.__name__: sequence for sequence in (
    spike_gradients, random_signs, vanishing, sparse_bursts)}


# The references, the same for every format: computed once per run.
@functools.cache
def _reference_largest(family: str, sequence: str) -> np.ndarray:
  """Per step, the largest |update| / lr of ``family`` with f32 state on a sequence.

  ``family``: a pallasopt drop-in, or ``"optax-<name>"`` for Optax's own.
  """
  optax_name = family.removeprefix("optax-")
  reference = getattr(optax if optax_name != family else pallasopt.optim, optax_name)
  return largest_updates(reference(LR), _SEQUENCES[sequence](), SPIKE_PARAMS)


@functools.cache
def _reference_digits(family: str) -> tuple[float, float]:
  """Digits' final loss and largest step with f32 state: Optax's AdamW, or Muon."""
  return digits_run(optax.adamw(LR) if family == "adamw" else pallasopt.optim.muon(3e-3))


@pytest.mark.parametrize("fmt", [*FORMATS, "bf16"])
@pytest.mark.parametrize("low", [-6.0, -8.0])
def test_the_spike_test_moves_no_weight_further_than_optax(fmt, low):
  # A 16 x 256 leaf, the same gradient every step, magnitudes over 10^0 ..
  # 10^low in each row (a block), AdamW(1e-3), 20 steps: Optax moves every
  # weight by lr each step. Before 2026-11-26 int8 state moved 1696 of them
  # by more than 2 lr at step 20 (7.0 lr at most), fp8 1920 (8.0 lr).
  want = largest_updates(optax.adamw(LR), spike_gradients(low), SPIKE_PARAMS)
  tx = pallasopt.optim.adamw(LR, state_format=fmt)
  updates = list(step_updates(tx, spike_gradients(low), SPIKE_PARAMS))
  got = [largest_update(u) for u in updates]
  assert max(got) <= _SPIKE_BOUND[fmt] * want.max(), (got, want)
  assert int(jnp.sum(jnp.abs(updates[-1]["w"]) > 2 * LR)) == 0


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("grads", [random_signs, vanishing, sparse_bursts],
                         ids=["random-signs", "vanishing", "sparse-bursts"])
@pytest.mark.parametrize("family", ["adamw", "nadamw", "mars"])
def test_no_step_outgrows_the_reference_by_more_than_the_maps_allow(family, grads, fmt):
  # Every step's largest update is within the bound of the module docstring
  # of the largest reference update so far (the reference: the same
  # transform with f32 state, which the drop-in tests hold to Optax's).
  want = np.maximum.accumulate(_reference_largest(family, grads.__name__))
  make = getattr(pallasopt.optim, family)
  got = largest_updates(make(LR, state_format=fmt), grads(), SPIKE_PARAMS)
  assert np.all(got <= _ADAM_BOUND[fmt] * want), (got / want).max()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("grads", [spike_gradients, random_signs, vanishing],
                         ids=["constant", "random-signs", "vanishing"])
def test_rmsprop_steps_carry_only_the_roots_error(grads, fmt):
  want = np.maximum.accumulate(_reference_largest("optax-rmsprop", grads.__name__))
  got = largest_updates(pallasopt.optim.rmsprop(LR, state_format=fmt), grads(), SPIKE_PARAMS)
  assert np.all(got <= want / (1 - _ROOT_STEP[fmt])), (got / want).max()


# The rounding seeds digits runs with: a final loss is a random variable of
# the stochastic roundings, and the bound is on the format, not on one
# draw. int4 sits near it (jax 0.10.2, CPU, 8 seeds: +2.5% to +3.4% of Optax's
# loss, mean +2.9%; at XLA's default CPU flags 6 seeds +2.6% to +3.3%), so one
# seed's pass or fail would be the draw's; four seeds' mean is steadier
# (standard error ~0.18%).
_DIGITS_SEEDS = range(4)


@pytest.mark.parametrize("fmt", [*FORMATS, "bf16"])
def test_digits_steps_and_loss_track_optax(fmt):
  # 300 AdamW(1e-3) steps on digits (its 64 x 64 first layer holds low-bit
  # state), once per rounding seed: no weight moves more than twice Optax's
  # largest step in any run, and the mean final loss is within 3% of Optax's.
  # Measured (jax 0.10.2, CPU): Optax 0.1664, largest step 0.0022; int4 mean
  # 0.1713, 0.0019; before 2026-11-26 int8 moved a weight 0.51 in a step.
  ref_loss, ref_step = _reference_digits("adamw")
  runs = [digits_run(pallasopt.optim.adamw(LR, state_format=fmt, seed=seed))
          for seed in _DIGITS_SEEDS]
  losses, largest = zip(*runs, strict=True)
  assert max(largest) <= 2 * ref_step, (largest, ref_step)
  assert abs(np.mean(losses) - ref_loss) <= 0.03 * ref_loss, (losses, ref_loss)


@pytest.mark.parametrize("fmt", FORMATS)
def test_muon_momentum_steps_track_f32_muon(fmt):
  # Muon's momentum is stored as itself (its orthogonalization divides by
  # nothing elementwise); the spike test and digits (Muon at 3e-3, 300 steps,
  # still training: loss 0.782) bound its steps against Muon with f32
  # momentum. Measured (jax 0.10.2, CPU): int8 0.786, fp8 0.789, int4 0.800
  # (the spike test's largest update: 1.0x Muon's in every format); to nearest,
  # before 2026-11-26, int8 ended 4.7% off. (At 1e-2, near convergence, the
  # losses are 0.050, 0.054 and 0.056: orthogonalization gives the noise of
  # any stored momentum a full-size step.)
  want = _reference_largest("muon", "spike_gradients")
  got = largest_updates(pallasopt.optim.muon(LR, state_format=fmt), spike_gradients(), SPIKE_PARAMS)
  assert got.max() <= 1.05 * want.max(), (got, want)
  ref_loss, ref_step = _reference_digits("muon")
  loss, largest = digits_run(pallasopt.optim.muon(3e-3, state_format=fmt))
  assert largest <= 2 * ref_step, (largest, ref_step)
  assert abs(loss - ref_loss) <= 0.03 * ref_loss, (loss, ref_loss)
