"""``python -m bench.muon_distributed``: Muon's Newton–Schulz split over data-parallel devices.

Compiles one Muon step (`pallasopt.optim.muon`, XLA path) on 8 CPU devices
(``--xla_force_host_platform_device_count=8``, set here) for the Muon
matrices of GPT-2 small (48: 12 x {768x2304, 768x768, 768x3072, 3072x768})
and of the 1B decoder (112), with params replicated and rows-sharded (FSDP) on
a ``data`` axis, with and without ``distributed_axes=("data",)``, and prints
per device what the compiled program does: flops (``cost_analysis()``) and
collectives (count and bytes, `pallasopt.compile_check.traffic`). Nothing is
timed. It then models a 64-way data-parallel run from the per-matrix flops:
each device orthogonalizes ceil(n / 64) of the n matrices of each shape, and
gathers each shape group once (labelled a model). ``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import functools
import json
import math

from bench import fake_cpu_devices

DEVICES = 8
MODEL_DEVICES = 64


def muon_trees() -> dict:
  from bench import workloads

  def matrices(tree, layers: str) -> dict:
    return {f"{name}/{k}": x for name, layer in tree[layers].items()
            for k, x in _flat(layer) if len(x.shape) == 2}

  return {
      "gpt2-small": matrices(workloads.gpt2(**workloads.GPT2_SMALL).tree, "h"),
      "decoder-1b": matrices(workloads.decoder(**workloads.DECODER_1B).tree, "layers"),
  }


def _flat(tree, prefix=""):
  for k, x in tree.items():
    if isinstance(x, dict):
      yield from _flat(x, f"{prefix}{k}/")
    else:
      yield f"{prefix}{k}", x


def measure(tree: dict, layout: str, distributed: bool) -> dict:
  """Per-device flops and collectives of one compiled Muon step."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  import pallasopt
  from pallasopt.compile_check import traffic

  mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  spec = P() if layout == "replicated" else P("data", None)
  tx = pallasopt.optim.muon(1e-2, impl="xla", distributed_axes=("data",) if distributed else None)
  with jax.set_mesh(mesh):
    params = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
              for k, x in tree.items()}
    state = jax.eval_shape(tx.init, params)
    compiled = jax.jit(functools.partial(pallasopt.optim.apply_gradients, tx)).lower(
        params, params, state).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  t = traffic(compiled)
  return {"flops_per_device": cost["flops"], "collectives": len(t.collectives),
          "collective_bytes_per_device": t.collective_bytes}


def model(tree: dict, replicated_flops: float, devices: int) -> dict:
  """A data-parallel run on ``devices``, from the per-matrix flops (a model, not a measurement)."""
  groups: dict[tuple, int] = {}
  for x in tree.values():
    groups[tuple(x.shape)] = groups.get(tuple(x.shape), 0) + 1
  work = {s: n * math.prod(s) * min(s) for s, n in groups.items()}  # flops ~ r c min(r, c)
  total = sum(work.values())
  share = sum(math.ceil(n / devices) / n * work[s] for s, n in groups.items()) / total
  gathered = sum(n * math.prod(s) * 4 for s, n in groups.items())
  return {"devices": devices, "flops_per_device": replicated_flops * share,
          "vs_replicated": share, "collectives": len(groups),
          "collective_bytes_per_device": gathered * (devices - 1) / devices}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m bench.muon_distributed", description=__doc__)
  parser.add_argument("--json")
  args = parser.parse_args(argv)
  out = {}
  for name, tree in muon_trees().items():
    rows = {}
    for layout in ("replicated", "fsdp"):
      for distributed in (False, True):
        rows[f"{layout}, {'split' if distributed else 'every device'}"] = measure(
            tree, layout, distributed)
    base = rows["replicated, every device"]["flops_per_device"]
    rows[f"model: {MODEL_DEVICES} devices, split"] = model(tree, base, MODEL_DEVICES)
    out[name] = rows
    print(f"{name}: {len(tree)} Muon matrices, {DEVICES} CPU devices (compiled; nothing timed)")
    for case, r in rows.items():
      print(f"  {case:34s} flops/device {r['flops_per_device'] / 1e9:9.2f} G "
            f"({r['flops_per_device'] / base:.3f}x)  collectives {r['collectives']:3d}  "
            f"{r['collective_bytes_per_device'] / 2**20:8.1f} MiB")
  if args.json:
    import jax

    with open(args.json, "w") as f:
      json.dump({"devices": DEVICES, "jax": jax.__version__, "host": "CPU (compile only)",
                 "trees": out}, f, indent=1)


if __name__ == "__main__":
  fake_cpu_devices(DEVICES)
  main()
