"""Gradient accumulation that lets a kernel decide whether the step applies.

``optax.MultiSteps(tx, k)`` runs ``tx``'s update on every call and then
selects, leaf by leaf, between the new and the old inner state
(``jnp.where(emit, new, old)``), emitting zero updates on the calls that only
accumulate. XLA fuses that select into an f32 update; it cannot fuse it into
a kernel, which overwrites its state in place, so around a pallasopt kernel
XLA copies the old codes before every kernel and selects after it: the int8
AdamW train step moved 1.06x-1.19x the bytes of Optax's f32 one in that form
(`pallasopt.whole_step`). `multi_steps` computes the same step, with the
same `optax.MultiStepsState`, and passes the select into the kernels (their
``gate``): one pass that writes the codes it read on the calls that only
accumulate.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from pallasopt.kernels._update import Gate
from pallasopt.optim._base import fused_transformation, fused_update, scaled_grads

__all__ = ["multi_steps"]


def multi_steps(
    tx: optax.GradientTransformation,
    every_k_schedule: int | Callable[[jax.Array], jax.typing.ArrayLike],
    use_grad_mean: bool = True,
    should_skip_update_fn: Callable[..., tuple[jax.Array, Any]] | None = None,
    accumulator_dtype: jax.typing.DTypeLike = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
  """``optax.MultiSteps(tx, ...)`` as a transform, its select inside ``tx``'s kernels.

  Accumulates the gradients of ``every_k_schedule(gradient_step)`` calls (their
  mean, Welford's update ``acc + (g - acc) / (n + 1)``, or with
  ``use_grad_mean=False`` their sum) and runs ``tx`` on them on the last: on
  the other calls the updates are zero and ``tx``'s state does not change.
  The arguments, the state (`optax.MultiStepsState`) and the results are
  Optax's (``optax.MultiSteps(...).gradient_transformation()``), so the two
  swap in a checkpoint.

  Where ``tx`` is a pallasopt transform whose entry points take a ``gate``
  (AdamW, NAdamW, Lion, RMSProp, MARS, and Muon, whose momentum kernel takes
  it and whose Newton-Schulz runs on every call, as in Optax's:
  `FusedUpdate.gated`), its update runs
  on every call with the gate open only on the last, and each kernel writes
  either the new state or the codes it read, in place; with a float32
  accumulator each kernel also reads the gradient and the accumulator and
  writes the accumulator (XLA would write the accumulated gradient for the
  kernel to read back); its fused
  ``apply_gradients`` (`pallasopt.optim.apply_gradients`) is this
  transform's too, the params written by the kernels. Any other ``tx`` gets
  Optax's ``MultiSteps`` itself.

  ``grad_scale`` of the fused entry points (``apply_gradients(...,
  max_grad_norm=)``'s clip factor) scales each call's gradients before they
  are accumulated, as ``optax.chain(optax.clip_by_global_norm(c),
  multi_steps(tx, k))`` does.

  Args:
    tx: the optimizer to run every k calls.
    every_k_schedule: k, an int, or a function of the gradient step (the
      applied steps so far) giving k.
    use_grad_mean: accumulate the mean of the gradients (else their sum).
    should_skip_update_fn: as Optax's: ``(updates, gradient_step, params) ->
      (skip, skip_state)``; a skipped call leaves everything but
      ``skip_state`` as it was.
    accumulator_dtype: the accumulator's dtype.

  Returns:
    An Optax transform (a `FusedGradientTransformation` when ``tx`` is gated).

  Examples:
    >>> import jax, jax.numpy as jnp, pallasopt
    >>> params = {"w": jnp.ones((64, 256))}
    >>> grads = {"w": jnp.full((64, 256), 0.01)}
    >>> tx = pallasopt.optim.multi_steps(pallasopt.optim.adamw(1e-3, state_format="int8"), 2)
    >>> state = tx.init(params)
    >>> updates, state = tx.update(grads, state, params)  # accumulates: no step
    >>> float(abs(updates["w"]).max())
    0.0
    >>> updates, state = tx.update(grads, state, params)  # steps on the mean
    >>> round(float(abs(updates["w"]).max()), 4)
    0.001
  """
  reference = optax.MultiSteps(
      tx, every_k_schedule, use_grad_mean, should_skip_update_fn, accumulator_dtype)
  entry = fused_update(tx)
  if entry is None or not entry.gated:
    return reference.gradient_transformation()
  every_k = every_k_schedule if callable(every_k_schedule) else lambda _: every_k_schedule
  acc_dtype = jnp.dtype(accumulator_dtype)
  # The kernels compute in float32: a narrower accumulator is Optax's
  # arithmetic in its own dtype, which XLA runs before the gated step.
  in_kernels = acc_dtype == jnp.float32

  def accumulate(g, acc, n):
    return acc + (g - acc) / (n + 1) if use_grad_mean else g + acc

  def step(grads, state, params, mode, grad_scale, learning_rate_now, **options):
    grads = scaled_grads(grads, grad_scale)
    if should_skip_update_fn is None:
      skip, skip_state = jnp.array(False), state.skip_state
    else:
      skip, skip_state = should_skip_update_fn(grads, state.gradient_step, params)
      if (jnp.result_type(skip), jnp.shape(skip)) != (jnp.bool_, ()):
        raise ValueError(
            "multi_steps: should_skip_update_fn must return a boolean scalar array; it "
            f"returned one of dtype {jnp.result_type(skip)} and shape {jnp.shape(skip)}."
        )
    emit = state.mini_step == every_k(state.gradient_step) - 1
    apply = jnp.logical_and(emit, jnp.logical_not(skip))
    kept = lambda new, old: jnp.where(skip, old, new)
    entry_point = entry.apply_gradients if mode == "apply" else entry.scaled_update
    call = lambda inner_grads, gate: entry_point(
        *((params, inner_grads) if mode == "apply" else (inner_grads,)),
        state.inner_opt_state, *(() if mode == "apply" else (params,)),
        learning_rate=learning_rate_now, gate=gate, **options)
    if in_kernels:
      divisor = (state.mini_step + 1).astype(jnp.float32) if use_grad_mean else jnp.float32(0)
      first, inner_state, acc_grads = call(
          grads, Gate(apply, state.acc_grads, divisor, emit, skip, like=None))
    else:
      acc = jax.tree.map(lambda g, a: accumulate(g, a, state.mini_step), grads, state.acc_grads)
      first, inner_state = call(optax.tree.cast_like(acc, grads), apply)
      acc_grads = jax.tree.map(
          lambda a, old: kept(((1 - emit) * a).astype(acc_dtype), old), acc, state.acc_grads)
    # Optax's counters, held where the call is skipped.
    new_state = optax.MultiStepsState(
        mini_step=kept(optax.safe_increment(state.mini_step) % every_k(state.gradient_step),
                       state.mini_step),
        gradient_step=kept(
            emit * optax.safe_increment(state.gradient_step) + (1 - emit) * state.gradient_step,
            state.gradient_step),
        inner_opt_state=inner_state,
        acc_grads=acc_grads,
        skip_state=skip_state,
    )
    return first, new_state

  return fused_transformation(
      reference.init, step, learning_rate=entry.learning_rate,
      elementwise=entry.elementwise and should_skip_update_fn is None,
  )
