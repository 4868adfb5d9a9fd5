"""``python -m bench.low_bit_libraries``: low-bit AdamW of torchao and bitsandbytes on `bench.low_bit`'s gradients.

The same gradient sequences as `bench.low_bit` (the spike test over 20 and
`bench.low_bit.LONG_SPIKE_STEPS` steps, random signs, vanishing gradients,
sparse bursts; one 16 x 256 leaf, lr 1e-3, no weight decay) through
PyTorch's AdamW in f32, torchao's ``AdamW8bit`` and ``AdamW4bit`` and
bitsandbytes' ``AdamW8bit``, beside Optax's AdamW and pallasopt's
``state_format="int8"`` and ``"int4"``: per sequence, the largest single
update over the learning rate. Each library keeps its own defaults; the
leaf's 4096 elements are as few as any of them quantizes, and each row says
what its state stores.

Needs torch, torchao and bitsandbytes beside the ``test`` extra, which the
project does not depend on (a scratch environment: ``pip install
torch==2.13.0 torchao bitsandbytes`` then ``pip install -e ".[test]"``);
``--json PATH`` writes the rows with every library's version and the commit
(bench/results/low-bit-libraries.json). CPU is enough: the numbers are each
library's math.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax

import pallasopt
from bench import low_bit

__all__ = ["SEQUENCES", "torch_largest_updates", "rows", "main"]

# name -> gradient sequence (bench.low_bit's), each of one 16 x 256 leaf "w".
SEQUENCES: dict[str, Callable[[], list[dict[str, Any]]]] = {
    "spike": low_bit.spike_gradients,
    "long_spike": lambda: low_bit.spike_gradients(steps=low_bit.LONG_SPIKE_STEPS),
    "random_signs": low_bit.random_signs,
    "vanishing": low_bit.vanishing,
    "sparse_bursts": low_bit.sparse_bursts,
}


def torch_largest_updates(
    make: Callable[[list], Any], grads: Sequence[dict[str, Any]]
) -> tuple[np.ndarray, Any]:
  """Per step, the largest |update| / lr of a torch optimizer ``make([param])`` over ``grads``.

  Returns those and the optimizer, holding its state after the last step.
  """
  import torch  # noqa: PLC0415 - optional: this script's environment only

  param = torch.nn.Parameter(torch.zeros(low_bit.SPIKE_PARAMS["w"].shape))
  optimizer = make([param])
  out = []
  for g in grads:
    before = param.detach().clone()
    param.grad = torch.as_tensor(np.asarray(g["w"]))
    optimizer.step()
    out.append(float((param.detach() - before).abs().max()) / low_bit.LR)
  return np.asarray(out), optimizer


def _torch_optimizers() -> dict[str, tuple[str, Callable[[list], Any]]]:
  """name -> (library, factory of the optimizer of a list of params)."""
  import bitsandbytes  # noqa: PLC0415
  import torch  # noqa: PLC0415
  from torchao import optim as torchao_optim  # noqa: PLC0415

  lr = low_bit.LR
  return {
      "torch.optim.AdamW (f32)": (
          "torch", lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.0)),
      "torchao AdamW8bit": (
          "torchao", lambda p: torchao_optim.AdamW8bit(p, lr=lr, weight_decay=0.0)),
      "torchao AdamW4bit": (
          "torchao", lambda p: torchao_optim.AdamW4bit(p, lr=lr, weight_decay=0.0)),
      "bitsandbytes AdamW8bit": (
          "bitsandbytes", lambda p: bitsandbytes.optim.AdamW8bit(p, lr=lr, weight_decay=0.0)),
  }


def _torch_state(optimizer: Any) -> str:
  """What the optimizer's one param keeps per element: each such state tensor's type or dtype.

  Per-block scales and code maps (smaller than the param) are left out.
  """
  (state,) = optimizer.state.values()
  size = low_bit.SPIKE_PARAMS["w"].size
  return ", ".join(
      f"{k}: {str(v.dtype).removeprefix('torch.') if type(v).__name__ == 'Tensor' else type(v).__name__}"
      for k, v in sorted(state.items()) if hasattr(v, "numel") and v.numel() == size)


def rows() -> list[dict[str, Any]]:
  """One row per optimizer: the largest update / lr on each sequence."""
  out = []
  jax_optimizers = {
      "optax.adamw (f32)": ("optax", optax.adamw(low_bit.LR)),
      'pallasopt adamw, state_format="int8"': (
          "pallasopt", pallasopt.optim.adamw(low_bit.LR, state_format="int8")),
      'pallasopt adamw, state_format="int4"': (
          "pallasopt", pallasopt.optim.adamw(low_bit.LR, state_format="int4")),
  }
  blockwise = pallasopt.kernels.quant.is_blockwise
  for name, (library, tx) in jax_optimizers.items():
    state = jax.eval_shape(tx.init, low_bit.SPIKE_PARAMS)
    stored = sorted({type(x).__name__ if blockwise(x) else str(x.dtype)
                     for x in jax.tree.leaves(state, is_leaf=blockwise)
                     if blockwise(x) or x.shape != ()})
    row = {"optimizer": name, "library": library, "stores": ", ".join(stored)}
    for label, grads in SEQUENCES.items():
      row[f"{label}_largest_update_over_lr"] = float(
          low_bit.largest_updates(tx, grads()).max())
    out.append(row)
  for name, (library, make) in _torch_optimizers().items():
    row = {"optimizer": name, "library": library}
    for label, grads in SEQUENCES.items():
      updates, optimizer = torch_largest_updates(make, grads())
      row[f"{label}_largest_update_over_lr"] = float(updates.max())
    row["stores"] = _torch_state(optimizer)
    out.append(row)
  return out


def _versions() -> dict[str, str]:
  found = {}
  for dist in ("pallasopt", "jax", "optax", "torch", "torchao", "bitsandbytes"):
    try:
      found[dist] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      found[dist] = None
  return found


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--json", help="write the rows (with the versions and the commit) here")
  args = parser.parse_args(argv)
  records = rows()
  for r in records:
    print(r)
  if args.json:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    with open(args.json, "w") as f:
      json.dump({**_versions(), "commit": commit, "backend": "cpu", "lr": low_bit.LR,
                 "rows": records}, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1:])
