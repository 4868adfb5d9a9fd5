"""Real GPU and TPU targets for the compile tier, from this CPU-only host.

The targets and compiling for them are `pallasopt.compile_check`'s (the
``aot`` extra); this adds what the tests need: skipping where the tier's
packages or ``JAX_PLATFORMS=cpu`` are missing (BUILD.md).
"""

from __future__ import annotations

import pytest

from pallasopt.compile_check import TARGETS, compile_for, compiled_kernels, devices, missing

__all__ = ["TPU_TARGETS", "require", "devices", "compile_for", "compiled_kernels"]

TPU_TARGETS = tuple(name for name, (platform, _) in TARGETS.items() if platform == "tpu")


def require(name: str) -> None:
  """Skips the calling test unless target ``name`` can be compiled for here."""
  why = missing(name)
  if why is not None:
    pytest.skip(why)
