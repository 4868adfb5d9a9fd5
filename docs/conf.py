"""Sphinx configuration of pallasopt's manual (built in CI with warnings as errors: BUILD.md)."""

import pallasopt

project = "pallasopt"
author = "The pallasopt authors"
copyright = "2026, The pallasopt authors"
release = version = pallasopt.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
# _generated/ holds the tables rendered from bench/results (`python -m
# bench.figures`); the pages include them, so they are not pages of their own.
exclude_patterns = ["_build", "_generated", "api/generated/*.md"]
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3

autosummary_generate = True
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
# Docstrings name other objects in single backticks, as Optax's do.
default_role = "py:obj"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_title = f"pallasopt {release}"
