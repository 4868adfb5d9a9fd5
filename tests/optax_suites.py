"""Optax's own test suites, generated at run time with pallasopt substituted.

Nothing of Optax's test code lives in this repository: `load_suite` reads the
test module *installed with optax*, keeps the rows of its parameter tables that
name the optimizers under test (a dict literal with an ``'opt_name'`` key
survives only if that name is kept) and the test classes asked for, rebinds
the modules it imports (``alias``, ``contrib``, ``_muon``) to proxies that
return pallasopt's drop-ins for the substituted names and Optax's objects for
everything else, and executes the result as a fresh module.

Run with no substitutions, the same generator yields Optax's suite against
Optax itself: a generator that broke Optax's tests could not pass unnoticed.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import types
from collections.abc import Collection, Mapping
from typing import Any


class _Proxy(types.ModuleType):
  """A module whose attributes are ``overrides`` first, then ``module``'s."""

  def __init__(self, module: types.ModuleType, overrides: Mapping[str, Any]):
    super().__init__(module.__name__)
    self._module = module
    self.__dict__.update(overrides)

  def __getattr__(self, name: str) -> Any:  # only called for missing names
    return getattr(self._module, name)


class _Filter(ast.NodeTransformer):

  def __init__(self, keep_opt_names: Collection[str], keep_classes: Collection[str]):
    self.keep_opt_names = set(keep_opt_names)
    self.keep_classes = set(keep_classes)

  def _opt_name(self, node: ast.AST) -> str | None:
    if not isinstance(node, ast.Dict):
      return None
    for key, value in zip(node.keys, node.values):
      if isinstance(key, ast.Constant) and key.value == "opt_name":
        if isinstance(value, ast.Constant):
          return value.value
    return None

  def _filter_elements(self, node):
    self.generic_visit(node)
    node.elts = [
        e for e in node.elts
        if self._opt_name(e) is None or self._opt_name(e) in self.keep_opt_names
    ]
    return node

  visit_List = visit_Tuple = _filter_elements

  def visit_ClassDef(self, node: ast.ClassDef):
    return node if node.name in self.keep_classes else None


def load_suite(
    module_name: str,
    *,
    keep_opt_names: Collection[str],
    keep_classes: Collection[str],
    overrides: Mapping[str, Mapping[str, Any]],
) -> types.ModuleType:
  """Builds Optax's test module ``module_name`` with substitutions.

  Args:
    module_name: e.g. ``"optax._src.alias_test"``, as installed with optax.
    keep_opt_names: the ``opt_name`` rows of its parameter tables to keep.
    keep_classes: the test classes to keep (the others are dropped).
    overrides: ``{imported module name: {attribute: replacement}}``, e.g.
      ``{"alias": {"adamw": pallasopt.optim.adamw}}``. A name the module
      imports with ``from X import name`` is rebound to a proxy of it.

  Returns:
    The generated module; its ``keep_classes`` are unittest TestCases.
  """
  spec = importlib.util.find_spec(module_name)
  if spec is None or spec.origin is None:
    raise FileNotFoundError(f"{module_name} is not installed with optax.")
  with open(spec.origin, encoding="utf-8") as f:
    tree = ast.parse(f.read(), filename=spec.origin)
  tree = ast.fix_missing_locations(_Filter(keep_opt_names, keep_classes).visit(tree))
  missing = set(keep_classes) - {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
  if missing:
    raise LookupError(f"{module_name} has no classes {sorted(missing)}.")

  module = types.ModuleType(f"pallasopt_generated.{module_name}")
  module.__file__ = spec.origin
  exec(compile(tree, spec.origin, "exec"), module.__dict__)  # noqa: S102
  for name, replacements in overrides.items():
    original = module.__dict__[name]
    module.__dict__[name] = _Proxy(original, replacements)
  return module
