"""RMSProp as a drop-in for `optax.rmsprop`, backed by the fused RMSProp kernel."""

import functools

import jax.numpy as jnp
import optax

from pallasopt.kernels import rmsprop as rmsprop_kernels
from pallasopt.kernels._dispatch import resolve_impl
from pallasopt.optim import _validation as v
from pallasopt.optim._base import (
    FusedGradientTransformation,
    advance_schedule,
    fused_transformation,
    gated_results,
    held_counters,
    split_accumulator,
    schedule_value,
)
from pallasopt.optim._elementwise_tx import (
    check_low_bit_options,
    check_moment_storage,
    decay_link_leaves,
    fused_leaf_steps,
    moment_arrays,
    stored_moment_trees,
)
from pallasopt.optim._types import Numeric, ScalarOrSchedule

__all__ = ["rmsprop"]

_OWNER = "pallasopt.optim.rmsprop"


def rmsprop(
    learning_rate: ScalarOrSchedule,
    decay: Numeric = 0.9,
    eps: Numeric = 1e-8,
    initial_scale: Numeric = 0.0,
    eps_in_sqrt: bool = True,
    centered: bool = False,
    momentum: Numeric | None = None,
    nesterov: bool = False,
    bias_correction: bool = False,
    *,
    state_format: str | None = None,
    param_rounding: str = "nearest",
    seed: int | None = None,
    impl: str = "auto",
) -> FusedGradientTransformation:
  r"""RMSProp, one fused kernel per leaf.

  Same arguments, math and state as `optax.rmsprop` (Hinton, 2012; the
  centered form after Graves, `Generating Sequences With Recurrent Neural
  Networks <https://arxiv.org/abs/1308.0850>`_, 2013). With decay
  :math:`\rho`, gradient :math:`g` and learning rate :math:`\eta_t`:

  .. math::

    \nu_t = \rho\nu_{t-1} + (1-\rho) g^2, \quad
    u_t = -\eta_t\, g / \sqrt{\nu_t + \epsilon}

  (centered: :math:`\nu_t - \mu_t^2` under the root, :math:`\mu_t` the EMA of
  :math:`g`; ``eps_in_sqrt=False`` adds :math:`\epsilon` outside the root;
  ``bias_correction`` divides the EMAs by :math:`1-\rho^t`). With
  ``momentum`` :math:`\beta` the updates then pass through Optax's
  ``trace``: :math:`\tau_t = u_t + \beta\tau_{t-1}`, the update being
  :math:`\tau_t` (or :math:`u_t + \beta\tau_t` with ``nesterov``).

  The state is exactly ``optax.rmsprop(...).init(params)``'s: the RMS state
  (``ScaleByRmsState``, ``ScaleByRStdDevState`` when centered, their
  ``WithCount`` forms with bias correction), the learning-rate state and the
  ``TraceState`` (or ``EmptyState``). ``apply_gradients`` runs the whole step
  in one kernel per leaf, in place.

  Low-bit state (``state_format``, ``param_rounding``, ``seed``) works as in
  `pallasopt.optim.adamw`: :math:`\nu` as its root on the zero-free map
  (`pallasopt.kernels.quant.RootBlockwise`), :math:`\mu` and the trace as
  themselves on the signed one. Stochastic rounding needs a
  step count: when Optax's state has none (no bias correction) the RMS state
  takes its ``WithCount`` form, which is then not Optax's tree.

  Args:
    learning_rate: a scalar or an ``optax`` schedule of the step count.
    decay: decay of the moving averages, in [0, 1).
    eps: added to the denominator, >= 0.
    initial_scale: initial value of :math:`\nu`.
    eps_in_sqrt: add ``eps`` inside the square root (else outside).
    centered: subtract the squared mean of the gradients.
    momentum: decay of the trace, in [0, 1), or None for no momentum.
    nesterov: Nesterov momentum.
    bias_correction: divide the moving averages by :math:`1-\rho^t`.
    state_format: ``None`` (Optax's state), ``"bf16"``, ``"int8"``, ``"fp8"`` or ``"int4"``.
    param_rounding: ``"nearest"`` or ``"stochastic"``: how
      ``apply_gradients`` rounds bfloat16 params. ``update`` returns
      updates, which ``optax.apply_updates`` rounds to nearest, so with
      ``"stochastic"`` it raises for bfloat16 params.
    seed: seed of the stochastic roundings (an int; None means 0).
    impl: ``"auto" | "pallas" | "interpret" | "xla"``; see
      `pallasopt.kernels.use_impl`.

  Returns:
    A `FusedGradientTransformation`.

  Raises:
    ValueError: a concrete hyperparameter out of range or NaN, an unknown
      ``state_format`` or rounding; at update time, mismatched trees.
  """
  v.check_finite(_OWNER, "learning_rate", learning_rate)
  v.check_hyperparameter(_OWNER, "decay", decay, high=1.0, high_inclusive=False)
  v.check_hyperparameter(_OWNER, "eps", eps)
  if momentum is not None:
    v.check_hyperparameter(_OWNER, "momentum", momentum, high=1.0, high_inclusive=False)
  resolve_impl(impl)
  seed = check_low_bit_options(_OWNER, state_format, param_rounding, seed)
  rounds = state_format == "bf16" or param_rounding == "stochastic"
  counted = bias_correction or rounds
  scale_kwargs = dict(decay=decay, eps=eps, initial_scale=initial_scale, eps_in_sqrt=eps_in_sqrt)
  scale_cls = optax.scale_by_stddev if centered else optax.scale_by_rms
  # Optax's links: their inits give our states, and leaves no kernel takes
  # run them.
  scaling = scale_cls(**scale_kwargs, bias_correction=bias_correction)
  lr_tx = optax.scale_by_learning_rate(learning_rate)
  trace_tx = optax.trace(momentum, nesterov) if momentum is not None else None
  counted_scaling = scale_cls(**scale_kwargs, bias_correction=True)
  # Kernel moment order (mu, nu, trace); how each is stored when blockwise.
  roles = rmsprop_kernels.moment_roles(centered=centered, momentum=trace_tx is not None)
  kernel_config = dict(centered=centered, eps_in_sqrt=eps_in_sqrt, nesterov=nesterov)

  # Where each moment sits in the state.
  fields = (*(["opt_state[0].mu"] if centered else []), "opt_state[0].nu",
            *(["opt_state[2].trace"] if trace_tx else []))

  def moment_trees(state):
    rms, _, trace = state
    return [*([rms.mu] if centered else []), rms.nu, *([trace.trace] if trace_tx else [])]

  def with_moments(state, trees, count):
    rms, lr_state, trace = state
    trees = list(trees)
    fields = {"mu": trees.pop(0)} if centered else {}
    fields["nu"] = trees.pop(0)
    if counted:
      fields["count"] = count
    if trace_tx is not None:
      trace = trace._replace(trace=trees.pop(0))
    return rms._replace(**fields), lr_state, trace

  def init_fn(params):
    rms = (counted_scaling if counted else scaling).init(params)
    state = (rms, lr_tx.init(params), trace_tx.init(params) if trace_tx else optax.EmptyState())
    trees = stored_moment_trees(
        moment_trees(state), params, roles=roles, state_format=state_format)
    return with_moments(state, trees, state[0].count if counted else None)

  def apply_kernel(p, g, *rest, decay, impl, gate=None, **rounding):
    *ms, scalars, key = rest
    return rmsprop_kernels.rmsprop_apply(
        p, g, tuple(ms), scalars, key, gate, decay=decay, impl=impl, **kernel_config,
        **rounding)

  def updates_kernel(p, g, *rest, decay, impl, gate=None, **rounding):
    *ms, scalars, key = rest
    return rmsprop_kernels.rmsprop_updates(
        p, g, tuple(ms), scalars, key, gate, decay=decay, impl=impl, **kernel_config,
        **rounding)

  def step(grads, state, params, mode, grad_scale, learning_rate_now, decay_link=None,
           gate=None):
    rms, lr_state, trace_state = state
    moments = moment_trees(state)
    v.check_same_tree(_OWNER, "grads", grads, "opt_state[0].nu", moment_arrays(rms.nu))
    # RMSProp has no decay of its own; a folded decay link adds -lr * rate * p.
    link_rate, decays = decay_link_leaves(_OWNER, decay_link, grads)
    ps = v.checked_param_leaves(_OWNER, params, grads, mode=mode, decays=decays)
    # convert_state leaves Optax's trace state as it is (it serves SGD's momentum too).
    check_moment_storage(_OWNER, dict(zip(fields, moments, strict=True)), roles, ps, grads,
                         state_format=state_format, any_array=fields[-1:] if trace_tx else ())
    count = optax.safe_increment(rms.count) if counted else jnp.zeros([], jnp.int32)
    if learning_rate_now is None:
      learning_rate_now = schedule_value(learning_rate, lr_state)

    decay_rate = -learning_rate_now * link_rate

    @functools.cache
    def scalars(unused_decay):
      return rmsprop_kernels.rmsprop_scalars(
          learning_rate_now, decay, eps, count=count if bias_correction else None,
          momentum=momentum, grad_scale=1.0 if grad_scale is None else grad_scale,
          decay_rate=decay_rate,
      )

    def optax_fallback(p, g, ms, decay_leaf):
      """One leaf through Optax's links (and the folded decay link), in its own dtypes."""
      ms = list(ms)
      fields = {"mu": [ms.pop(0)]} if centered else {}
      fields["nu"] = [ms.pop(0)]
      leaf_rms = scaling.init([g])._replace(**fields)
      if bias_correction:
        leaf_rms = leaf_rms._replace(count=rms.count)
      (u,), new_rms = scaling.update([g], leaf_rms, [p])
      u = jnp.asarray(-learning_rate_now, jnp.result_type(u)) * u
      new = ([new_rms.mu[0]] if centered else []) + [new_rms.nu[0]]
      if trace_tx is not None:
        (u,), new_trace = trace_tx.update([u], optax.TraceState(trace=[ms.pop(0)]))
        new.append(new_trace.trace[0])
      if decay_leaf:
        u = u + decay_rate * p
      first = optax.apply_updates(p, u) if mode == "apply" else u
      return (first, *new)

    kernel = apply_kernel if mode == "apply" else updates_kernel
    first, *new_moments = fused_leaf_steps(
        _OWNER, grads, ps, moments, decays, mode=mode, kernel=kernel, scalars=scalars,
        optax_fallback=optax_fallback, grad_scale=grad_scale, state_format=state_format,
        param_rounding=param_rounding, seed=seed, count=count, impl=impl, gate=gate,
    )
    new_moments, accumulator = split_accumulator(gate, new_moments)
    new_rms, _, new_trace = with_moments(state, new_moments, count)
    new_state = (new_rms, advance_schedule(lr_state), new_trace)
    return gated_results(gate, first, held_counters(gate, new_state, state), accumulator)

  return fused_transformation(
      init_fn, step, learning_rate=learning_rate, elementwise=True, gated=True)
