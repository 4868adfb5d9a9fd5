"""The arithmetic of a circular pipeline schedule, in plain Python.

A stack of ``L = R * S * lps`` identical layers runs on ``S`` pipeline stages.
Stage ``s`` holds, for every repeat ``r < R``, the ``lps`` consecutive layers
``(r * S + s) * lps .. (r * S + s + 1) * lps - 1``, so a microbatch travels
round the stage ring ``R`` times (Narayanan et al., `Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM
<https://arxiv.org/abs/2104.04473>`_, 2021, interleaved schedule; MaxText's
``CircularPipeline``). With ``M`` microbatches, work item ``k = t - s`` is what
stage ``s`` computes at iteration ``t``:

.. math::

  k = t - s, \\quad m = k \\bmod M, \\quad r = \\lfloor k / M \\rfloor,
  \\qquad 0 \\le k < M R,

and iterations where ``k`` falls outside ``[0, M R)`` are bubbles. There are
``M R + S - 1`` iterations, so the bubble fraction is
``(S - 1) / (M R + S - 1)``. Stage 0 starts repeat ``r > 0`` of microbatch
``m`` at iteration ``r M + m``, while stage ``S - 1`` finished repeat ``r - 1``
of it at ``(r - 1) M + m + S - 1``: the schedule needs ``M >= S`` when
``R > 1``, and stage 0 holds each wrapped-round activation for ``M - S``
iterations in a circular buffer of that many slots.

With streamed io, microbatch inputs and outputs are sharded over the stages
(``M / S`` per stage, contiguous blocks) instead of replicated. Each iteration
``t`` the io column ``t mod (M / S)`` rotates one stage down the ring (stage
``s`` receives stage ``s + 1``'s slot), stage 0 reads its input from that
column before the rotation, and stage ``S - 1`` writes a finished output into
it. Microbatch ``m`` then ends on stage ``m div (M / S)`` (where its input
started) in column ``(m + S - 1) mod (M / S)``; `realign_outputs` rolls each
stage's columns back into order, without communication.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["CircularSchedule"]


def _positive_int(name: str, value: Any) -> int:
  try:
    as_int = operator.index(value)
  except TypeError:
    raise TypeError(f"CircularSchedule: {name} must be an int, got {value!r}.") from None
  if as_int < 1:
    raise ValueError(f"CircularSchedule: {name} must be >= 1, got {as_int}.")
  return as_int


@dataclasses.dataclass(frozen=True)
class CircularSchedule:
  """A circular pipeline schedule: who computes what at which iteration.

  Attributes:
    num_stages: ``S``, the pipeline stages (devices along the stage axis).
    num_microbatches: ``M``, the microbatches a batch is split into.
    num_repeats: ``R``, how many times a microbatch goes round the ring
      (each stage holds ``R`` non-consecutive groups of layers).
    layers_per_stage: ``lps``, consecutive layers per stage and repeat.
    streamed_io: inputs and outputs are sharded over the stages and streamed
      round the ring instead of replicated on every stage.

  Raises:
    TypeError: a count that is not an int.
    ValueError: a count < 1; ``R > 1`` with ``M < S``; streamed io with
      ``M % S != 0``.
  """

  num_stages: int
  num_microbatches: int
  num_repeats: int = 1
  layers_per_stage: int = 1
  streamed_io: bool = False

  def __post_init__(self):
    for field in ("num_stages", "num_microbatches", "num_repeats", "layers_per_stage"):
      object.__setattr__(self, field, _positive_int(field, getattr(self, field)))
    if not isinstance(self.streamed_io, (bool, np.bool_)):
      raise TypeError(f"CircularSchedule: streamed_io must be a bool, got {self.streamed_io!r}.")
    object.__setattr__(self, "streamed_io", bool(self.streamed_io))
    S, M, R = self.num_stages, self.num_microbatches, self.num_repeats
    if R > 1 and M < S:
      raise ValueError(
          f"CircularSchedule: a circular schedule (num_repeats={R} > 1) needs"
          f" num_microbatches >= num_stages, got num_microbatches={M} < num_stages={S}:"
          " stage 0 would need a microbatch's previous repeat before the last stage"
          " has finished it."
      )
    if self.streamed_io and M % S:
      raise ValueError(
          f"CircularSchedule: streamed io needs num_microbatches divisible by num_stages,"
          f" got num_microbatches={M}, num_stages={S}."
      )

  @classmethod
  def for_layers(
      cls,
      num_layers: int,
      num_stages: int,
      num_microbatches: int,
      num_repeats: int = 1,
      *,
      streamed_io: bool = False,
  ) -> CircularSchedule:
    """The schedule for ``num_layers`` layers, ``num_layers / (R S)`` per stage.

    Raises:
      ValueError: ``num_layers`` not divisible by ``num_stages * num_repeats``.
    """
    num_layers = _positive_int("num_layers", num_layers)
    groups = _positive_int("num_stages", num_stages) * _positive_int("num_repeats", num_repeats)
    if num_layers % groups:
      raise ValueError(
          f"CircularSchedule: num_layers={num_layers} is not divisible by"
          f" num_stages * num_repeats = {num_stages} * {num_repeats} = {groups}."
      )
    return cls(num_stages, num_microbatches, num_repeats, num_layers // groups, streamed_io)

  # ---- Sizes. ----

  @property
  def num_layers(self) -> int:
    """``L = R * S * lps``."""
    return self.num_repeats * self.num_stages * self.layers_per_stage

  @property
  def num_items(self) -> int:
    """Work items per stage, ``M * R``."""
    return self.num_microbatches * self.num_repeats

  @property
  def num_iterations(self) -> int:
    """``M * R + S - 1``."""
    return self.num_items + self.num_stages - 1

  @property
  def bubble_fraction(self) -> float:
    """``(S - 1) / (M * R + S - 1)``: the idle share of every stage's iterations."""
    return (self.num_stages - 1) / self.num_iterations

  @property
  def buffer_size(self) -> int:
    """Slots of stage 0's circular buffer: ``M - S`` when ``R > 1``, else 0."""
    return self.num_microbatches - self.num_stages if self.num_repeats > 1 else 0

  @property
  def microbatches_per_stage(self) -> int:
    """``M / S``, the io columns per stage with streamed io."""
    if not self.streamed_io:
      raise ValueError("CircularSchedule: microbatches_per_stage is defined for streamed io only.")
    return self.num_microbatches // self.num_stages

  # ---- Stacked-parameter layout. ----

  @property
  def stacked_shape(self) -> tuple[int, ...]:
    """Leading dims of a stacked param: ``(R, S)``, or ``(R, S, lps)`` if ``lps > 1``."""
    lps = (self.layers_per_stage,) if self.layers_per_stage > 1 else ()
    return (self.num_repeats, self.num_stages, *lps)

  @property
  def stacked_axes(self) -> int:
    """``len(stacked_shape)``: the ``stacked_axes`` to give the optimizer."""
    return len(self.stacked_shape)

  def layer_index(self, repeat: int, stage: int, sublayer: int = 0) -> int:
    """The layer that ``(repeat, stage, sublayer)`` holds: ``(r S + s) lps + j``."""
    return (repeat * self.num_stages + stage) * self.layers_per_stage + sublayer

  # ---- Who works on what, when. ----

  def work(self, iteration: int, stage: int) -> tuple[int, int] | None:
    """``(microbatch, repeat)`` stage ``stage`` computes at ``iteration``; None in a bubble."""
    item = iteration - stage
    if not 0 <= item < self.num_items:
      return None
    return item % self.num_microbatches, item // self.num_microbatches

  def iteration_of(self, stage: int, microbatch: int, repeat: int) -> int:
    """The iteration at which ``stage`` computes ``(microbatch, repeat)``."""
    return repeat * self.num_microbatches + microbatch + stage

  def work_table(self) -> np.ndarray:
    """``[iterations, S, 2]`` int array of ``(microbatch, repeat)``; ``-1`` in bubbles."""
    t = np.arange(self.num_iterations)[:, None]
    item = t - np.arange(self.num_stages)[None, :]
    valid = (item >= 0) & (item < self.num_items)
    table = np.stack([item % self.num_microbatches, item // self.num_microbatches], axis=-1)
    return np.where(valid[..., None], table, -1)

  @property
  def first_output_iteration(self) -> int:
    """The iteration at which the last stage finishes microbatch 0: ``(R-1) M + S - 1``."""
    return self.output_iteration(0)

  def output_iteration(self, microbatch: int) -> int:
    """The iteration at which the last stage finishes ``microbatch``."""
    return self.iteration_of(self.num_stages - 1, microbatch, self.num_repeats - 1)

  # ---- Streamed io. ----

  def io_column(self, iteration: int) -> int:
    """The io column that rotates at ``iteration`` (streamed io)."""
    return iteration % self.microbatches_per_stage

  def io_home(self, microbatch: int) -> tuple[int, int]:
    """``(stage, column)`` where ``microbatch``'s input starts (streamed io)."""
    return divmod(microbatch, self.microbatches_per_stage)

  def output_home(self, microbatch: int) -> tuple[int, int]:
    """``(stage, column)`` where ``microbatch``'s output ends before realignment."""
    per_stage = self.microbatches_per_stage
    return microbatch // per_stage, (microbatch + self.num_stages - 1) % per_stage

  @property
  def output_shift(self) -> int:
    """``(S - 1) mod (M / S)``: how far `realign_outputs` rolls each stage's columns."""
    return (self.num_stages - 1) % self.microbatches_per_stage

  def realign_outputs(self, columns: Any, axis: int = 0) -> Any:
    """One stage's output columns in microbatch order (numpy or jax arrays).

    Column ``b`` of the result is column ``(b + S - 1) mod (M / S)`` of
    `columns`, a local roll: no data moves between stages.
    """
    roll = np.roll if isinstance(columns, np.ndarray) else jnp.roll
    return roll(columns, -self.output_shift, axis=axis)
