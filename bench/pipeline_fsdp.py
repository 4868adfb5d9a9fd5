"""``python -m bench.pipeline_fsdp``: a pipelined train step with and without FSDP, compiled.

  python -m bench.pipeline_fsdp --json bench/results/compiled/pipeline-fsdp.json

Compiles one step of `pallasopt.pipeline.make_train_step` (4 stages, 8
microbatches, 8 repeats of a residual MLP block: ``x + gelu(rms(x) W_up)
W_down``, width 1024, 32 layers, f32 params) on 8 devices, the 4 stages times
2 devices per stage, in two ways: the 2 devices as a data axis (each holds its
stage's whole params and state) and as an FSDP axis (``fsdp_axis``: each
holds half). It does so for a TPU v5e 2x4 (compile-only, from this host: the
``aot`` extra) and for this host's CPU as 8 devices, with AdamW (f32 and
int8 state) and Muon, and prints per device what the compiled program holds and moves: peak
memory (``memory_analysis()``: arguments + outputs - aliased + temporaries),
the collectives one step runs and the bytes of their operands (counted from
the step's jaxpr, each scan's body times its length, at most: the compiled
module's loops do not say how often they run), and the Pallas kernels it
runs. Nothing is timed. ``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import json

from bench import fake_cpu_devices

DEVICES = 8
STAGES, MICROBATCHES, REPEATS, WIDTH, MICROBATCH = 4, 8, 8, 1024, 16
# (optimizer, state format): f32 AdamW, AdamW with int8 state (its kernels on
# each device's slices), Muon (whole layers split over the FSDP axis).
CASES = (("adamw", None), ("adamw", "int8"), ("muon", None))


def mlp_block(params, x):
  """One residual MLP block (its norm scale is the small leaf FSDP leaves whole)."""
  import jax
  import jax.numpy as jnp

  h = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + 1e-6) * params["scale"]
  return x + jax.nn.gelu(h @ params["up"]) @ params["down"]


def _mse(outputs, targets):
  import jax.numpy as jnp

  return jnp.mean(jnp.square(outputs - targets))


def build_step(devices, *, fsdp: bool, optimizer: str = "adamw", impl: str = "auto",
               repeats: int = REPEATS, state_format: str | None = None):
  """The step on ``devices`` (8: 4 stages x 2), the 2 as an FSDP or a data axis, and its arguments.

  The arguments are `jax.ShapeDtypeStruct`s placed as the step places them.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding

  from pallasopt.optim.eformer import AdamWConfig, MuonConfig, OptimizerFactory, SchedulerConfig
  from pallasopt.pipeline import CircularSchedule, io_specs, make_train_step, named_shardings

  schedule = CircularSchedule(STAGES, MICROBATCHES, repeats)
  axis = "fsdp" if fsdp else "data"
  mesh = Mesh(np.asarray(devices).reshape(STAGES, DEVICES // STAGES), ("stage", axis))
  config = (AdamWConfig(state_format=state_format) if optimizer == "adamw"
            else MuonConfig(state_format=state_format))
  tx, _ = OptimizerFactory.create(optimizer, SchedulerConfig(learning_rate=1e-3), config,
                                  clip_grad=1.0, weight_decay=0.1, impl=impl,
                                  stacked_axes=schedule.stacked_axes)
  step = make_train_step(mlp_block, _mse, tx, mesh=mesh, schedule=schedule,
                         **({"fsdp_axis": axis} if fsdp else {"data_axis": axis}))
  stacked = schedule.stacked_shape
  params = {
      "up": jax.ShapeDtypeStruct(stacked + (WIDTH, 4 * WIDTH), jnp.float32),
      "down": jax.ShapeDtypeStruct(stacked + (4 * WIDTH, WIDTH), jnp.float32),
      "scale": jax.ShapeDtypeStruct(stacked + (WIDTH,), jnp.float32),
  }
  placed = lambda tree, specs: jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
      named_shardings(mesh, specs))
  state = placed(jax.eval_shape(tx.init, params), step.state_specs(params))
  params = placed(params, step.param_specs(params))
  io = NamedSharding(mesh, io_specs(schedule, data_axis=step.data_axis, fsdp_axis=step.fsdp_axis))
  batch = jax.ShapeDtypeStruct((MICROBATCHES, MICROBATCH, WIDTH), jnp.float32, sharding=io)
  return step, (params, state, batch, batch)


def compile_step(devices, **options):
  """`build_step`'s step, compiled."""
  step, args = build_step(devices, **options)
  return step.lower(*args).compile()


_COLLECTIVES = ("all_gather", "reduce_scatter", "psum", "all_to_all", "ppermute")


def collective_runs(jaxpr, times: int = 1) -> dict[tuple[str, tuple[int, ...]], list[int]]:
  """How often each collective of a step's jaxpr runs: (primitive, operand shape) -> [least, most].

  A scan's body runs ``length`` times; a cond runs one of its branches: the
  least count takes the branch with fewer, the most the one with more.
  Counted from the jaxpr because the compiled module's loops do not say how
  often they run.
  """
  from jax.extend import core

  counts: dict = {}

  def add(key, least, most):
    total = counts.setdefault(key, [0, 0])
    total[0] += least
    total[1] += most

  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in _COLLECTIVES:
      for operand in eqn.invars:
        add((name, tuple(operand.aval.shape), str(operand.aval.dtype)), times, times)
    repeat = eqn.params["length"] if name == "scan" else 1
    branches = [collective_runs(sub, times * repeat) for sub in core.jaxprs_in_params(eqn.params)]
    if name == "cond":
      for key in set().union(*branches):
        runs = [b.get(key, [0, 0]) for b in branches]
        add(key, min(r[0] for r in runs), max(r[1] for r in runs))
    else:
      for branch in branches:
        for key, (least, most) in branch.items():
          add(key, least, most)
  return counts


def measure(devices, **options) -> dict:
  """Per device: peak memory, collectives (at most, per step) and Pallas kernels of the step."""
  import jax
  import numpy as np

  from pallasopt.compile_check import compiled_kernels
  from pallasopt.whole_step import peak_bytes

  step, args = build_step(devices, **options)
  compiled = step.lower(*args).compile()
  memory = compiled.memory_analysis()
  runs, moved = {}, {}
  jaxpr = jax.make_jaxpr(step._step)(*args).jaxpr
  for (name, shape, dtype), (_, most) in collective_runs(jaxpr).items():
    runs[name] = runs.get(name, 0) + most
    moved[name] = moved.get(name, 0) + most * int(np.prod(shape)) * np.dtype(dtype).itemsize
  return {"peak_bytes": peak_bytes(compiled), "argument_bytes": memory.argument_size_in_bytes,
          "temp_bytes": memory.temp_size_in_bytes, "collective_runs": runs,
          "collective_operand_bytes": moved, "kernels": sum(compiled_kernels(compiled).values())}


def targets() -> dict[str, object]:
  """The 8-device targets this host can compile for: its CPU and, with the aot extra, a v5e 2x4."""
  import jax

  from pallasopt.compile_check import devices, missing

  found = {}
  if len(jax.devices("cpu")) >= DEVICES:
    found["cpu x8"] = jax.devices("cpu")[:DEVICES]
  if missing("v5e") is None:
    found["tpu v5e 2x4"] = devices("v5e", "2x4")
  return found


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m bench.pipeline_fsdp", description=__doc__)
  parser.add_argument("--json")
  args = parser.parse_args(argv)
  rows = {}
  for target, devices in targets().items():
    for optimizer, state_format in CASES:
      pair = {f"fsdp={fsdp}": measure(devices, fsdp=fsdp, optimizer=optimizer,
                                      state_format=state_format)
              for fsdp in (False, True)}
      pair["peak_ratio"] = pair["fsdp=True"]["peak_bytes"] / pair["fsdp=False"]["peak_bytes"]
      case = optimizer + (f" {state_format}" if state_format else "")
      rows[f"{target}, {case}"] = pair
      print(f"{target}, {case} (compiled; nothing timed):")
      for case in ("fsdp=False", "fsdp=True"):
        r = pair[case]
        moved = {k: f"{v / 2**20:.1f} MiB" for k, v in r["collective_operand_bytes"].items()}
        print(f"  {case:10s} peak {r['peak_bytes'] / 2**20:8.1f} MiB/device (params and state"
              f" {r['argument_bytes'] / 2**20:.1f})  collectives per step {r['collective_runs']}"
              f" of {moved}  kernels {r['kernels']}")
      print(f"  peak with FSDP / without: {pair['peak_ratio']:.3f}")
  if args.json:
    import jax

    config = dict(stages=STAGES, microbatches=MICROBATCHES, repeats=REPEATS, width=WIDTH,
                  microbatch=MICROBATCH, devices=DEVICES, params="f32")
    with open(args.json, "w") as f:
      json.dump({"jax": jax.__version__, "host": "CPU (compile only)", "config": config,
                 "rows": rows}, f, indent=1)


if __name__ == "__main__":
  fake_cpu_devices(DEVICES)
  main()
