"""The manual: its examples run, its figures are its records', its API pages list every public name.

The README and every page under docs/ are checked here; CI also builds the
docs with warnings as errors (BUILD.md).
"""

import doctest
import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest

from bench import figures

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_PAGES = figures.pages()


def _python_blocks() -> list[tuple[str, str]]:
  """Every python block of every page, each once (a block shown on two pages runs once)."""
  seen, blocks = set(), []
  for page in _PAGES:
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
      if block not in seen:
        seen.add(block)
        blocks.append((str(page.relative_to(_ROOT)), block))
  return blocks


_BLOCKS = _python_blocks()


def test_the_pages_are_the_readme_and_the_docs():
  names = {str(p.relative_to(_ROOT)) for p in _PAGES}
  assert "README.md" in names and "docs/getting_started.md" in names
  assert len(_BLOCKS) >= 10


@pytest.mark.parametrize("index", range(len(_BLOCKS)), ids=lambda i: f"{_BLOCKS[i][0]}-{i}")
def test_a_python_block_runs_alone(index, tmp_path):
  # A fresh process, outside the checkout, with no device count set from outside:
  # a block that needs several CPU devices says so itself.
  page, block = _BLOCKS[index]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  run = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600, check=False)
  assert run.returncode == 0, f"{page}:\n{block}\n{run.stderr[-3000:]}"


def test_every_figure_on_the_pages_is_rendered_from_its_records():
  stale = [str(p.relative_to(_ROOT)) for p in figures.stale_pages()]
  assert not stale, f"run `python -m bench.figures`: the figures of {stale} differ from the records"


def test_every_figure_is_on_a_page():
  shown = set()
  for page in _PAGES:
    shown.update(re.findall(r"<!-- figure: ([\w-]+) -->", page.read_text()))
  assert shown == set(figures.FIGURES)


def test_a_figure_that_disagrees_with_its_records_is_found():
  page = "<!-- figure: low-bit-stability -->\n| a stale table |\n<!-- /figure -->\n"
  rendered = figures.updated(page)
  assert rendered != page and "| a stale table |" not in rendered
  assert figures.updated(rendered) == rendered
  with pytest.raises(ValueError, match="unknown figure 'nope'"):
    figures.updated("<!-- figure: nope -->\n<!-- /figure -->")


@pytest.mark.parametrize("module", ["optim", "pipeline", "kernels"])
def test_the_api_reference_lists_every_public_name(module):
  page = (_ROOT / "docs" / "api" / f"{module}.md").read_text()
  listed = set(re.findall(r"^   (\w+)$", page, re.M)) | set(re.findall(r"py:data:: (\w+)", page))
  public = set(importlib.import_module(f"pallasopt.{module}").__all__)
  assert public <= listed, f"missing from docs/api/{module}.md: {sorted(public - listed)}"


def _documented_examples() -> list[tuple[str, str]]:
  found = []
  for module in ("optim", "pipeline", "kernels"):
    mod = importlib.import_module(f"pallasopt.{module}")
    found += [(module, name) for name in mod.__all__
              if ">>>" in (getattr(getattr(mod, name), "__doc__", None) or "")]
  return found


_EXAMPLES = _documented_examples()


def test_the_main_entry_points_show_an_example():
  shown = {name for _, name in _EXAMPLES}
  assert {"adamw", "apply_gradients", "clipped", "multi_steps", "convert_state"} <= shown


@pytest.mark.parametrize("module,name", _EXAMPLES)
def test_a_docstring_example_runs_as_written(module, name):
  # Each example runs alone (no module globals), as a user pastes it.
  obj = getattr(importlib.import_module(f"pallasopt.{module}"), name)
  tests = doctest.DocTestFinder(recurse=False).find(obj, name, globs={})
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  report = []
  for test in tests:
    runner.run(test, out=report.append)
  assert runner.tries > 0 and runner.failures == 0, "".join(report)


def test_the_readme_is_a_front_door():
  text = (_ROOT / "README.md").read_text()
  assert len(text.splitlines()) <= 250
  hashes = {h for h in re.findall(r"\b[0-9a-f]{7,40}\b", text)
            if re.search(r"[a-f]", h) and re.search(r"[0-9]", h)}
  assert len(hashes) <= 3, sorted(hashes)
  for link in re.findall(r"\]\(((?:docs/|BUILD|LICENSE|CHANGELOG)[^)#]*)", text):
    assert (_ROOT / link).exists(), link
