"""Elementwise optimizer updates: both Optax modes from one update math, and their dispatch.

The families whose update is elementwise (AdamW, NAdamW, Lion, RMSProp, MARS)
share this layer over `pallasopt.kernels._elementwise.elementwise_call`,
`reference_update` and `kernel_update`: a family writes its *update
math* once, ``math(scalars, p, g, *moments, decay=...) -> (u, *moments)``,
and gets both of its modes from it, with the same dtypes and aliasing:

* ``"apply"``: returns ``(p + u, *moments)``, p and the moments in place;
* ``"updates"``: returns ``(u, *moments)`` (the Optax contract), the moments
  in place, reading p only where weight decay needs it.

Both take a ``gate`` (a boolean scalar, or None for always): where it is
false the step holds, returning its operands as they are stored (p in
``"apply"`` mode, zeros in ``"updates"`` mode) without changing a code. A
step gated inside the kernel writes the moments once, where selecting
between the new and the old state after the kernel (as ``optax.MultiSteps``
does) needs the old state copied before the kernel overwrites it in place
(`pallasopt.optim.multi_steps`). A `Gate` also folds a gradient accumulator
into the same pass, which then returns the accumulator it stores last.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pallasopt.kernels import codecs, policy, quant, rounding
from pallasopt.kernels._dispatch import dispatch
from pallasopt.kernels._elementwise import elementwise_call

__all__ = [
    "UpdateMath",
    "check_update_mode",
    "check_rounding",
    "ROUNDINGS",
    "Moment",
    "per_element",
    "update_dispatch",
    "store_moment",
    "updates_dtype",
    "lr_times_weight_decay",
    "scalars_decay_rate",
    "held_where_closed",
    "Gate",
    "accumulated",
    "stored_accumulator",
    "open_gate",
    "leaf_gate",
    "gated_gradient",
    "gated_accumulator",
    "reference_update",
    "kernel_update",
]

UpdateMath = Callable[..., Sequence[jax.Array]]
# One optimizer state leaf: an array (f32 or bf16) or a blockwise moment (`quant.Blockwise`).
Moment = jax.Array | quant.Blockwise


def check_update_mode(mode: str, p: jax.Array | None, decay: bool) -> None:
  """``mode`` is ``"apply"`` or ``"updates"`` and ``p`` is there if it is read."""
  if mode not in ("apply", "updates"):
    raise ValueError(f"mode must be 'apply' or 'updates'; got {mode!r}.")
  if p is None and (mode == "apply" or decay):
    raise ValueError(f"p is required in {mode!r} mode{' with decay' if decay else ''}.")


def updates_dtype(p: jax.Array | None, g: jax.Array, *moments: Moment) -> jnp.dtype:
  """The dtype of Optax's updates: its inputs' promoted dtype (blockwise moments count as f32)."""
  return jnp.result_type(
      *(_moment_dtype(x) for x in (p, g, *moments) if x is not None)
  )


# How a result is rounded into a bfloat16 leaf.
ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic")
# Per element, the cost-estimate flops of decoding and encoding one blockwise
# moment, and of one stochastic rounding (hash and add).
_QUANTIZED_FLOPS = 110
_ROUNDING_FLOPS = 20
_STORED_AS = {quant.RATIO: "a first moment as its ratio to the second moment's root",
              quant.ROOT: "a second moment as its square root", quant.SIGNED: "a moment as itself"}


def check_rounding(name: str, value: object) -> str:
  """``value`` is one of `ROUNDINGS`, else a ValueError naming ``name``."""
  if value not in ROUNDINGS:
    raise ValueError(f"{name} must be 'nearest' or 'stochastic'; got {value!r}.")
  return value  # type: ignore[return-value]


def _moment_dtype(m: Moment) -> jnp.dtype:
  return jnp.dtype(jnp.float32) if quant.is_blockwise(m) else jnp.dtype(m.dtype)


def _rounded_streams(
    p, moments, *, mode: str, state_rounding: str, param_rounding: str, key
) -> frozenset[int]:
  """The streams a step draws by element index: 0 (bf16 params), ``1 + i`` (bf16 moment ``i``)."""
  check_rounding("state_rounding", state_rounding)
  check_rounding("param_rounding", param_rounding)
  bf16 = jnp.dtype(jnp.bfloat16)
  streams = set()
  if mode == "apply" and param_rounding == "stochastic" and p.dtype == bf16:
    streams.add(0)
  if state_rounding == "stochastic":
    streams.update(1 + i for i, m in enumerate(moments) if _moment_dtype(m) == bf16)
  if streams and key is None:
    raise ValueError("stochastic rounding needs a key (see rounding.leaf_key); got key=None.")
  return frozenset(streams)


def _coded_streams(moments, key) -> frozenset[int]:
  """The streams ``1 + i`` of the blockwise moments, whose codes round stochastically."""
  streams = frozenset(1 + i for i, m in enumerate(moments) if quant.is_blockwise(m))
  if streams and key is None:
    raise ValueError(
        "blockwise moments round their codes stochastically: pass the leaf's random key "
        "(see rounding.leaf_key); got key=None."
    )
  return streams


def _root_partner(moments, roles: Sequence[str]) -> int | None:
  """The index of the blockwise second moment a ratio moment is divided by, if any."""
  if quant.ROOT not in roles:
    return None
  index = list(roles).index(quant.ROOT)
  return index if quant.is_blockwise(moments[index]) else None


def _check_blockwise(moments, roles: Sequence[str]) -> None:
  """Each blockwise moment is stored in the role its update expects (`quant.ROLES`)."""
  if not any(map(quant.is_blockwise, moments)):
    return
  if len(roles) != len(moments):
    raise ValueError(
        f"blockwise moments need one role per moment; got {len(roles)} for {len(moments)}."
    )
  ratios = [i for i, (m, r) in enumerate(zip(moments, roles))
            if quant.is_blockwise(m) and r == quant.RATIO]
  if ratios and _root_partner(moments, roles) is None:
    raise ValueError(
        f"moment {ratios[0]} is a ratio to the second moment's root, which is not blockwise."
    )
  for i, (m, role) in enumerate(zip(moments, roles, strict=True)):
    if not quant.is_blockwise(m):
      continue
    quant.check_scales(m)
    stored = quant.role_of(m)
    if stored == role:
      if not quant.is_current(m):
        raise ValueError(
            f"moment {i} is a {type(m).__name__} with {m.codes.dtype} codes on the "
            f"{quant.codec_of(m)} map: an int8 state saved by pallasopt before 2026-12-07, "
            "which the steps no longer write. Convert it once with "
            "pallasopt.optim.convert_state(opt_state, params, state_format)."
        )
      continue
    if stored == quant.SIGNED:
      raise ValueError(
          f"moment {i} is a {type(m).__name__} where this update keeps "
          f"{_STORED_AS[role]} ({'RootBlockwise' if role == quant.ROOT else 'RatioBlockwise'}): "
          "a state saved by pallasopt before 2026-11-26, when second moments were stored on a "
          "map that decodes their small entries to zero. Convert it once with "
          "pallasopt.optim.convert_state(opt_state, params, state_format)."
      )
    raise ValueError(
        f"moment {i} is a {type(m).__name__} ({_STORED_AS[stored]}); this update keeps "
        f"{_STORED_AS[role]} there."
    )


def _decoded(stored: Sequence, moments, roles: Sequence[str], partner: int | None) -> list:
  """Moment values from their stored values (blockwise ones decoded to f32)."""
  root = stored[partner] if partner is not None else None
  return [
      quant.from_stored(y, roles[i], root) if quant.is_blockwise(m) else y
      for i, (y, m) in enumerate(zip(stored, moments, strict=True))
  ]


def per_element(roundings: Sequence[str]) -> bool:
  """Whether an update with these roundings may run per shard.

  Rounded to nearest, every output element depends only on the same input
  element, or, for a blockwise moment, on its own block of `quant.BLOCK`
  elements along a row (the dispatch runs such an update per shard only
  where every shard holds whole blocks). Stochastic rounding is not per
  element: its random bits are drawn from an element's index in the whole
  leaf.
  """
  return all(r == "nearest" for r in roundings)


def update_dispatch(
    reference: Callable[..., tuple[Moment, ...]],
    kernel: Callable[..., tuple[Moment, ...]],
    impl: str,
    moments: Sequence[Moment],
    *,
    roundings: Sequence[str],
) -> Callable[..., tuple[Moment, ...]]:
  """`_dispatch.dispatch` of an elementwise update family.

  Its row of the auto policy is `policy.BLOCKWISE_UPDATE` where a moment is
  blockwise, else `policy.UPDATE`; blockwise moments with a ragged last
  block run the reference (the kernel reads whole blocks); the update runs
  per shard under a mesh where it is `per_element`. The kernel reads the
  gradient (argument 1) in bfloat16 where the step converts it from
  bfloat16, as a bf16 matmul's weight gradient is.
  """
  blockwise = [m for m in moments if quant.is_blockwise(m)]
  return dispatch(
      reference, kernel, impl,
      family=policy.BLOCKWISE_UPDATE if blockwise else policy.UPDATE,
      kernel_takes=all(m.codes.size % quant.BLOCK == 0 for m in blockwise),
      elementwise=per_element(roundings), narrowable_args=(1,),
  )


def store_moment(
    x: jax.Array, like: Moment, *, bits: jax.Array | None = None,
    root: jax.Array | None = None, key: jax.Array | None = None, stream: int = 1,
) -> Moment:
  """An f32 result ``x`` stored in ``like``'s format: a moment's or the params' (XLA path).

  A blockwise ``like`` gets ``x``'s blockwise codes in its role and format
  (`quant.quantize_like`: ``root`` for a ratio, ``key`` and ``stream`` for
  the codes that round stochastically); an array ``like`` gets ``x`` in its
  dtype, rounded stochastically with ``bits`` (`rounding.random_bits`) when
  given and the dtype is bfloat16, else to nearest.
  """
  if quant.is_blockwise(like):
    return quant.quantize_like(x, like, root=root, key=key, stream=stream)
  if bits is not None and like.dtype == jnp.bfloat16:
    x = rounding.stochastic_round_bf16(x, bits)
  return x.astype(like.dtype)


class Gate(NamedTuple):
  """A gated step that folds in a gradient accumulator (``optax.MultiSteps``'s).

  The step runs on the accumulator after this call's gradient ``g`` joins
  it (`accumulated`), cast to ``like``'s dtype (Optax casts it to the
  gradient's), and holds where ``apply`` is false; the accumulator stored is
  the old one where ``keep`` (a skipped call), else the new one times ``1 -
  restart`` (zero after the call that applies, as Optax writes it).

  Attributes:
    apply: boolean scalar: the step applies.
    acc: the leaf's accumulator (float32, the gradient's shape).
    divisor: float32 scalar: the calls in the mean, this one included (the
      running mean ``acc + (g - acc) / divisor``), or 0 for the sum ``g + acc``.
    restart: boolean scalar: the accumulator restarts from zero.
    keep: boolean scalar: the accumulator is kept as it was.
    like: a 0-d array in the dtype the accumulated gradient is cast to.
  """

  apply: jax.Array
  acc: jax.Array
  divisor: jax.Array
  restart: jax.Array
  keep: jax.Array
  like: jax.Array


def accumulated(g: jax.Array, acc: jax.Array, divisor: jax.Array) -> jax.Array:
  """The accumulator with ``g`` joined (`Gate`): f32 values in, f32 out."""
  return jnp.where(divisor > 0, acc + (g - acc) / divisor, g + acc)


def stored_accumulator(new: jax.Array, old: jax.Array, restart, keep) -> jax.Array:
  """The accumulator a `Gate`'s step stores: ``old`` where ``keep``, else
  Optax's ``(1 - restart) * new`` (zero times a non-finite value is NaN, as there)."""
  return jnp.where(keep, old, (1 - restart) * new)


def open_gate(gate: Any) -> Any:
  """Where a step applies: a `Gate`'s ``apply``, or the boolean ``gate`` itself (None: always)."""
  return gate.apply if isinstance(gate, Gate) else gate


def leaf_gate(gate: Any, acc: jax.Array | None, g: jax.Array) -> Any:
  """One leaf's gate: a `Gate` with that leaf's accumulator ``acc``, cast like
  its gradient ``g``; any other gate as it is."""
  if not isinstance(gate, Gate):
    return gate
  return gate._replace(acc=acc, like=jnp.zeros((), jnp.result_type(g)))


def _summed(g: jax.Array, gate: Gate) -> jax.Array:
  """A leaf's accumulator with ``g`` joined, in f32: what both gated helpers read."""
  return accumulated(g.astype(jnp.float32), gate.acc.astype(jnp.float32), gate.divisor)


def gated_gradient(g: jax.Array, gate: Any) -> jax.Array:
  """The gradient a leaf's gated step runs on (XLA path): ``g``, or under a
  (leaf's) `Gate` the accumulated gradient cast to ``gate.like``'s dtype."""
  if not isinstance(gate, Gate):
    return g
  return _summed(g, gate).astype(gate.like.dtype)


def gated_accumulator(g: jax.Array, gate: Gate) -> jax.Array:
  """The accumulator a leaf's `Gate`d step stores (XLA path), in its dtype."""
  stored = stored_accumulator(_summed(g, gate), gate.acc.astype(jnp.float32), gate.restart,
                              gate.keep)
  return stored.astype(gate.acc.dtype)


def reference_update(
    math: UpdateMath,
    p: jax.Array | None,
    g: jax.Array,
    moments: Sequence[Moment],
    scalars: tuple,
    *,
    mode: str,
    decay: bool,
    roles: Sequence[str] = (),
    state_rounding: str = "nearest",
    param_rounding: str = "nearest",
    key: jax.Array | None = None,
    gate: jax.Array | None = None,
) -> tuple[Moment, ...]:
  """Runs an update ``math`` as plain jnp: the XLA path of a family.

  Args:
    math: ``math(scalars, p, g, *moments, decay=decay) -> (u, *moments)`` on
      f32 values (``p`` is None when it is not read).
    p: params, or None in ``"updates"`` mode without decay.
    g: gradient.
    moments: the optimizer state leaves, each kept in its own format: an
      array in its own dtype, or a blockwise moment (`quant.Blockwise`).
    scalars: the family's NamedTuple of per-step scalars.
    mode: ``"apply"`` returns ``(p + u, *moments)``; ``"updates"`` returns
      ``(u, *moments)``, ``u`` in `updates_dtype`.
    decay: whether the leaf gets weight decay.
    roles: per moment, the role a blockwise moment is stored in
      (`quant.SIGNED`, `quant.RATIO` or `quant.ROOT`; at most one root,
      which the ratios divide by); needed when a moment is blockwise.
    state_rounding: how bf16 moments are stored: ``"nearest"`` or
      ``"stochastic"`` (`rounding.stochastic_round_bf16`). Blockwise codes
      always round stochastically (`rounding.code_bits`).
    param_rounding: the same for bf16 params in ``"apply"`` mode.
    key: the leaf's int32 random key (`rounding.leaf_key`), needed when
      anything is rounded stochastically.
    gate: None, a boolean scalar: where false, ``(p or zeros, *moments)``
      as they are stored (module docstring), or a `Gate`: the same, run on
      the accumulated gradient, the stored accumulator returned last.
  """
  check_update_mode(mode, p, decay)
  _check_blockwise(moments, roles)
  streams = _rounded_streams(
      p, moments, mode=mode, state_rounding=state_rounding, param_rounding=param_rounding,
      key=key,
  )
  _coded_streams(moments, key)
  partner = _root_partner(moments, roles)
  s = type(scalars)(*(jnp.asarray(x, jnp.float32) for x in scalars))
  f32 = lambda x: None if x is None else x.astype(jnp.float32)
  stored = [quant.stored_values(m) if quant.is_blockwise(m) else f32(m) for m in moments]
  grad = f32(gated_gradient(g, gate))
  u, *new = math(s, f32(p), grad, *_decoded(stored, moments, roles, partner), decay=decay)
  index = rounding.element_index(g.shape) if streams else None
  bits = lambda stream: rounding.random_bits(key, index, stream) if stream in streams else None
  if mode == "apply":
    first = store_moment(f32(p) + u, p, bits=bits(0))
  else:
    first = u.astype(updates_dtype(p, g, *moments))
  root = None if partner is None else quant.to_stored(new[partner], quant.ROOT)
  kept = [
      store_moment(x, m, bits=bits(1 + i), root=root, key=key, stream=1 + i)
      for i, (x, m) in enumerate(zip(new, moments, strict=True))
  ]
  held = p if mode == "apply" else jnp.zeros_like(first)
  results = held_where_closed(open_gate(gate), (first, *kept), (held, *moments))
  if isinstance(gate, Gate):
    results = (*results, gated_accumulator(g, gate))
  return results


def held_where_closed(gate: jax.Array | None, stepped: Any, held: Any) -> Any:
  """``stepped`` where ``gate`` is true (or None), else ``held``: trees alike, leaf by leaf."""
  if gate is None:
    return stepped
  return jax.tree.map(lambda new, old: jnp.where(gate, new, old), stepped, held)


def lr_times_weight_decay(s: tuple) -> jax.Array:
  """``-learning_rate * weight_decay``: the decay rate of a ``-lr (u + wd p)`` update."""
  return -s.learning_rate * s.weight_decay


def scalars_decay_rate(s: tuple) -> jax.Array:
  """The scalars' own ``decay_rate``: the rate of a ``u + decay_rate p`` update."""
  return s.decay_rate


def kernel_update(
    math: UpdateMath,
    p: jax.Array | None,
    g: jax.Array,
    moments: Sequence[Moment],
    scalars: tuple,
    *,
    mode: str,
    decay: bool,
    backend: str,
    interpret: bool,
    name: str,
    flops_per_element: int,
    transcendentals_per_element: int = 0,
    roles: Sequence[str] = (),
    state_rounding: str = "nearest",
    param_rounding: str = "nearest",
    key: jax.Array | None = None,
    decay_rate: Callable[[tuple], jax.Array] | None = None,
    gate: jax.Array | None = None,
) -> tuple[Moment, ...]:
  """`reference_update` as one fused Pallas kernel (`elementwise_call`).

  The moments are aliased to their outputs (a blockwise moment's codes and
  scales both), and in ``"apply"`` mode p too; donate them in the enclosing
  jit to update in place. p is read only in ``"apply"`` mode, or with decay
  where ``decay_rate`` is None. The kernel is named ``{name}_{mode}``.

  ``decay_rate(scalars)``: the ``r`` of the decoupled weight decay term
  ``r p`` that ``math`` adds with ``decay`` (``-learning_rate *
  weight_decay`` for AdamW; Loshchilov & Hutter, 2019). Given, an f32 update
  in ``"updates"`` mode is the kernel's ``u`` without decay plus ``r p``
  added by XLA outside the kernel, which XLA fuses with the
  ``optax.apply_updates`` that follows: the kernel does not read p, which
  the apply reads anyway (4 B per f32 parameter less in a train step). The
  sum rounds once more than ``math``'s, within an f32 ulp of its terms.

  Blockwise moments are decoded, updated in f32 and re-encoded with their new
  per-block absmax in the same pass: each block (a run of `quant.BLOCK`
  elements, see `elementwise_call`) is a row of the body's values, its absmax
  a row reduction; a leaf of whole blocks only (`update_dispatch` sends
  others to `reference_update`).
  Stochastic rounding draws its bits from the key and each element's flat
  index (bf16) or stored value (blockwise codes), exactly as the reference
  does.

  ``gate`` is one more kernel scalar: each output selects between its new
  value and its aliased operand as loaded (zero for the updates), so a
  closed gate stores the codes, scales and params it read. A `Gate` adds its
  accumulator as an operand aliased to one more output, and its scalars: the
  kernel reads the gradient and the accumulator, where XLA would write the
  accumulated gradient for it to read back.
  """
  check_update_mode(mode, p, decay)
  _check_blockwise(moments, roles)
  streams = _rounded_streams(
      p, moments, mode=mode, state_rounding=state_rounding, param_rounding=param_rounding,
      key=key,
  )
  coded = _coded_streams(moments, key)
  quantized = [quant.is_blockwise(m) for m in moments]
  partner = _root_partner(moments, roles)
  codec_names = [quant.codec_of(m) if q else None for m, q in zip(moments, quantized, strict=True)]
  decay_outside = (mode == "updates" and decay and decay_rate is not None
                   and updates_dtype(p, g, *moments) == jnp.float32)
  decay_inside = decay and not decay_outside
  with_p = p is not None and (mode == "apply" or decay_inside)
  # Operands: g, each moment (a blockwise one as codes and scales), then p if read.
  operands, block_inputs = [g], []
  out_dtypes, block_outputs = [p.dtype if mode == "apply" else updates_dtype(p, g, *moments)], []
  aliases = {}
  for m, q in zip(moments, quantized, strict=True):
    parts = (m.codes, m.scales) if q else (m,)
    for part in parts:
      aliases[len(operands)] = len(out_dtypes)
      operands.append(part)
      out_dtypes.append(part.dtype)
    if q:
      block_inputs.append(len(operands) - 1)
      block_outputs.append(len(out_dtypes) - 1)
  if with_p:
    operands.append(p)
    if mode == "apply":
      aliases[len(operands) - 1] = 0
  accumulating = isinstance(gate, Gate)
  if accumulating:
    aliases[len(operands)] = len(out_dtypes)
    operands.append(gate.acc)
    out_dtypes.append(gate.acc.dtype)
    gate_scalars = tuple(jnp.asarray(x, jnp.float32)
                         for x in (gate.apply, gate.divisor, gate.restart, gate.keep))
  else:
    gate_scalars = () if gate is None else (jnp.asarray(gate, jnp.float32),)
  num_scalars = len(scalars)
  extra_scalars = rounding.split_key(key) if streams or coded else ()

  def body(values, g, *rest, index=None):
    key_in = (rounding.join_key(*values[num_scalars:num_scalars + len(extra_scalars)])
              if streams or coded else None)
    if accumulating:
      *rest, acc = rest
      apply, divisor, restart, keep = values[-4:]
      summed = accumulated(g, acc, divisor)
      g = summed.astype(gate.like.dtype).astype(jnp.float32)
    elif gate is not None:
      apply = values[-1]
    loaded = rest

    def rounded(x, stream):
      if stream not in streams:
        return x
      return rounding.stochastic_round_bf16(x, rounding.random_bits(key_in, index, stream))

    rest = iter(rest)
    stored = [
        codecs.decode_rows(next(rest), next(rest), codec_names[i]) if q else next(rest)
        for i, q in enumerate(quantized)
    ]
    p = next(rest) if with_p else None
    u, *new = math(type(scalars)(*values[:num_scalars]), p, g,
                   *_decoded(stored, moments, roles, partner), decay=decay_inside)
    outputs = [rounded(p + u, 0) if mode == "apply" else u]
    root = None if partner is None else quant.to_stored(new[partner], quant.ROOT)
    for i, (x, q) in enumerate(zip(new, quantized, strict=True)):
      if q:
        y = root if i == partner else quant.to_stored(x, roles[i], root)
        outputs.extend(codecs.encode_rows(
            y, codec_names[i], rounding.code_bits(key_in, y, 1 + i),
            saturate_outliers=quant.saturates_outliers(roles[i])))
      else:
        outputs.append(rounded(x, 1 + i))
    if gate is None:
      return outputs
    # Output k > 0 is operand k (after g), a moment's part; p is the last operand.
    held = [loaded[-1] if mode == "apply" else jnp.zeros_like(outputs[0]),
            *loaded[:len(outputs) - 1]]
    outputs = [jnp.where(apply != 0, new, old) for new, old in zip(outputs, held, strict=True)]
    if accumulating:
      outputs.append(stored_accumulator(summed, acc, restart, keep != 0))
    return outputs

  flops = (
      flops_per_element + _QUANTIZED_FLOPS * sum(quantized)
      + _ROUNDING_FLOPS * (len(streams) + len(coded))
  )
  outs = iter(elementwise_call(
      body, operands, (*scalars, *extra_scalars, *gate_scalars), out_dtypes,
      backend=backend, interpret=interpret, name=f"{name}_{mode}", aliases=aliases,
      flops_per_element=flops, transcendentals_per_element=transcendentals_per_element,
      blockwise=any(quantized), block_inputs=block_inputs, block_outputs=block_outputs,
      with_index=bool(streams),
  ))
  first = next(outs)
  if decay_outside:
    rate = decay_rate(type(scalars)(*(jnp.asarray(x, jnp.float32) for x in scalars)))
    first = held_where_closed(open_gate(gate), first + rate * p.astype(jnp.float32), first)
  kept = [
      type(m)(next(outs), next(outs)) if q else next(outs)
      for m, q in zip(moments, quantized, strict=True)
  ]
  return (first, *kept, *outs)
