"""The package's face: its version, license and changelog say the same as pyproject.toml."""

import importlib.metadata
import pathlib
import tomllib

import pallasopt

_ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_version_license_and_changelog_agree_with_pyproject():
  project = tomllib.loads((_ROOT / "pyproject.toml").read_text())["project"]
  assert pallasopt.__version__ == project["version"] == importlib.metadata.version("pallasopt")
  assert project["license"]["text"] == "Apache-2.0"
  assert "Apache License\n                           Version 2.0" in (_ROOT / "LICENSE").read_text()
  assert f"## {pallasopt.__version__} " in (_ROOT / "CHANGELOG.md").read_text()
