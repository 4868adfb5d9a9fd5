"""Sharding rules, optimizer-state specs, the analyzer and barrier_sync.

Runs on the 8 fake CPU devices that conftest.py requests.
"""

import itertools
import math
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from hypothesis import given, settings, strategies as st
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pallasopt import optim
from pallasopt.pipeline.sharding import (
    AutoShardingRule,
    CompositeShardingRule,
    MemoryConstrainedShardingRule,
    ShapeBasedShardingRule,
    ShardingAnalyzer,
    barrier_sync,
    named_shardings,
    optimizer_state_specs,
    shard_factors_like_params,
)

MESH_SHAPES = [(1,), (2,), (8,), (2, 4), (4, 2), (1, 8), (2, 2, 2), (2, 1, 4)]
SIDES = [1, 2, 3, 4, 6, 8, 12, 16, 24]


def make_mesh(shape, names=("a", "b", "c")):
  # jax.make_mesh defaults to explicit axes in jax 0.10; these tests use the
  # automatic (GSPMD) semantics that `Mesh` gives.
  devices = np.array(jax.devices()[: math.prod(shape)]).reshape(shape)
  return Mesh(devices, names[: len(shape)])


meshes = st.sampled_from(MESH_SHAPES).map(make_mesh)
leaf_shapes = st.lists(st.sampled_from(SIDES), min_size=0, max_size=3).map(tuple)


@st.composite
def param_trees(draw, min_leaves=1, max_leaves=4):
  shapes = draw(st.lists(leaf_shapes, min_size=min_leaves, max_size=max_leaves))
  dtypes = [draw(st.sampled_from([jnp.float32, jnp.bfloat16])) for _ in shapes]
  return {f"p{i}": sds(*s, dtype=d) for i, (s, d) in enumerate(zip(shapes, dtypes))}


def sds(*shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def nbytes(leaf):
  return math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize


def shard_count(mesh, spec):
  axes = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
  return math.prod(mesh.shape[a] for a in axes)


def shard_counts(mesh, shape):
  """Every shard count a valid spec of `shape` can have (brute force)."""
  axes = list(mesh.axis_names)
  counts = set()
  for dims in itertools.product([None, *range(len(shape))], repeat=len(axes)):
    factors = [1] * len(shape)
    for axis, dim in zip(axes, dims):
      if dim is not None:
        factors[dim] *= mesh.shape[axis]
    if all(size % f == 0 for size, f in zip(shape, factors)):
      counts.add(math.prod(factors))
  return counts


def zeros(tree):
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


def assert_placed(mesh, tree, specs):
  """Every array of `tree` is sharded as `specs` says."""
  arrays, treedef = jax.tree_util.tree_flatten_with_path(tree)
  for (path, x), spec in zip(arrays, treedef.flatten_up_to(specs)):
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (
        jax.tree_util.keystr(path), x.shape, x.sharding.spec, spec)


# ----------------------------------------------------------------------------
# Rules.
# ----------------------------------------------------------------------------


@settings(deadline=None)
@given(
    mesh=meshes,
    params=param_trees(),
    min_shard_size=st.sampled_from([None, 0, 1, 64]),
    reverse=st.booleans(),
)
def test_auto_rule_gives_valid_maximal_specs(mesh, params, min_shard_size, reverse):
  rule = AutoShardingRule(mesh, min_shard_size=min_shard_size, reverse=reverse)
  specs = rule.apply(params)
  ShardingAnalyzer(mesh).validate(params, specs)
  for leaf, spec in zip(jax.tree.leaves(params), jax.tree.leaves(specs)):
    if math.prod(leaf.shape) < rule.min_shard_size:
      assert spec == P()
      continue
    # Greedy and maximal: no unused axis of size > 1 divides an unsharded dim.
    entries = list(spec) + [None] * (len(leaf.shape) - len(spec))
    unused = [a for a in mesh.axis_names if a not in entries and mesh.shape[a] > 1]
    for size, entry in zip(leaf.shape, entries):
      assert isinstance(entry, (str, type(None)))
      if entry is None:
        assert all(size % mesh.shape[a] for a in unused)


def test_auto_rule_puts_largest_dims_first_and_reverse_flips_the_axes():
  mesh = make_mesh((2, 4))
  leaf = {"w": sds(8, 32), "tiny": sds(2)}
  assert AutoShardingRule(mesh).apply(leaf) == {"w": P("b", "a"), "tiny": P()}
  assert AutoShardingRule(mesh, reverse=True).apply(leaf) == {"w": P("a", "b"), "tiny": P()}
  assert AutoShardingRule(mesh, axis_names=["b"]).apply(leaf)["w"] == P(None, "b")
  # 6 is not divisible by 4, so the largest dim takes "a" and "b" goes to 4.
  assert AutoShardingRule(mesh).apply(sds(4, 6)) == P("b", "a")


@settings(deadline=None)
@given(mesh=meshes, params=param_trees(), divisor=st.sampled_from([1, 2, 3, 4, 8, 16, 64, 1000]))
def test_memory_rule_meets_the_budget_whenever_it_is_achievable(mesh, params, divisor):
  budget = max(nbytes(leaf) for leaf in jax.tree.leaves(params)) // divisor
  strict = MemoryConstrainedShardingRule(mesh, budget)
  lenient = MemoryConstrainedShardingRule(mesh, budget, strict=False)
  analyzer = ShardingAnalyzer(mesh)
  for name, leaf in params.items():
    path = (jax.tree_util.DictKey(name),)
    counts = shard_counts(mesh, leaf.shape)
    fitting = [c for c in counts if nbytes(leaf) // c <= budget]
    if fitting:
      spec = strict.leaf_spec(path, leaf)
      analyzer.validate(leaf, spec)
      # Sharded just enough: the smallest shard count that fits.
      assert shard_count(mesh, spec) == min(fitting)
    else:
      message = rf"\['{name}'\].*cannot fit max_bytes_per_device={budget}"
      with pytest.raises(ValueError, match=message):
        strict.leaf_spec(path, leaf)
      with pytest.warns(UserWarning, match="cannot fit"):
        spec = lenient.leaf_spec(path, leaf)
      analyzer.validate(leaf, spec)
      assert shard_count(mesh, spec) == max(counts)


def test_memory_rule_replicates_what_fits_and_uses_the_largest_axis_on_the_largest_dim():
  mesh = make_mesh((2, 4))
  leaf = sds(8, 16)  # 512 bytes
  assert MemoryConstrainedShardingRule(mesh, 512).apply(leaf) == P()
  assert MemoryConstrainedShardingRule(mesh, 256).apply(leaf) == P(None, "a")
  assert MemoryConstrainedShardingRule(mesh, 128).apply(leaf) == P(None, "b")
  assert MemoryConstrainedShardingRule(mesh, 64).apply(leaf) == P(None, ("a", "b"))
  cube = sds(4, 4, 4)  # equal dims: the first one
  assert MemoryConstrainedShardingRule(mesh, 64, axis_names=["b"]).apply(cube) == P("b")
  with pytest.raises(ValueError, match="cannot fit"):
    MemoryConstrainedShardingRule(mesh, 32, axis_names=["b"]).apply(leaf)


def test_shape_rule_matches_patterns_with_wildcards_in_order():
  rule = ShapeBasedShardingRule({
      (None, 16): P(None, "b"),
      (8, None): P("a", None),
      (None,): P("a"),
  })
  tree = {"w": sds(8, 16), "v": sds(8, 3), "b": sds(6), "x": sds(2, 2, 2)}
  assert rule.apply(tree) == {"w": P(None, "b"), "v": P("a"), "b": P("a"), "x": P()}
  with pytest.raises(TypeError, match=r"patterns\[0\]"):
    ShapeBasedShardingRule([((None,), P("a", "b"))])
  with pytest.raises(TypeError, match=r"patterns\[0\]"):
    ShapeBasedShardingRule([([8], P("a"))])


def test_composite_rule_takes_the_first_spec_that_shards():
  mesh = make_mesh((2, 4))
  rule = CompositeShardingRule(
      ShapeBasedShardingRule({(None, 16): P(None, "b"), (3,): P()}),
      AutoShardingRule(mesh, min_shard_size=1),
  )
  tree = {"w": sds(8, 16), "c": sds(8), "odd": sds(3)}
  assert rule.apply(tree) == {"w": P(None, "b"), "c": P("a"), "odd": P()}
  with pytest.raises(TypeError, match=r"rules\[1\]"):
    CompositeShardingRule(AutoShardingRule(mesh), "auto")


def test_rules_name_bad_arguments_and_leaves():
  mesh = make_mesh((2, 4))
  with pytest.raises(ValueError, match="axis_names"):
    AutoShardingRule(mesh, axis_names=["model"])
  with pytest.raises(ValueError, match="max_bytes_per_device"):
    MemoryConstrainedShardingRule(mesh, -1)
  with pytest.raises(TypeError, match=r"\['x'\]\[1\].*str"):
    AutoShardingRule(mesh).apply({"x": [jnp.zeros(3), "not an array"]})


# ----------------------------------------------------------------------------
# Optimizer state.
# ----------------------------------------------------------------------------

TRANSFORMS = {
    "adamw": lambda: optax.adamw(1e-2),
    "lion": lambda: optax.lion(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=2),
    "muon": lambda: optax.contrib.muon(1e-2),
    "chain_masked_adamw": lambda: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.masked(optax.adamw(1e-2), lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
    ),
    "inject_adafactor": lambda: optax.inject_hyperparams(
        optax.adafactor, static_args=("min_dim_size_to_factor",)
    )(learning_rate=1e-2, min_dim_size_to_factor=2),
    "multisteps_lion": lambda: optax.MultiSteps(optax.lion(1e-2), 2),
    "pallasopt_adamw": lambda: optim.adamw(1e-2),
}


def check_state_specs(mesh, params, tx, param_specs=None):
  """Specs validate, device_put places every leaf, a jitted update keeps them."""
  if param_specs is None:
    param_specs = AutoShardingRule(mesh, min_shard_size=1).apply(params)
  state_shapes = jax.eval_shape(tx.init, params)
  state_specs = optimizer_state_specs(state_shapes, params, param_specs)
  ShardingAnalyzer(mesh).validate(state_shapes, state_specs, name="opt_state")
  param_sh, state_sh = named_shardings(mesh, param_specs), named_shardings(mesh, state_specs)

  rng = np.random.default_rng(0)
  values = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape), s.dtype), params)
  p = jax.device_put(values, param_sh)
  g = jax.device_put(jax.tree.map(lambda x: 0.1 * x, values), param_sh)
  state = jax.device_put(tx.init(values), state_sh)
  assert_placed(mesh, state, state_specs)
  # No out_shardings: XLA's propagation must land on the same specs, so the
  # state never moves between steps (Optax's update and the fused apply path).
  step = jax.jit(lambda p, g, s: (tx.update(g, s, p), optim.apply_gradients(tx, p, g, s)))
  (updates, new_state), (new_params, applied_state) = step(p, g, state)
  assert_placed(mesh, updates, param_specs)
  assert_placed(mesh, new_params, param_specs)
  assert_placed(mesh, new_state, state_specs)
  assert_placed(mesh, applied_state, state_specs)
  return param_specs, state_specs


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_state_specs_for_optax_transforms(name):
  mesh = make_mesh((2, 4))
  params = {
      "w": sds(8, 16),
      "sq": sds(8, 8, 4),  # equal dims: ambiguous reductions
      "b": sds(16, dtype=jnp.bfloat16),
      "s": sds(),
  }
  check_state_specs(mesh, params, TRANSFORMS[name]())


@settings(deadline=None)
@given(mesh=meshes, params=param_trees(), name=st.sampled_from(sorted(TRANSFORMS)))
def test_state_specs_place_every_leaf(mesh, params, name):
  check_state_specs(mesh, params, TRANSFORMS[name]())


def test_state_specs_of_moments_and_factored_statistics():
  params = {"w": sds(8, 16), "sq": sds(8, 8, 4), "b": sds(16)}
  param_specs = {"w": P("a", "b"), "sq": P("a", "b"), "b": P("b")}
  adam = optimizer_state_specs(jax.eval_shape(optax.adamw(1.0).init, params), params, param_specs)
  assert adam[0].count == P() and adam[0].mu == param_specs and adam[0].nu == param_specs

  state = jax.eval_shape(optax.adafactor(1.0, min_dim_size_to_factor=2).init, params)
  factored = optimizer_state_specs(state, params, param_specs)[0]
  # v_row reduces the largest dim, v_col the second largest (ties: the later
  # dim is "largest", as optax's argsort orders them).
  assert factored.v_row == {"w": P("a"), "sq": P("a"), "b": P()}
  assert factored.v_col == {"w": P("b"), "sq": P("b"), "b": P()}
  assert factored.v == {"w": P(), "sq": P(), "b": P("b")}  # (1,) placeholders replicated


def test_state_specs_keep_masked_nodes_and_reduced_dims():
  params = {"w": sds(8, 16), "b": sds(16)}
  param_specs = {"w": P("a", "b"), "b": P("b")}
  state = {
      "mu": {"w": sds(8, 16), "b": optax.MaskedNode()},
      "kept": {"w": sds(8, 1), "b": sds(1)},
      "other": sds(8, 16),
  }
  specs = optimizer_state_specs(state, params, param_specs)
  assert specs == {
      "mu": {"w": P("a", "b"), "b": optax.MaskedNode()},
      "kept": {"w": P("a"), "b": P()},
      "other": P(),
  }


@pytest.mark.parametrize("name", ["adamw", "adafactor", "muon"])
def test_stage_stacked_state_keeps_the_stage_axis(name):
  mesh = make_mesh((4, 2), ("stage", "model"))
  params = {"w": sds(4, 8, 16), "b": sds(4, 16)}
  param_specs = {"w": P("stage", None, "model"), "b": P("stage", "model")}
  _, state_specs = check_state_specs(mesh, params, TRANSFORMS[name](), param_specs)
  state_shapes = jax.eval_shape(TRANSFORMS[name]().init, params)
  for shape, spec in zip(jax.tree.leaves(state_shapes), jax.tree.leaves(state_specs)):
    if shape.shape[:1] == (4,):
      assert spec[0] == "stage", (shape, spec)


def test_state_specs_for_a_bare_array_param():
  params = sds(8, 16)
  specs = optimizer_state_specs(jax.eval_shape(optax.adamw(1.0).init, params), params, P("a"))
  assert specs[0] == optax.ScaleByAdamState(count=P(), mu=P("a"), nu=P("a"))


def kron_like_state(params):
  """psgd_jax.kron's state layout: a list of factors per param."""
  qs = {
      "blocks": {  # stacked over 4 stages: factors carry the stage dim
          "w": [sds(4, 8, 8), sds(4, 16, 16)],
          "b": [sds(4, 16)],
      },
      "emb": [sds(12, 12), sds(8)],
  }
  return {"count": sds(dtype=jnp.int32), "mu": params, "Qs_preconditioners": qs}


def test_kron_factors_are_replicated_by_default_except_the_stage_axis():
  mesh = make_mesh((4, 2), ("stage", "model"))
  params = {"blocks": {"w": sds(4, 8, 16), "b": sds(4, 16)}, "emb": sds(12, 8)}
  param_specs = {
      "blocks": {"w": P("stage", None, "model"), "b": P("stage", "model")},
      "emb": P("model"),
  }
  state = kron_like_state(params)

  default = optimizer_state_specs(state, params, param_specs)
  assert default["count"] == P() and default["mu"] == param_specs
  assert default["Qs_preconditioners"] == {
      "blocks": {"w": [P("stage"), P("stage")], "b": [P("stage")]},
      "emb": [P(), P()],
  }
  by_dim = optimizer_state_specs(state, params, param_specs, factor_rule=shard_factors_like_params)
  assert by_dim["Qs_preconditioners"] == {
      "blocks": {"w": [P("stage"), P("stage", "model")], "b": [P("stage", "model")]},
      "emb": [P("model"), P()],
  }
  masked_qs = {**state["Qs_preconditioners"], "emb": optax.MaskedNode()}
  masked = dict(state, Qs_preconditioners=masked_qs)
  assert optimizer_state_specs(masked, params, param_specs)["Qs_preconditioners"] == {
      "blocks": {"w": [P("stage"), P("stage")], "b": [P("stage")]},
      "emb": optax.MaskedNode(),
  }
  for specs in (default, by_dim):
    ShardingAnalyzer(mesh).validate(state, specs)
    placed = jax.device_put(zeros(state), named_shardings(mesh, specs))
    assert_placed(mesh, placed, specs)


def test_state_specs_name_bad_arguments():
  params = {"w": sds(8, 16)}
  state = jax.eval_shape(optax.adamw(1.0).init, params)
  with pytest.raises(ValueError, match="param_specs must have the structure"):
    optimizer_state_specs(state, params, {"v": P()})
  with pytest.raises(TypeError, match=r"param_specs\['w'\] must be a PartitionSpec"):
    optimizer_state_specs(state, params, {"w": ("a", None)})
  with pytest.raises(TypeError, match="factor_rule must return a PartitionSpec"):
    optimizer_state_specs(
        {"q": {"w": [sds(8, 8)]}}, params, {"w": P()}, factor_rule=lambda info: None
    )


# ----------------------------------------------------------------------------
# Analyzer.
# ----------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:.*cannot fit max_bytes_per_device:UserWarning")
@settings(deadline=None)
@given(
    mesh=meshes,
    params=param_trees(),
    rule=st.sampled_from(["auto", "memory"]),
    name=st.sampled_from(["adamw", "adafactor", "chain_masked_adamw"]),
)
def test_analyzer_bytes_equal_the_real_shards(mesh, params, rule, name):
  if rule == "auto":
    param_specs = AutoShardingRule(mesh, min_shard_size=1).apply(params)
  else:
    param_specs = MemoryConstrainedShardingRule(mesh, 64, strict=False).apply(params)
  tx = TRANSFORMS[name]()
  state_shapes = jax.eval_shape(tx.init, params)
  state_specs = optimizer_state_specs(state_shapes, params, param_specs)
  estimate = ShardingAnalyzer(mesh).estimate_memory(params, param_specs, state_shapes, state_specs)

  def real_bytes(shapes, specs):
    """(total bytes, the set of bytes held per device) of the placed arrays."""
    arrays = jax.tree.leaves(jax.device_put(zeros(shapes), named_shardings(mesh, specs)))
    held = {device: 0 for device in mesh.devices.flat}
    for x in arrays:
      for shard in x.addressable_shards:
        held[shard.device] += shard.data.nbytes
    return sum(x.nbytes for x in arrays), set(held.values())

  assert real_bytes(params, param_specs) == (
      estimate.param_bytes, {estimate.param_bytes_per_device})
  assert real_bytes(state_shapes, state_specs) == (
      estimate.state_bytes, {estimate.state_bytes_per_device})
  assert estimate.total_bytes == estimate.param_bytes + estimate.state_bytes
  assert estimate.bytes_per_device == (
      estimate.param_bytes_per_device + estimate.state_bytes_per_device
  )


def test_validate_names_the_leaf_dim_axis_and_sizes():
  mesh = make_mesh((2, 4), ("data", "model"))
  analyzer = ShardingAnalyzer(mesh)
  params = {"layer": {"w": sds(8, 6)}, "b": sds(6)}
  specs = {"layer": {"w": P("data", "model")}, "b": P("data", "model")}
  with pytest.raises(ValueError) as e:
    analyzer.validate(params, specs, name="params")
  message = str(e.value)
  assert "params['layer']['w']" in message
  assert "dim 1 of size 6 is not divisible by mesh axis 'model' of size 4" in message
  assert "params['b']" in message and "2 entries for 1 dims" in message
  with pytest.raises(ValueError, match=r"dim 0: mesh axis 'stage' is not one of \('data', 'mo"):
    analyzer.validate(params["b"], P("stage"))
  with pytest.raises(ValueError, match=r"dim 1: mesh axis 'data' is used twice in P\('data', 'd"):
    analyzer.validate(params["layer"]["w"], P("data", "data"))
  message = r"size 6 is not divisible by mesh axis \('data', 'model'\) of size 8"
  with pytest.raises(ValueError, match=message):
    analyzer.validate(params["b"], P(("data", "model")))
  with pytest.raises(ValueError, match="expected a PartitionSpec"):
    analyzer.validate(params["b"], "data")
  with pytest.raises(ValueError, match="must have its structure"):
    analyzer.validate(params, {"b": P()})
  with pytest.raises(ValueError, match="given together"):
    analyzer.estimate_memory(params, jax.tree.map(lambda _: P(), params), opt_state=params)


# ----------------------------------------------------------------------------
# barrier_sync.
# ----------------------------------------------------------------------------


def test_barrier_sync_returns_at_once_with_one_process(monkeypatch):
  def fail(name):
    raise AssertionError("no sync with one process")

  monkeypatch.setattr(multihost_utils, "sync_global_devices", fail)
  barrier_sync()
  barrier_sync("named", timeout=0.01)
  with pytest.raises(ValueError, match="timeout"):
    barrier_sync(timeout=0)


def test_barrier_sync_with_several_processes(monkeypatch):
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  calls = []
  monkeypatch.setattr(multihost_utils, "sync_global_devices", calls.append)
  barrier_sync("step")
  barrier_sync("step2", timeout=5.0)
  assert calls == ["step", "step2"]

  release = threading.Event()
  monkeypatch.setattr(multihost_utils, "sync_global_devices", lambda name: release.wait())
  try:
    with pytest.raises(TimeoutError, match="'stuck'.*2 processes.*0.05 s"):
      barrier_sync("stuck", timeout=0.05)
  finally:
    release.set()

  def broken(name):
    raise RuntimeError("peer died")

  monkeypatch.setattr(multihost_utils, "sync_global_devices", broken)
  with pytest.raises(RuntimeError, match="peer died"):
    barrier_sync("broken", timeout=5.0)


def test_eformer_escale_names_and_the_mesh_in_context():
  # eFormer's escale spellings: mesh=None takes the mesh in context,
  # max_memory_per_device / shape_patterns keywords, and the analyzer's
  # validate_partition_specs / estimate_memory_usage; our rules and checks.
  mesh = make_mesh((2, 4), ("a", "b"))
  leaf = {"w": sds(8, 64), "tiny": sds(3)}
  specs = AutoShardingRule(mesh).apply(leaf)
  for context in (lambda: jax.set_mesh(mesh), lambda: mesh):  # `with mesh:` is eFormer's way
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      with context():
        assert AutoShardingRule().apply(leaf) == specs
        assert AutoShardingRule(None, None, None, False).apply(leaf) == specs
        by_memory = MemoryConstrainedShardingRule(max_memory_per_device=256).apply(leaf)
        assert by_memory == MemoryConstrainedShardingRule(mesh, 256).apply(leaf)
        analyzer = ShardingAnalyzer()
  rule = ShapeBasedShardingRule(shape_patterns={(None, 64): P(None, "b")})
  assert rule.apply(leaf) == {"w": P(None, "b"), "tiny": P()}
  assert analyzer.validate_partition_specs(leaf, specs) == []
  bad = {"w": P("b", "b"), "tiny": P("a")}
  problems = analyzer.validate_partition_specs(leaf, bad)
  assert len(problems) == 2, problems
  assert "used twice" in problems[1] and "not divisible" in problems[0], problems
  usage = analyzer.estimate_memory_usage(leaf, specs)
  assert usage == {"total_size": (8 * 64 + 3) * 4, "size_per_device": 8 * 64 * 4 // 8 + 3 * 4}
  with pytest.raises(ValueError, match="none is active"):
    AutoShardingRule()
  with pytest.raises(TypeError, match="exactly one of max_bytes_per_device"):
    MemoryConstrainedShardingRule(mesh)
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
    MemoryConstrainedShardingRule(1024, mesh)  # eFormer's positional order
  with pytest.raises(TypeError, match="exactly one of patterns and shape_patterns"):
    ShapeBasedShardingRule()
