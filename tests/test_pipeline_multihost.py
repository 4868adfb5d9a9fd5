"""Two processes on localhost, two CPU devices each, run one pipeline train step.

`jax.distributed.initialize` joins the processes through a coordinator on
127.0.0.1; CPU collectives across processes use gloo
(``jax_cpu_collectives_implementation``). The worker script runs three steps
of a (stage=2, data=2) mesh whose stage ring crosses the process boundary and
checks them against the unpipelined model; see pipeline_multihost_worker.py.
"""

import os
import pathlib
import socket
import subprocess
import sys

WORKER = pathlib.Path(__file__).with_name("pipeline_multihost_worker.py")
NUM_PROCESSES = 2


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_process_cpu_launch():
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  port = free_port()
  workers = [
      subprocess.Popen(
          [sys.executable, str(WORKER), str(port), str(i), str(NUM_PROCESSES)],
          cwd=WORKER.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      )
      for i in range(NUM_PROCESSES)
  ]
  logs = []
  try:
    for worker in workers:
      logs.append(worker.communicate(timeout=300)[0])
  finally:
    for worker in workers:
      if worker.poll() is None:
        worker.kill()
  for i, (worker, log) in enumerate(zip(workers, logs)):
    assert worker.returncode == 0, f"process {i} failed:\n{log[-4000:]}"
    assert log.rstrip().splitlines()[-1].startswith("OK "), log[-2000:]
  # Both processes saw the same (replicated) loss.
  assert len({log.rstrip().splitlines()[-1] for log in logs}) == 1
