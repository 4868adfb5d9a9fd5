"""``python -m bench.low_bit``: the largest single update with low-bit state, against f32 state.

A final loss cannot show a low-bit state whose second moment decodes to
zero: single weights then move hundreds of times further than the learning
rate allows while the loss looks fine. This bench runs, for each
``state_format``, the same gradients through the optimizer with f32 state
and with low-bit state and reports the largest per-step update beside the
final loss:

* the spike test: one 16 x 256 leaf whose gradient is the same every step,
  its magnitudes spanning 10^0 .. 10^-6 (or 10^-8) inside each 256-element
  row (a quantization block), AdamW(1e-3), 20 ``tx.update`` steps: the
  largest |update| / lr, and the elements moved by more than 2 lr at the
  last step; and its largest update over `LONG_SPIKE_STEPS` steps, where a
  still root held on the code below it for tens of steps shows (the
  update tends to the ratio of the two codes around the root);
* harder sequences (random signs over 10^-8 .. 1, gradients that vanish,
  sparse bursts) whose largest step `tests/test_low_bit_updates.py` bounds;
* scikit-learn's digits (1797 8x8 images), a 64-64-10 tanh MLP, 300
  full-batch AdamW(1e-3) steps (Muon(3e-3) for Muon's momentum): the largest
  step of any weight and the final loss.

The numbers are the math of the XLA reference (the kernels store the same
codes, `tests/test_low_bit_state.py`), so any host gives them: ``--json
PATH`` writes the rows with the jax version and commit
(bench/results/low-bit-updates.json). Needs scikit-learn (the ``test``
extra).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pallasopt

__all__ = [
    "LR",
    "LONG_SPIKE_STEPS",
    "SPIKE_PARAMS",
    "digits_mlp",
    "largest_update",
    "spike_gradients",
    "random_signs",
    "vanishing",
    "sparse_bursts",
    "step_updates",
    "largest_updates",
    "digits_run",
    "rows",
    "main",
]

LR = 1e-3
# The long spike run: long enough for the first moment to relax while the
# root sits on one code (its update was still rising at 200 with "int4").
LONG_SPIKE_STEPS = 200
# The leaf of every synthetic sequence: 16 rows of one 256-element block each.
SPIKE_PARAMS = {"w": jnp.zeros((16, 256), jnp.float32)}


def _magnitudes(low: float) -> np.ndarray:
  """Each 256-element row spans 10^0 .. 10^low."""
  return np.repeat(10.0 ** np.linspace(0, low, 256)[None, :], 16, axis=0).astype(np.float32)


def spike_gradients(low: float = -6.0, steps: int = 20) -> list[dict[str, jax.Array]]:
  """The spike test: the same gradient every step, magnitudes over 10^0 .. 10^low per row."""
  return [{"w": jnp.asarray(_magnitudes(low))}] * steps


def random_signs(steps: int = 50, seed: int = 0) -> list[dict[str, jax.Array]]:
  """Fixed magnitudes over 10^-8 .. 1 with signs drawn anew every step."""
  rng = np.random.default_rng(seed)
  magnitudes = 10.0 ** rng.uniform(-8, 0, (16, 256))
  return [{"w": jnp.asarray(magnitudes * rng.choice([-1.0, 1.0], (16, 256)), jnp.float32)}
          for _ in range(steps)]


def vanishing(steps: int = 60) -> list[dict[str, jax.Array]]:
  """20 steps of the spike test's gradient (to 10^-8), 20 of a thousandth of it, then zeros."""
  g = _magnitudes(-8)
  scale = lambda t: 1.0 if t < 20 else (1e-3 if t < 40 else 0.0)
  return [{"w": jnp.asarray(g * scale(t), jnp.float32)} for t in range(steps)]


def sparse_bursts(steps: int = 60, seed: int = 1) -> list[dict[str, jax.Array]]:
  """A tenth of the elements at a time, magnitudes over 10^-8 .. 1, random signs."""
  rng = np.random.default_rng(seed)
  base = 10.0 ** rng.uniform(-8, 0, (16, 256))
  return [{"w": jnp.asarray(base * (rng.random((16, 256)) < 0.1)
                            * rng.choice([-1.0, 1.0], (16, 256)), jnp.float32)}
          for _ in range(steps)]


def step_updates(
    tx: optax.GradientTransformation, grads: Sequence[Any], params: Any = None
) -> Iterator[Any]:
  """The updates of jitted ``tx.update`` from ``tx.init(params)`` over the gradient sequence."""
  params = SPIKE_PARAMS if params is None else params
  update = jax.jit(tx.update)
  state = tx.init(params)
  for g in grads:
    u, state = update(g, state, params)
    yield u


def largest_update(u: Any, lr: float = LR) -> float:
  """The largest |update| / lr of one step's updates (any tree)."""
  return max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(u)) / lr


def largest_updates(
    tx: optax.GradientTransformation, grads: Sequence[Any], params: Any = None, lr: float = LR
) -> np.ndarray:
  """Per step, the largest |update| / lr of ``tx.update`` over the gradient sequence."""
  return np.asarray([largest_update(u, lr) for u in step_updates(tx, grads, params)])


def digits_mlp(hidden: int) -> tuple[dict[str, jax.Array], Callable[[Any], jax.Array]]:
  """scikit-learn's digits (1797 8x8 images, 10 classes) and a 64-hidden-10 tanh MLP.

  Returns ``(init_params, loss)``; ``loss(params)`` is the full-batch mean
  cross-entropy, computed in f32 whatever the params' dtype.
  """
  from sklearn.datasets import load_digits

  digits = load_digits()
  x = jnp.asarray(digits.data / 16.0, jnp.float32)
  y = jnp.asarray(digits.target)
  k1, k2 = jax.random.split(jax.random.key(0))
  init = {"w1": jax.random.normal(k1, (64, hidden)) / 8, "b1": jnp.zeros(hidden),
          "w2": jax.random.normal(k2, (hidden, 10)) / np.sqrt(hidden), "b2": jnp.zeros(10)}

  def loss(p):
    p = jax.tree.map(lambda a: a.astype(jnp.float32), p)
    logits = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  return init, loss


def digits_run(tx: optax.GradientTransformation, steps: int = 300) -> tuple[float, float]:
  """Digits, a 64-64-10 MLP (its 64 x 64 layer takes low-bit state), ``steps`` full-batch steps.

  Returns the final loss and the largest step any weight took.
  """
  init, loss = digits_mlp(64)

  @jax.jit
  def step(p, s):
    new, s = pallasopt.optim.apply_gradients(tx, p, jax.grad(loss)(p), s)
    moved = jnp.max(jnp.stack([
        jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(p))]))
    return new, s, moved

  p, s, largest = init, tx.init(init), 0.0
  for _ in range(steps):
    p, s, moved = step(p, s)
    largest = max(largest, float(moved))
  return float(loss(p)), largest


_FORMATS = ("bf16", "int8", "fp8", "int4")


def rows() -> list[dict[str, Any]]:
  """One row per optimizer and state format (``None``: the f32 reference)."""
  out = []
  for name, make, reference, digits_lr in (
      ("adamw", pallasopt.optim.adamw, optax.adamw, LR),
      ("muon", pallasopt.optim.muon, pallasopt.optim.muon, 3e-3),
  ):
    for fmt in (None, *_FORMATS):
      build = (lambda lr: reference(lr)) if fmt is None else (
          lambda lr, fmt=fmt: make(lr, state_format=fmt))
      tx = build(LR)
      # One run of the long spike test; the spike test is its first steps.
      spike_steps, long_spike, u = len(spike_gradients()), [], None
      for step, update in enumerate(
          step_updates(tx, spike_gradients(steps=LONG_SPIKE_STEPS)), start=1):
        long_spike.append(largest_update(update))
        u = update if step == spike_steps else u
      long_spike = np.asarray(long_spike)
      spike = long_spike[:spike_steps]
      loss, step = digits_run(build(digits_lr))
      out.append({
          "optimizer": name, "state_format": fmt,
          "spike_largest_update_over_lr": float(spike.max()),
          "spike_moved_over_2lr_at_step_20": int(jnp.sum(jnp.abs(u["w"]) > 2 * LR)),
          "long_spike_largest_update_over_lr": float(long_spike.max()),
          **{f"{label}_largest_update_over_lr": float(largest_updates(tx, grads()).max())
             for label, grads in (("random_signs", random_signs), ("vanishing", vanishing),
                                  ("sparse_bursts", sparse_bursts))},
          "digits_lr": digits_lr, "digits_final_loss": loss, "digits_largest_step": step,
      })
  return out


def _table(records: list[dict[str, Any]]) -> str:
  lines = ["| optimizer | state | spike: largest update / lr | > 2 lr at step 20"
           f" | spike, {LONG_SPIKE_STEPS} steps | random signs"
           " | vanishing | sparse bursts | digits: largest step | digits: final loss |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in records:
    lines.append(
        f"| {r['optimizer']} | {r['state_format'] or 'f32'} | "
        f"{r['spike_largest_update_over_lr']:.3f} | {r['spike_moved_over_2lr_at_step_20']} | "
        f"{r['long_spike_largest_update_over_lr']:.3f} | "
        f"{r['random_signs_largest_update_over_lr']:.3f} | "
        f"{r['vanishing_largest_update_over_lr']:.3f} | "
        f"{r['sparse_bursts_largest_update_over_lr']:.3f} | {r['digits_largest_step']:.5f} | "
        f"{r['digits_final_loss']:.4f} |")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--json", help="write the rows (with jax's version and the commit) here")
  args = parser.parse_args(argv)
  records = rows()
  print(_table(records))
  if args.json:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    with open(args.json, "w") as f:
      json.dump({"jax": jax.__version__, "commit": commit, "backend": jax.default_backend(),
                 "rows": records}, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1:])
