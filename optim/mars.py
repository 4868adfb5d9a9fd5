"""MARS as eFormer builds it (``eformer.optimizers._tx.mars``), backed by a fused kernel.

`scale_by_mars` is the transform in Optax style (each leaf in its own dtypes,
no kernel): the specification. `mars` chains it with the learning rate as
eFormer's ``mars`` does and runs every float32/bfloat16 leaf as one fused
kernel (`pallasopt.kernels.mars`), with the same state tree.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pallasopt.kernels import mars as mars_kernels
from pallasopt.kernels._dispatch import resolve_impl
from pallasopt.optim import _validation as v
from pallasopt.optim._base import (
    FusedGradientTransformation,
    advance_schedule,
    fused_transformation,
    gated_results,
    held_counters,
    split_accumulator,
    scaled_grads,
    schedule_value,
)
from pallasopt.optim._elementwise_tx import (
    check_low_bit_options,
    check_moment_storage,
    decay_link_leaves,
    fused_leaf_steps,
    is_quantized,
    moment_arrays,
    moment_value,
    stored_moment_trees,
)
from pallasopt.optim._types import ScalarOrSchedule

__all__ = ["ScaleByMarsState", "scale_by_mars", "mars"]

_OWNER = "pallasopt.optim.mars"


class ScaleByMarsState(NamedTuple):
  """MARS's state, field for field eFormer's.

  Attributes:
    count: steps taken (int32), for the bias corrections.
    mu: first moment of the variance-reduced gradient (``mu_dtype``).
    nu: second moment.
    mog: the previous step's gradient.
  """

  count: jax.Array
  mu: optax.Updates
  nu: optax.Updates
  mog: optax.Updates


def _check(b1, b2, gamma, eps, eps_root, max_grad_norm) -> None:
  for name, value in (("b1", b1), ("b2", b2)):
    v.check_hyperparameter(_OWNER, name, value, high=1.0, high_inclusive=False)
  for name, value in (("gamma", gamma), ("eps", eps), ("eps_root", eps_root)):
    v.check_hyperparameter(_OWNER, name, value)
  if max_grad_norm is not None:
    v.check_hyperparameter(_OWNER, "max_grad_norm", max_grad_norm)


def _variance_reduced(g, mog, gamma, b1):
  """:math:`c = g + \\gamma\\beta_1/(1-\\beta_1) (g - g_{t-1})`, in the inputs' dtypes."""
  return g + mars_kernels.correction_coefficient(gamma, b1) * (g - mog)


def _clip_scale(cs: list[jax.Array], max_grad_norm) -> jax.Array | None:
  """The global-norm clip factor of the variance-reduced gradients, or None."""
  if not max_grad_norm:
    return None
  return jnp.minimum(1.0, max_grad_norm / (optax.tree.norm(cs) + 1e-6))


def scale_by_mars(
    b1: float = 0.9,
    b2: float = 0.999,
    gamma: float = 0.05,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    max_grad_norm: float | None = 0.0,
    mu_dtype: Any | None = None,
) -> optax.GradientTransformation:
  r"""Rescales updates by MARS (Yuan et al., 2024, arXiv 2411.10438), Optax style.

  The math of `pallasopt.kernels.mars` without the learning rate, each leaf
  in its own dtypes: :math:`c` is the variance-reduced gradient (clipped by
  its global norm when ``max_grad_norm`` is truthy), Adam's bias-corrected
  moments of it give :math:`\hat\mu / (\sqrt{\hat\nu + \epsilon_{root}} +
  \epsilon)`, and the state keeps the incoming gradient as ``mog``. ``mu``
  and ``mog`` start in ``mu_dtype`` (default: the params'), ``nu`` in the
  params' dtype.
  """
  _check(b1, b2, gamma, eps, eps_root, max_grad_norm)
  mu_dtype = v.optional_dtype(_OWNER, "mu_dtype", mu_dtype)

  def init_fn(params):
    zeros = lambda dtype: jax.tree.map(lambda p: jnp.zeros_like(p, dtype or p.dtype), params)
    return ScaleByMarsState(jnp.zeros([], jnp.int32), zeros(mu_dtype), zeros(None), zeros(mu_dtype))

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates)
    cs = [_variance_reduced(g, m, gamma, b1)
          for g, m in zip(leaves, jax.tree.leaves(state.mog), strict=True)]
    scale = _clip_scale(cs, max_grad_norm)
    if scale is not None:
      cs = [c * scale for c in cs]
    count = optax.safe_increment(state.count)
    out, mus, nus = [], [], []
    for c, mu, nu in zip(cs, jax.tree.leaves(state.mu), jax.tree.leaves(state.nu), strict=True):
      mu = (1 - b1) * c + b1 * mu
      nu = (1 - b2) * (c * c) + b2 * nu
      mu_hat = mu / (1 - b1**count).astype(mu.dtype)
      nu_hat = nu / (1 - b2**count).astype(nu.dtype)
      out.append(mu_hat / (jnp.sqrt(nu_hat + eps_root) + eps))
      mus.append(mu.astype(mu_dtype) if mu_dtype is not None else mu)
      nus.append(nu)
    new = ScaleByMarsState(count, *(treedef.unflatten(x) for x in (mus, nus, leaves)))
    return treedef.unflatten(out), new

  return optax.GradientTransformation(init_fn, update_fn)


def mars(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    gamma: float = 0.05,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    max_grad_norm: float | None = 0.0,
    mu_dtype: Any | None = None,
    *,
    state_format: str | None = None,
    param_rounding: str = "nearest",
    seed: int | None = None,
    impl: str = "auto",
) -> FusedGradientTransformation:
  r"""MARS, one fused kernel per leaf: eFormer's ``mars`` (`scale_by_mars`, then the lr).

  The state is ``(ScaleByMarsState(count, mu, nu, mog), <lr state>)``, as
  ``optax.chain(scale_by_mars(...), optax.scale_by_learning_rate(lr))``
  builds it, and keeps its dtypes from step to step (params and state are
  updated in place): ``mog`` stays in ``mu_dtype`` where eFormer's (and
  `scale_by_mars`) store the gradients in their own dtype, which differs
  only when ``mu_dtype`` differs from the gradients'. With ``max_grad_norm`` truthy, one XLA pass over the grads and
  previous grads first computes the global norm of the variance-reduced
  gradient; the kernels then scale by it.

  Args:
    learning_rate: a scalar or an ``optax`` schedule of the step count.
    b1, b2: decays of the moments, in [0, 1).
    gamma: strength of the variance reduction, >= 0.
    eps, eps_root: added to the denominator outside and inside the root.
    max_grad_norm: global-norm clip of the variance-reduced gradient (0 or
      None: off).
    mu_dtype: dtype of ``mu`` and ``mog`` (None: the params'); with a
      ``state_format``, as in `pallasopt.optim.adamw`.
    state_format: ``None``, ``"bf16"``, ``"int8"``, ``"fp8"`` or ``"int4"`` (as in
      `pallasopt.optim.adamw`; ``mog`` on the signed map).
    param_rounding: ``"nearest"`` or ``"stochastic"``: how
      ``apply_gradients`` rounds bfloat16 params. ``update`` returns
      updates, which ``optax.apply_updates`` rounds to nearest, so with
      ``"stochastic"`` it raises for bfloat16 params.
    seed: seed of the stochastic roundings (None: 0).
    impl: ``"auto" | "pallas" | "interpret" | "xla"``.

  Returns:
    A `FusedGradientTransformation`.
  """
  _check(b1, b2, gamma, eps, eps_root, max_grad_norm)
  v.check_finite(_OWNER, "learning_rate", learning_rate)
  resolve_impl(impl)
  mu_dtype = v.optional_dtype(_OWNER, "mu_dtype", mu_dtype)
  seed = check_low_bit_options(_OWNER, state_format, param_rounding, seed)
  scaling = scale_by_mars(b1, b2, gamma, eps, eps_root, max_grad_norm, mu_dtype)
  lr_tx = optax.scale_by_learning_rate(learning_rate)

  def init_fn(params):
    state = scaling.init(params)
    stored = stored_moment_trees(
        (state.mu, state.nu, state.mog), params, roles=mars_kernels.ROLES,
        state_format=state_format, kept_dtypes=(mu_dtype, None, mu_dtype),
    )
    return ScaleByMarsState(state.count, *stored), lr_tx.init(params)

  def kernel_for(mode):
    run = mars_kernels.mars_apply if mode == "apply" else mars_kernels.mars_updates

    def kernel(p, g, mu, nu, mog, scalars, key, *, decay, impl, gate=None, **rounding):
      return run(p, g, mu, nu, mog, scalars, key, gate, decay=decay, impl=impl, **rounding)

    return kernel

  def step(grads, state, params, mode, grad_scale, learning_rate_now, decay_link=None,
           gate=None):
    mars_state, lr_state = state
    v.check_same_tree(_OWNER, "grads", grads, "opt_state[0].mu", moment_arrays(mars_state.mu))
    # MARS has no decay of its own; a folded decay link adds -lr * rate * p.
    link_rate, decays = decay_link_leaves(_OWNER, decay_link, grads)
    ps = v.checked_param_leaves(_OWNER, params, grads, mode=mode, decays=decays)
    moments = (mars_state.mu, mars_state.nu, mars_state.mog)
    check_moment_storage(
        _OWNER, {f"opt_state[0].{f}": m for f, m in zip(("mu", "nu", "mog"), moments)},
        mars_kernels.ROLES, ps, grads, state_format=state_format, mu_dtype=mu_dtype,
        mu_dtype_fields=("opt_state[0].mu", "opt_state[0].mog"))
    count = optax.safe_increment(mars_state.count)
    if learning_rate_now is None:
      learning_rate_now = schedule_value(learning_rate, lr_state)
    decay_rate = -learning_rate_now * link_rate
    gs = jax.tree.leaves(scaled_grads(grads, grad_scale))
    previous = [moment_value(m)
                for m in jax.tree.leaves(mars_state.mog, is_leaf=is_quantized)]
    clip = _clip_scale(
        [_variance_reduced(g, m, gamma, b1) for g, m in zip(gs, previous, strict=True)],
        max_grad_norm,
    )

    @functools.cache
    def scalars(unused_decay):
      return mars_kernels.mars_scalars(
          count, learning_rate_now, b1, b2, gamma, eps, eps_root,
          clip_scale=1.0 if clip is None else clip,
          grad_scale=1.0 if grad_scale is None else grad_scale, decay_rate=decay_rate,
      )

    def optax_fallback(p, g, ms, decay):
      """One leaf through `scale_by_mars`, the lr (and the folded decay link), in its dtypes."""
      mu, nu, mog = ms
      c = _variance_reduced(g, mog, gamma, b1)
      if clip is not None:
        c = c * clip
      # scale_by_mars on a one-leaf tree whose own clip is already applied.
      leaf = scale_by_mars(b1, b2, 0.0, eps, eps_root, None, mu_dtype)
      (u,), new = leaf.update([c], ScaleByMarsState(mars_state.count, [mu], [nu], [mog]))
      u = jnp.asarray(-learning_rate_now, jnp.result_type(u)) * u
      if decay:
        u = u + decay_rate * p
      first = optax.apply_updates(p, u) if mode == "apply" else u
      return (first, new.mu[0], new.nu[0], g)

    first, *new_moments = fused_leaf_steps(
        _OWNER, grads, ps, moments, decays, mode=mode, kernel=kernel_for(mode),
        scalars=scalars, optax_fallback=optax_fallback, grad_scale=grad_scale,
        state_format=state_format, param_rounding=param_rounding, seed=seed, count=count,
        impl=impl, gate=gate,
    )
    (mu, nu, mog), accumulator = split_accumulator(gate, new_moments)
    new_state = (ScaleByMarsState(count, mu, nu, mog), advance_schedule(lr_state))
    return gated_results(gate, first, held_counters(gate, new_state, state), accumulator)

  return fused_transformation(init_fn, step, learning_rate=learning_rate, gated=True)
