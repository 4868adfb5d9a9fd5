"""The kernel is chosen when a call is lowered, for the chip it is lowered for.

No pallasopt context anywhere here: plain ``jax.jit``, ``jax.export`` and
``jax.vmap``/``jax.grad``. Exports name their chip, when they do, the plain JAX
way (`helpers.named_chip`: an abstract device in context); one that names
none assumes the platform's oldest supported chip.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallasopt
from helpers import (
    CHIPS, CUSTOM_CALL, ELEMENTWISE_FAMILIES, FAMILY_TREE, MOSAIC_GPU_CALL, STATE_FORMATS,
    assert_close, auto_kernels, blockwise_adam_moments, lowered_text, sds,
)
from pallasopt import kernels
from pallasopt.kernels import _by_target, _dispatch, policy
from pallasopt.kernels import adamw as adamw_k
from pallasopt.kernels import rounding
from pallasopt.kernels._target import Target

_SCALARS = adamw_k.adamw_scalars(jnp.int32(3), 1e-3, 0.9, 0.999, 1e-8, 0.0, 0.1)
# Blockwise second moments and ratios round their codes stochastically.
_KEY = rounding.leaf_key(0, 3, 0)


def _adamw(impl):
  return lambda p, g, m, v, s: adamw_k.adamw_apply(p, g, m, v, s, impl=impl)


def _kernels(text):
  return {
      "tpu": text.count(CUSTOM_CALL["tpu"]),
      "triton": text.count(CUSTOM_CALL["cuda"]),
      "mosaic_gpu": text.count(MOSAIC_GPU_CALL),
  }


# ---- Tracing decides nothing. ----


def test_tracing_binds_one_primitive_and_traces_no_kernel():
  x = jnp.ones((256,))
  jaxpr = lambda impl: str(jax.make_jaxpr(_adamw(impl))(x, x, x, x, _SCALARS))
  # "interpret" too: its kernel is placed when lowered (per shard where XLA partitions).
  for impl in ("auto", "pallas", "interpret"):
    assert jaxpr(impl).count("pallasopt_by_target") == 1 and "pallas_call" not in jaxpr(impl)
  assert "pallasopt_by_target" not in jaxpr("xla") and "pallas_call" not in jaxpr("xla")


def test_the_reference_is_traced_once_per_call_signature():
  traced = []

  def reference(x, scale, *, power):
    traced.append(x.shape)
    return x**power * scale

  call = _by_target.by_target(reference, lambda target: None)
  tree = [jnp.ones((8, 4)) for _ in range(50)] + [jnp.ones((3,))]
  jax.jit(lambda t: [call(x, 2.0, power=2) for x in t]).lower(tree)
  assert traced == [(8, 4), (3,)]
  # Static configuration is part of the signature.
  jax.jit(lambda x: call(x, 2.0, power=3)).lower(tree[0])
  assert traced == [(8, 4), (3,), (8, 4)]


# ---- Plain export and jit carry each target's choice. ----


def test_cpu_jit_runs_the_reference():
  x = sds((4096,))
  assert "custom_call" not in jax.jit(_adamw("auto")).lower(x, x, x, x, _SCALARS).as_text()


@pytest.mark.parametrize(
    "platforms,expected",
    [
        (["tpu"], {"tpu": 1, "triton": 0}),
        (["cuda"], {"tpu": 0, "triton": 1}),
        (["cpu"], {"tpu": 0, "triton": 0}),
        (["cpu", "tpu"], {"tpu": 1, "triton": 0}),
        (["cpu", "tpu", "cuda"], {"tpu": 1, "triton": 1}),
    ],
)
def test_export_carries_the_target_kernel(platforms, expected):
  # int8 AdamW: "auto" runs the kernel on TPUs and GPUs (f32 moments run XLA there).
  x = sds((4096, 1024))
  m, v = jax.eval_shape(functools.partial(blockwise_adam_moments, fmt="int8"), x, x)
  step = lambda p, g, m, v, s: adamw_k.adamw_apply(p, g, m, v, s, _KEY, impl="auto")
  counts = _kernels(lowered_text(step, platforms, x, x, m, v, _SCALARS))
  assert {k: counts[k] for k in expected} == expected


def test_multi_platform_export_carries_each_kernel_in_its_branch():
  x = sds((4096,))
  text = lowered_text(_adamw("pallas"), ["tpu", "cuda"], x, x, x, x, _SCALARS)
  assert _kernels(text) == {"tpu": 1, "triton": 1, "mosaic_gpu": 0}
  assert "stablehlo.case" in text


def test_exports_of_pallas_need_a_kernel_platform():
  x = sds((4096,))
  with pytest.raises(ValueError, match=r"impl='pallas' cannot run the adamw kernel on platform 'cpu'.*interpret"):
    lowered_text(_adamw("pallas"), ["cpu"], x, x, x, x, _SCALARS)


def test_lowering_platforms_was_removed_with_a_clear_error():
  with pytest.raises(ValueError, match=r"lowering_platforms was removed.*jax\.export"):
    kernels.lowering_platforms("tpu")


# ---- TPU: a kernel only where the train step moves fewer bytes than XLA's. ----


@pytest.mark.parametrize(
    "shape,fmt,mode,kernel",
    [
        # f32 moments: XLA fuses the update into the gradient's producer.
        ((4096, 1024), None, "apply", False),
        ((4096, 1024), None, "updates", False),
        ((50257, 768), None, "apply", False),
        ((4096, 1024), "int8", "updates", True),
        ((4096, 1024), "int8", "apply", True),
        ((128, 256), "int8", "apply", False),  # below TPU_MIN_KERNEL_SIZE
        ((4096, 4097), "int8", "apply", False),  # rows of partial blocks
        ((1000, 1024), "int8", "apply", True),
        ((12, 768, 2304), "int8", "apply", True),
        ((50304, 768), "int8", "apply", True),
        ((4096, 384), "int8", "apply", False),  # 8-bit blocks would cross its rows
        ((64, 16384), "int8", "apply", True),  # blocks of 2048 columns, 8 blocks' scales
        ((256, 5376), "int8", "apply", True),  # 21 blocks a row: runs of 8, the last ragged
        ((2048, 32000), "int8", "apply", True),  # a Llama head: 125 blocks a row
    ],
)
def test_tpu_auto_takes_the_kernel_where_it_pays(shape, fmt, mode, kernel):
  x = sds(shape)
  if fmt is None:
    m = v = x
  else:
    m, v = jax.eval_shape(functools.partial(blockwise_adam_moments, fmt=fmt), x, x)
  family = policy.UPDATE if fmt is None else policy.BLOCKWISE_UPDATE
  choice = policy.auto_choice(family, jax.tree.leaves((x, x, m, v)), Target("tpu"))
  assert choice == ("pallas" if kernel else "xla")
  fn = adamw_k.adamw_apply if mode == "apply" else adamw_k.adamw_updates
  text = lowered_text(functools.partial(fn, impl="auto"), ["tpu"], x, x, m, v, _SCALARS, _KEY)
  assert _kernels(text)["tpu"] == int(kernel)


# ---- The chip decides: fp8 and wgmma. ----


def _int8_or_fp8_adamw(fmt, impl):
  def step(p, g, m, v, s):
    return adamw_k.adamw_apply(p, g, *blockwise_adam_moments(m, v, fmt), s, _KEY, impl=impl)
  return step


@pytest.mark.parametrize(
    "fmt,chip,auto_triton",
    [("int8", "a100", 1), ("int8", "h100", 1), ("fp8", "a100", 0), ("fp8", "h100", 1),
     ("fp8", None, 0), ("fp8", "b200", 1)],
)
def test_low_bit_state_follows_the_chip(fmt, chip, auto_triton):
  x = sds((4096, 256))
  args = (x, x, x, x, _SCALARS)
  assert _kernels(lowered_text(_int8_or_fp8_adamw(fmt, "auto"), ["cuda"], *args, chip=chip))[
      "triton"] == auto_triton
  pallas = _int8_or_fp8_adamw(fmt, "pallas")
  if auto_triton:
    assert _kernels(lowered_text(pallas, ["cuda"], *args, chip=chip))["triton"] == 1
  else:
    with pytest.raises(ValueError, match=r"adamw GPU kernel cannot run on .*>= 8\.9 .*fp8"):
      lowered_text(pallas, ["cuda"], *args, chip=chip)


def _target(kind, platform, capability=None, partitioned=False):
  return Target(platform, kind, capability, partitioned)


@pytest.mark.parametrize(
    "target,impl,auto,requirement,expected",
    [
        (_target("TPU v5 lite", "tpu"), "auto", "pallas", None, "tpu"),
        (_target("TPU v5 lite", "tpu"), "auto", "xla", None, None),
        (_target("TPU v6 lite", "tpu"), "pallas", "xla", None, "tpu"),
        (_target("NVIDIA H100 80GB HBM3", "cuda", (9, 0)), "auto", "xla", None, None),
        (_target("NVIDIA H100 80GB HBM3", "cuda", (9, 0)), "auto", "pallas", None, "triton"),
        (_target("NVIDIA H100 80GB HBM3", "cuda", (9, 0)), "pallas", "xla", None, "triton"),
        (_target("NVIDIA A100-SXM4-80GB", "cuda", (8, 0)), "auto", "pallas", "fp8", None),
        (_target("NVIDIA L4", "cuda", (8, 9)), "auto", "pallas", "fp8", "triton"),
        (_target("cpu", "cpu"), "auto", "pallas", None, None),
        (_target("TPU v5 lite", "tpu", partitioned=True), "auto", "pallas", None, None),
        (_target(None, "rocm"), "auto", "pallas", None, None),
        (_target(None, "rocm"), "pallas", "pallas", None, "triton"),
    ],
)
def test_chip_limits_and_placement_on_the_policy_choice(target, impl, auto, requirement, expected):
  requirement = {"fp8": _dispatch.FP8_REQUIREMENT, None: None}[requirement]
  got = _dispatch.kernel_backend(target, impl, "adamw", auto=auto, cuda_requirement=requirement)
  assert got == expected


@pytest.mark.parametrize("family", policy.FAMILIES)
def test_every_family_has_one_measured_row_per_target(family):
  for table in (policy.TPU_AUTO, policy.CUDA_AUTO):
    entry = table[family]
    assert entry.provenance.strip() and (callable(entry.choice) or entry.choice in ("pallas", "xla"))
  assert set(policy.TPU_AUTO) == set(policy.CUDA_AUTO) == set(policy.FAMILIES)
  for platform in ("cpu", "rocm"):
    assert policy.auto_choice(family, [sds((1024, 1024))], Target(platform)) == "xla"


def test_an_unknown_family_is_named():
  with pytest.raises(ValueError, match="no auto policy for kernel family 'adamw'"):
    policy.auto_choice("adamw", [], Target("tpu"))
  with pytest.raises(ValueError, match="family must be one of"):
    _dispatch.dispatch(adamw_k.adamw_reference, adamw_k.adamw_kernel, family="adamw")


def test_policy_errors_name_target_family_and_remedy():
  a100 = _target("NVIDIA A100-SXM4-80GB", "cuda", (8, 0))
  with pytest.raises(ValueError, match=r"lion GPU kernel cannot run on NVIDIA A100.*8\.0.*impl='auto'"):
    _dispatch.kernel_backend(a100, "pallas", "lion", cuda_requirement=_dispatch.FP8_REQUIREMENT)
  partitioned = _target("TPU v5 lite", "tpu", partitioned=True)
  with pytest.raises(ValueError, match=r"adamw kernel cannot run where XLA's partitioner.*jax\.set_mesh"):
    _dispatch.kernel_backend(partitioned, "pallas", "adamw")


def test_unnamed_chips_assume_the_baseline():
  assert Target("cuda").cuda_capability == (8, 0)
  assert "assumed NVIDIA A100" in Target("cuda").chip
  assert Target.of_device(
      jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="cuda")
  ).compute_capability == (9, 0)
  assert Target.of_device(
      jax.sharding.AbstractDevice(device_kind="NVIDIA A10G", num_cores=None, platform="cuda")
  ).compute_capability == (8, 6)


# ---- Sharded by XLA (Auto axes, shardings given to jit only): the layout is read when lowered. ----


def _sharded_adamw_operands(mesh, spec):
  shard = jax.sharding.NamedSharding(mesh, spec)
  rng = np.random.default_rng(0)
  operands = [jax.device_put(jnp.asarray(rng.random((8 * 16, 256)), jnp.float32), shard)
              for _ in range(4)]
  return shard, operands


_XLA_SHARDED_CONTEXTS = ["jit shardings", "with mesh", "set_mesh auto"]


def _in_context(context, mesh):
  import contextlib
  # (jax.set_mesh(mesh) outside a `with` sets the mesh for good: called only here.)
  if context == "set_mesh auto":
    return jax.set_mesh(mesh)
  return mesh if context == "with mesh" else contextlib.nullcontext()


@pytest.mark.parametrize("device_order", ["iota", "reversed"])
@pytest.mark.parametrize("context", _XLA_SHARDED_CONTEXTS)
def test_where_xla_shards_the_operands_the_kernel_runs_on_their_local_shards(context, device_order):
  devices = jax.devices()[:8]
  devices = devices[::-1] if device_order == "reversed" else devices
  mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 4), ("data", "model"),
                           axis_types=(jax.sharding.AxisType.Auto,) * 2)
  spec = jax.sharding.PartitionSpec("model", "data")
  shard, operands = _sharded_adamw_operands(mesh, spec)
  for impl in ("interpret", "auto"):
    step = jax.jit(_adamw(impl), in_shardings=(shard,) * 4 + (None,))
    with _in_context(context, mesh):
      text = step.lower(*operands, _SCALARS).as_text()
      got = step(*operands, _SCALARS)
    # The kernel on each (32, 128) shard; on a CPU "auto" is the reference, which XLA partitions.
    assert ("sdy.manual_computation" in text) == (impl == "interpret"), impl
    assert ("tensor<32x128xf32>" in text) == (impl == "interpret"), impl
    want = adamw_k.adamw_reference(*operands, _SCALARS, mode="apply", nesterov=False, decay=True)
    for a, b in zip(got, want):
      assert a.sharding.is_equivalent_to(shard, a.ndim)
      assert_close(a, b, 4 * 2**-24)


@pytest.mark.parametrize("context", ["set_mesh explicit", *_XLA_SHARDED_CONTEXTS])
@pytest.mark.parametrize("split,per_shard", [
    (jax.sharding.PartitionSpec("data", "model"), True),  # (32, 256) shards: whole blocks
    (jax.sharding.PartitionSpec(None, ("data", "model")), False),  # 128 columns: a block cut
], ids=["rows-and-blocks", "blocks-cut"])
def test_blockwise_state_runs_per_shard_where_shards_hold_whole_blocks(context, split, per_shard):
  from pallasopt.pipeline.sharding import optimizer_state_specs

  explicit = context == "set_mesh explicit"
  axis_type = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)
  params = {"w": jnp.linspace(-1, 1, 64 * 1024, dtype=jnp.float32).reshape(64, 1024)}
  grads = jax.tree.map(lambda p: jnp.cos(3 * p) + 0.1, params)
  tx = pallasopt.optim.adamw(1e-3, state_format="int8", impl="interpret")
  state = tx.init(params)
  step = lambda p, g, s: pallasopt.optim.apply_gradients(tx, p, g, s)
  want = jax.jit(step)(params, grads, state)
  specs = {"w": split}
  state_specs = optimizer_state_specs(jax.eval_shape(tx.init, params), params, specs)
  put = lambda tree, spec: jax.tree.map(
      lambda x, s: jax.device_put(x, jax.sharding.NamedSharding(mesh, s)), tree, spec)
  args = (put(params, specs), put(grads, specs), put(state, state_specs))
  scope = jax.set_mesh(mesh) if explicit else _in_context(context, mesh)
  with scope:
    text = jax.jit(step).lower(*args).as_text()
    got = jax.jit(step)(*args)
  # Per shard: the kernel reads (32, 256) codes and (1, 32) scales; cut: whole (64, 1024) leaves.
  assert "sdy.manual_computation" in text
  assert ("tensor<32x256xui8>" in text) == per_shard
  # The state bit for bit; the params within an f32 rounding of the update:
  # XLA compiles the interpreted kernel for the shard's shape and may fuse
  # p - lr * (u + wd * p) differently (measured: 13 of 65536 elements, 1 ulp).
  (got_params, got_state), (want_params, want_state) = got, want
  for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert_close(got_params["w"], want_params["w"], 2 * 2**-24)


def test_operands_computed_in_the_step_have_no_layout_to_read():
  # Not arguments of the jitted function: no layout shows. With no mesh in
  # context "pallas" says so and "auto" is the reference; with one, a kernel
  # impl runs on the gathered operands.
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  shard, operands = _sharded_adamw_operands(mesh, jax.sharding.PartitionSpec("data"))
  computed = lambda impl: jax.jit(
      lambda p, g, m, v, s: _adamw(impl)(p * 1, g * 1, m * 1, v * 1, s),
      in_shardings=(shard,) * 4 + (None,))
  assert "custom_call" not in computed("auto").lower(*operands, _SCALARS).as_text()
  with pytest.raises(ValueError, match=r"partitioner splits.*jax\.set_mesh"):
    computed("pallas").lower(*operands, _SCALARS)
  with jax.set_mesh(mesh):
    text = computed("interpret").lower(*operands, _SCALARS).as_text()
  assert "sdy.manual_computation" in text and "tensor<16x256xf32>" not in text  # whole leaves


def test_shardy_shardings_read_as_partition_specs():
  from pallasopt.kernels._target import Layout, parse_sdy_sharding

  P = jax.sharding.PartitionSpec
  two_axes = (("data", 2), ("model", 4))
  assert parse_sdy_sharding('#sdy.sharding<mesh<["data"=2, "model"=4]>, [{"model"}, {"data"}]>') \
      == Layout(P("model", "data"), two_axes)
  assert parse_sdy_sharding(
      '#sdy.sharding<mesh<["data"=2, "model"=4], device_ids=[7, 6, 5, 4, 3, 2, 1, 0]>, '
      '[{"data", "model"}, {}]>') == Layout(P(("data", "model"), None), two_axes)
  assert parse_sdy_sharding('#sdy.sharding<@mesh, [{}, {"data"}], replicated={"model"}>') \
      == Layout(P(None, "data"), None)
  assert parse_sdy_sharding("#sdy.sharding<@mesh, []>") == Layout(P(), None)
  # What a PartitionSpec cannot say exactly is no layout.
  for text in ('#sdy.sharding<@mesh, [{"data", ?}, {}]>', '#sdy.sharding<@mesh, [{?}, {}]>',
               '#sdy.sharding<@mesh, [{"data":(1)2}, {}]>',
               '#sdy.sharding<@mesh, [{"data"}, {}], unreduced={"model"}>', '{devices=[2,1]<=[2]}'):
    assert parse_sdy_sharding(text) is None, text
  mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
  assert Layout(P("model", "data"), two_axes).fits(mesh, (8, 6))
  assert not Layout(P("model", "data"), two_axes).fits(mesh, (8, 5))  # 5 rows over 2
  assert not Layout(P("data"), (("data", 4),)).fits(mesh, (8, 6))  # another mesh
  assert not Layout(P("batch"), None).fits(mesh, (8, 6))


def test_explicit_typed_operands_without_a_mesh_in_context_run_the_kernel_per_shard():
  # The operands' types carry the mesh: the kernel runs on each local shard.
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  shard = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None))
  x = jax.ShapeDtypeStruct((8 * 512, 256), jnp.float32, sharding=shard)
  text = jax.jit(_adamw("interpret")).lower(x, x, x, x, _SCALARS).as_text()
  assert "sdy.manual_computation" in text and "tensor<512x256xf32>" in text  # local shards
  # (Compiled for a 4-device TPU v5e, the Mosaic kernel itself: the compile tier.)
  rng = np.random.default_rng(0)
  p, g, m, v = (jax.device_put(jnp.asarray(rng.random((8 * 16, 128)), jnp.float32), shard)
                for _ in range(4))
  got = jax.jit(_adamw("interpret"))(p, g, m, v, _SCALARS)
  want = adamw_k.adamw_reference(p, g, m, v, _SCALARS, mode="apply", nesterov=False, decay=True)
  for a, b in zip(got, want):
    assert a.sharding.spec == shard.spec
    assert_close(a, b, 4 * 2**-24)


# ---- Transformations. ----


def test_eager_vmap_and_grad_follow_the_reference_on_cpu():
  rng = np.random.default_rng(0)
  p, g, m = (jnp.asarray(rng.standard_normal((5, 300)), jnp.float32) for _ in range(3))
  v = jnp.abs(m)
  ref = jax.vmap(lambda *a: adamw_k.adamw_reference(*a, _SCALARS, mode="apply", nesterov=False,
                                                    decay=True))(p, g, m, v)
  batched = jax.vmap(lambda *a: _adamw("auto")(*a, _SCALARS))(p, g, m, v)
  for got, want in zip(batched, ref):
    assert_close(got, want, 0.0)
  eager = _adamw("auto")(p[0], g[0], m[0], v[0], _SCALARS)
  assert_close(eager[0], ref[0][0], 0.0)
  # The tangents are the reference's: the same jaxpr, differentiated.
  grad = jax.grad(lambda q: _adamw("auto")(q, g[0], m[0], v[0], _SCALARS)[0].sum())(p[0])
  want = jax.grad(lambda q: adamw_k.adamw_reference(
      q, g[0], m[0], v[0], _SCALARS, mode="apply", nesterov=False, decay=True)[0].sum())(p[0])
  assert_close(grad, want, 0.0)


def test_vmapped_kernels_export_for_tpu():
  x = sds((3, 1 << 16))
  fn = jax.vmap(_adamw("pallas"), in_axes=(0, 0, 0, 0, None))
  assert _kernels(lowered_text(fn, ["tpu"], x, x, x, x, _SCALARS))["tpu"] == 1


# ---- Every elementwise family and state format, through the transforms. ----

@pytest.mark.parametrize("chip", ["v5e", "h100", "a100", "b200"])
@pytest.mark.parametrize("fmt", STATE_FORMATS, ids=str)
@pytest.mark.parametrize("family", sorted(ELEMENTWISE_FAMILIES))
def test_every_elementwise_family_and_format_exports_the_chips_kernels(family, fmt, chip):
  tx = ELEMENTWISE_FAMILIES[family]("auto", fmt)
  state = jax.eval_shape(tx.init, FAMILY_TREE)
  fused = functools.partial(pallasopt.optim.apply_gradients, tx)
  platform = CHIPS[chip][1]
  counts = _kernels(lowered_text(fused, platform, FAMILY_TREE, FAMILY_TREE, state, chip=chip))
  assert counts["tpu"] + counts["triton"] == auto_kernels(fmt, chip, family=family)


# ---- A kernel reads a bf16 matmul's weight gradient before its conversion to f32. ----


def _bf16_matmul_step(impl, fmt=None):
  def step(p, x, m, v):
    # f32 params, bf16 matmul: jax.grad converts the bf16 weight gradient to f32.
    g = jax.grad(lambda w: jnp.sum((x @ w.astype(jnp.bfloat16)).astype(jnp.float32) ** 2))(p)
    if fmt is not None:
      m, v = blockwise_adam_moments(m, v, fmt)
    return adamw_k.adamw_apply(p, g, m, v, _SCALARS, _KEY, impl=impl)
  return step


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_kernels_read_a_bf16_matmul_gradient_before_its_conversion(platform):
  w, x = sds((256, 1024)), sds((64, 256), jnp.bfloat16)
  text = lowered_text(_bf16_matmul_step("pallas", "int8"), platform, w, x, w, w)
  call = next(line for line in text.splitlines() if CUSTOM_CALL[platform] in line)
  # The gradient reaches the kernel as bf16 (in the kernel's (1, rows, cols) view).
  assert "x256x1024xbf16>" in call, call[-600:]
  # Without a conversion in the step (the gradient an argument), it reads f32.
  plain = lowered_text(_adamw("pallas"), platform, w, w, w, w, _SCALARS)
  call = next(line for line in plain.splitlines() if CUSTOM_CALL[platform] in line)
  assert "xbf16>" not in call


@pytest.mark.parametrize("fmt", [None, "int8"], ids=str)
def test_reading_the_bf16_gradient_computes_the_same_step(fmt):
  rng = np.random.default_rng(3)
  p = jnp.asarray(rng.standard_normal((256, 1024)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((64, 256)), jnp.bfloat16)
  m = jnp.asarray(rng.standard_normal((256, 1024)) * 0.1, jnp.float32)
  v = jnp.asarray(rng.uniform(size=(256, 1024)) * 0.01, jnp.float32)
  got = jax.jit(_bf16_matmul_step("interpret", fmt))(p, x, m, v)
  want = jax.jit(_bf16_matmul_step("xla", fmt))(p, x, m, v)
  assert_close(got[0], want[0], 2e-6)
  for a, b in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:])):
    assert_close(a, b, 0.0) if a.dtype == jnp.float32 else np.testing.assert_array_equal(a, b)
