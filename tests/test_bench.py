"""The bench scripts, end to end at tiny sizes on the CPU, so they cannot rot.

These run the XLA paths (and one Pallas-interpreter configuration) and check
the plumbing: JSONL records, resume, the table, the plot, the bytes models.
They measure nothing worth reading.
"""

import dataclasses
import itertools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# `bench/` is a folder at the repository root, not installed; pyproject.toml's
# `pythonpath = ["."]` makes it importable, as `python -m bench` does.
from bench import (
    cases_adamw,
    cases_lion,
    cases_mars,
    cases_rmsprop,
    cases_white_kron,
    harness,
    kernels,
    maxtext,
    plot,
    records,
    timing,
    trace_cost,
    workloads,
)
from helpers import pairwise
from pallasopt.kernels._compat import pl

# Three implementations on a leaf, and the fused path on a stacked mixed-dtype tree.
CI_FILTER = r"adamw/(leaf/f32/1000|decoder-tiny[^/]*/mixed.*fused)"


def _run(argv, capsys):
  records = kernels.main(argv, default_tier="ci")
  out, err = capsys.readouterr()
  return records, out, err


@pytest.fixture(scope="module")
def ci_results(tmp_path_factory):
  """One ci-tier run (4 configurations) shared by the tests that read it."""
  path = tmp_path_factory.mktemp("bench") / "kernels-ci.jsonl"
  records = kernels.main(["--filter", CI_FILTER, "--out", str(path)], default_tier="ci")
  return path, records


def test_ci_run_writes_one_record_per_configuration(ci_results):
  from bench.records import latest  # noqa: PLC0415 - `records` is this test's result

  path, records = ci_results
  appended = [json.loads(line) for line in path.read_text().splitlines()]
  lines = latest(appended)
  assert [r["key"] for r in lines] == [r["key"] for r in records]
  assert len(lines) == 4
  # Each case's baseline is timed again after its other rows (the run-to-run
  # noise), and its record appended again with both timings.
  baselines = [r for r in lines if r["impl"] == r["baseline"]]
  assert len(appended) == 4 + len(baselines) and baselines
  assert all(r["rerun_median_ms"] > 0 for r in baselines)
  for r in lines:
    assert not r.get("error"), r
    assert r["device_kind"] == jax.devices()[0].device_kind
    assert r["jax"] == jax.__version__ and r["optax"] and r["git_commit"]
    assert r["kernel"] == "xla"  # on a CPU the pallasopt rows time the XLA path
    assert r["timing"] in ("wall", "wall-loop")
    assert 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"]
    assert r["samples"] >= 3 and r["compile_s"] > 0 and r["finite"]
    assert r["achieved"] == pytest.approx(r["model_bytes"] / (r["median_ms"] * 1e-3) / 1e9)
    assert r["ceiling"]["name"] == "copy" and r["ceiling"]["gbps"] > 0
    assert r["ceiling_pct"] == pytest.approx(100 * r["achieved"] / r["ceiling"]["gbps"])
    assert r["peak_pct"] is None  # no datasheet for a CPU
    assert r["memory"]["footprint"] > 0
  optax_row = next(r for r in lines if r["impl"] == "optax")
  assert optax_row["vs_baseline"] == pytest.approx(1.0)


def test_resume_skips_measured_configurations(ci_results, capsys):
  path, records = ci_results
  before = path.read_text()
  again, out, err = _run(["--filter", CI_FILTER, "--out", str(path)], capsys)
  assert path.read_text() == before
  assert "4 already in" in err and "0 to measure" in err
  # It says so, and how to start fresh, before measuring and when done.
  assert err.count("--no-resume measures them again") == 2
  assert "0 new record(s), 4 reused from an earlier run" in err
  assert [r["key"] for r in again] == [r["key"] for r in records]
  assert "| adamw/decoder-tiny-stacked2x2/mixed/mu-f32 | pallasopt.fused | xla |" in out


def test_records_of_another_commit_or_jax_are_measured_anew(ci_results, capsys, tmp_path):
  # Half the records name another commit, half another jax: one run measures all 4.
  path, records = ci_results
  stale_fields = itertools.cycle([("git_commit", "0" * 40), ("jax", "0.0.1")])
  stale = tmp_path / "stale.jsonl"
  stale.write_text("".join(
      json.dumps({**r, field: value}) + "\n" for r, (field, value) in zip(records, stale_fields)))
  _, _, err = _run(["--filter", CI_FILTER, "--out", str(stale), "--iters", "3"], capsys)
  assert "0 already in" in err and "4 to measure" in err


def test_every_file_written_is_named(ci_results, capsys):
  path, _ = ci_results
  _, _, err = _run(["--filter", CI_FILTER, "--out", str(path)], capsys)
  for written in (path, path.with_suffix(".md"), path.with_suffix(".png")):
    assert f"wrote {written}" in err
  assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_says_what_was_timed(ci_results, capsys):
  path, _ = ci_results
  _, out, err = _run(["--filter", CI_FILTER, "--out", str(path)], capsys)
  # The banner once, with the one line that says what CPU rows are, then the table.
  (cpu_line,) = [line for line in out.splitlines() if line.startswith("CPU:")]
  assert "Pallas kernels are NOT timed" in cpu_line and "no speed claim for a GPU or TPU" in cpu_line
  assert out.count("device: ") == 1 and "device: " not in err
  assert "| case | impl | kernel | median ms |" in out
  assert path.with_suffix(".md").read_text().strip() == out.strip()


def test_plot_writes_a_png(ci_results, tmp_path):
  pytest.importorskip("matplotlib")
  path, _ = ci_results
  png = plot.main(["--in", str(path), "--out", str(tmp_path / "bench.png")])[0]
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_draws_one_bar_per_timed_row_at_its_ratio(ci_results, monkeypatch, tmp_path):
  # What a person reads: each non-baseline row's speed vs Optax, by case.
  matplotlib = pytest.importorskip("matplotlib")
  matplotlib.use("Agg")
  from matplotlib import pyplot  # noqa: PLC0415
  path, records = ci_results
  drawn = []
  monkeypatch.setattr(pyplot, "close", lambda fig: drawn.append(fig))
  plot.plot(records, tmp_path / "ratios.png")
  (ax,) = drawn[0].axes
  bars = {t.get_text(): p.get_width() for t, p in zip(ax.get_yticklabels(), ax.patches)}
  want = {f"{r['workload']} {r['label']} · {r['impl']}[{r['kernel']}]": r["vs_baseline"]
          for r in records if r["impl"] != "optax" and r["vs_baseline"] is not None}
  assert bars == pytest.approx(want), (bars, want)


def test_interpreted_rows_carry_no_speed(tmp_path, capsys):
  path = tmp_path / "interpret.jsonl"
  records, out, _ = _run(
      ["--interpret", "--filter", r"adamw/leaf/f32/1000/pallasopt\.fused", "--out", str(path)], capsys
  )
  (r,) = records
  assert r["kernel"] == "interpret" and not r.get("error") and r["finite"]
  assert r["achieved"] is None and r["peak_pct"] is None and r["vs_baseline"] is None
  assert "INTERPRETER" in out and "NOT a kernel speed" in out


def test_a_failing_configuration_is_recorded_and_retried(tmp_path, capsys):
  spec = jax.ShapeDtypeStruct((8,), jnp.float32)

  def broken(kernel_impl):
    def step(carry, consts):
      raise RuntimeError("boom")
    return step

  case = harness.Case(
      family="test", workload="leaf", label="f32/8", params=8, leaves=1,
      inputs=lambda key: (workloads.random_tree(key, spec), ()),
      impls=(harness.Impl("broken", broken, pallas=False),), bytes=64,
  )
  settings = timing.Settings.for_tier("ci", "cpu")
  path = tmp_path / "errors.jsonl"
  (r,) = harness.run([case], settings, path)
  assert "boom" in r["error"]
  assert "ERROR: RuntimeError: boom" in capsys.readouterr().out
  harness.run([case], settings, path)  # errors are measured again, not skipped
  assert len(records.load_records(path)) == 2


def _matmul_case(dtype, *, explicit: bool) -> harness.Case:
  spec = jax.ShapeDtypeStruct((64, 64), dtype)

  def inputs(key):
    return workloads.random_tree(key, spec), workloads.random_tree(key, spec, stream=1)

  step = lambda c, g: (c @ g).astype(c.dtype)
  return harness.Case(
      family="mm", workload="matrix", label=jnp.dtype(dtype).name, params=64 * 64, leaves=1,
      inputs=inputs, impls=(harness.Impl("xla", lambda _: step, pallas=False),),
      bytes=3 * 64 * 64 * jnp.dtype(dtype).itemsize, flops=2 * 64**3, metric="compute",
      baseline="xla", compute_dtype=jnp.dtype(dtype).name if explicit else None,
  )


def test_compute_rows_are_divided_by_the_matmul_ceiling_of_their_own_dtype(tmp_path, capsys):
  # An f32 case against a bf16 matmul ceiling (emulated, slow on a CPU) read 256%.
  cases = [_matmul_case(jnp.float32, explicit=True), _matmul_case(jnp.bfloat16, explicit=False)]
  records = harness.run(cases, timing.Settings.for_tier("ci", "cpu"), tmp_path / "mm.jsonl")
  out = capsys.readouterr().out
  by_dtype = {r["label"]: r for r in records}
  assert set(by_dtype) == {"float32", "bfloat16"}
  for dtype, r in by_dtype.items():
    assert not r.get("error"), r
    assert r["compute_dtype"] == r["ceiling"]["dtype"] == dtype
    assert r["ceiling"]["name"] == f"matmul-{dtype}"
    assert r["ceiling_pct"] == pytest.approx(100 * r["achieved"] / r["ceiling"]["tflops"])
    assert f"{dtype} matmul" in out
  assert by_dtype["float32"]["ceiling"]["tflops"] != by_dtype["bfloat16"]["ceiling"]["tflops"]
  assert "% ceiling" in out and "% copy" not in out


def test_compute_cases_name_the_dtype_their_matmuls_run_in():
  for case in kernels.cases("ci", ("muon", "kron")):
    # bf16 params iterate in bf16; "ns-bf16" rows are f32 params, bf16 iterates.
    want = "bfloat16" if case.label.endswith(("/bfloat16", "/ns-bf16")) else "float32"
    assert case.metric == "compute" and case.compute_dtype == want, case.key
  assert any(c.compute_dtype == "bfloat16" for c in kernels.cases("ci", ("muon",)))
  assert harness.compute_dtype(_matmul_case(jnp.bfloat16, explicit=False)) == "bfloat16"


def test_kernel_labels_follow_each_familys_cuda_dispatch():
  assert harness.kernel_label("auto", "gpu") == "triton"
  assert harness.kernel_label("auto", "gpu", auto_on_cuda="xla") == "xla"
  assert harness.kernel_label("pallas", "gpu", auto_on_cuda="xla") == "triton"
  assert harness.kernel_label("auto", "tpu", auto_on_cuda="xla") == "mosaic"
  # AdamW's, Lion's and Newton-Schulz's "auto" is XLA on CUDA (their modules' docs),
  # except with blockwise moments (kernels.policy.CUDA_AUTO).
  for c in kernels.cases("ci", ("adamw", "lion", "muon")):
    blockwise = c.label.endswith(("state-int8", "state-fp8", "state-int4"))
    assert c.auto_on_cuda == ("pallas" if blockwise else "xla"), c.key
  assert {c.auto_on_cuda for c in kernels.cases("ci", ("adafactor", "kron"))} == {"pallas"}
  # Newton-Schulz's one CUDA kernel is Mosaic GPU, for bf16 iterates: f32 rows
  # have no kernel row there.
  assert harness.kernel_label("pallas", "gpu", "xla", cuda_kernel=None) is None
  assert harness.kernel_label("pallas", "tpu", "xla", cuda_kernel=None) == "mosaic"
  muon_cases = kernels.cases("ci", ("muon",))
  assert {c.compute_dtype: c.cuda_kernel for c in muon_cases} == {
      "float32": None, "bfloat16": "mosaic-gpu"}
  assert any(c.label.endswith("/gram-L1") for c in muon_cases)


def test_kernel_impls_that_run_the_same_kernel_are_timed_once(tmp_path, capsys):
  out = tmp_path / "k.jsonl"
  records, _, err = _run(
      ["--filter", r"adamw/leaf/f32/1000/", "--kernel-impls", "xla,xla", "--out", str(out)], capsys
  )
  assert [r["impl"] for r in records] == ["optax", "pallasopt.update", "pallasopt.fused"]
  assert "3 to measure" in err


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU host's quick tier")
def test_quick_tier_on_a_cpu_runs_only_small_cases_of_every_family():
  cases = kernels.cases("quick")
  assert {c.family for c in cases} == set(kernels.FAMILIES)
  for c in cases:
    assert c.workload in ("leaf", "matrix", "stack") or c.workload.startswith("stack"), c.key
    assert c.params <= 1 << 20, c.key


def test_loop_runner_equals_sequential_steps():
  step = lambda c, k: (c[0] * 0.5 + k[0], c[1] + jnp.sum(c[0]) * k[1])
  carries = [(jnp.arange(4.0), jnp.float32(0)), (jnp.ones(4), jnp.float32(1))]
  consts = [(jnp.full(4, 2.0), jnp.float32(3)), (jnp.full(4, -1.0), jnp.float32(0))]
  want = []
  for c, k in zip(carries, consts):
    for _ in range(3):
      c = step(c, k)
    want.append(c)
  got = timing._loop_runner(step)(tuple(jax.tree.map(jnp.copy, carries)), tuple(consts), 3)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-6)


def _cost_estimate_bytes(monkeypatch, fn, *args) -> int:
  """Sum of ``bytes_accessed`` over every pallas_call `fn` makes when lowered.

  (A kernel is chosen, and so traced, when its call is lowered.)
  """
  seen = []
  real = pl.pallas_call

  def spy(*a, **kw):
    seen.append(kw["cost_estimate"].bytes_accessed)
    return real(*a, **kw)

  monkeypatch.setattr(pl, "pallas_call", spy)
  jax.jit(fn).lower(*args)
  return sum(seen)


@pytest.mark.parametrize("workload,mu_dtype", [
    (workloads.leaf(1000, "f32"), None),
    (workloads.leaf(4096, "bf16"), jnp.float32),
    (workloads.for_tier("ci", ("mixed",))[0], jnp.float32),  # masked decay, mixed dtypes
    (workloads.for_tier("ci")[1], None),  # stacked layers
], ids=lambda x: getattr(x, "name", str(x)))
def test_adamw_bytes_model_equals_the_kernels_cost_estimates(monkeypatch, workload, mu_dtype):
  case = cases_adamw.case(workload, mu_dtype)
  carry, grads = jax.eval_shape(case.inputs, jax.random.key(0))
  impls = {i.name: i for i in case.impls}
  fused = impls["pallasopt.fused"].build("interpret")
  assert _cost_estimate_bytes(monkeypatch, fused, carry, grads) == case.bytes
  update = impls["pallasopt.update"].build("interpret")
  decays = jax.tree.leaves(cases_adamw.decay_mask(workload)) or [True] * workload.leaves
  assert _cost_estimate_bytes(monkeypatch, update, carry, grads) == (
      cases_adamw.update_kernel_bytes(workload.tree, decays, mu_dtype)
  )
  if workload.label == "f32" or workload.label.startswith("f32/"):
    assert case.bytes == 28 * workload.params  # DESIGN.md: 28 B/param fp32 AdamW


@pytest.mark.parametrize("family,per_param", [(cases_rmsprop, 20), (cases_mars, 36)],
                         ids=["rmsprop", "mars"])
@pytest.mark.parametrize("workload", [workloads.leaf(4096, "f32"), workloads.for_tier("ci")[0]],
                         ids=lambda w: w.name)
def test_rmsprop_and_mars_bytes_models_equal_the_kernels_cost_estimates(
    monkeypatch, family, per_param, workload
):
  case = family.case(workload)
  carry, grads = jax.eval_shape(case.inputs, jax.random.key(0))
  impls = {i.name: i for i in case.impls}
  assert case.baseline in impls and not impls[case.baseline].pallas
  assert _cost_estimate_bytes(monkeypatch, impls["pallasopt.fused"].build("interpret"), carry,
                              grads) == case.bytes == per_param * workload.params


def _low_bit_case_id(value) -> str:
  if isinstance(value, tuple):  # (state format, bf16 params)
    return value[0] + ("-bf16-params" if value[1] else "")
  return getattr(value, "name", None) or value.__name__.removeprefix("bench.cases_")


# Every pair of family, state (with bf16 params once) and workload.
@pytest.mark.parametrize("family,state,workload", pairwise(
    [cases_adamw, cases_lion], [("int8", False), ("fp8", False), ("int4", False),
                                ("bf16", False), ("int8", True)],
    [workloads.leaf(4096, "f32"), workloads.for_tier("ci")[0]],
), ids=_low_bit_case_id)
def test_low_bit_bytes_model_equals_the_kernels_cost_estimates(
    monkeypatch, family, state, workload
):
  state_format, bf16_params = state
  case = family.SPEC.low_bit_case(workload, state_format, bf16_params=bf16_params)
  fused = {i.name: i for i in case.impls}["pallasopt.fused"]
  carry, grads = jax.eval_shape(fused.inputs, jax.random.key(0))
  got = _cost_estimate_bytes(monkeypatch, fused.build("interpret"), carry, grads)
  assert got == case.bytes == fused.bytes
  if workload.name == "leaf":
    # 12 B of p, g, p (f32) or 6 (bf16), and k moments of 1 B codes (int4:
    # 1/2 B) + 4 B per 256 (int8) or 2 B read and written (bf16 state).
    per_moment = {"int8": 2 * (1 + 4 / 256), "fp8": 2 * (1 + 4 / 256),
                  "int4": 2 * (0.5 + 4 / 256), "bf16": 4}[state_format]
    per_param = (6 if bf16_params else 12) + family.SPEC.moments * per_moment
    assert case.bytes == per_param * workload.params


def test_realistic_workloads_have_the_published_sizes():
  small = workloads.gpt2(**workloads.GPT2_SMALL)
  assert (small.leaves, round(small.params / 1e6, 1)) == (148, 124.4)
  full = {w.name: w for w in workloads.for_tier("full", ("f32",))}
  assert round(full["decoder-1b"].params / 1e9, 3) == 1.236  # Llama 3.2 1B
  assert full["decoder-1b-stacked16"].params == full["decoder-1b"].params
  assert full["decoder-1b-stacked4x4"].stacked_axes == 2
  assert full["decoder-1b-stacked4x4"].leaves == 11
  mixed = workloads.gpt2(**workloads.GPT2_SMALL, policy="mixed")
  dtypes = {len(s.shape): s.dtype for s in jax.tree.leaves(mixed.tree)}
  assert dtypes == {1: jnp.float32, 2: jnp.bfloat16}


def test_rotation_covers_the_cache_within_limits():
  s = timing.Settings(rotate_bytes=1 << 20, max_rotations=16, max_rotated_leaves=64)
  assert timing._rotations(1 << 20, 1, s) == 1
  assert timing._rotations(1 << 16, 1, s) == 16
  assert timing._rotations(1 << 18, 1, s) == 4
  assert timing._rotations(1 << 10, 32, s) == 2  # bounded by leaves per loop body


def test_random_inputs_are_never_zero():
  specs = {"a": jax.ShapeDtypeStruct((3, 5), jnp.bfloat16), "b": jax.ShapeDtypeStruct((7,), jnp.float32)}
  tree = jax.jit(lambda k: workloads.random_tree(k, specs, positive=True))(jax.random.key(0))
  for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(specs)):
    assert x.shape == s.shape and x.dtype == s.dtype and bool(jnp.all(x > 0))


def test_results_folder_is_documented_and_ignores_cpu_runs():
  results = pathlib.Path(records.RESULTS_DIR)
  assert (results / "README.md").exists()
  assert "cpu/" in (results / ".gitignore").read_text().split()


def test_profile_writes_a_perfetto_trace_per_configuration(tmp_path, capsys):
  trace_dir = tmp_path / "trace"
  (r,) = _run(
      ["--filter", r"adamw/leaf/f32/1000/optax", "--out", str(tmp_path / "p.jsonl"),
       "--profile", str(trace_dir)], capsys,
  )[0]
  assert pathlib.Path(r["profile"]).parent == trace_dir
  assert list(pathlib.Path(r["profile"]).rglob("perfetto_trace.json.gz"))


class _FakeCuptiExt:
  """Stands in for the mosaic_gpu extension: two kernels per call while active."""

  def __init__(self):
    self.active, self.timings = False, []

  def _cupti_init(self):
    self.active, self.timings = True, []

  def _cupti_get_timings(self, finalize):
    assert finalize
    self.active = False
    return self.timings

  def launch(self):
    if self.active:
      self.timings += [("scale", 0.5), ("add", 0.25)]


def test_cupti_samples_are_per_call_kernel_sums():
  ext = _FakeCuptiExt()
  cupti = object.__new__(timing._Cupti)
  cupti._ext = ext
  calls = []

  def compiled(carry, consts):
    calls.append(carry)
    ext.launch()
    return carry + consts

  carries, consts = [jnp.float32(0), jnp.float32(10)], [jnp.float32(1), jnp.float32(1)]
  s = timing.Settings(warmup=1, iters=5, max_time_s=10)
  stats, carries = cupti.time(compiled, carries, consts, s)
  assert stats["samples"] == 5 and stats["kernels_per_step"] == 2
  assert stats["median_ms"] == stats["min_ms"] == stats["max_ms"] == 0.75
  # Warm-up steps every set once; then 5 steps rotate over the 2 sets.
  assert len(calls) == 2 + 5 and [float(c) for c in carries] == [4.0, 13.0]


def test_gpu_timing_falls_back_to_wall_clock_and_says_why():
  env = dataclasses.replace(records.environment(), platform="gpu")
  spec = jax.ShapeDtypeStruct((64,), jnp.float32)
  out = timing.measure(
      "t", lambda c, k: c * 0.5 + k, lambda key: (workloads.random_tree(key, spec), workloads.random_tree(key, spec, stream=1)),
      leaves=1, s=timing.Settings.for_tier("ci", "cpu"), env=env,
  )
  assert out["timing"] in ("wall", "wall-loop") and out["finite"]
  assert out["timing_note"].startswith("CUPTI unavailable, wall clock used")


def test_trace_cost_times_every_optimizer_against_its_reference(tmp_path, capsys):
  out = tmp_path / "trace-cost.jsonl"
  records = trace_cost.main(["--leaves", "12", "--out", str(out)])
  assert [r["optimizer"] for r in records] == list(trace_cost.OPTIMIZERS)
  assert [json.loads(line)["optimizer"] for line in out.read_text().splitlines()] == list(
      trace_cost.OPTIMIZERS)
  for r in records:
    assert r["leaves"] == 12 and r["pallasopt_s"] > 0 and r["reference_s"] > 0
    assert r["ratio"] == pytest.approx(r["pallasopt_s"] / r["reference_s"])
  assert f"wrote {out}" in capsys.readouterr().err


@pytest.mark.parametrize("style", cases_white_kron.STYLES)
def test_white_kron_flops_model_counts_the_dense_block_matmuls(style):
  # XLA's compiled count of the XLA step: at least the model's dense-block
  # matmuls, and not much more at blocks of 32 (the rest: power iterations of
  # 4 probes, their random bits, elementwise terms; their share shrinks as
  # 1 / block size). Measured 1.42x (QUAD) and 1.55x (skew) with every
  # threefry round counted, as the GPU and TPU lowering has them (and the
  # tests' conftest on CPU); 1.31x and 1.44x with XLA:CPU's rolled loop,
  # whose rounds count once.
  case = cases_white_kron.case(cases_white_kron._stack(2, 64, 96), style, 32)
  carry, consts = jax.jit(case.inputs)(jax.random.key(0))
  cost = jax.jit(case.impls[0].build("xla")).lower(carry, consts).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  assert case.flops <= cost["flops"] <= 1.6 * case.flops


def _timed_row(impl, median, lo, hi):
  return dict(key=f"adamw/leaf/f32/1000/{impl}[xla]", case="adamw/leaf/f32/1000", family="adamw",
              workload="leaf", label="f32/1000", impl=impl, kernel="xla", baseline="optax",
              params=1000, timing="wall", median_ms=median, min_ms=lo, max_ms=hi,
              wall_median_ms=median, device_kind="cpu", platform="cpu")


@pytest.mark.parametrize("ours,same", [((1.0, 0.6, 1.5), True), ((1.0, 0.9, 1.1), False)])
def test_overlapping_timing_ranges_read_as_no_difference(ours, same, monkeypatch, tmp_path):
  # A 2.0x "win" whose range (0.6-1.5 ms) overlaps the baseline's (1.4-3 ms)
  # measured nothing: the table and the plot say so, and the axis is not set by it.
  rows = [_timed_row("optax", 2.0, 1.4, 3.0), _timed_row("pallasopt.fused", *ours)]
  records.attach_ratios(rows)
  assert rows[1]["same_as_baseline"] is same
  assert rows[1]["vs_baseline"] == (1.0 if same else 2.0)
  table_row = records.format_table(rows).splitlines()[3]
  assert ("same (within noise)" in table_row) is same and ("2.00x" in table_row) is not same
  matplotlib = pytest.importorskip("matplotlib")
  matplotlib.use("Agg")
  from matplotlib import pyplot  # noqa: PLC0415
  drawn = []
  monkeypatch.setattr(pyplot, "close", lambda fig: drawn.append(fig))
  plot.plot(rows, tmp_path / "same.png")
  (ax,) = drawn[0].axes
  assert [p.get_width() for p in ax.patches] == [1.0 if same else 2.0]


@pytest.mark.parametrize("rerun,same", [(5.0, True), (2.1, False)])
def test_a_difference_within_the_run_to_run_noise_reads_as_no_difference(rerun, same):
  # The baseline took 2.0 ms, then `rerun` ms when timed again after the case's
  # rows: a 2.0x "win" (1.0 ms) whose ranges do not overlap is a speed-up only
  # if the baseline itself moved less than that.
  base = dict(_timed_row("optax", 2.0, 1.9, 2.1), rerun_median_ms=rerun)
  rows = [base, _timed_row("pallasopt.fused", 1.0, 0.95, 1.05)]
  records.attach_ratios(rows)
  assert rows[1]["same_as_baseline"] is same
  assert rows[1]["vs_baseline"] == (1.0 if same else 2.0)
  assert records.noise(base) == pytest.approx(rerun / 2.0 - 1.0)


_BUNDLES = """\
 0x0   : { %s1 = smov 0 }
 0x1   : > { %v1 = vld [vmem:[%s1]] }
 0x2   : >> { %v2 = vmul.f32 %v1, %v1 }
 0x3   : >> { %p1 = scmp.ge.s32.totalorder %s2_s3, 8 /* loop exit test */ }
 0x4   : > { %v3 = vadd.f32 %v2, %v2 }
 0x5   : >> { %v4 = vmul.f32 %v3, %v3 }
 0x6   : > { %p2 = scmp.ge.s32.totalorder %s4_s5, 66 /* loop exit test */ }
 0x7   : { %s6 = smov 1 }
"""


def test_schedule_counts_each_bundle_once_per_trip_of_its_loops():
  from bench.schedule import program_cycles

  # Two bundles outside any loop; three in the grid loop (66 trips), one of
  # them scheduled inside the inner loop's span; three in the inner loop (8
  # trips a grid step), one past its exit test.
  assert program_cycles(_BUNDLES) == 2 + 3 * 66 + 3 * 66 * 8
  assert program_cycles("no bundles here") == 0


def test_maxtext_reads_the_adamw_kernels_of_a_compiled_step():
  # Lines of a step compiled for a TPU v5e (backend configs cut): pallasopt's
  # fused AdamW, and another Mosaic kernel of the step (MaxText's flash
  # attention), which is not the optimizer's.
  text = "\n".join([
      '  %adamw_apply.1 = (f32[1,512,2048]{2,1,0:T(8,128)}, s8[1,512,2048]{2,1,0:T(32,128)(4,1)})'
      ' custom-call(%stack.1, %bitcast.24), custom_call_target="tpu_custom_call",'
      ' metadata={op_name="jit(apply_fn)/adamw_apply/pallas_call"}, backend_config="..."',
      '  %splash.3 = f32[8,512,128]{2,1,0:T(8,128)} custom-call(%q, %k, %v),'
      ' custom_call_target="tpu_custom_call",'
      ' metadata={op_name="jit(train_step)/splash_mha_fwd/pallas_call"}, backend_config="..."',
      '  %adamw_updates.2 = f32[1,256,32000]{2,1,0:T(8,128)} custom-call(%g),'
      ' custom_call_target="tpu_custom_call",'
      ' metadata={op_name="jit(train_step)/jvp/adamw_updates/pallas_call"}, backend_config="..."',
  ])
  assert maxtext.adamw_kernels(text) == ["f32[1,512,2048]", "f32[1,256,32000]"]
