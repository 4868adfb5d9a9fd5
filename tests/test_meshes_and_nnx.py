"""Every optimizer on JAX's default (Explicit-axis) mesh, an Auto mesh, with
flax NNX and through an orbax checkpoint; the drop-in details Optax's suites
do not reach (injected states that swap, x64 Muon, clear errors)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pallasopt
from helpers import pairwise
from pallasopt import kernels

_OPTIMIZERS = {
    "adamw": lambda: pallasopt.optim.adamw(1e-3, weight_decay=0.1),
    "lion": lambda: pallasopt.optim.lion(1e-4),
    "adafactor": lambda: pallasopt.optim.adafactor(1e-2),
    "muon": lambda: pallasopt.optim.muon(1e-2, weight_decay=0.01),
    "kron": lambda: pallasopt.optim.kron(1e-3, preconditioner_update_probability=1.0),
}
_SHARDING = {"w": P("model", "data"), "b": P("model")}


def _problem():
  params = {"w": jnp.linspace(-1, 1, 64 * 32).reshape(64, 32), "b": jnp.zeros((32,))}
  grads = jax.tree.map(lambda p: jnp.cos(3 * p) + 0.1, params)
  return params, grads


def _steps(tx, params, grads, state, n=2):
  """`n` applied steps from `state`, and `tx.update`'s first updates: one program."""

  def steps(params, grads, state):
    updates, _ = tx.update(grads, state, params)
    step = lambda carry, _: (pallasopt.optim.apply_gradients(tx, carry[0], grads, carry[1]), None)
    (params, state), _ = jax.lax.scan(step, (params, state), length=n)
    return params, state, updates

  return jax.jit(steps)(params, grads, state)


def _close(a, b):
  # Same math on a sharded layout: XLA may reassociate the few reductions
  # (norms, factored statistics) across shards, a few f32 ulps apart.
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=1e-6)


# Every pair of impl, optimizer and axis type meets at least once
# (`pairwise`). Families whose kernel is not elementwise run it on gathered
# operands under a kernel impl, by the same code whatever the axis type:
# Adafactor runs that path under Auto axes, Muon and Kron (8 s of compiles)
# under Explicit ones.
_GATHERED_AXES = {"adafactor": "auto", "muon": "explicit", "kron": "explicit"}
_SHARDED_CASES = pairwise(
    ("auto", "interpret"), list(_OPTIMIZERS), ("auto", "explicit"),
    allowed=lambda impl, name, axis_type: (
        impl != "interpret" or _GATHERED_AXES.get(name, axis_type) == axis_type),
)


@functools.cache
def _unsharded_steps(impl, name):
  """The unsharded steps every axis type is held to (computed once per run)."""
  tx = _OPTIMIZERS[name]()
  params, grads = _problem()
  with kernels.use_impl(impl):
    return _steps(tx, params, grads, tx.init(params))


@pytest.mark.parametrize("impl,name,axis_type", _SHARDED_CASES)
def test_sharded_steps_equal_the_unsharded_steps(name, axis_type, impl):
  # The sharding guide's example (docs/guides/sharding.md): jax.make_mesh (Explicit axes by default).
  axis_types = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[axis_type]
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_types,) * 2)
  tx = _OPTIMIZERS[name]()
  params, grads = _problem()
  want = _unsharded_steps(impl, name)
  with kernels.use_impl(impl):
    with jax.set_mesh(mesh):
      shardings = {k: NamedSharding(mesh, spec) for k, spec in _SHARDING.items()}
      sharded_params = jax.device_put(params, shardings)
      sharded_grads = jax.device_put(grads, shardings)
      state = tx.init(sharded_params)
      got = _steps(tx, sharded_params, sharded_grads, state)
  _close(got, want)
  if axis_type == "explicit":  # types carry the layout: a step keeps them, so compiles once
    assert jax.tree.map(jax.typeof, (got[0], got[1])) == jax.tree.map(
        jax.typeof, (sharded_params, state))


@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_inside_shard_map_each_device_steps_its_own_replica(name):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  tx = _OPTIMIZERS[name]()
  params, grads = _problem()
  want, _, _ = _steps(tx, params, grads, tx.init(params), n=1)

  @jax.jit
  @functools.partial(pallasopt.kernels._compat.shard_map, mesh=mesh, in_specs=P(),
                     out_specs=P(), check_vma=False)
  def replicated_step(params, grads):
    return pallasopt.optim.apply_gradients(tx, params, grads, tx.init(params))[0]

  _close(replicated_step(params, grads), want)


def _nnx_and_plain_runs(tx, features, each_step=lambda optimizer: None, steps=3):
  """One dense layer (``features``: in, out) trained ``steps`` steps by ``tx`` two
  ways: flax NNX's ``nnx.Optimizer`` under ``nnx.jit``, as an NNX training loop
  steps (one program, not each op eagerly), and ``tx`` on plain pytrees.

  Returns the NNX params as a pure dict and the plain run's params;
  ``each_step(optimizer)`` runs after each NNX step.
  """
  nnx = pytest.importorskip("flax.nnx")
  x = jnp.linspace(-1, 1, 4 * features[0]).reshape(4, features[0])
  model = nnx.Linear(*features, rngs=nnx.Rngs(0))
  loss = lambda model: jnp.mean((model(x) - 1.0) ** 2)
  pure = jax.tree.map(jnp.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  pure_loss = lambda p: jnp.mean((x @ p["kernel"] + p["bias"] - 1.0) ** 2)
  state, update = tx.init(pure), jax.jit(tx.update)
  for _ in range(steps):
    updates, state = update(jax.grad(pure_loss)(pure), state, pure)
    pure = optax.apply_updates(pure, updates)

  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer):
    optimizer.update(model, nnx.grad(loss)(model))

  for _ in range(steps):
    train_step(model, optimizer)
    each_step(optimizer)
  return nnx.to_pure_dict(nnx.state(model, nnx.Param)), pure


@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_flax_nnx_optimizer_trains_with_every_optimizer(name):
  _close(*_nnx_and_plain_runs(_OPTIMIZERS[name](), (16, 8)))


@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8", "int4"])
@pytest.mark.parametrize("name", ["adamw", "lion", "muon", "rmsprop"])
def test_flax_nnx_optimizer_keeps_low_bit_state_across_steps(name, fmt):
  # nnx.Optimizer writes each step's state back into its variables, array by
  # array: a blockwise moment must come back the NamedTuple it was (the
  # kernel's 64 x 128 holds blockwise state) step after step, and the model
  # trains as the same transform on plain pytrees (`_close`: one program
  # against two, Muon's f32 matmuls may round a few ulps apart).
  nnx = pytest.importorskip("flax.nnx")
  tx = getattr(pallasopt.optim, name)(1e-3, state_format=fmt)
  structures = []
  got, want = _nnx_and_plain_runs(
      tx, (64, 128), lambda optimizer: structures.append(nnx.as_pure(optimizer.opt_state)))
  blockwise = lambda state: [m for m in jax.tree.leaves(state, is_leaf=kernels.quant.is_blockwise)
                             if kernels.quant.is_blockwise(m)]
  assert len(blockwise(structures[-1])) == (0 if fmt == "bf16" else 1 + (name == "adamw"))
  want_structure = jax.tree.structure(structures[0])
  assert all(jax.tree.structure(s) == want_structure for s in structures)
  assert want_structure == jax.tree.structure(
      nnx.as_pure(nnx.Optimizer(nnx.Linear(64, 128, rngs=nnx.Rngs(0)), tx, wrt=nnx.Param).opt_state))
  _close(got, want)


def test_orbax_round_trip_of_a_sharded_state(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  tx = pallasopt.optim.adamw(1e-3)
  params, grads = _problem()
  with jax.set_mesh(mesh):
    shardings = {k: NamedSharding(mesh, spec) for k, spec in _SHARDING.items()}
    params = jax.device_put(params, shardings)
    params, state, _ = _steps(tx, params, jax.device_put(grads, shardings), tx.init(params), 1)
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(tmp_path / "state", state)
      checkpointer.wait_until_finished()
      abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
      restored = checkpointer.restore(tmp_path / "state", abstract)
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- Drop-in details. ----

_INJECTED = {
    "adamw": (optax.adamw, pallasopt.optim.adamw, {}),
    "nadamw": (optax.nadamw, pallasopt.optim.nadamw, {}),
    "lion": (optax.lion, pallasopt.optim.lion, {}),
    "adafactor": (optax.adafactor, pallasopt.optim.adafactor,
                  {"static_args": ("min_dim_size_to_factor",)}),
    "muon": (optax.contrib.muon, pallasopt.optim.muon, {}),
}


@pytest.mark.parametrize("name", list(_INJECTED))
def test_injected_states_swap_with_optax(name):
  theirs, ours, kwargs = _INJECTED[name]
  params, grads = _problem()
  opt_theirs = optax.inject_hyperparams(theirs, **kwargs)(learning_rate=0.01)
  opt_ours = optax.inject_hyperparams(ours, **kwargs)(learning_rate=0.01)
  state_theirs, state_ours = opt_theirs.init(params), opt_ours.init(params)
  assert state_ours.hyperparams.keys() == state_theirs.hyperparams.keys()
  assert jax.tree.structure(state_ours) == jax.tree.structure(state_theirs)
  # Each one continues from the other's state with the other's numbers.
  u_theirs, _ = jax.jit(opt_theirs.update)(grads, state_ours, params)
  u_ours, _ = jax.jit(opt_ours.update)(grads, state_theirs, params)
  _close(u_ours, u_theirs)


def test_muon_under_x64_matches_optax():
  with jax.enable_x64(True):
    params = {"w": jnp.linspace(-1, 1, 48, dtype=jnp.float32).reshape(8, 6),
              "b": jnp.ones((6,), jnp.float32)}
    grads = jax.tree.map(lambda p: jnp.sin(p) + 0.5, params)
    ours, theirs = pallasopt.optim.muon(1e-2), optax.contrib.muon(1e-2)
    # Traced under x64 (jitted: its ops are this test's alone, each would compile eagerly).
    u_ours, _ = jax.jit(ours.update)(grads, ours.init(params), params)
    u_theirs, _ = jax.jit(theirs.update)(grads, theirs.init(params), params)
    assert jax.tree.map(lambda x: x.dtype, u_ours) == jax.tree.map(lambda x: x.dtype, u_theirs)
    _close(u_ours, u_theirs)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.complex64])
@pytest.mark.parametrize("name", ["adamw", "adafactor", "muon"])
def test_leaves_no_kernel_takes_follow_optax_in_every_impl(name, dtype):
  theirs = {"adamw": optax.adamw(1e-2), "adafactor": optax.adafactor(1e-2),
            "muon": optax.contrib.muon(1e-2)}[name]
  w = jnp.linspace(-1, 1, 48).reshape(8, 6)
  params = {"w": (w * (1 + 0.5j) if dtype == jnp.complex64 else w).astype(dtype)}
  grads = jax.tree.map(lambda p: (p * 0.3 + 0.1).astype(dtype), params)
  u_theirs, _ = theirs.update(grads, theirs.init(params), params)
  for impl in ("xla", "interpret"):
    ours = {"adamw": pallasopt.optim.adamw(1e-2, impl=impl),
            "adafactor": pallasopt.optim.adafactor(1e-2, impl=impl),
            "muon": pallasopt.optim.muon(1e-2, impl=impl)}[name]
    u_ours, state = ours.update(grads, ours.init(params), params)
    assert u_ours["w"].dtype == u_theirs["w"].dtype
    # Optax's own math on those leaves: equal up to f16 rounding of the
    # final product (2**-10 relative), exact for complex64.
    tol = 1e-3 if dtype == jnp.float16 else 1e-5
    np.testing.assert_allclose(np.asarray(u_ours["w"]), np.asarray(u_theirs["w"]),
                               rtol=tol, atol=tol * 1e-2)


@pytest.mark.parametrize("name", ["adamw", "lion", "adafactor", "muon"])
def test_integer_leaves_behave_as_optaxs(name):
  # Optax accepts them and returns float updates (Adafactor and Muon NaNs on
  # this input, as Optax does); ours are Optax's, bit for bit.
  theirs = {"adamw": optax.adamw, "lion": optax.lion, "adafactor": optax.adafactor,
            "muon": optax.contrib.muon}[name](1e-2)
  ours = getattr(pallasopt.optim, name)(1e-2)
  params = {"i": jnp.arange(4, dtype=jnp.int32), "f": jnp.ones((3,))}
  u_ours, _ = ours.update(params, ours.init(params), params)
  u_theirs, _ = theirs.update(params, theirs.init(params), params)
  assert u_ours["i"].dtype == u_theirs["i"].dtype
  np.testing.assert_array_equal(np.asarray(u_ours["i"]), np.asarray(u_theirs["i"]))


def test_structural_errors_name_the_argument_and_leaf():
  params = {"w": jnp.ones((4, 4)), "b": jnp.ones((3,))}
  tx = pallasopt.optim.muon(1e-2)
  with pytest.raises(ValueError, match=r"muon: grads must have the same tree structure as "
                                       r"opt_state mu. missing in grads: \['b'\]"):
    tx.update({"w": jnp.ones((4, 4))}, tx.init(params))
  stacked = {"w": jnp.ones((2, 4, 4)), "gate": jnp.ones((2, 1))}
  for make in (lambda: pallasopt.optim.adafactor(1e-2, stacked_axes=1),
               lambda: pallasopt.optim.muon(1e-2, stacked_axes=1),
               lambda: pallasopt.optim.kron(1e-3, stacked_axes=1)):
    make().init(stacked)
    for bad, shape in (({"embed": jnp.ones((4,))}, r"\(4,\)"), ({"s": jnp.ones(())}, r"\(\)")):
      (name,) = bad
      with pytest.raises(ValueError, match=rf"stacked_axes=1 .* leaf\['{name}'\] has shape {shape}"):
        make().init({**stacked, **bad})
