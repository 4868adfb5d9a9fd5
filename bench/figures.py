"""The manual's figures, rendered from the records under ``bench/results/``.

A page (``README.md``, ``docs/**/*.md``) holds each figure between the
markers ``<!-- figure: NAME -->`` and ``<!-- /figure -->``. This script
rewrites what lies between them from the records; ``--check`` changes
nothing and fails where a page and its records disagree (the test suite runs
it: ``tests/test_docs.py``). A figure's caption names its records, which hold
the device, the versions and the commit; it says "predicted" for figures read
from code compiled on a CPU host and "measured" for figures a chip ran.

    python -m bench.figures            # rewrite every page's figures
    python -m bench.figures --check    # exit 1 where a page is stale
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import re
import sys
from collections.abc import Callable, Iterable, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
COMPILED = RESULTS / "compiled"
H100 = RESULTS / "nvidia-h100-80gb-hbm3"
PAGES = ("README.md", "docs/**/*.md")

_FIGURE = re.compile(r"(<!-- figure: ([\w-]+) -->\n)(.*?)(<!-- /figure -->)", re.S)
_PREDICTED = ("Predicted: compiled from a CPU host for each target, no chip ran these steps.")


@functools.cache
def _record(path: pathlib.Path) -> dict:
  if path.suffix == ".jsonl":
    return {"rows": [json.loads(line) for line in path.read_text().splitlines() if line.strip()]}
  return json.loads(path.read_text())


def _where(paths: Iterable[pathlib.Path]) -> str:
  return ", ".join(f"`{p.relative_to(ROOT)}`" for p in paths)


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
  lines += ["| " + " | ".join(row) + " |" for row in rows]
  return "\n".join(lines)


def _x(value: float | None, digits: int = 2) -> str:
  return "" if value is None else f"{value:.{digits}f}x"


# --- whole train steps, compiled (bench.whole_step) -------------------------

def _step_row(paths: Sequence[pathlib.Path], model: str, form: str, case: str,
              family: str = "adamw") -> dict | None:
  """The first row of the records that measured ``case`` in ``form`` on ``model``."""
  for path in paths:
    if not path.exists():
      continue
    for row in _record(path)["rows"]:
      if (row["model"], row.get("family", "adamw"), row["form"], row["case"]) == (
          model, family, form, case):
        return row
  return None


def _bytes_and_peak(row: dict | None, digits: int = 2) -> str:
  if row is None:
    return ""
  return f"{_x(row['hbm_vs_baseline'], digits)} / {_x(row['peak_vs_baseline'], digits)}"


# The forms of a train step a user writes (bench.whole_step's names), as the
# pages name them, with the Optax step each is compared with.
_FORMS = {
    "clip-fused": "`apply_gradients(tx, params, grads, state, max_grad_norm=1.0)`, against "
                  "Optax's clip chain",
    "fused": "`apply_gradients(tx, params, grads, state)`",
    "update": "`tx.update` + `optax.apply_updates`",
    "clip": "`optax.chain(optax.clip_by_global_norm(1.0), tx)`",
    "clipped": "`clipped(tx, 1.0)`, update form, against Optax's clip chain",
    "multi-steps": "`multi_steps(tx, 4)`, update form, against `optax.MultiSteps`",
    "multi-steps-fused": "`apply_gradients(multi_steps(tx, 4), ...)`, against `optax.MultiSteps`",
}
# The records that hold each form, per target.
_FORM_RECORDS = {
    "clipped": "whole-step-clipped-{target}.json",
    "multi-steps": "whole-step-multi-steps-{target}.json",
    "multi-steps-fused": "whole-step-multi-steps-{target}.json",
}


def _form_records(form: str, target: str, prefix: str = "") -> list[pathlib.Path]:
  name = _FORM_RECORDS.get(form, "whole-step-{target}.json").format(target=target)
  if prefix:
    name = name.replace("whole-step-", f"whole-step-{prefix}-")
  return [COMPILED / name]


def _whole_step_int8() -> tuple[str, list[pathlib.Path]]:
  targets = ("v5e", "v6e", "h100")
  forms = ("clip-fused", "fused", "update", "clip", "clipped", "multi-steps-fused")
  used = sorted({p for f in forms for t in targets for p in _form_records(f, t)})
  rows = [[_FORMS[f]] + [_bytes_and_peak(_step_row(_form_records(f, t), "llama-1b-2l", f,
                                                    "auto int8")) for t in targets]
          for f in forms]
  return _table(["the step you write (int8 state)", "TPU v5e", "TPU v6e", "H100"], rows), used


def _whole_step_forms() -> tuple[str, list[pathlib.Path]]:
  columns = [("Llama-1B-shaped, 2 layers: v5e", "llama-1b-2l", "v5e"),
             ("v6e", "llama-1b-2l", "v6e"), ("H100", "llama-1b-2l", "h100"),
             ("GPT-2 small: v5e", "gpt2-small", "v5e"), ("H100", "gpt2-small", "h100")]
  int4 = {  # int4 rows came from their own runs
      ("llama-1b-2l", "v5e"): "whole-step-llama-1b-2l-int4-v5e.json",
      ("llama-1b-2l", "v6e"): "whole-step-v6e.json",
      ("llama-1b-2l", "h100"): "whole-step-llama-1b-2l-int4-h100.json",
      ("gpt2-small", "v5e"): "whole-step-gpt2-small-int4-v5e.json",
      ("gpt2-small", "h100"): "whole-step-gpt2-small-int4-h100.json",
  }
  used: set[pathlib.Path] = set()

  def cell(form, case, model, target):
    paths = ([COMPILED / int4[model, target]] if case == "auto int4"
             else _form_records(form, target))
    used.update(p for p in paths if p.exists())
    return _bytes_and_peak(_step_row(paths, model, form, case), 3)

  rows = [["any", "f32"] + [cell("fused", "auto f32", m, t) for _, m, t in columns]]
  for case in ("auto int8", "auto int4"):
    forms = (("fused", "clip-fused", "update", "clip", "clipped", "multi-steps",
              "multi-steps-fused") if case == "auto int8" else ("fused", "update"))
    rows += [[_FORMS[f], case.split()[1]] + [cell(f, case, m, t) for _, m, t in columns]
             for f in forms]
  return _table(["form", "state"] + [c[0] for c in columns], rows), sorted(used)


def _whole_step_hf() -> tuple[str, list[pathlib.Path]]:
  columns = [("HF Llama-1B-shaped, 2 layers: v5e", "hf-llama-1b-2l", "v5e"),
             ("v6e", "hf-llama-1b-2l", "v6e"), ("H100", "hf-llama-1b-2l", "h100"),
             ("HF GPT-2 small: v5e", "hf-gpt2-small", "v5e"), ("v6e", "hf-gpt2-small", "v6e"),
             ("H100", "hf-gpt2-small", "h100")]
  forms = ("fused", "clip-fused", "update", "clip", "clipped")
  used = sorted({p for f in forms for _, _, t in columns for p in _form_records(f, t, "hf")})
  rows = [["any", "f32"] + [_bytes_and_peak(_step_row(_form_records("fused", t, "hf"), m,
                                                       "fused", "auto f32"), 3)
                            for _, m, t in columns]]
  rows += [[_FORMS[f], "int8"] + [_bytes_and_peak(_step_row(_form_records(f, t, "hf"), m, f,
                                                             "auto int8"), 3)
                                  for _, m, t in columns] for f in forms]
  return _table(["form", "state"] + [c[0] for c in columns], rows), used


def _whole_step_families() -> tuple[str, list[pathlib.Path]]:
  # Muon's own record first: it was compiled again after its XLA path changed.
  paths = [COMPILED / "whole-step-muon-v5e.json", COMPILED / "whole-step-kron-v5e.json",
           COMPILED / "whole-step-families-v5e.json"]
  rows = []
  for family, name in (("lion", "Lion"), ("rmsprop", "RMSProp"), ("mars", "MARS"),
                       ("adafactor", "Adafactor"), ("muon", "Muon"), ("kron", "Kron")):
    rows.append([name] + [
        _bytes_and_peak(_step_row(paths, "llama-1b-2l", "fused", case, family), 3)
        for case in ("auto f32", "auto int8", "auto int4")])
  return _table(["family", "f32 `auto`", "int8", "int4"], rows), paths


# --- one optimizer step, compiled (bench.compiled, bench.schedule) ----------

def _adamw_bytes() -> tuple[str, list[pathlib.Path]]:
  paths = [COMPILED / "adamw-bytes-v5e.json", COMPILED / "adamw-bytes-v6e.json"]
  cases = (("optax.adamw float32", "`optax.adamw`, f32"),
           ("auto update f32", "`update` + `apply_updates`, f32"),
           ("auto fused f32", "fused `apply_gradients`, f32"),
           ("auto fused int8", "fused, `state_format=\"int8\"`"),
           ("auto fused bf16 params, int8", "fused, bf16 params + int8"))
  rows = []
  for case, label in cases:
    row = [label]
    for path in paths:
      for tree in ("gpt2-small", "4096x4096"):
        found = next(r for r in _record(path)["trees"][tree] if r["case"] == case)
        row.append(f"{found['hbm_per_param']:.1f} B ({_x(found['hbm_vs_optax'])})")
    rows.append(row)
  header = ["HBM bytes per param", "v5e: GPT-2 small", "v5e: 4096×4096",
            "v6e: GPT-2 small", "v6e: 4096×4096"]
  return _table(header, rows), paths


def _schedule() -> tuple[str, list[pathlib.Path]]:
  paths = [COMPILED / f"schedule-{t}.json" for t in ("v5e", "v6e", "h100")]
  by_target = {p: {r["case"]: r for r in _record(p)["rows"]} for p in paths}
  rows = []
  for case in ("adamw fused f32", "adamw fused int8", "adamw fused fp8", "adamw fused int4",
               "lion fused int8", "lion fused int4"):
    row = [f"`{case}`"]
    for path in paths:
      r = by_target[path][case]
      cost = (f"{r['cycles_per_1024']:.1f} cycles/1024" if "cycles_per_1024" in r
              else f"{r['sass_per_element']:.0f} SASS/elem")
      row.append(f"{_x(r['predicted_vs_optax'])} ({cost}, {r['bound']})")
    rows.append(row)
  return _table(["4096×4096 leaf", "TPU v5e", "TPU v6e", "H100"], rows), paths


# --- measured -----------------------------------------------------------------

def _h100_adamw_leaf() -> tuple[str, list[pathlib.Path]]:
  path = H100 / "kernels-priority.jsonl"
  rows = []
  for workload, label in (("leaf/f32/16777216", "16.7M-element leaf"),
                          ("gpt2-small/f32", "GPT-2 small")):
    for fmt in ("bf16", "int8", "fp8", "int4"):
      found = {r["impl"]: r for r in _record(path)["rows"]
               if r["case"] == f"adamw/{workload}/state-{fmt}"}
      fused, optax = found["pallasopt.fused"], found["optax"]
      rows.append([label, f"`\"{fmt}\"`", f"{optax['median_ms']:.3f}",
                   f"{fused['median_ms']:.3f}", _x(fused["vs_baseline"])])
  header = ["workload", "state", "Optax f32 (ms)", "pallasopt fused (ms)",
            "speed vs Optax"]
  return _table(header, rows), [path]


def _h100_whole_step_time() -> tuple[str, list[pathlib.Path]]:
  path = H100 / "whole-step-time.json"
  rows = []
  for form in ("fused", "clip-fused", "update"):
    row = [_FORMS[form]]
    for case in ("auto f32", "auto int8", "auto int4"):
      found = _step_row([path], "llama-1b-2l", form, case)
      row.append(_x(found["vs_baseline"]) if found else "")
    rows.append(row)
  return _table(["form (time vs Optax's)", "f32 `auto`", "int8", "int4"], rows), [path]


def _low_bit_stability() -> tuple[str, list[pathlib.Path]]:
  path = RESULTS / "low-bit-updates.json"
  rows = []
  for r in _record(path)["rows"]:
    if r["optimizer"] != "adamw":
      continue
    name = "Optax, f32" if r["state_format"] is None else f"`\"{r['state_format']}\"`"
    rows.append([name, f"{r['spike_largest_update_over_lr']:.3f}",
                 f"{r['long_spike_largest_update_over_lr']:.3f}",
                 str(r["spike_moved_over_2lr_at_step_20"]), f"{r['digits_largest_step']:.5f}",
                 f"{r['digits_final_loss']:.4f}"])
  header = ["AdamW(1e-3) state", "spike: largest update / lr", "over 200 steps",
            "weights moved > 2 lr", "digits: largest step", "digits: final loss"]
  return _table(header, rows), [path]


def _low_bit_libraries() -> tuple[str, list[pathlib.Path]]:
  path = RESULTS / "low-bit-libraries.json"
  record = _record(path)
  columns = (("spike", "spike, 20 steps"), ("long_spike", "spike, 200 steps"),
             ("random_signs", "random signs"), ("vanishing", "vanishing"),
             ("sparse_bursts", "sparse bursts"))
  rows = [[f"`{r['optimizer']}`", f"{r['library']} {record[r['library']]}", r["stores"]]
          + [f"{r[f'{key}_largest_update_over_lr']:.3g}" for key, _ in columns]
          for r in record["rows"]]
  header = ["AdamW, lr 1e-3", "version", "state per element"] + [label for _, label in columns]
  return _table(header, rows), [path]


def _maxtext() -> tuple[str, list[pathlib.Path]]:
  path = RESULTS / "maxtext-train-compile.json"
  rows = _record(path)["rows"]
  optax_rows = {r["param_scan_axis"]: r for r in rows if r["optimizer"] == "optax"}
  mib = lambda n: f"{n / 2**20:.0f} MiB"
  table = []
  for r in rows:
    base = optax_rows[r["param_scan_axis"]]
    name = ("`optax.adamw`" if r["optimizer"] == "optax"
            else f"`pallasopt.optim.adamw`, `\"{r['state_format']}\"` state")
    # Weight matrices: MaxText's stacked norm scales, (emb, layers), are vectors.
    leaves = None if r["matrix_leaves"] is None else [
        shape for shape in r["matrix_leaves"] if math.prod(shape) >= 1 << 16]
    table.append([
        str(r["param_scan_axis"]), name,
        f"{mib(r['peak_bytes'])} ({_x(r['peak_bytes'] / base['peak_bytes'], 3)})",
        f"{mib(r['argument_bytes'])} ({_x(r['argument_bytes'] / base['argument_bytes'])})",
        mib(r["temp_bytes"]), _x(r["hbm_bytes"] / base["hbm_bytes"], 3),
        "" if leaves is None else f"{len(r['adamw_kernels'])} of {len(leaves)}",
        mib(r["relayout_bytes_over_1mib"]),
    ])
  header = ["`param_scan_axis`", "optimizer", "peak memory per chip", "params + state",
            "temporaries", "HBM bytes", "weight matrices on the kernel", "relayouts of 1 MiB+"]
  return _table(header, table), [path]


def _caption(kind: str, paths: Sequence[pathlib.Path], what: str) -> str:
  return f"{what} {kind} Records: {_where(paths)}."


# name -> (render, caption text before the records' names, measured or predicted)
FIGURES: dict[str, tuple[Callable[[], tuple[str, list[pathlib.Path]]], str, str]] = {
    "whole-step-int8": (_whole_step_int8, "Whole train step of a Llama-1B-shaped decoder "
                        "(2 layers, batch 4 x 512), AdamW `impl=\"auto\"`: HBM bytes moved / "
                        "peak memory against `optax.adamw` in the same form.", _PREDICTED),
    "whole-step-forms": (_whole_step_forms, "Whole train step, AdamW `impl=\"auto\"`: HBM "
                         "bytes moved / peak memory against `optax.adamw` in the same form.",
                         _PREDICTED),
    "whole-step-hf": (_whole_step_hf, "Hugging Face's Flax decoders (bf16 activations, f32 "
                      "params), AdamW `impl=\"auto\"`: HBM bytes moved / peak memory against "
                      "`optax.adamw` in the same form.", _PREDICTED),
    "whole-step-families": (_whole_step_families, "The other families on the Llama-shaped "
                            "decoder, fused form, TPU v5e: HBM bytes moved / peak memory "
                            "against Optax's optimizer (the family's XLA path where Optax has "
                            "none: MARS, Kron).", _PREDICTED),
    "adamw-bytes": (_adamw_bytes, "HBM bytes per parameter of one compiled AdamW step "
                    "(against `optax.adamw` in f32).", _PREDICTED),
    "schedule": (_schedule, "Predicted step time against Optax's, max(compute, HBM bytes / "
                 "bandwidth), compute read from the compiled code (TPU bundles, H100 SASS; "
                 "`python -m bench.schedule`).", "Predicted: no chip ran these kernels."),
    "h100-adamw-leaf": (_h100_adamw_leaf, "Fused AdamW step, f32 params, median time.",
                        "Measured on an NVIDIA H100 80GB HBM3 (jax 0.11.2), before int8 "
                        "state moved to the e3m4 map."),
    "h100-whole-step-time": (_h100_whole_step_time, "Whole train step of the Llama-shaped "
                             "decoder, median of 20 steps: time against Optax's AdamW in the "
                             "same form.", "Measured on an NVIDIA H100 80GB HBM3 (jax 0.11.2), "
                             "before int8 state moved to the e3m4 map."),
    "maxtext": (_maxtext, "MaxText 0.2.5's own `train_compile` for a TPU v5e-8 (`python -m "
                "bench.maxtext`): its compiled train step per chip, against Optax's AdamW at "
                "the same `param_scan_axis`.", _PREDICTED),
    "low-bit-libraries": (_low_bit_libraries, "Largest single update / lr of each library's "
                          "low-bit AdamW on the same gradients (`python -m "
                          "bench.low_bit_libraries`: one 16 x 256 leaf; the spike test's "
                          "magnitudes span 1 to 1e-6 in every block; random signs, vanishing "
                          "and sparse gradients over 1 to 1e-8).", "Measured on a CPU: each "
                          "library's own math."),
    "low-bit-stability": (_low_bit_stability, "Largest single AdamW update of each state "
                          "format on the same gradients (`python -m bench.low_bit`: a 16 x 256 "
                          "leaf with magnitudes from 1 to 1e-6 in every block, 20 and 200 "
                          "steps; scikit-learn's digits, a 64-64-10 MLP, 300 steps).",
                          "Measured on a CPU (the kernels store the same codes as this XLA "
                          "path)."),
}


def render(name: str) -> str:
  """The text between a page's markers for figure ``name``."""
  make, what, kind = FIGURES[name]
  table, paths = make()
  return f"{table}\n\n{_caption(kind, paths, what)}\n"


def pages() -> list[pathlib.Path]:
  found = []
  for pattern in PAGES:
    found += sorted(p for p in ROOT.glob(pattern) if "_build" not in p.parts)
  return found


def updated(text: str, where: str = "page") -> str:
  """``text`` with every figure between its markers rendered again."""
  def one(match):
    name = match.group(2)
    if name not in FIGURES:
      raise ValueError(f"{where}: unknown figure {name!r}; expected one of {sorted(FIGURES)}.")
    return match.group(1) + render(name) + match.group(4)
  return _FIGURE.sub(one, text)


def stale_pages() -> dict[pathlib.Path, str]:
  """Each page whose figures differ from their rendering from the records, with its new text."""
  stale = {}
  for page in pages():
    text = page.read_text()
    new = updated(text, str(page.relative_to(ROOT)))
    if new != text:
      stale[page] = new
  return stale


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--check", action="store_true",
                 help="change nothing; exit 1 where a page's figures differ from the records")
  args = p.parse_args(argv)
  stale = stale_pages()
  for page, new in stale.items():
    if not args.check:
      page.write_text(new)
    verb = "differ from their records" if args.check else "rewritten"
    print(f"{page.relative_to(ROOT)}: figures {verb}")
  return 1 if (stale and args.check) else 0


if __name__ == "__main__":
  sys.exit(main())
