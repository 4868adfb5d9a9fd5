r"""Low-precision optimizer state: 8-bit and 4-bit blockwise codes.

One module for every family's kernel and reference. Its functions are plain
``jnp`` on f32 (and int32) values, so the same code runs inside a Pallas kernel
body (Mosaic TPU, Triton, the interpreter) and in the XLA reference, and both
produce the same codes, scales and rounded values.

**Blockwise state** (Dettmers et al., `8-bit Optimizers via Block-wise
Quantization <https://arxiv.org/abs/2110.02861>`_, 2022). A stored value is
cut into blocks of `BLOCK` consecutive elements (row-major order); each block
stores its absolute maximum ``s`` in f32 and each element an 8-bit code of
``x / s`` on a *map*.

**What is stored: the roles.** A moment is stored in one of three roles:

* `SIGNED`: the moment itself (Lion's, Muon's and Adafactor's momentum,
  RMSProp's mean and trace, MARS's previous gradient): `Int8Blockwise` on the
  e3m4 map, `Fp8Blockwise`, or `Int4Blockwise` on the linear 4-bit map;
* `ROOT`: a second moment :math:`v` as its square root :math:`w = \sqrt v`,
  on a zero-free root map (`RootBlockwise`: 8 bits for ``"int8"`` and
  ``"fp8"``, 4 bits for ``"int4"``);
* `RATIO`: a first moment :math:`m` that an update divides by the root of a
  second moment, stored as :math:`r = m / w` with :math:`w` that second
  moment's root (0 where :math:`w = 0`), on the format's signed codes
  (`Int8RatioBlockwise`; `RatioBlockwise` for ``"fp8"`` and ``"int4"``); it
  decodes as :math:`r\,\hat w` with :math:`\hat w` the decoded root.

Why (Li, Chen, Zhu, `Memory Efficient Optimizers with 4-bit States
<https://arxiv.org/abs/2309.01507>`_, 2023, name it the zero-point problem):
the second moment spans the square of the first moment's range, and on a map
with a zero code (bitsandbytes', torchao's) its small entries in a block
decode to 0 while the first moment's do not: measured single AdamW updates of
7x to :math:`10^5` x the learning rate. The root spans the first moment's
range, and its map has no zero: a value below the map's least one
(:math:`2^{-15}` of the block's absmax) decodes to that least value, larger
than the truth, which can only shrink an update. Storing the ratio makes the
update :math:`m / w` depend on the stored ratio, whose largest values (the
largest updates) sit at the top of the map, where it is finest; where the
stored root is off, the decoded first moment is off by the same factor.

**Faults stay in their element.** One scale per block must not let one
element spoil the block (a 1e20 gradient squares to inf): a block's scale is
its largest *finite* magnitude, and in a moment or a root (not a ratio) an
element over `codecs.OUTLIER_RATIO` times the next largest is left out of
it too (`codecs.block_scales`). Such elements are stored apart, each
decoding as Optax's state would for that element's update, or clamped:

* inf, or an outlier: saturated at the top code of its sign (it decodes as
  the block's scale). A root that overflowed to inf (Optax: that element's
  updates are 0 from then on) decodes as the block's largest root, and its
  ratio as 0 (``m / inf``): its next update is that of a zero first moment,
  and it trains on from there where Optax's stays frozen;
* NaN: stored as 0 (a root as its map's least value). The step that met the
  NaN wrote a NaN update, and so a NaN param, as Optax's does: the param
  carries the NaN from then on, as Optax's state and param both do.

The other elements of the block keep the codes they would have without it.

**4-bit state** (``"int4"``, after Li et al.; torchao's 4-bit optimizers):
codes are ``int4`` arrays of the moment's shape, which XLA stores two to a
byte, with the same blocks and scales as 8-bit state: 0.5 + 4/256 bytes
per element and moment.

The codes and their maps are `pallasopt.kernels.codecs`; the random bits
and stochastic rounding `pallasopt.kernels.rounding`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallasopt.kernels import _compat, codecs
from pallasopt.kernels.codecs import decode, decode_rows, encode_rows
from pallasopt.kernels.rounding import code_bits

__all__ = [
    "BLOCK",
    "MIN_QUANTIZED_SIZE",
    "FORMATS",
    "SIGNED",
    "RATIO",
    "ROOT",
    "ROLES",
    "Int8Blockwise",
    "Fp8Blockwise",
    "Int4Blockwise",
    "RootBlockwise",
    "RatioBlockwise",
    "Int8RatioBlockwise",
    "DynamicInt8Blockwise",
    "Blockwise",
    "is_blockwise",
    "blockwise_class",
    "is_float8",
    "stored_bytes",
    "role_of",
    "codec_of",
    "codec",
    "is_current",
    "code_dtype",
    "format_of",
    "scales_shape",
    "scales_spec",
    "rows_hold_blocks",
    "from_transposed_scales",
    "check_scales",
    "saturates_outliers",
    "to_stored",
    "from_stored",
    "quantize",
    "quantize_like",
    "dequantize",
    "stored_values",
    "legacy_second_moment",
]

# Elements per quantization block (one f32 scale each): 8 + 32/256 bits each.
BLOCK = 256
# Leaves smaller than this keep f32 state, as bitsandbytes does: their
# scales would cost more than the codes save and they are a rounding error of
# a model's bytes.
MIN_QUANTIZED_SIZE = 4096
# The blockwise state formats (`state_format`).
FORMATS: tuple[str, ...] = ("int8", "fp8", "int4")
# The roles of a stored moment (module docstring).
SIGNED, RATIO, ROOT = "signed", "ratio", "root"
ROLES: tuple[str, ...] = (SIGNED, RATIO, ROOT)


class Fp8Blockwise(NamedTuple):
  """A signed moment stored as float8 e4m3 values with one f32 absmax per block.

  Attributes:
    codes: float8_e4m3fn, the moment's shape: ``448 x / absmax``, rounded
      stochastically (by the steps) or to nearest (even).
    scales: f32 absmax per block of `BLOCK` elements, shaped by `scales_shape`
      (as `Int8Blockwise`'s).
  """

  codes: jax.Array
  scales: jax.Array


class Int4Blockwise(NamedTuple):
  """A signed moment stored as 4-bit codes with one f32 absmax per block.

  Attributes:
    codes: int4, the moment's shape (two to a byte in memory): ``k`` for
      the linear map's value ``k / 7`` of each element over its block's
      absmax.
    scales: f32 absmax per block of `BLOCK` elements, shaped by `scales_shape`
      (as `Int8Blockwise`'s).
  """

  codes: jax.Array
  scales: jax.Array


def _read_as_codes_and_scales(cls: type) -> type:
  """A blockwise class whose fields are named apart, read as ``codes`` and ``scales`` too."""
  cls.codes = property(lambda self: self[0], doc="The codes (the first field).")
  cls.scales = property(lambda self: self[1], doc="The per-block absmax (the second field).")
  return cls


@_read_as_codes_and_scales
class RootBlockwise(NamedTuple):
  """A second moment stored as its square root on the zero-free root map.

  The fields' names differ from the signed classes' on purpose: a checkpoint
  that stored the second moment itself (before 2026-11-26) cannot restore
  into this state unnoticed.

  Attributes:
    root_codes: uint8 (int4 for ``"int4"``), the moment's shape: the root
      map's code of each element's root over its block's absmax.
    root_scales: f32, the absmax of the root in each block, shaped by
      `scales_shape`.
  """

  root_codes: jax.Array
  root_scales: jax.Array


@_read_as_codes_and_scales
class RatioBlockwise(NamedTuple):
  """A first moment stored as its ratio to its second moment's root (``"fp8"``, ``"int4"``).

  Attributes:
    ratio_codes: the moment's shape: float8 e4m3 values (``"fp8"``) or int4
      codes on the linear 4-bit map (``"int4"``) of ``m / w`` over its
      block's absmax; uint8 codes on the dynamic map in an ``"int8"`` state
      saved before 2026-12-07 (`Int8RatioBlockwise` since).
    ratio_scales: f32, the absmax of the ratio in each block, shaped by
      `scales_shape`.
  """

  ratio_codes: jax.Array
  ratio_scales: jax.Array


@_read_as_codes_and_scales
class Int8Blockwise(NamedTuple):
  """A signed moment stored as 8-bit codes on the e3m4 map, one f32 absmax per block.

  The fields are named for the map: a checkpoint of an ``"int8"`` state saved
  before 2026-12-07 (uint8 codes on the dynamic map, `DynamicInt8Blockwise`)
  cannot restore into this state unnoticed.

  Attributes:
    e3m4_codes: int8, the moment's shape: each element's e3m4 code of ``x /
      absmax`` (`pallasopt.kernels.codecs`).
    e3m4_scales: f32, the absmax of each block of `BLOCK` elements, shaped by
      `scales_shape`: for a matrix whose rows hold whole blocks,
      ``(..., rows, blocks per row)``, so that they shard under the param's
      own `PartitionSpec`.
  """

  e3m4_codes: jax.Array
  e3m4_scales: jax.Array


@_read_as_codes_and_scales
class Int8RatioBlockwise(NamedTuple):
  """A first moment stored as its ratio to its second moment's root on the e3m4 map (``"int8"``).

  Attributes:
    e3m4_ratio_codes: int8, the moment's shape: the e3m4 code of ``m / w``
      over its block's absmax.
    e3m4_ratio_scales: f32, the absmax of the ratio in each block, shaped by
      `scales_shape`.
  """

  e3m4_ratio_codes: jax.Array
  e3m4_ratio_scales: jax.Array


class DynamicInt8Blockwise(NamedTuple):
  """An ``"int8"`` moment as saved before 2026-12-07: uint8 codes on the dynamic map.

  Read only, to convert (`pallasopt.optim.convert_state`): the signed moments
  of such states (``Int8Blockwise`` then), and before 2026-11-26 every
  moment, the second on the unsigned dynamic map. A step refuses it.

  Attributes:
    codes: uint8, the moment's shape: the rank of each element's map value.
    scales: f32 absmax per block, shaped by `scales_shape`.
  """

  codes: jax.Array
  scales: jax.Array


Blockwise = (Int8Blockwise | Fp8Blockwise | Int4Blockwise | RootBlockwise | RatioBlockwise
             | Int8RatioBlockwise | DynamicInt8Blockwise)
_CLASSES = (Int8Blockwise, Fp8Blockwise, Int4Blockwise, RootBlockwise, RatioBlockwise,
            Int8RatioBlockwise, DynamicInt8Blockwise)
_RATIO_CLASSES = (RatioBlockwise, Int8RatioBlockwise)


def is_blockwise(x: object) -> bool:
  """Whether ``x`` is a blockwise-quantized moment (any role and format)."""
  return isinstance(x, _CLASSES)


def stored_bytes(count: int, dtype) -> int:
  """The bytes ``count`` elements of ``dtype`` take in HBM: 4-bit types two to a byte."""
  if jnp.dtype(dtype) in (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)):
    return -(-count // 2)
  return count * jnp.dtype(dtype).itemsize


def is_float8(dtype) -> bool:
  """Whether ``dtype`` is an 8-bit float (fp8 codes), any of JAX's float8 types."""
  return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 1


def role_of(q: Blockwise) -> str:
  """The role (`SIGNED`, `RATIO` or `ROOT`) a blockwise moment is stored in."""
  if isinstance(q, RootBlockwise):
    return ROOT
  return RATIO if isinstance(q, _RATIO_CLASSES) else SIGNED


# The map of each format's signed codes (moments and ratios) and roots.
_SIGNED_CODEC = {"int8": "e3m4", "fp8": "e4m3", "int4": "linear4"}
_ROOT_CODEC = {"int8": "root", "fp8": "root", "int4": "root4"}
# The dtype of each map's codes.
_CODE_DTYPES = {
    "e3m4": jnp.int8, "root": jnp.uint8, "e4m3": jnp.float8_e4m3fn,
    "linear4": jnp.int4, "root4": jnp.int4,
}


def codec(role: str, fmt: str) -> str:
  """The map of a role in a format (`pallasopt.kernels.codecs`).

  ``"e3m4"``, ``"e4m3"``, ``"root"``, ``"linear4"`` or ``"root4"``.
  """
  if role not in ROLES:
    raise ValueError(f"role must be one of {ROLES}; got {role!r}.")
  if fmt not in FORMATS:
    raise ValueError(f"fmt must be one of {FORMATS}; got {fmt!r}.")
  return (_ROOT_CODEC if role == ROOT else _SIGNED_CODEC)[fmt]


def code_dtype(role: str, fmt: str) -> jnp.dtype:
  """The dtype of a role's codes in a format: int8, uint8, float8_e4m3fn or int4."""
  return jnp.dtype(_CODE_DTYPES[codec(role, fmt)])


def format_of(q: Blockwise) -> str:
  """The `FORMATS` entry a blockwise moment is stored in, read from its codes' dtype."""
  dtype = jnp.dtype(q.codes.dtype)
  if dtype == jnp.int4:
    return "int4"
  return "fp8" if is_float8(dtype) else "int8"


def codec_of(q: Blockwise) -> str:
  """The map a blockwise moment's codes are on (see `codec`).

  ``"dynamic"`` for uint8 signed codes: an ``"int8"`` state saved before
  2026-12-07 (`DynamicInt8Blockwise`, or a `RatioBlockwise` with uint8
  codes), which only converts.
  """
  if role_of(q) != ROOT and jnp.dtype(q.codes.dtype) == jnp.uint8:
    return "dynamic"
  return codec(role_of(q), format_of(q))


def is_current(q: Blockwise) -> bool:
  """Whether a blockwise moment is in a format the steps write (not one saved before 2026-12-07)."""
  return codec_of(q) != "dynamic" and type(q) is blockwise_class(role_of(q), format_of(q))


def blockwise_class(role: str, fmt: str) -> type:
  """The NamedTuple a moment stored in ``role`` and format ``fmt`` is (`Blockwise`)."""
  if role == ROOT:
    return RootBlockwise
  if role == RATIO:
    return Int8RatioBlockwise if fmt == "int8" else RatioBlockwise
  return {"int8": Int8Blockwise, "fp8": Fp8Blockwise, "int4": Int4Blockwise}[fmt]


def rows_hold_blocks(shape: tuple[int, ...]) -> bool:
  """Whether a moment of ``shape`` has rows of whole blocks (2 or more dims)."""
  return len(shape) >= 2 and shape[-1] % BLOCK == 0


def scales_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
  """The shape of the per-block scales of a moment of ``shape``.

  Rows of whole blocks (`rows_hold_blocks`): ``shape[:-1] + (shape[-1] //
  BLOCK,)``, the moment's own dims with the last one counted in blocks, so
  that the param's `PartitionSpec` splits the scales as it splits the codes
  wherever each shard holds whole blocks (the convention of trainers that
  give every array of a param's state the param's spec). Otherwise
  ``shape[:k] + (blocks,)`` with ``k`` the most leading dims whose trailing
  product is a whole number of blocks, and ``(ceil(size / BLOCK),)`` when no
  trailing product is (the last block is then ragged).

  From 2026-11-25 until this layout (2026-12-07) such rows' scales were laid
  out ``shape[:-2] + (shape[-1] // BLOCK, shape[-2])``:
  ``pallasopt.optim.convert_state(..., legacy_scales=True)`` converts them
  (`from_transposed_scales`).
  """
  if rows_hold_blocks(shape):
    return tuple(shape[:-1]) + (shape[-1] // BLOCK,)
  for k in range(len(shape), 0, -1):
    tail = math.prod(shape[k - 1 :])
    if tail % BLOCK == 0:
      return tuple(shape[: k - 1]) + (tail // BLOCK,)
  return (-(-math.prod(shape) // BLOCK),)


def scales_spec(
    shape: tuple[int, ...],
    spec: jax.sharding.PartitionSpec,
    axis_sizes: Mapping[str, int] | None,
    *,
    exact: bool,
) -> jax.sharding.PartitionSpec | None:
  """How the per-block scales of a moment of ``shape`` split when it splits as ``spec``.

  The one rule for the kernels' per-shard layout and the state specs a mesh
  declares (`pallasopt.pipeline.optimizer_state_specs`): a shard holds the
  scales of the blocks its codes hold.

  Rows of whole blocks (scales ``(..., rows, blocks per row)``): the
  moment's spec, but for the blocks axis, which splits like the columns where
  every column shard holds whole blocks (which takes the mesh's
  ``axis_sizes`` to know) and is whole otherwise. Other layouts (scales
  ``shape[:k] + (blocks,)``): the ``k`` leading dims split like the moment's
  and the blocks axis is whole.

  Args:
    shape: the moment's (its param's) shape.
    spec: the moment's `PartitionSpec`.
    axis_sizes: the mesh's axis sizes, or None where no mesh is known.
    exact: if true, None when a shard's scales would not be those of the
      blocks its codes hold (columns split mid-block, or dims merged into the
      blocks axis split): then no shard can encode on its own.
  """
  entries = [*spec, *(None,) * (len(shape) - len(spec))]
  axes_of = lambda entry: () if entry is None else (entry,) if isinstance(entry, str) else entry
  scales = scales_shape(shape)
  if rows_hold_blocks(shape):
    column_axes = axes_of(entries[-1])
    if not column_axes:
      whole = True
    elif axis_sizes is None:
      whole = False
    else:
      shards = math.prod(axis_sizes[a] for a in column_axes)
      whole = shape[-1] % (shards * BLOCK) == 0
    if exact and not whole:
      return None
    return jax.sharding.PartitionSpec(*entries[:-1], entries[-1] if whole else None)
  leading = len(scales) - 1
  if tuple(scales[:leading]) != tuple(shape[:leading]):
    leading = 0
  if exact and any(axes_of(entry) for entry in entries[leading:]):
    return None
  return jax.sharding.PartitionSpec(*entries[:leading], None)



def saturates_outliers(role: str) -> bool:
  r"""Whether a role's blocks saturate an outlier (`codecs.block_scales`).

  A moment (`SIGNED`) and a root (`ROOT`) do: one element of 1e19 would
  otherwise push the rest of its block below the map's least value. A
  `RATIO` does not: ratios are bounded, :math:`|m| / \sqrt v \le (1 -
  \beta_1) / \sqrt{(1 - \beta_2)(1 - \beta_1^2 / \beta_2)}` by
  Cauchy-Schwarz (7.3 at AdamW's defaults), while a block of ratios near
  zero around one of 0.5 is ordinary, and that one must keep its update.
  """
  return role != RATIO


def to_stored(x, role: str, root=None):
  """The f32 values a moment ``x`` is stored as in ``role``.

  `ROOT`: ``sqrt(x)``; `RATIO`: ``x / root`` (0 where ``root`` is 0), with
  ``root`` the f32 root of the second moment it is divided by; `SIGNED`: ``x``.
  """
  if role == ROOT:
    return jnp.sqrt(x)
  if role == RATIO:
    positive = root > 0
    return jnp.where(positive, x / jnp.where(positive, root, 1.0), 0.0)
  return x


def from_stored(y, role: str, root=None):
  """The moment stored values ``y`` hold in ``role`` (the inverse of `to_stored`)."""
  if role == ROOT:
    return y * y
  if role == RATIO:
    return y * root
  return y


def _reshape(x, shape, sharding):
  # Under Explicit mesh axes a reshape must name its output's sharding.
  if sharding is None:
    return jnp.reshape(x, shape)
  return jax.lax.reshape(x, shape, out_sharding=sharding)


def _sharding(x, leading: int | None = None):
  """``x``'s explicit sharding, cut to its first ``leading`` dims; None if it has none."""
  spec = _compat.explicit_spec(x)
  if spec is None:
    return None
  entries = (tuple(spec) + (None,) * x.ndim)[: x.ndim if leading is None else leading]
  return jax.sharding.NamedSharding(
      jax.typeof(x).sharding.mesh, jax.sharding.PartitionSpec(*entries)
  )


def _block_rows(x):
  """``x`` as rows of one block each, in the order of its scales (`scales_shape`) + (BLOCK,).

  Whole blocks keep the leading dims (and their sharding); rows of whole
  blocks split their last dim into blocks, which split as `scales_spec`
  splits the scales (like the columns where each column shard holds whole
  blocks: no data moves); a ragged last block is zero-padded (which changes
  no absmax).
  """
  if rows_hold_blocks(x.shape):
    sharding = _sharding(x)
    if sharding is not None:
      spec = scales_spec(x.shape, sharding.spec, dict(sharding.mesh.shape), exact=False)
      sharding = jax.sharding.NamedSharding(
          sharding.mesh, jax.sharding.PartitionSpec(*spec, None))
    return _reshape(x, scales_shape(x.shape) + (BLOCK,), sharding)
  blocks = scales_shape(x.shape)
  size = math.prod(x.shape)
  if size % BLOCK:
    flat = _reshape(x, (size,), _sharding(x, 0))
    return jnp.pad(flat, (0, -size % BLOCK)).reshape(blocks + (BLOCK,))
  return _reshape(x, blocks + (BLOCK,), _sharding(x, len(blocks) - 1))


def _from_block_rows(rows, like):
  """The inverse of `_block_rows`: ``like``'s shape and sharding."""
  size = math.prod(like.shape)
  if size % BLOCK:
    flat = _reshape(rows, (rows.size,), _sharding(rows, 0))
    return _reshape(flat[:size], like.shape, _sharding(like))
  return _reshape(rows, like.shape, _sharding(like))


def quantize(
    x: jax.Array, *, role: str = SIGNED, fmt: str = "int8", root: jax.Array | None = None,
    key: jax.Array | None = None, stream: int = 1,
) -> Blockwise:
  """The blockwise moment of an array of any shape (its last block may be ragged).

  Args:
    x: the moment's f32 values.
    role: `SIGNED`, `RATIO` or `ROOT` (module docstring).
    fmt: one of `FORMATS`.
    root: for `RATIO`, the f32 root of the second moment ``x`` is divided by.
    key: the leaf's random key (`leaf_key`): the codes round stochastically
      with `code_bits` of ``stream``. Without it they round to nearest (a
      one-off conversion does; the optimizer steps pass the key).
    stream: the moment's random stream.
  """
  codec(role, fmt)  # checks both
  if role == RATIO and root is None:
    raise ValueError("a first moment stored as a ratio needs root=, its second moment's root.")
  return blockwise_class(role, fmt)(*_encoded(x, root, key, role=role, fmt=fmt, stream=stream))


# `quantize` and `stored_values` as one program per shape and format: called
# eagerly (`init`, `convert_state`), the codec's ops would each compile alone.
@functools.partial(jax.jit, static_argnames=("role", "fmt", "stream"))
def _encoded(x, root, key, *, role: str, fmt: str, stream: int):
  name = codec(role, fmt)
  rows = _block_rows(to_stored(x.astype(jnp.float32), role, root))
  bits = None if key is None else code_bits(key, rows, stream)
  codes, scales = encode_rows(rows, name, bits, saturate_outliers=saturates_outliers(role))
  return _from_block_rows(codes.astype(_CODE_DTYPES[name]), x), scales.reshape(scales.shape[:-1])


@functools.partial(jax.jit, static_argnames=("name",))
def _decoded(codes, scales, *, name: str):
  rows = _block_rows(codes.astype(jnp.int32 if name in codecs.INTEGER_CODECS else jnp.float32))
  return _from_block_rows(decode_rows(rows, scales[..., None], name), codes)


def quantize_like(
    x: jax.Array, like: Blockwise, *, root: jax.Array | None = None,
    key: jax.Array | None = None, stream: int = 1,
) -> Blockwise:
  """`quantize` of ``x`` in the role and format of the blockwise moment ``like``."""
  return quantize(x, role=role_of(like), fmt=format_of(like), root=root, key=key, stream=stream)


def stored_values(q: Blockwise) -> jax.Array:
  """The f32 values a blockwise moment's codes decode to: in its role (`to_stored`).

  A `RootBlockwise`'s are the roots of its second moment; a
  `RatioBlockwise`'s the ratios.
  """
  check_scales(q)
  return _decoded(q.codes, q.scales, name=codec_of(q))


def dequantize(q: Blockwise, *, root: jax.Array | None = None) -> jax.Array:
  """The f32 moment a blockwise moment holds.

  A `RatioBlockwise` needs ``root``, the `stored_values` of its second
  moment's `RootBlockwise`.
  """
  role = role_of(q)
  if role == RATIO and root is None:
    raise ValueError("a first moment stored as a ratio needs root=, its second moment's root.")
  return from_stored(stored_values(q), role, root)


def legacy_second_moment(q: DynamicInt8Blockwise | Fp8Blockwise) -> jax.Array:
  """The f32 second moment a blockwise state saved before 2026-11-26 held.

  Until then a second moment was stored as itself: on the unsigned dynamic
  map (``"int8"``) or as e4m3 values (``"fp8"``).
  """
  if codec_of(q) == "e4m3":
    return stored_values(q)
  check_scales(q)
  rows = _block_rows(q.codes.astype(jnp.float32))
  return _from_block_rows(decode(rows, False) * q.scales[..., None], q.codes)


def check_scales(q: Blockwise) -> None:
  """Raises a ValueError unless ``q``'s scales have the shape `scales_shape` gives its codes."""
  shape, got = tuple(q.codes.shape), tuple(q.scales.shape)
  if got == scales_shape(shape):
    return
  transposed = rows_hold_blocks(shape) and got == _transposed_scales_shape(shape)
  raise ValueError(
      f"blockwise scales of shape {got} do not fit codes of shape {shape}: expected "
      f"{scales_shape(shape)}."
      + (" A state saved from 2026-11-25 until 2026-12-07 keeps them as "
         f"{got}: convert it with pallasopt.optim.convert_state(opt_state, params, "
         "state_format, legacy_scales=True)." if transposed else "")
  )


def _transposed_scales_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
  return tuple(shape[:-2]) + (shape[-1] // BLOCK, shape[-2])


def from_transposed_scales(q: Blockwise) -> Blockwise:
  """A blockwise moment saved from 2026-11-25 until 2026-12-07, in the current layout.

  In that time a matrix whose rows hold whole blocks kept its scales as
  ``shape[:-2] + (blocks per row, rows)``; `scales_shape` now keeps the
  moment's own dims, and other scales are unchanged. (The shapes alone
  cannot tell the layouts apart when a matrix has as many rows as blocks per
  row, hence a function that is only called on a state known to be from
  then.) Scales that fit neither layout are a ValueError.
  """
  shape = tuple(q.codes.shape)
  if rows_hold_blocks(shape) and tuple(q.scales.shape) == _transposed_scales_shape(shape):
    return type(q)(q.codes, jnp.swapaxes(q.scales, -1, -2))
  check_scales(q)
  return q
