"""The full kernel sweep: every optimizer family, every size, every tree.

  python -m bench.kernels                      # full sweep (accelerator)
  python -m bench.kernels --quick              # what `python -m bench` runs
  python -m bench.kernels --filter 'adamw/leaf/f32' --kernel-impls auto,xla
  python -m bench.kernels --profile /tmp/trace # + a jax.profiler trace per configuration

Results are appended to ``bench/results/<device-kind>/kernels-<tier>.jsonl``
(resumable: configurations already there are skipped), with the Markdown
table beside it (``.md``); ``python -m bench.plot`` draws them. Each family is
one module ``bench/cases_<family>.py`` listed in `FAMILIES` (the interface is
documented in `bench.harness`).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from bench import harness

# One entry per optimizer family: the module bench/cases_<name>.py.
FAMILIES: tuple[str, ...] = (
    "adamw", "lion", "rmsprop", "mars", "adafactor", "muon", "kron", "white_kron",
)


def cases(tier: str, families: Sequence[str] = FAMILIES) -> list[harness.Case]:
  """Every family's cases for a tier, in `FAMILIES` order."""
  out = []
  for name in families:
    out += importlib.import_module(f"bench.cases_{name}").cases(tier)
  return out


def main(argv: Sequence[str] | None = None, default_tier: str = "full") -> list[dict]:
  return harness.main(
      argv, cases, script="kernels", default_tier=default_tier,
      prog="python -m bench" if default_tier == "quick" else "python -m bench.kernels",
      description="pallasopt optimizer steps against jitted Optax: time, GB/s or TFLOP/s, "
      "% of the datasheet peak and of a measured ceiling (copy stream, or a matmul in the case's "
      "dtype), peak memory.",
  )


if __name__ == "__main__":
  main(sys.argv[1:])
