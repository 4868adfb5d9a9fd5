"""Test configuration shared by every test module.

Eight fake CPU devices (for sharding and shard_map tests) must be requested
before JAX initialises its backends, so this runs before any test imports jax.
"""

import importlib.metadata
import os
import platform
import pkgutil

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import gc  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import cpu_threefry  # noqa: E402

# One compilation cache for the run, fresh each time and shared by the
# xdist workers (they inherit the controller's environment): tests of one
# contract compile the same programs under new closures (each impl, each
# generated copy of Optax's suites, each eager op per process), and a hit
# reads the executable XLA built for the same HLO instead of building it
# again: the README's test command went from 12 min 47 s to 11 min 2 s.
# Tests still compile everything they run once per run; a cache the user set
# is left alone. Not for the compile tier: an executable compiled for a
# topology without devices cannot be read back (JAX warns and compiles).
_CACHE_VARIABLE = "JAX_COMPILATION_CACHE_DIR"
_OWNED_CACHE = pytest.StashKey[str]()

# XLA:CPU's LLVM optimisation is most of what compiling a test program costs
# (the tests' arrays are small: codegen time, not run time, is the budget).
# Level 0 turns it off, and then FMA contraction must go too: XLA lets LLVM
# fuse a multiply into an add, at level 2 in every fusion, at level 0 only in
# some (measured: the interpreted Muon momentum kernel multiplied and added
# apart while its reference fused, so the stochastic codes hashed from the
# values differed by one in 22% of elements). With AVX as the widest ISA there
# is no FMA instruction, every f32 op rounds on its own in every program, and
# a kernel equals its reference bit for bit because it does the same
# operations, not because both were contracted alike. Measured:
# test_factory + test_newton_schulz_kernel 56.9 s -> 36.9 s in one process.
# Only for a run on CPU devices of an x86 host (a GPU plugin's backend, the
# compile tier's targets, which `pytest_configure` leaves alone, and other
# ISAs keep XLA's defaults).
_CPU_TEST_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_max_isa=AVX")


def _accelerator_plugin_installed() -> bool:
  try:
    import jax_plugins
  except ImportError:
    namespace = []
  else:
    namespace = list(pkgutil.iter_modules(jax_plugins.__path__))
  return bool(namespace or importlib.metadata.entry_points(group="jax_plugins"))


def _compile_for_cpu_tests(config) -> None:
  if ("gpu" in (config.option.markexpr or "") or _accelerator_plugin_installed()
      or platform.machine().lower() not in ("x86_64", "amd64")):
    return
  for flag in _CPU_TEST_FLAGS:
    if flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
      os.environ["XLA_FLAGS"] += " " + flag


def pytest_configure(config):
  if "aot" in (config.option.markexpr or ""):
    return
  # Before any backend starts (importing jax and pallasopt starts none; the
  # test modules are collected after this), and inherited by the workers.
  _compile_for_cpu_tests(config)
  if _CACHE_VARIABLE not in os.environ:
    os.environ[_CACHE_VARIABLE] = tempfile.mkdtemp(prefix="pallasopt-test-xla-cache-")
    config.stash[_OWNED_CACHE] = os.environ[_CACHE_VARIABLE]
  jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_VARIABLE])
  # Most test programs compile in well under the default 1 s threshold.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_unconfigure(config):
  # The process that made the cache removes it: the controller, after its
  # workers have ended (a worker inherits the directory and owns nothing).
  owned = config.stash.get(_OWNED_CACHE, None)
  if owned is not None:
    shutil.rmtree(owned, ignore_errors=True)


# Python's full (generation 2) collections walk every object a test process
# holds, JAX's caches of traced and compiled programs included: late in a
# worker's run each takes 1-2.5 s, and the README's test command made 33-36
# of them per worker (24 s of each worker's time, timed by gc.callbacks).
# Waiting for 1000 younger collections before one instead of 10 (CPython
# also waits for a quarter of the old objects to be new) made 3 instead of 22
# on three of the test files: their GC time 7.6 s -> 2.7 s of 165 s, at the
# same peak memory. The younger generations are collected as before.
gc.set_threshold(*gc.get_threshold()[:2], 1000)


# Threefry's rounds are most of a random program's compile on XLA:CPU; the
# tests' CPU programs draw the same bits from NumPy (`cpu_threefry`).
cpu_threefry.install()


# The default `ci` profile is derandomized, so `pytest -q` runs the same
# examples on every machine, with or without $CI, within the 2-core budget.
# `dev` explores fresh random examples (HYPOTHESIS_PROFILE=dev); `thorough` is
# for a long local sweep (HYPOTHESIS_PROFILE=thorough).
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("ci", max_examples=8, derandomize=True, **_COMMON)
settings.register_profile("dev", max_examples=25, **_COMMON)
settings.register_profile("thorough", max_examples=300, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or "ci")


# The files that took longest in the README's test command (seconds of test
# time at 4a8a7cc, 2 workers), started first so that with `--dist loadfile` no
# worker is left with one of them at the end while the other idles.
_SLOWEST_FILES = (
    "test_optax_suites.py", "test_low_bit_state.py", "test_meshes_and_nnx.py",
    "test_factory.py", "test_low_bit_updates.py", "test_whole_step.py", "test_gram.py",
    "test_bench.py", "test_drop_in_details.py", "test_pipeline_train.py",
)


def pytest_collection_modifyitems(config, items):
  # The compile tier's longest compiles first, longest first, likewise.
  def minutes(item):
    marker = item.get_closest_marker("long_compile")
    return 0 if marker is None else marker.kwargs["minutes"]

  def file_rank(item):
    name = item.path.name
    return _SLOWEST_FILES.index(name) if name in _SLOWEST_FILES else len(_SLOWEST_FILES)

  items.sort(key=lambda item: (-minutes(item), file_rank(item)))
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU (jax.default_backend() != 'gpu')")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)

