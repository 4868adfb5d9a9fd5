"""Optax's own tests for the optimizers pallasopt replaces, with ours substituted.

Generated at run time from the installed optax (`optax_suites.load_suite`):

* ``optax._src.alias_test.AliasTest``, rows adamw, nadamw, lion, adafactor,
  rmsprop;
* ``optax.contrib._muon_test.MuonTest``;
* ``optax.contrib._common_test.ContribTest``, the muon rows.

Each runs with pallasopt's drop-ins under ``impl="xla"`` and under
``impl="interpret"`` (the Pallas kernels in the interpreter). All must pass.
The generator is checked below (the suites are not empty, the substitution
reaches the generated module); running them against Optax itself is Optax's
own CI, not ours.

Under ``"interpret"``, ``ContribTest.test_optimizers`` (hundreds of Muon
steps on a toy problem, checking that the loss falls) is left to the
``"xla"`` run: each of those steps interprets Newton–Schulz grid step by
grid step (~20 s a case), while the interpreted kernel's equality with the
reference is tested call by call in ``test_newton_schulz_kernel.py`` and
over fused Muon steps in ``test_muon_optax.py``.
"""

import re
import unittest

import pytest

import pallasopt
from optax_suites import load_suite
from pallasopt.kernels import use_impl

_ALIAS_NAMES = ("adamw", "nadamw", "lion", "adafactor", "rmsprop")
_OURS = {name: getattr(pallasopt.optim, name) for name in _ALIAS_NAMES}

# (module, kept rows, kept class, {imported module: substitutions}).
_SUITES = {
    "alias": (
        "optax._src.alias_test", _ALIAS_NAMES, "AliasTest", {"alias": _OURS},
    ),
    "muon": (
        "optax.contrib._muon_test", (), "MuonTest",
        {"_muon": {"muon": pallasopt.optim.muon}},
    ),
    "contrib_muon": (
        "optax.contrib._common_test", ("muon",), "ContribTest",
        {"contrib": {"muon": pallasopt.optim.muon}},
    ),
}
_IMPLS = ("xla", "interpret")
# (suite, impl) -> the test methods (parameterized copies included) left to
# the "xla" run (module doc).
_LEFT_TO_XLA = {("contrib_muon", "interpret"): re.compile(r"test_optimizers\d*")}


def _suite_class(suite: str, impl: str) -> type[unittest.TestCase]:
  module_name, rows, class_name, overrides = _SUITES[suite]
  module = load_suite(
      module_name, keep_opt_names=rows, keep_classes=(class_name,), overrides=overrides,
  )
  base = getattr(module, class_name)

  class Suite(base):

    def setUp(self):
      super().setUp()
      self.enterContext(use_impl(impl))

  left_out = _LEFT_TO_XLA.get((suite, impl))
  for name in unittest.TestLoader().getTestCaseNames(base):
    if left_out is not None and left_out.fullmatch(name):
      setattr(Suite, name, None)  # unittest collects only callables
  Suite.__name__ = Suite.__qualname__ = f"Test_{suite}_{impl}"
  Suite.__module__ = __name__
  return Suite


for _suite in _SUITES:
  for _impl in _IMPLS:
    _cls = _suite_class(_suite, _impl)
    globals()[_cls.__name__] = _cls
del _suite, _impl, _cls


def test_generated_suites_are_not_empty():
  for suite in _SUITES:
    cls = globals()[f"Test_{suite}_xla"]
    names = unittest.TestLoader().getTestCaseNames(cls)
    assert len(names) >= 10, (suite, names)


@pytest.mark.parametrize("suite", list(_SUITES))
def test_substitution_reaches_the_generated_module(suite):
  module_name, rows, class_name, overrides = _SUITES[suite]
  module = load_suite(module_name, keep_opt_names=rows, keep_classes=(class_name,),
                      overrides=overrides)
  (imported, names), = overrides.items()
  for name, ours in names.items():
    assert getattr(getattr(module, imported), name) is ours
