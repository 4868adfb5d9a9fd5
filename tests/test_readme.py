"""Every python block of the README runs alone, as a user pastes it into a fresh interpreter."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

_README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
_BLOCKS = re.findall(r"```python\n(.*?)```", _README.read_text(), re.S)


def test_the_readme_has_python_blocks():
  assert len(_BLOCKS) >= 10


@pytest.mark.parametrize("index", range(len(_BLOCKS)))
def test_a_readme_block_runs_alone(index, tmp_path):
  # A fresh process, outside the checkout, with no device count set from outside:
  # a block that needs several CPU devices says so itself.
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  run = subprocess.run([sys.executable, "-c", _BLOCKS[index]], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600, check=False)
  assert run.returncode == 0, f"block {index}:\n{_BLOCKS[index]}\n{run.stderr[-3000:]}"
