"""Global-norm clipping that a pallasopt transform applies inside its kernels.

``optax.chain(optax.clip_by_global_norm(c), tx)`` writes the clipped
gradients and ``tx`` reads them back: a kernel chained after the clip only
ever sees them. Compiled as a whole train step (`pallasopt.whole_step`),
that round trip costs pallasopt's int8 AdamW 4-7% more bytes than Optax's
f32 chain, whose clip XLA fuses into the update. `clipped` is the same step
with the clip factor passed to ``tx``'s kernels, which scale each gradient
as they load it.
"""

import jax
import optax

from pallasopt.kernels._update import Gate, gated_gradient, leaf_gate
from pallasopt.optim import _validation as v
from pallasopt.optim._base import clip_factor, fused_transformation, fused_update, gated_results

__all__ = ["clipped"]


def clipped(tx: optax.GradientTransformation, max_norm: float) -> optax.GradientTransformationExtraArgs:
  """``optax.chain(optax.clip_by_global_norm(max_norm), tx)``, the clip inside ``tx``'s kernels.

  Gradient clipping by the global norm (Pascanu et al., "On the difficulty
  of training recurrent neural networks", 2013): with ``|g|`` the l2 norm
  over every leaf (`optax.tree.norm`), ``tx`` steps on
  ``g * max_norm / |g|`` where ``|g| >= max_norm`` and ``g`` itself below
  (an infinite ``max_norm`` never clips). XLA computes the norm, a
  reduction it fuses into the gradients' producers; where ``tx`` is a
  pallasopt transform, the factor rides into its kernels (``grad_scale`` of
  its entry points), so the clipped gradients are never written, in the
  ``update`` form and in `apply_gradients` alike. Any other ``tx`` (one
  without ``scaled_update``) gets Optax's chain itself.

  The state is the chain's, ``(optax.EmptyState(), tx_state)``, so the two
  swap in a checkpoint; the updates equal the chain's up to the rounding of
  the factor where it clips (``g * (c / |g|)`` here, ``g / |g| * c`` in
  Optax).

  Where ``tx`` is gated (`FusedUpdate.gated`) so is this transform:
  ``multi_steps(clipped(tx, c), k)``, ``optax.MultiSteps(optax.chain(clip,
  tx), k)``, clips the accumulated mean on the k-th call (its norm is an XLA
  reduction over the gradients and accumulators; the kernels form the mean
  and scale it); ``clipped(multi_steps(tx, k), c)``, ``optax.chain(clip,
  optax.MultiSteps(tx, k))``, clips each call's gradients before they are
  accumulated. Both keep the select and the accumulation in the kernels.

  Args:
    tx: the optimizer that steps on the clipped gradients.
    max_norm: the largest global norm let through; > 0.

  Returns:
    An Optax transform (a `FusedGradientTransformation` when ``tx`` is a
    pallasopt transform).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, pallasopt
    >>> params = {"w": jnp.ones((64, 256))}
    >>> tx = pallasopt.optim.clipped(pallasopt.optim.adamw(1e-3), 1.0)
    >>> chain = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    >>> state = tx.init(params)  # the chain's state: they swap in a checkpoint
    >>> jax.tree.structure(state) == jax.tree.structure(chain.init(params))
    True
  """
  v.check_hyperparameter("clipped", "max_norm", max_norm)
  if not max_norm > 0:
    raise ValueError(f"clipped: max_norm must be > 0; got {max_norm!r}.")
  reference = optax.chain(optax.clip_by_global_norm(max_norm), tx)
  entry = fused_update(tx)
  if entry is None or entry.scaled_update is None:
    return reference

  def step(grads, state, params, mode, grad_scale, learning_rate_now, gate=None, **options):
    clip_state, inner_state = state
    # The clip sees the gradients the step runs on: under a `Gate` each leaf's
    # accumulated mean, which the kernels form and then scale.
    seen = grads if not isinstance(gate, Gate) else jax.tree.map(
        lambda g, acc: gated_gradient(g, leaf_gate(gate, acc, g)), grads, gate.acc)
    scale = clip_factor(seen, max_norm, grad_scale)
    options = dict(grad_scale=scale, learning_rate=learning_rate_now, **options)
    if gate is not None:
      options["gate"] = gate
    if mode == "apply":
      first, inner_state, *acc = entry.apply_gradients(params, grads, inner_state, **options)
    else:
      first, inner_state, *acc = entry.scaled_update(grads, inner_state, params, **options)
    return gated_results(gate, first, (clip_state, inner_state), *(acc or [None]))

  return fused_transformation(
      reference.init, step, learning_rate=entry.learning_rate,
      stacked_axes=entry.stacked_axes, collective_axes=entry.collective_axes,
      layer_indexed=entry.layer_indexed, gated=entry.gated,
  )
