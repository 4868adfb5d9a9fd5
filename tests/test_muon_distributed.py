"""Muon's Newton–Schulz split over data-parallel devices (``distributed_axes``).

On 8 CPU devices (conftest.py): the split step equals the replicated one,
each device's compiled flops shrink to its share, and the only collectives
are a few per shape group, outside the iterations.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import pallasopt
from helpers import assert_close

# 8 matrices of each of two shapes, and a vector AdamW takes.
_SHAPES = {"up": (64, 96), "down": (96, 64)}
_COLLECTIVE = re.compile(r" (all-to-all|all-gather|all-reduce|collective-permute|reduce-scatter)"
                         r"(?:-start)?\(")


def _problem():
  rng = np.random.default_rng(0)
  params = {f"{name}{i}": jnp.asarray(rng.standard_normal(shape) * 0.02, jnp.float32)
            for name, shape in _SHAPES.items() for i in range(8)}
  params["bias"] = jnp.zeros((64,), jnp.float32)
  grads = jax.tree.map(lambda p: jnp.sin(100 * p) + 0.01, params)
  return params, grads


def _run(distributed_axes, axis_type, layout, impl="xla", steps=2, **options):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
  params, grads = _problem()
  tx = pallasopt.optim.muon(1e-2, distributed_axes=distributed_axes, impl=impl, **options)
  with jax.set_mesh(mesh):
    place = lambda tree: {
        k: jax.device_put(x, NamedSharding(mesh, layout if x.ndim == 2 else P()))
        for k, x in tree.items()}
    params, grads = place(params), place(grads)
    state = tx.init(params)
    step = jax.jit(functools.partial(pallasopt.optim.apply_gradients, tx))
    compiled = step.lower(params, grads, state).compile()
    # One compile: a step's outputs are inputs the same executable takes.
    for _ in range(steps):
      params, state = compiled(params, grads, state)
  return params, compiled


def _flops(compiled):
  cost = compiled.cost_analysis()
  return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


@pytest.mark.parametrize("layout", [P(), P("data", None)], ids=["replicated", "rows sharded"])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=str)
def test_split_newton_schulz_equals_the_replicated_one_at_an_eighth_of_the_flops(axis_type, layout):
  want, whole = _run(None, axis_type, layout)
  got, split = _run(("data",), axis_type, layout)
  for name in want:
    # Each matrix gets the same math; only XLA's batching of it differs.
    assert_close(got[name], want[name], 1e-5, err_msg=name)
    assert got[name].sharding.spec == want[name].sharding.spec
  # 16 matrices on 8 devices: 2 each, 1/8 of the replicated step's work.
  if layout == P():
    assert _flops(split) <= 0.25 * _flops(whole)
  collectives = _COLLECTIVE.findall(split.as_text())
  # Replicated: one gather (or permute) per shape group back to every device;
  # rows sharded: one all-to-all into the batch layout and one back, per group.
  assert len(collectives) <= 2 * len(_SHAPES), collectives
  assert "while" not in split.as_text() or not re.search(
      r"while.*\n(?:.*\n)*?.*(all-to-all|all-gather)", split.as_text()), "collective in a loop"


def test_split_newton_schulz_runs_the_kernel_per_device():
  want, _ = _run(None, AxisType.Explicit, P(), impl="interpret", steps=1)
  got, _ = _run(("data",), AxisType.Explicit, P(), impl="interpret", steps=1)
  for name in want:
    assert_close(got[name], want[name], 1e-5, err_msg=name)


@pytest.mark.parametrize("options", [
    {"ns_coeffs": "polar_express"}, {"scale_mode": "spectral"}, {"second_moment": "normuon"},
    {"iter_dtype": jnp.bfloat16}, {"gram_levels": 1},
], ids=str)
def test_per_matrix_options_split_alike(options):
  want, _ = _run(None, AxisType.Explicit, P(), steps=1, **options)
  got, _ = _run(("data",), AxisType.Explicit, P(), steps=1, **options)
  # bf16 iterates round each product: two batchings may differ by a bf16 ulp.
  rtol = 2**-7 if "iter_dtype" in options else 1e-5
  for name in want:
    assert_close(got[name], want[name], rtol, err_msg=name)


def test_inside_shard_map_each_replica_orthogonalizes_its_share():
  # A pipeline stage's view: the data axis manual, every device a replica.
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  params, grads = _problem()
  replicated = pallasopt.optim.muon(1e-2)
  want = jax.jit(functools.partial(pallasopt.optim.apply_gradients, replicated))(
      params, grads, replicated.init(params))[0]
  tx = pallasopt.optim.muon(1e-2, distributed_axes=("data",))

  @jax.jit
  @functools.partial(pallasopt.kernels._compat.shard_map, mesh=mesh, in_specs=P(),
                     out_specs=P(), check_vma=False)
  def replica_step(params, grads):
    return pallasopt.optim.apply_gradients(tx, params, grads, tx.init(params))[0]

  compiled = replica_step.lower(params, grads).compile()
  got = compiled(params, grads)
  for name in want:
    assert_close(got[name], want[name], 1e-5, err_msg=name)
  assert len(_COLLECTIVE.findall(compiled.as_text())) == len(_SHAPES)  # one all-gather per shape


def test_distributed_axes_errors_name_the_problem():
  params, grads = _problem()
  tx = pallasopt.optim.muon(1e-2, distributed_axes=("data",))
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"distributed_axes=\('data',\) needs the mesh in context.*set_mesh"):
    tx.update(grads, state, params)
  mesh = jax.make_mesh((8,), ("batch",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"names \['data'\].*lacks"):
    tx.update(grads, state, params)
  for bad in [(), ("data", "data"), (3,)]:
    with pytest.raises(ValueError, match="distributed_axes must be distinct mesh axis names"):
      pallasopt.optim.muon(1e-2, distributed_axes=bad)


def test_the_config_and_factory_carry_distributed_axes():
  config = pallasopt.optim.eformer.MuonConfig(distributed_axes=("data",))
  assert pallasopt.optim.eformer.MuonConfig.from_dict(config.to_dict()).distributed_axes in (
      ("data",), ["data"])
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  params, grads = _problem()
  tx = pallasopt.optim.eformer.OptimizerFactory.create(
      "muon", scheduler_config=pallasopt.optim.eformer.SchedulerConfig(learning_rate=1e-2),
      optimizer_config=config)[0]
  with jax.set_mesh(mesh):
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  reference = pallasopt.optim.eformer.OptimizerFactory.create(
      "muon", scheduler_config=pallasopt.optim.eformer.SchedulerConfig(learning_rate=1e-2),
      optimizer_config=pallasopt.optim.eformer.MuonConfig())[0]
  want, _ = reference.update(grads, reference.init(params), params)
  for name in want:
    assert_close(updates[name], want[name], 1e-5, err_msg=name)


def test_the_bench_measures_and_models_the_split():
  from bench import muon_distributed as bench

  tree = {f"m{i}": jax.ShapeDtypeStruct((64, 96), jnp.float32) for i in range(8)}
  whole = bench.measure(tree, "replicated", distributed=False)
  split = bench.measure(tree, "replicated", distributed=True)
  assert split["flops_per_device"] <= 0.25 * whole["flops_per_device"]
  assert whole["collectives"] == 0 and 0 < split["collectives"] <= 2
  modelled = bench.model(tree, whole["flops_per_device"], 64)
  assert modelled["vs_replicated"] == 1 / 8  # one matrix of the 8 on each busy device
