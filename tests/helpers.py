"""Strategies, data builders and comparisons shared by the tests."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import strategies as st

import pallasopt
from pallasopt import chips
from pallasopt.kernels import quant
from bench.low_bit import digits_mlp  # noqa: F401  (the tests' digits task)


FLOAT_DTYPES = (jnp.float32, jnp.bfloat16)

# Shapes that hit every tiling case: 0-d, tiny, non-multiples of 128 (flat
# view), multiples of 128 with ragged row blocks, and ranks up to 4.
SPECIAL_SHAPES = [(), (1,), (7,), (128,), (129,), (37, 128), (3, 5, 7, 11), (2, 3, 128), (1000,)]


def shapes(max_rank: int = 4, max_side: int = 40):
  random = st.lists(st.integers(1, max_side), min_size=0, max_size=max_rank).map(tuple)
  return st.one_of(st.sampled_from(SPECIAL_SHAPES), random)


# `hypothesis.given` arguments shared by the elementwise kernel-vs-reference
# tests: one leaf's shape, operand dtypes, mode, decay flag and backend.
ELEMENTWISE_KERNEL_CASES = dict(
    shape=shapes(),
    param_dtype=st.sampled_from(FLOAT_DTYPES),
    grad_dtype=st.sampled_from(FLOAT_DTYPES),
    mu_dtype=st.sampled_from(FLOAT_DTYPES),
    mode=st.sampled_from(["apply", "updates"]),
    decay=st.booleans(),
    backend=st.sampled_from(["tpu", "triton"]),
    seed=st.integers(0, 2**16),
)


def pairwise(*factors, allowed=lambda *row: True) -> list[tuple]:
  """Rows in which every pair of values of any two factors meets at least once.

  For a test parametrized over options that interact in pairs (backend and
  format, format and shape, ...): a strength-2 covering array, far fewer rows
  than the full product. Built greedily from the product in order (each row
  the candidate that covers the most pairs not yet covered; ties go to the
  earlier), so every machine runs the same cases. ``allowed(*row)`` rules
  rows out; a pair that only ruled-out rows hold is not asked for.
  """
  candidates = [row for row in itertools.product(*(range(len(f)) for f in factors))
                if allowed(*(f[i] for f, i in zip(factors, row)))]

  def pairs(row):
    return {(i, row[i], j, row[j]) for i, j in itertools.combinations(range(len(row)), 2)}

  uncovered, rows = set().union(*map(pairs, candidates)), []
  while uncovered:
    best = max(candidates, key=lambda row: len(pairs(row) & uncovered))
    rows.append(best)
    uncovered -= pairs(best)
  return [tuple(f[i] for f, i in zip(factors, row)) for row in rows]


def random_array(rng: np.random.Generator, shape, dtype, *, positive=False, scale=1.0):
  x = rng.standard_normal(shape).astype(np.float32) * scale
  if positive:
    x = np.abs(x)
  return jnp.asarray(x, dtype)


def tree_of(rng, shapes_and_dtypes, **kwargs):
  return {f"leaf{i}": random_array(rng, s, d, **kwargs) for i, (s, d) in enumerate(shapes_and_dtypes)}


def tolerance(*dtypes) -> float:
  """Relative tolerance for results stored in the narrowest of `dtypes`."""
  return 1e-2 if any(jnp.dtype(d) == jnp.bfloat16 for d in dtypes) else 2e-6


def _f32(x) -> np.ndarray:
  return np.asarray(x).astype(np.float32)


def assert_close(actual, expected, rtol, err_msg="", *, operands=()):
  """|actual - expected| <= rtol * max|expected, operands| elementwise; NaN never passes.

  The tolerance scales with the largest magnitude of `expected` (and of any
  `operands` it was computed from, e.g. the old params of ``p + u``), so
  values that cancel to ~0 are judged at the scale the computation worked at.
  """
  # Converted by NumPy (ml_dtypes): an eager jnp conversion compiles per shape.
  actual, expected = _f32(actual), _f32(expected)
  assert actual.shape == expected.shape, (actual.shape, expected.shape, err_msg)
  assert np.all(np.isfinite(actual)), f"non-finite result {err_msg}"
  assert np.all(np.isfinite(expected)), f"non-finite expectation {err_msg}"
  magnitudes = [expected] + [_f32(x) for x in operands]
  scale = max(max(float(np.max(np.abs(x), initial=0.0)) for x in magnitudes), 1e-30)
  np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * scale, err_msg=err_msg)


def assert_trees_close(got, want, rtol=2e-6):
  """Same structure, same leaf dtypes, and `assert_close` on every leaf."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    assert jnp.result_type(a) == jnp.result_type(b), jax.tree_util.keystr(path)
    assert_close(a, b, rtol, err_msg=jax.tree_util.keystr(path))


def _code_ordinals(codes) -> np.ndarray:
  """Codes as their ranks: int8, uint8 and int4 codes as they are (their maps are
  monotone in the code), float8 codes by their bits (sign-magnitude)."""
  if codes.dtype in (jnp.int8, jnp.uint8, jnp.int4):
    return np.asarray(codes.astype(jnp.int32))
  bits = np.asarray(jax.lax.bitcast_convert_type(codes, jnp.uint8), np.int32)
  return np.where(bits & 0x80, -(bits & 0x7F), bits)


def assert_nearly_same_codes(got, want):
  """Two blockwise moments computed by differently compiled code agree.

  Two compilations of the same f32 math may contract a multiply-add into an
  FMA differently, so a moment may differ by an f32 ulp before it is
  encoded, and an element next to a rounding boundary of the map lands one
  code apart. The codes round stochastically with bits hashed from the value
  rounded: a value an ulp apart draws its rounding anew, one of the same two
  codes. A block's scale is the absmax of what is encoded; for a first moment
  stored as its ratio to the root of the second, ``m / (sqrt(v) + eps)``, the
  differences compound: m's ulp, v's ulp halved by the root, and the root's,
  the sum's and the quotient's roundings, each landing either side: at most 4
  ulps, and an f32 ulp is up to ``finfo.eps`` (2**-23) of the value (seen on
  an H100: 2.5 of them).
  """
  assert type(got) is type(want) and got.codes.dtype == want.codes.dtype
  codes = np.abs(_code_ordinals(got.codes) - _code_ordinals(want.codes))
  assert codes.max() <= 1
  np.testing.assert_allclose(got.scales, want.scales, rtol=4 * np.finfo(np.float32).eps)


def step_grads(params, step):
  """Deterministic, non-zero gradients that change with the step."""
  return jax.tree.map(lambda p: jnp.sin(p * (step + 1.0)) + 0.01 * step, params)


def optax_step(tx):
  """Optax's step of `tx`, jitted: ``(params, grads, state) -> (params, state)``
  by ``tx.update`` and `optax.apply_updates`."""

  @jax.jit
  def step(params, grads, state):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def run_steps(tx, params, steps, fused, apply_gradients=None, *, feedback=True):
  """`steps` optimizer steps with `step_grads`; returns (params, state).

  With `fused`, steps go through `apply_gradients(tx, params, grads, state)`;
  otherwise through `tx.update` and `optax.apply_updates`. With `feedback`
  the gradients are taken at the current params, else at the initial ones.
  """
  # Jitted: one compile for the run, not one per op and leaf shape.
  if fused:
    step = jax.jit(lambda params, grads, state: apply_gradients(tx, params, grads, state))
  else:
    step = optax_step(tx)
  state, initial = tx.init(params), params
  for i in range(steps):
    params, state = step(params, step_grads(params if feedback else initial, i), state)
  return params, state


def _upcast(tree):
  return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def run_optax_f32_math(make, kwargs, params, steps, fused, moment_of=None, *, feedback=True):
  """Optax's math in f32, results stored in the original dtypes each step.

  That is pallasopt's contract for bf16 leaves (f32 inside the kernel, one
  rounding on store); for f32 leaves it is plain Optax. Unfused updates are
  stored in the promoted dtype of params and the first moment
  (``moment_of(state)`` gives that moment tree) before `optax.apply_updates`.

  Args:
    make: the Optax factory, e.g. ``optax.adamw``.
    kwargs: its arguments; ``mu_dtype`` only sets the stored dtype.
    params: initial params.
    steps: number of steps, with `step_grads`.
    fused: whether the run being compared skips the rounded-updates pass.
    moment_of: state -> first-moment tree, used to promote unfused updates.
    feedback: as in `run_steps`.
  """
  math_tx = make(**{**kwargs, "mu_dtype": None}) if "mu_dtype" in kwargs else make(**kwargs)
  state = make(**kwargs).init(params)
  storage = jax.tree.map(lambda x: x.dtype, (params, state))

  @jax.jit  # one compile for the run, not one per op and leaf shape
  def step(params, grads, state):
    updates, new_state = math_tx.update(_upcast(grads), _upcast(state), _upcast(params))
    if not fused:
      moments = moment_of(state) if moment_of else params
      updates = jax.tree.map(
          lambda u, p, m: u.astype(jnp.result_type(p, m)).astype(jnp.float32),
          updates, params, moments,
      )
    new_params = optax.apply_updates(_upcast(params), updates)
    return jax.tree.map(lambda x, d: x.astype(d), (new_params, new_state), storage)

  initial = params
  for i in range(steps):
    params, state = step(params, step_grads(params if feedback else initial, i), state)
  return params, state


# ---- Newton–Schulz spectra. ----


def spread_spectrum(rng: np.random.Generator, rows: int, cols: int):
  """A ``rows x cols`` f32 matrix (rows <= cols) with singular values spread
  geometrically over [0.05, 1], and those values after Frobenius scaling."""
  u, _ = np.linalg.qr(rng.standard_normal((rows, rows)))
  w, _ = np.linalg.qr(rng.standard_normal((cols, rows)))
  sigma = np.geomspace(1.0, 0.05, rows)
  return jnp.asarray((u * sigma) @ w.T, jnp.float32), sigma / np.sqrt(np.sum(sigma**2))


def promised_band(table, lo: float, hi: float) -> tuple[float, float]:
  """[min, max] of the composed scalar NS polynomials of ``table`` over [lo, hi]."""
  s = np.linspace(lo, hi, 20001)
  for a, b, c in np.asarray(table, np.float64):
    s = a * s + b * s**3 + c * s**5
  return s.min(), s.max()


# ---- Cross-platform lowering from the CPU host. ----

CUSTOM_CALL = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}
# A Pallas Mosaic GPU kernel's custom call (`mosaic_gpu_v2` on jax 0.10).
MOSAIC_GPU_CALL = "custom_call @mosaic_gpu"
# Leaf shapes lowering tests cover: 0-d, flat ragged, row-ragged, 4-d, a large
# prime size and a large matrix (as ShapeDtypeStructs they cost nothing).
LOWERING_SHAPES = [(), (7,), (37, 128), (3, 5, 7, 11), (1_000_003,), (4096, 1024)]


def sds(shape, dtype=jnp.float32) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, dtype)


# Export refuses custom calls without a stability guarantee unless told.
_DISABLED_CHECKS = {
    "tpu": (),
    "cuda": (jax.export.DisabledSafetyCheck.custom_call(CUSTOM_CALL["cuda"]),),
}


# Device kinds as the chips report them, to name the chip of an export.
CHIPS = {name: (chip.device_kind, chip.platform) for name, chip in chips.CHIPS.items()}


def named_chip(chip: str):
  """Context naming the chip an export is for (plain JAX: an abstract device)."""
  kind, platform = CHIPS[chip]
  device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform=platform)
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))


def lowered_text(fn, platform, *args, chip: str | None = None) -> str:
  """StableHLO of `jax.jit(fn)` exported for `platform`, plain JAX.

  ``platform``: ``"tpu"``, ``"cuda"``, ``"cpu"`` or a list of them (one
  artifact with a branch each). Without ``chip`` the export names no device
  (the platform's baseline chip is assumed); with one, the export is for that
  chip (`CHIPS`).
  """
  platforms = [platform] if isinstance(platform, str) else list(platform)
  checks = [c for p in platforms for c in _DISABLED_CHECKS.get(p, ())]
  export = jax.export.export(jax.jit(fn), platforms=platforms, disabled_checks=checks)
  if chip is None:
    return export(*args).mlir_module()
  with named_chip(chip):
    return export(*args).mlir_module()


def blockwise_adam_moments(m, v, fmt: str = "int8", key=None):
  """AdamW's moments ``(m, v)`` stored blockwise in ``fmt``: ``m`` as its ratio to ``v``'s root.

  Rounded to nearest, or stochastically with ``key`` as the optimizer's steps do.
  """
  root = quant.quantize(v, role=quant.ROOT, fmt=fmt, key=key, stream=2)
  ratio = quant.quantize(m, role=quant.RATIO, fmt=fmt, root=jnp.sqrt(v), key=key, stream=1)
  return ratio, root


def frozen_at(got, init, keys):
  """`got` with every leaf under the dict keys `keys` (a param's own entries
  in params and state alike) replaced by `init`'s: what a None gradient
  leaves untouched in the stage-local path."""
  def pick(path, g, i):
    names = [getattr(k, "key", None) for k in path]
    under = any(names[j:j + len(keys)] == list(keys) for j in range(len(names)))
    return i if under else g

  return jax.tree_util.tree_map_with_path(pick, got, init)


# ---- What each chip runs under impl="auto" (lowering and compile tiers). ----

# A matrix with 8-bit state and a bias that keeps f32 state (under 4096 elements).
FAMILY_TREE = {"w": sds((256, 512)), "b": sds((512,))}
STATE_FORMATS = [None, "bf16", "int8", "fp8", "int4"]


def _elementwise_family(make):
  return lambda impl, fmt: make(1e-3, state_format=fmt, impl=impl)


ELEMENTWISE_FAMILIES = {
    name: _elementwise_family(getattr(pallasopt.optim, name))
    for name in ("adamw", "lion", "rmsprop", "mars")
}


def auto_kernels(fmt, chip: str, mode: str = "apply", family: str = "adamw") -> int:
  """Kernels in one elementwise step of ``family`` on `FAMILY_TREE` under ``"auto"``.

  ``mode``: ``"apply"`` (the fused step) or ``"updates"`` (``tx.update`` and
  ``optax.apply_updates``): the same choice. A TPU runs the matrix's kernel
  (the vector is too small to pay) only for blockwise moments: XLA fuses f32
  and bf16 updates into the gradient's producer in a train step. A CUDA GPU
  runs Triton only for blockwise moments (XLA fuses f32 and bf16 updates as
  well), and fp8
  conversions only from compute capability 8.9 (not on an A100). RMSProp's
  only moment (as `ELEMENTWISE_FAMILIES` builds it: neither centered nor
  with momentum) is its second, whose root is stored as uint8 codes in the
  ``"fp8"`` format too: no fp8 conversion.
  """
  del mode
  blockwise = fmt in quant.FORMATS
  if CHIPS[chip][1] == "tpu":
    return int(blockwise)
  float8 = fmt == "fp8" and family != "rmsprop"
  return int(blockwise and not (float8 and chip == "a100"))
