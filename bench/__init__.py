"""pallasopt's benchmark scripts (run from the repository root; not installed).

* ``python -m bench`` -- quick sweep; ``python -m bench.kernels`` -- full sweep;
* ``python -m bench.plot`` -- PNG from the JSONL results.

`bench.harness` documents the case interface each
``bench/cases_<family>.py`` implements and runs the cases; `bench.timing`
measures one configuration and the ceilings; `bench.records` keeps the
records, their provenance and the table; `bench.workloads` the shared
parameter trees and their random data.
"""

import os
import sys


def fake_cpu_devices(count: int) -> None:
  """Has this process's JAX run on ``count`` CPU devices; call before JAX starts (else a no-op)."""
  if "jax" in sys.modules:
    return
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
