"""Version-sensitive JAX and Pallas imports, in one place.

pallasopt supports jax >= 0.10, < 0.13. Names that moved between those
releases are resolved here so the kernels import one stable spelling, and
the JAX internals the project needs (``jax._src``, ``jax.interpreters``: the
lowering-time dispatch of `_by_target`, the legacy ``with mesh:`` context,
the CUPTI timer of the bench) are reached only from here. `missing_internals`
names any that a JAX release has dropped; the tests fail on it, and where
the code falls back it warns.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import jax
from jax._src import api_util
from jax._src import config as jax_config
from jax._src import linear_util as lu
from jax._src.interpreters import mlir as _mlir_internal
from jax._src.interpreters import partial_eval as pe
from jax._src.lib.mlir import ir
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallasopt.kernels._tiling import check_backend

__all__ = [
    "pl",
    "plgpu",
    "pltpu",
    "pltriton",
    "TPUCompilerParams",
    "TritonCompilerParams",
    "shard_map",
    "trace_to_closed_jaxpr",
    "trace_context",
    "use_abstract_device",
    "compiler_params",
    "kept_in_hbm",
    "mosaic_gpu_interpret",
    "explicit_spec",
    "reshard_like",
    "gathered",
    "register_inline_lowering",
    "lower_in_place",
    "register_batching_and_jvp",
    "instantiate_zeros",
    "legacy_context_mesh",
    "mosaic_gpu_extension",
    "missing_internals",
    "entry_argument_sharding",
]


def mosaic_gpu_interpret(interpret: bool) -> dict:
  """``plgpu.kernel`` keywords that run it in the Mosaic GPU interpreter (or not).

  The interpreter's parameters have no public name (JAX's own tests import
  them from ``jax._src``, as here).
  """
  if not interpret:
    return {}
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

  return {"interpret": InterpretGPUParams()}


TPUCompilerParams = getattr(pltpu, "CompilerParams", None) or getattr(
    pltpu, "TPUCompilerParams"
)
TritonCompilerParams = getattr(pltriton, "CompilerParams", None) or getattr(
    pltriton, "TritonCompilerParams"
)


def compiler_params(
    backend: str,
    dimension_semantics: tuple[str, ...],
    *,
    num_warps: int = 4,
    num_stages: int = 2,
    vmem_limit_bytes: int | None = None,
    interpret: bool = False,
):
  """Explicit compiler params for ``backend``, as every pallas_call passes them.

  TPU: the grid's ``dimension_semantics`` (and a VMEM limit, None for the
  default). Triton: ``num_warps`` and ``num_stages``. Passing them always
  pins the GPU lowering to Triton on every supported jax release. None when
  ``interpret``: the Pallas interpreter takes no compiler params.
  """
  check_backend(backend)
  if interpret:
    return None
  if backend == "tpu":
    return TPUCompilerParams(
        dimension_semantics=tuple(dimension_semantics), vmem_limit_bytes=vmem_limit_bytes
    )
  return TritonCompilerParams(num_warps=num_warps, num_stages=num_stages)


def kept_in_hbm(operands: Sequence[Any], backend: str, interpret: bool) -> list[Any]:
  """A TPU kernel's operands, constrained to stay in HBM.

  Given a kernel's `pl.CostEstimate`, XLA's memory-space assignment copies
  the operands that fit in VMEM into it ahead of the kernel (and aliased
  results back out). For a kernel that streams a leaf through VMEM in blocks
  itself, that is the same HBM traffic plus a VMEM copy of every operand,
  which ``cost_analysis()`` counts too. Outputs aliased to an operand stay
  with it; other outputs are placed by XLA. Operands are constrained only
  where all are being staged into a jaxpr: the constraint has no eager,
  batching or differentiation rule (a kernel called eagerly is compiled
  alone, with nothing to stage), and under `jax.vmap` the pallas_call's
  batching rule broadcasts the unbatched operands, which JAX 0.12 refuses for
  a value constrained to HBM ("unknown memory_space type"), so then none is.
  Triton, the interpreter, and a JAX without ``with_memory_space_constraint``
  take the operands as they are too.
  """
  constrain = getattr(pltpu, "with_memory_space_constraint", None)
  staged = all(isinstance(x, pe.DynamicJaxprTracer) for x in operands)
  if backend != "tpu" or interpret or constrain is None or not staged:
    return list(operands)
  return [constrain(x, pltpu.HBM) for x in operands]


if hasattr(jax, "shard_map"):
  shard_map = jax.shard_map
else:  # pragma: no cover - jax < 0.10 is outside the supported range.
  from jax.experimental.shard_map import shard_map  # type: ignore[no-redef]


def trace_to_closed_jaxpr(fn: Callable[..., Any], avals: Sequence[Any]):
  """``fn``'s closed jaxpr for operands of these abstract values.

  Unlike `jax.make_jaxpr`, the values keep everything their type carries
  (weak types, shardings, varying manual axes).
  """
  debug = api_util.debug_info("pallasopt", fn, tuple(avals), {})
  jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(fn, debug_info=debug), list(avals))
  return jex_core.ClosedJaxpr(jaxpr, consts)


def trace_context() -> Hashable:
  """The configuration a trace depends on, as `jax.jit` keys its cache on it."""
  return jax_config.trace_context()


@contextlib.contextmanager
def use_abstract_device(mesh, device) -> Iterator[None]:
  """``mesh`` (an abstract mesh) with ``device`` as its device, in context.

  Pallas reads the chip it lowers for from the abstract mesh in context
  (jax >= 0.10), falling back to the default device otherwise.
  """
  with jax.sharding.use_abstract_mesh(mesh.update(abstract_device=device)):
    yield


def explicit_spec(x) -> jax.sharding.PartitionSpec | None:
  """``x``'s sharding as its type carries it (Explicit mesh axes), or None.

  None means the type says nothing (no mesh, Auto axes, or a replicated
  value): XLA's partitioner, not the type system, decides.
  """
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if not isinstance(spec, jax.sharding.PartitionSpec) or all(s is None for s in spec):
    return None
  return spec


def reshard_like(tree, like):
  """``tree`` with every leaf resharded to the explicit sharding of ``like``'s."""

  def one(x, ref):
    spec = explicit_spec(ref)
    if spec is None and explicit_spec(x) is None:
      return x
    return jax.sharding.reshard(x, spec or jax.sharding.PartitionSpec())

  return jax.tree.map(one, tree, like)


def gathered(x):
  """``x`` replicated if its type is sharded over Explicit axes, else ``x``."""
  if explicit_spec(x) is None:
    return x
  return jax.sharding.reshard(x, jax.sharding.PartitionSpec())


def register_inline_lowering(primitive, platform_rules: dict, default_rule) -> None:
  """Registers a primitive's lowering rules so that they run in place, on the caller's values.

  JAX may lower a primitive into a private function shared by equal calls;
  its operands are then that function's arguments, and a rule cannot see
  where they come from (`entry_argument_sharding`). The ``cacheable`` flag
  that turns this off is marked temporary in JAX: where it is gone, the rule
  is registered as usual and the arguments' shardings read as unknown.

  One rule is registered for every platform and picks ``platform_rules``'
  rule (else ``default_rule``) per platform of the lowering itself: JAX
  0.10's own per-platform choice fails on an uncached primitive in a
  multi-platform export (it adds a tuple of output types to a list).
  """
  per_platform = getattr(_mlir_internal, "lower_per_platform", None)
  if per_platform is None:  # pragma: no cover - a JAX without it: JAX's own choice.
    _warn_missing("mlir.lower_per_platform")
    mlir.register_lowering(primitive, default_rule)
    for platform, platform_rule in platform_rules.items():
      mlir.register_lowering(primitive, platform_rule, platform=platform)
    return

  def rule(ctx, *operands, **params):
    ctx = ctx.replace(avals_out=list(ctx.avals_out))
    return per_platform(
        ctx, primitive.name, platform_rules, default_rule, jex_core.no_effects, *operands,
        **params,
    )

  try:
    mlir.register_lowering(primitive, rule, cacheable=False)
  except TypeError:  # pragma: no cover - a JAX without the flag.
    _warn_missing("register_lowering(cacheable=False)")
    mlir.register_lowering(primitive, rule)


def _takes_cacheable() -> bool:
  import inspect  # noqa: PLC0415

  return "cacheable" in inspect.signature(mlir.register_lowering).parameters


def missing_internals() -> list[str]:
  """The JAX internals this module relies on that this JAX lacks (empty when all are there)."""
  checks = {
      "mlir.lower_per_platform": hasattr(_mlir_internal, "lower_per_platform"),
      "register_lowering(cacheable=False)": _takes_cacheable(),
      "partial_eval.trace_to_jaxpr_dynamic": hasattr(pe, "trace_to_jaxpr_dynamic"),
      "config.trace_context": hasattr(jax_config, "trace_context"),
      "mesh.thread_resources": _legacy_mesh_module() is not None,
  }
  return [name for name, present in checks.items() if not present]


def _warn_missing(name: str) -> None:
  warnings.warn(
      f"this JAX ({jax.__version__}) has no {name}: pallasopt's kernels lower as JAX shares "
      "them, so a kernel cannot read its operands' shardings and runs on whole leaves "
      "instead of per shard. pallasopt supports jax < 0.13; please report this JAX.",
      RuntimeWarning, stacklevel=3,
  )


def lower_in_place(fn: Callable[..., Any], ctx, *operands):
  """Lowers ``fn(*operands)`` inside a lowering rule (``fn`` returns a sequence)."""
  return mlir.lower_fun(fn, multiple_results=True)(ctx, *operands)


def register_batching_and_jvp(primitive, batching_rule, jvp_rule) -> None:
  """Registers ``primitive``'s vmap and forward-mode rules."""
  batching.primitive_batchers[primitive] = batching_rule
  ad.primitive_jvps[primitive] = jvp_rule


def instantiate_zeros(tangent):
  """``tangent`` as an array where JAX passes a symbolic zero."""
  return ad.instantiate_zeros(tangent)


def _legacy_mesh_module():
  try:
    from jax._src import mesh as mesh_lib  # noqa: PLC0415
  except ImportError:  # pragma: no cover
    return None
  return mesh_lib if hasattr(mesh_lib, "thread_resources") else None


def legacy_context_mesh() -> jax.sharding.Mesh | None:
  """The mesh of an enclosing ``with mesh:`` block, which sets no public context, or None."""
  mesh_lib = _legacy_mesh_module()
  if mesh_lib is None:  # pragma: no cover
    _warn_missing("mesh.thread_resources")
    return None
  return mesh_lib.thread_resources.env.physical_mesh


def mosaic_gpu_extension():
  """jaxlib's Mosaic GPU extension module (its CUPTI timer), by its public name where it has one."""
  from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415

  lib = getattr(profiler, "mosaic_gpu_lib", None)
  if lib is None:
    from jax._src.lib import mosaic_gpu as lib  # noqa: PLC0415
  return lib._mosaic_gpu_ext


def widened_from_bfloat16(value):
  """The bfloat16 value a lowered f32 ``value`` was exactly converted from, or None.

  None unless ``value`` is the result of a ``stablehlo.convert`` in the same
  function whose operand is a bfloat16 tensor and whose result is f32 (a
  weight gradient of a bf16 matmul, as ``jax.grad`` returns it for f32
  params).
  """
  if isinstance(value, ir.BlockArgument):
    return None
  op = getattr(value.owner, "operation", value.owner)
  if getattr(op, "name", None) != "stablehlo.convert":
    return None
  source = op.operands[0]
  element = lambda v: str(ir.RankedTensorType(v.type).element_type)  # MLIR's spelling
  try:
    widened = element(value) == "f32" and element(source) == "bf16"
  except (ValueError, TypeError):  # not a ranked tensor
    return None
  return source if widened else None


def entry_argument_sharding(value) -> str | None:
  """The sharding attribute of a lowered value that is an argument of the module's ``main``.

  The text of its ``sdy.sharding`` attribute (Shardy), which holds the
  sharding the jitted computation receives that argument with, or None for
  any other value (computed in the step, an argument of a nested function, a
  module lowered without Shardy).
  """
  if not isinstance(value, ir.BlockArgument):
    return None
  function = value.owner.owner
  function = getattr(function, "operation", function)
  try:
    if function.name != "func.func" or ir.StringAttr(function.attributes["sym_name"]).value != "main":
      return None
    attributes = ir.DictAttr(ir.ArrayAttr(function.attributes["arg_attrs"])[value.arg_number])
    return str(attributes["sdy.sharding"])
  except (KeyError, IndexError, ValueError, AttributeError, TypeError):
    return None
