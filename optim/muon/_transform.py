"""`muon`: the drop-in for `optax.contrib.muon` built from its parts.

The Muon leaves' step is `_chain.MuonChain` (its options `_chain.MuonOptions`);
the other leaves take the fused AdamW; ``optax.partition`` routes them, so the
state is Optax's.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax

from pallasopt.kernels._dispatch import resolve_impl
from pallasopt.kernels._update import Gate
from pallasopt.optim import _validation as v
from pallasopt.optim._base import (
    FusedGradientTransformation,
    fused_transformation,
    gated_results,
)
from pallasopt.optim._elementwise_tx import check_low_bit_options, is_quantized, moment_arrays
from pallasopt.optim._types import MaskOrFn, Numeric, ScalarOrSchedule
from pallasopt.optim.adamw import adamw
from pallasopt.optim.muon._chain import MuonChain, MuonOptions
from pallasopt.optim.muon._options import (
    DEFAULT_NS_COEFFS,
    MOMENTUM_STYLES,
    OWNER,
    PRECONDITIONINGS,
    SCALE_MODES,
    SECOND_MOMENTS,
)
from pallasopt.optim.muon._orthogonalize import resolve_coeffs


def muon(
    learning_rate: ScalarOrSchedule,
    ns_coeffs: Any = DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    beta: Numeric = 0.95,
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 0.0,
    weight_decay_mask: MaskOrFn = None,
    mu_dtype: Any | None = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = "frobenius",
    adam_b1: Numeric = 0.9,
    adam_b2: Numeric = 0.999,
    adam_eps_root: Numeric = 0.0,
    adam_weight_decay: ScalarOrSchedule = 0.0,
    adam_learning_rate: ScalarOrSchedule | None = None,
    muon_weight_dimension_numbers: Any = None,
    consistent_rms: float | None = None,
    impl: str = "auto",
    stacked_axes: int | None = None,
    ns_rule: str | None = None,
    custom_ns_coeffs: Any = None,
    iter_dtype: Any = None,
    gram_levels: int | None = None,
    scale_mode: str | None = None,
    extra_scale_factor: float | None = None,
    momentum: str = "optax",
    second_moment: str | None = None,
    beta2: float | None = None,
    second_moment_eps: float | None = None,
    qkv_split_shapes: Any = None,
    adamw_predicate: Callable[[str, jax.Array], bool] | None = None,
    blockwise: tuple[int, int] | None = None,
    distributed_axes: Sequence[str] | None = None,
    state_format: str | None = None,
    seed: int | None = None,
) -> FusedGradientTransformation:
  r"""Muon: momentum orthogonalized by Newton–Schulz; a drop-in for Optax's.

  The positional and Optax keyword arguments, their defaults and meaning are
  those of `optax.contrib.muon` (optax 0.2.8); the result, the state tree and
  the routing of leaves are the same. Per Muon leaf (a matrix, or a stack of
  matrices along its batch axes), with :math:`t` the step count:

  .. math::

    \mu_t = \beta \mu_{t-1} + (1 - \beta) g, \quad
    \hat\mu = \frac{\beta \mu_t}{1-\beta^{t+1}} + \frac{(1-\beta) g}{1-\beta^t}
    \;\;(\text{nesterov; else } \mu_t / (1-\beta^t)), \\
    O = \mathrm{NS}(\hat\mu), \quad
    u = -\eta_t \left(s\, O + \lambda p\right),

  with :math:`s = \sqrt{\max(1, \text{fan\_out}/\text{fan\_in})}` or, with
  ``consistent_rms=r``, :math:`r\sqrt{\max(\text{fan\_in}, \text{fan\_out})}`;
  ``adaptive`` multiplies :math:`O` by :math:`\langle \hat\mu, O\rangle`
  (summed over the leaf) first. Leaves not routed to Muon get
  ``adamw(adam_learning_rate or learning_rate, adam_b1, adam_b2, eps,
  adam_eps_root, adam_weight_decay, mu_dtype, nesterov=nesterov)``.

  Routing: without ``muon_weight_dimension_numbers``, a leaf is a Muon leaf
  iff its rank is ``2 + stacked_axes`` (its leading ``stacked_axes`` axes are
  a batch of matrices, each orthogonalized on its own; ``stacked_axes=0`` is
  Optax's rank-2 rule) and ``adamw_predicate(path, leaf)`` is not true; a
  leaf of rank ``stacked_axes`` or less is an error that names it. With
  dimension numbers (a `MuonDimensionNumbers`, a tree or prefix tree of them
  with None for AdamW leaves, or a callable returning one), they decide, as in
  Optax, and ``stacked_axes`` is not used (their batch axes are implicit).

  Extensions (keyword-only; defaults reproduce Optax):

  * ``ns_coeffs`` also takes the presets of `ns_coefficients.PRESETS`:
    ``"simple"``, ``"quintic"``, ``"polar_express"``, ``"cans"``, ``"aol"``,
    ``"deepseekv4"``, ``"cubic5"`` (Emerging-Optimizers' tables), expanded to
    ``ns_steps`` rows by the preset's rule (``repeat_last`` for
    polar_express, cans and deepseekv4, else ``cycle``; deepseekv4 is
    published with ``ns_steps=10``; cubic5 takes exactly ``ns_steps=5``),
    and ``"custom"`` with ``custom_ns_coeffs`` (cycled).
    ``ns_rule`` (``"cycle"``/``"repeat_last"``) expands a given table to
    ``ns_steps`` rows instead of Optax's "one step per row". Optax's
    ``"standard"`` and ``"dion"`` keep Optax's semantics.
  * ``iter_dtype``: float32 or bfloat16 Newton–Schulz iterates (f32
    accumulation, f32 epilogues: Jordan's recipe); default: the momentum's
    dtype. With bf16 iterates the singular values after Newton–Schulz stay
    within the coefficients' promised band widened by 2^-7 (measured: 1.2 *
    2^-8 at most), and 100 Muon steps on scikit-learn's digits end at the f32
    loss within 0.1% (tests/test_gram.py). On CUDA with ``impl="pallas"``
    they run the Mosaic GPU Gram kernel (`kernels.newton_schulz`, regime
    ``wgmma``), the one CUDA Newton–Schulz kernel: there ``impl="pallas"``
    with f32 iterates is a TypeError naming ``iter_dtype``.
  * ``gram_levels``: how the XLA path computes the two symmetric products of
    each Newton–Schulz step (`kernels.gram.block_gram`): ``L`` levels of
    2 x 2 block splits compute only the upper blocks, :math:`(2^L+1)/2^{L+1}`
    of the flops (4 levels: 0.69x of Optax's compiled Muon step flops on a
    4096² matrix, 0.74x on GPT-2 small's tree); 0 computes them in full, op
    for op as Optax; None takes the levels measured fastest on the platform
    (`kernels.gram.gram_levels_for`: 2 on a CPU from 2048 rows, 1.13x-1.23x
    faster there; full dots below, and on GPUs and TPUs, where no split was
    timed yet). Results equal Optax's up to f32 summation order.
  * ``scale_mode`` (`SCALE_MODES`, see `shape_scale`) with
    ``extra_scale_factor``: :math:`s = \text{scale}(\text{in}, \text{out})
    \cdot \text{extra}`, replacing Optax's scale (exclusive with
    ``consistent_rms``).
  * ``momentum="lerp"``: Emerging-Optimizers' uncorrected momentum,
    :math:`\hat\mu = (1-\beta) g + \beta\mu_t` with Nesterov, else
    :math:`\mu_t` (no bias correction).
  * ``second_moment`` (after Newton–Schulz, before the scale; decay
    ``beta2``, ``second_moment_eps`` = :math:`\epsilon`), per matrix:
    ``"adamuon"`` (Si et al., arXiv:2507.11005): :math:`v \leftarrow
    \beta_2 v + (1-\beta_2) O^2`, :math:`O \leftarrow O/(\sqrt v + \epsilon)`;
    ``"normuon"`` (Li et al., arXiv:2510.05491): :math:`v \leftarrow \beta_2
    v + (1-\beta_2)\,\mathrm{mean}(O^2)` over the fan-in axis when
    fan_out >= fan_in (one entry per output neuron), else over the fan-out
    axis, :math:`O \leftarrow O / \sqrt{\max(v, \epsilon)}`;
    ``"namo"`` (arXiv:2602.17080): :math:`v \leftarrow \beta_2 v +
    (1-\beta_2)\|g\|_F^2`, :math:`O \leftarrow O\,\|\hat\mu\|_F /
    (\sqrt v + \epsilon)`. The state gains `MuonSecondMomentState`.
  * ``qkv_split_shapes``: a tuple (e.g. ``(q, k, v)`` rows per head group), a
    tree or prefix tree of tuples/None, or a callable returning one: the
    output axis of that Muon leaf, viewed as ``(groups, sum(split))``, is
    split into parts orthogonalized (and scaled) separately, as Megatron does
    for fused QKV weights.
  * ``adamw_predicate(path, leaf) -> bool``: route more leaves (embeddings,
    output heads) to AdamW; ``path`` is `jax.tree_util.keystr` of the leaf.
  * ``blockwise=(r, c)``: see the module docstring (sharded matrices).
  * ``distributed_axes=("data",)``: names of mesh axes (the mesh in context,
    ``jax.set_mesh``) over whose devices one step's Newton–Schulz work is
    split instead of repeated on each: every device orthogonalizes about 1/N
    of each batch of same-shape matrices and the results return to the
    params' layout (see the module docstring). Exact: the same math on each
    matrix; no new state.

  Args:
    learning_rate: scalar or schedule.
    ns_coeffs: ``(a, b, c)``, an ``(n, 3)`` table, or a preset name.
    ns_steps: Newton–Schulz steps (ignored for an ``(n, 3)`` table unless
      ``ns_rule`` is given).
    beta: momentum decay, in [0, 1).
    eps: Newton–Schulz normalization epsilon and AdamW's ``eps``.
    weight_decay: decoupled weight decay of the Muon leaves (times lr).
    weight_decay_mask: Optax mask (tree, prefix or callable) of decaying leaves.
    mu_dtype: momentum dtype (both parts); with a ``state_format``, as in
      `pallasopt.optim.adamw`.
    nesterov: Nesterov momentum (both parts).
    adaptive: Optax's dual-norm scaling.
    preconditioning: ``"frobenius"``, ``"spectral"``, ``"aol"``, ``"schatten"``.
    adam_b1, adam_b2, adam_eps_root, adam_weight_decay, adam_learning_rate:
      the AdamW part.
    muon_weight_dimension_numbers: see "Routing".
    consistent_rms: see the update formula.
    impl: ``"auto" | "pallas" | "interpret" | "xla"`` for both kernels.
      ``"auto"`` orthogonalizes with XLA (``gram_levels``) on CUDA GPUs,
      where cuBLAS was measured 1.5x-5x faster than the (since removed)
      Triton Newton–Schulz kernels (`pallasopt.kernels.newton_schulz`), and
      on CPUs; the Mosaic kernels on TPU. ``"pallas"`` forces the kernels:
      on CUDA the Mosaic GPU one, which takes bf16 iterates only.
    stacked_axes: leading batch axes of every leaf (see "Routing").
    ns_rule, custom_ns_coeffs, iter_dtype, gram_levels, scale_mode: see "Extensions".
    extra_scale_factor, momentum, second_moment, beta2: see "Extensions".
    second_moment_eps, qkv_split_shapes, adamw_predicate: see "Extensions".
    blockwise, distributed_axes: see "Extensions".
    state_format: storage of the momentum (both parts): None (Optax's),
      ``"bf16"`` (stochastic rounding on every store), ``"int8"``, ``"fp8"``
      or ``"int4"`` (blockwise codes for leaves of at least 4096 elements,
      decoded, stepped and re-encoded by one kernel on a TPU or GPU under
      ``"auto"``: `pallasopt.kernels.muon_momentum`); see `pallasopt.optim.adamw`.
    seed: seed of the stochastic roundings (None: 0).

  Returns:
    A `FusedGradientTransformation`; ``apply_gradients`` applies the AdamW
    leaves with the fused kernel and the Muon leaves after Newton–Schulz.
  """
  # Our extensions default to None, so optax.inject_hyperparams never lifts
  # them into its traced hyperparameters: its dict is exactly Optax's.
  stacked_axes = 0 if stacked_axes is None else stacked_axes
  extra_scale_factor = 1.0 if extra_scale_factor is None else extra_scale_factor
  beta2 = 0.95 if beta2 is None else beta2
  second_moment_eps = 1e-8 if second_moment_eps is None else second_moment_eps
  for name, value in (
      ("learning_rate", learning_rate),
      ("adam_learning_rate", adam_learning_rate),
      ("weight_decay", weight_decay),
      ("adam_weight_decay", adam_weight_decay),
  ):
    v.check_finite(OWNER, name, value)
  for name, value, high, inclusive in (
      ("beta", beta, 1.0, False),
      ("eps", eps, math.inf, True),
      ("adam_b1", adam_b1, 1.0, False),
      ("adam_b2", adam_b2, 1.0, False),
      ("adam_eps_root", adam_eps_root, math.inf, True),
      ("beta2", beta2, 1.0, False),
      ("second_moment_eps", second_moment_eps, math.inf, True),
  ):
    v.check_hyperparameter(OWNER, name, value, high=high, high_inclusive=inclusive)
  stacked_axes = v.static_int(
      OWNER, "stacked_axes", stacked_axes, low=0, static_args="MUON_STATIC_ARGS"
  )
  if gram_levels is not None:
    gram_levels = v.static_int(
        OWNER, "gram_levels", gram_levels, low=0, static_args="MUON_STATIC_ARGS"
    )
  resolve_impl(impl)
  for name, value, allowed in (
      ("preconditioning", preconditioning, PRECONDITIONINGS),
      ("momentum", momentum, MOMENTUM_STYLES),
      ("scale_mode", scale_mode, SCALE_MODES + (None,)),
      ("second_moment", second_moment, SECOND_MOMENTS + (None,)),
      ("ns_rule", ns_rule, ("cycle", "repeat_last", None)),
  ):
    if value not in allowed:
      raise ValueError(f"{OWNER}: {name} must be one of {allowed}; got {value!r}.")
  if scale_mode is not None and consistent_rms is not None:
    raise ValueError(f"{OWNER}: pass scale_mode or consistent_rms, not both.")
  if blockwise is not None and (
      len(blockwise) != 2 or any(not isinstance(b, int) or b < 1 for b in blockwise)
  ):
    raise ValueError(f"{OWNER}: blockwise must be a pair of positive ints; got {blockwise!r}.")
  if distributed_axes is not None:
    if isinstance(distributed_axes, str):
      distributed_axes = (distributed_axes,)
    distributed_axes = tuple(distributed_axes)
    if not distributed_axes or not all(isinstance(a, str) for a in distributed_axes) or len(
        set(distributed_axes)) != len(distributed_axes):
      raise ValueError(
          f"{OWNER}: distributed_axes must be distinct mesh axis names; got {distributed_axes!r}."
      )
  v.optional_float_dtype(OWNER, "iter_dtype", iter_dtype)
  traced_steps = isinstance(ns_steps, jax.core.Tracer)
  if traced_steps:
    # optax.inject_hyperparams traces ns_steps: Optax's orthogonalization
    # (a loop of traced length) then runs every Muon leaf, in every impl.
    if isinstance(ns_coeffs, str) or ns_rule is not None:
      raise TypeError(
          f"{OWNER}: a traced ns_steps works only with numeric ns_coeffs and no ns_rule; "
          "under optax.inject_hyperparams pass static_args=MUON_STATIC_ARGS."
      )
    init_coeffs = np.asarray(ns_coeffs, np.float32)
  else:
    ns_steps = v.static_int(OWNER, "ns_steps", ns_steps, low=1, static_args="MUON_STATIC_ARGS")
    init_coeffs = resolve_coeffs(ns_coeffs, ns_steps, ns_rule, custom_ns_coeffs)
  table_steps = ns_steps if init_coeffs.ndim == 1 else None
  mu_dtype = v.optional_dtype(OWNER, "mu_dtype", mu_dtype)
  seed = check_low_bit_options(OWNER, state_format, "nearest", seed)
  if adam_learning_rate is None:
    adam_learning_rate = learning_rate

  chain = MuonChain(MuonOptions(
      learning_rate=learning_rate, ns_steps=ns_steps, beta=beta, eps=eps,
      weight_decay=weight_decay, weight_decay_mask=weight_decay_mask, mu_dtype=mu_dtype,
      nesterov=nesterov, adaptive=adaptive, preconditioning=preconditioning,
      muon_weight_dimension_numbers=muon_weight_dimension_numbers,
      consistent_rms=consistent_rms, impl=impl, stacked_axes=stacked_axes,
      iter_dtype=iter_dtype, gram_levels=gram_levels, scale_mode=scale_mode,
      extra_scale_factor=extra_scale_factor, momentum=momentum, second_moment=second_moment,
      beta2=beta2, second_moment_eps=second_moment_eps, qkv_split_shapes=qkv_split_shapes,
      adamw_predicate=adamw_predicate, blockwise=blockwise, distributed_axes=distributed_axes,
      state_format=state_format, seed=seed, init_coeffs=init_coeffs, table_steps=table_steps,
      traced_steps=traced_steps,
  ))

  muon_tx = optax.GradientTransformationExtraArgs(
      chain.init, lambda u, s, p=None, **extra: chain.update(u, s, p)
  )
  adam_tx = adamw(
      adam_learning_rate, b1=adam_b1, b2=adam_b2, eps=eps, eps_root=adam_eps_root,
      mu_dtype=mu_dtype, weight_decay=adam_weight_decay, nesterov=nesterov,
      state_format=state_format, seed=seed, impl=impl,
  )
  partition = optax.partition({"muon": muon_tx, "adam": adam_tx}, chain.labels)

  def step(grads, state, params, mode, grad_scale, learning_rate, gate=None):
    """Both partitions: the AdamW part fused, the Muon part by its chain.

    ``mode="apply"`` returns the new params, ``"updates"`` the updates;
    ``gate`` (`FusedUpdate.gated`) goes to both partitions, a `Gate`'s
    accumulators split between them as the leaves are.
    """
    if params is not None:
      v.check_same_tree(OWNER, "grads", grads, "params", params)
    labels = jax.tree.leaves(chain.labels(grads))
    treedef = jax.tree.structure(grads)

    def mask(tree, group):
      if tree is None:
        return None
      leaves = jax.tree.leaves(tree)
      return treedef.unflatten(
          [x if l == group else optax.MaskedNode() for x, l in zip(leaves, labels)]
      )

    def gate_of(group):
      return gate._replace(acc=mask(gate.acc, group)) if isinstance(gate, Gate) else gate

    def merged(trees):
      picked = {group: iter(jax.tree.leaves(tree)) for group, tree in trees.items()}
      return treedef.unflatten([next(picked[l]) for l in labels])

    inner = state.inner_states
    options = dict(grad_scale=grad_scale, learning_rate=learning_rate)
    if gate is not None:
      options["gate"] = gate_of("adam")
    if mode == "apply":
      adam_out, adam_state, *adam_acc = adam_tx.apply_gradients(
          mask(params, "adam"), mask(grads, "adam"), inner["adam"].inner_state, **options
      )
    else:
      adam_out, adam_state, *adam_acc = adam_tx.scaled_update(
          mask(grads, "adam"), inner["adam"].inner_state, mask(params, "adam"), **options
      )
    muon_params = mask(params, "muon")
    muon_out, muon_state, *muon_acc = chain.update(
        mask(grads, "muon"), inner["muon"].inner_state, muon_params, learning_rate,
        gate_of("muon"), grad_scale,
    )
    if mode == "apply":
      muon_out = optax.apply_updates(muon_params, muon_out)
    out = merged({"adam": adam_out, "muon": muon_out})
    new_state = type(state)(
        {"muon": optax.MaskedState(muon_state), "adam": optax.MaskedState(adam_state)}
    )
    accumulator = merged({"adam": adam_acc[0], "muon": muon_acc[0]}) if isinstance(
        gate, Gate) else None
    return gated_results(gate, out, new_state, accumulator)

  def update_fn(updates, state, params=None, **extra_args):
    if params is not None:
      v.check_same_tree(OWNER, "grads", updates, "params", params)
    else:
      v.check_same_tree(OWNER, "grads", updates, "opt_state mu", moment_arrays(_state_mu(state)))
    return partition.update(updates, state, params, **extra_args)

  return fused_transformation(
      partition.init, step, update=update_fn, stacked_axes=stacked_axes,
      collective_axes=distributed_axes or (), gated=True,
  )


def _state_mu(state) -> Any:
  """The momentum tree of a Muon state: its two partitions' mu trees merged."""
  masked = lambda x: isinstance(x, optax.MaskedNode)
  inner = state.inner_states
  return jax.tree.map(
      lambda m, a: a if masked(m) else m,
      inner["muon"].inner_state[0].mu, inner["adam"].inner_state[0].mu,
      is_leaf=lambda x: masked(x) or is_quantized(x),
  )
