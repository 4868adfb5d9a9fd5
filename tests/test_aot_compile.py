"""The compile tier: optimizer steps compiled for real GPUs and TPUs from this host.

``pytest -m aot`` with the ``aot`` extra and ``JAX_PLATFORMS=cpu`` (BUILD.md);
skipped otherwise. Each step is compiled by the target's own compilers
(libtpu's Mosaic, Triton + ptxas, Mosaic GPU) for a compile-only device of
`jax.experimental.topologies`, with plain ``jax.jit(...).lower(...).compile()``:
no pallasopt context. Each test asserts the compile succeeds and that the
compiled module holds the kernels the dispatch policy chooses for that chip
(`pallasopt.kernels._dispatch.kernel_backend`), no more and no fewer, and the
same kernels as a ``jax.export`` naming that chip.
"""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import aot_targets
import pallasopt
from aot_targets import TPU_TARGETS, compile_for, compiled_kernels
from helpers import (
    CHIPS, CUSTOM_CALL, ELEMENTWISE_FAMILIES, FAMILY_TREE, STATE_FORMATS, auto_kernels,
    lowered_text, sds,
)

pytestmark = pytest.mark.aot


def _fused(tx):
  return functools.partial(pallasopt.optim.apply_gradients, tx)


def _exported_kernels(fn, chip, *args):
  platform = CHIPS[chip][1]
  text = lowered_text(fn, platform, *args, chip=chip)
  return text.count(CUSTOM_CALL["tpu"]) + text.count(CUSTOM_CALL["cuda"])


def _all_kernels(compiled):
  return sum(compiled_kernels(compiled).values())


@pytest.mark.parametrize("chip", ["v5e", "v6e", "h100", "a100", "b200"])
@pytest.mark.parametrize("fmt", STATE_FORMATS, ids=str)
@pytest.mark.parametrize("family", sorted(ELEMENTWISE_FAMILIES))
def test_elementwise_families_compile_with_the_chips_kernels(family, fmt, chip):
  aot_targets.require(chip)
  tx = ELEMENTWISE_FAMILIES[family]("auto", fmt)
  state = jax.eval_shape(tx.init, FAMILY_TREE)
  compiled = compile_for(_fused(tx), chip, FAMILY_TREE, FAMILY_TREE, state)
  assert _all_kernels(compiled) == auto_kernels(fmt, chip)
  assert _exported_kernels(_fused(tx), chip, FAMILY_TREE, FAMILY_TREE, state) == auto_kernels(
      fmt, chip)


@pytest.mark.parametrize("chip", ["v5e", "h100", "a100"])
@pytest.mark.parametrize("fmt", STATE_FORMATS, ids=str)
@pytest.mark.parametrize("family", ["adamw", "lion"])
def test_update_mode_compiles_the_same_choice(family, fmt, chip):
  # tx.update + optax.apply_updates: the kernels write the updates instead.
  aot_targets.require(chip)
  tx = ELEMENTWISE_FAMILIES[family]("auto", fmt)
  state = jax.eval_shape(tx.init, FAMILY_TREE)

  def step(params, grads, state):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  compiled = compile_for(step, chip, FAMILY_TREE, FAMILY_TREE, state)
  assert _all_kernels(compiled) == auto_kernels(fmt, chip, "updates")


@pytest.mark.parametrize("chip", TPU_TARGETS)
def test_every_tpu_generation_compiles_the_int8_step(chip):
  aot_targets.require(chip)
  tx = pallasopt.optim.adamw(1e-3, state_format="int8", impl="pallas")
  state = jax.eval_shape(tx.init, FAMILY_TREE)
  compiled = compile_for(_fused(tx), chip, FAMILY_TREE, FAMILY_TREE, state)
  assert compiled_kernels(compiled)["tpu"] == len(FAMILY_TREE)


def test_fp8_state_for_an_a100_compiles_the_reference_or_refuses_clearly():
  # Triton's fp8 conversions abort the process on sm_80: never chosen there.
  aot_targets.require("a100")
  auto = pallasopt.optim.lion(1e-4, state_format="fp8")
  state = jax.eval_shape(auto.init, FAMILY_TREE)
  assert _all_kernels(compile_for(_fused(auto), "a100", FAMILY_TREE, FAMILY_TREE, state)) == 0
  pallas = pallasopt.optim.lion(1e-4, state_format="fp8", impl="pallas")
  with pytest.raises(ValueError, match=r"lion GPU kernel cannot run on NVIDIA A100.*8\.9"):
    compile_for(_fused(pallas), "a100", FAMILY_TREE, FAMILY_TREE, state)


_MUON_TREE = {"w": sds((512, 1024)), "v": sds((1024, 256)), "b": sds((1024,))}


def _muon(impl):
  return pallasopt.optim.muon(1e-3, iter_dtype=jnp.bfloat16, impl=impl)


@pytest.mark.parametrize("chip", ["h100", "a100", "b200"])
def test_bf16_newton_schulz_compiles_wgmma_on_hopper_only(chip):
  aot_targets.require(chip)
  state = jax.eval_shape(_muon("auto").init, _MUON_TREE)
  auto = compile_for(_fused(_muon("auto")), chip, _MUON_TREE, _MUON_TREE, state)
  assert compiled_kernels(auto)["mosaic_gpu"] == 0  # cuBLAS wins under "auto" (module doc)
  if chip != "h100":
    with pytest.raises(ValueError, match=r"newton_schulz GPU kernel cannot run.*sm_90a"):
      compile_for(_fused(_muon("pallas")), chip, _MUON_TREE, _MUON_TREE, state)
    return
  compiled = compile_for(_fused(_muon("pallas")), chip, _MUON_TREE, _MUON_TREE, state)
  # Two matrix shapes, 5 steps of two symmetric products each; the bias's AdamW.
  assert compiled_kernels(compiled) == {"tpu": 0, "triton": 1, "mosaic_gpu": 20}


# Kron's and White-Kron's Triton kernel takes layers of at most 128 per side
# (README): the small tree runs it on a GPU, the larger matrices run XLA.
_TREES = {"matrices": _MUON_TREE, "small": {"w": sds((64, 128)), "b": sds((128,))}}


_OTHER_FAMILIES = {
    "adafactor": lambda fmt: pallasopt.optim.adafactor(
        1e-3, momentum=0.9 if fmt else None, state_format=fmt),
    "muon": lambda fmt: pallasopt.optim.muon(1e-3, state_format=fmt),
    "kron": lambda fmt: pallasopt.optim.kron(1e-3),
    "quad": lambda fmt: pallasopt.optim.quad(1e-3, block_size=128),
    "skew": lambda fmt: pallasopt.optim.skew(1e-3, block_size=128),
}
# Families with a state_format take each format on the matrices; the
# Kron-kernel families also take the small tree their GPU kernel runs on.
_OTHER_CASES = [
    *((name, fmt, "matrices") for name in ("adafactor", "muon") for fmt in STATE_FORMATS),
    *((name, None, tree) for name in ("kron", "quad", "skew") for tree in sorted(_TREES)),
]


@pytest.mark.parametrize("chip", ["v5e", "h100", "a100"])
@pytest.mark.parametrize("name,fmt,tree", _OTHER_CASES, ids=str)
def test_other_families_compile_what_their_export_carries(name, fmt, tree, chip):
  aot_targets.require(chip)
  params = _TREES[tree]
  tx = _OTHER_FAMILIES[name](fmt)
  state = jax.eval_shape(tx.init, params)
  kernels = _all_kernels(compile_for(_fused(tx), chip, params, params, state))
  assert kernels == _exported_kernels(_fused(tx), chip, params, params, state)
  # Every family has a Mosaic kernel; on CUDA so do Adafactor and, on the
  # small tree, the Kron-kernel families (Muon's f32 Newton-Schulz runs XLA).
  if CHIPS[chip][1] == "tpu" or name == "adafactor" or tree == "small":
    assert kernels > 0, name


def test_a_sharded_jit_without_a_mesh_in_context_compiles_the_reference():
  # XLA's partitioner cannot split a Pallas call: "auto" runs XLA there and
  # "pallas" says to put the mesh in context.
  aot_targets.require("v5e")
  mesh = jax.sharding.Mesh(aot_targets.devices("v5e")[:4], ("data",))
  shard = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None))
  params = {"w": jax.ShapeDtypeStruct((1024, 512), jnp.float32, sharding=shard)}
  for impl, ok in (("auto", True), ("pallas", False)):
    tx = pallasopt.optim.adamw(1e-3, impl=impl)
    state = jax.eval_shape(tx.init, params)
    step = jax.jit(_fused(tx))
    if ok:
      assert compiled_kernels(step.lower(params, params, state).compile())["tpu"] == 0
    else:
      with pytest.raises(ValueError, match=r"partitioner splits.*jax\.set_mesh"):
        step.lower(params, params, state)
