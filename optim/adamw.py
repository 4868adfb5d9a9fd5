"""AdamW as a drop-in for `optax.adamw`, backed by the fused AdamW kernel."""

import functools
from typing import Any

import optax

from pallasopt.kernels import adamw as adamw_kernels
from pallasopt.kernels import quant
from pallasopt.optim._base import FusedGradientTransformation
from pallasopt.optim._elementwise_tx import elementwise_transform
from pallasopt.optim._types import MaskOrFn, Numeric, ScalarOrSchedule

__all__ = ["adamw", "nadamw"]

_OWNER = "pallasopt.optim.adamw"


def adamw(
    learning_rate: ScalarOrSchedule,
    b1: Numeric = 0.9,
    b2: Numeric = 0.999,
    eps: Numeric = 1e-8,
    eps_root: Numeric = 0.0,
    mu_dtype: Any | None = None,
    weight_decay: ScalarOrSchedule = 1e-4,
    mask: MaskOrFn = None,
    *,
    nesterov: bool = False,
    state_format: str | None = None,
    param_rounding: str = "nearest",
    seed: int | None = None,
    impl: str = "auto",
) -> FusedGradientTransformation:
  r"""AdamW with decoupled weight decay, one fused kernel per leaf.

  Same arguments, math and state as `optax.adamw` (Loshchilov & Hutter,
  `Decoupled Weight Decay Regularization <https://arxiv.org/abs/1711.05101>`_,
  2019; with ``nesterov=True``, NAdamW after Dozat, 2016). With step
  :math:`t`, gradient :math:`g` and parameter :math:`p`:

  .. math::

    m_t = \beta_1 m_{t-1} + (1-\beta_1) g, \quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2) g^2, \\
    u_t = -\eta_t \left(\frac{m_t / (1-\beta_1^t)}
        {\sqrt{v_t / (1-\beta_2^t) + \epsilon_{root}} + \epsilon}
        + \lambda_t p \right).

  The state is exactly ``optax.adamw(...).init(params)``'s: a tuple of
  ``ScaleByAdamState(count, mu, nu)``, the weight-decay state and the
  learning-rate state. A checkpoint written with one restores into the other.

  ``update`` returns Optax updates (one kernel per leaf writes ``u``, ``m``,
  ``v``). ``apply_gradients`` (or `pallasopt.optim.apply_gradients`) writes
  ``p + u``, ``m`` and ``v`` in place instead, saving the separate
  ``optax.apply_updates`` pass.

  .. _low-bit state:

  Low-bit state (``state_format``) moves fewer bytes per step and keeps less
  memory (Dettmers et al., `8-bit Optimizers via Block-wise Quantization
  <https://arxiv.org/abs/2110.02861>`_, 2022). ``"bf16"``: every moment in
  bfloat16, rounded stochastically on each store (unbiased; round-to-nearest
  stalls small updates). ``"int8"``: the moments of a leaf with at least
  4096 elements as 8-bit codes with one f32 absmax per block of 256
  elements (~2.03 bytes per moment and param), in place of the arrays
  inside Optax's state NamedTuple; smaller leaves keep f32 moments. The
  second moment is stored as its square root on a map without zero
  (`pallasopt.kernels.quant.RootBlockwise`) and the first as its ratio to
  that root (`pallasopt.kernels.quant.Int8RatioBlockwise`, on an 8-bit float),
  both rounded stochastically: a second moment that decodes to zero would
  divide a nonzero first moment by ``eps`` (Li et al., `Memory Efficient
  Optimizers with 4-bit States <https://arxiv.org/abs/2309.01507>`_, 2023),
  and rounding to nearest freezes an average that moves by less than half a
  code per step. ``"fp8"``: the ratio as float8 e4m3 values, the root as
  ``"int8"`` stores it. ``"int4"``: both as 4-bit codes (XLA stores them two
  to a byte; ~0.52 bytes per moment and param), the ratio on a linear map,
  the root on a 2 + 2 bit float map without zero. Each step decodes,
  updates in f32 and re-encodes in one pass. They apply to leaves whose params are float32 or bfloat16 and
  need float32 or bfloat16 grads there. `pallasopt.optim.convert_state`
  converts a state between formats (and a low-bit state saved before
  2026-11-26, which held the second moment itself). The random bits hash
  ``seed``, the step, the leaf's index and the element's index (bf16) or the
  value rounded (blockwise codes): the same in every ``impl``.

  Dtypes: leaves whose params, grads and moments are float32 or bfloat16 run
  the fused kernel (f32 math inside); any other leaf Optax accepts (float16,
  float64, complex, ...) runs Optax's own scaling for that leaf, in its
  dtype, in every ``impl``, so its numbers and state dtypes are Optax's.

  Args:
    learning_rate: a scalar or an ``optax`` schedule of the step count.
    b1: decay of the first moment, in [0, 1).
    b2: decay of the second moment, in [0, 1).
    eps: added to the denominator outside the square root, >= 0.
    eps_root: added inside the square root, >= 0.
    mu_dtype: dtype of the first moment (None: the params' dtype). With a
      ``state_format``, its dtype wherever that format keeps it as an array
      (every leaf for ``"bf16"``, default bfloat16; leaves under 4096
      elements for the blockwise formats, default float32); blockwise first
      moments are computed in f32. Optax's trainers (MaxText) pass it always.
    weight_decay: decoupled weight decay (scalar or schedule); as in
      Optax it is multiplied by the learning rate.
    mask: a tree of bools (or a prefix of the params tree, or a callable
      returning one) selecting the leaves that decay.
    nesterov: use Nesterov momentum (NAdamW).
    state_format: how the moments are stored (`low-bit state`_): ``None``
      (Optax's state), ``"bf16"``, ``"int8"``, ``"fp8"`` or ``"int4"``.
    param_rounding: ``"nearest"`` or ``"stochastic"``: how
      ``apply_gradients`` rounds bfloat16 params. ``update`` returns
      updates, which ``optax.apply_updates`` rounds to nearest, so with
      ``"stochastic"`` it raises for bfloat16 params.
    seed: seed of the stochastic roundings (an int; None means 0, and keeps
      ``optax.inject_hyperparams``' state tree Optax's).
    impl: ``"auto" | "pallas" | "interpret" | "xla"``; see
      `pallasopt.kernels.use_impl`.

  Returns:
    A `FusedGradientTransformation`.

  Raises:
    ValueError: a concrete hyperparameter out of range or NaN; at update time,
      grads, params and state trees that do not match.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, pallasopt
    >>> params = {"w": jnp.ones((64, 256))}
    >>> tx = pallasopt.optim.adamw(1e-3, weight_decay=0.1, state_format="int8")
    >>> opt_state = tx.init(params)  # Optax's state tree, the moments as codes
    >>> type(opt_state[0].nu["w"]).__name__, opt_state[0].nu["w"].codes.dtype
    ('RootBlockwise', dtype('uint8'))
    >>> grads = {"w": jnp.full((64, 256), 0.01)}
    >>> updates, opt_state = tx.update(grads, opt_state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> round(float(params["w"][0, 0]), 6)  # 1 - lr * (1 + weight_decay)
    0.9989
  """
  return elementwise_transform(
      _OWNER, learning_rate, weight_decay, mask, mu_dtype, impl,
      betas={"b1": b1, "b2": b2},
      nonnegative={"eps": eps, "eps_root": eps_root},
      state_cls=optax.ScaleByAdamState,
      scalars=lambda count, lr, wd, grad_scale: adamw_kernels.adamw_scalars(
          count, lr, b1, b2, eps, eps_root, wd, grad_scale=grad_scale
      ),
      apply_kernel=functools.partial(adamw_kernels.adamw_apply, nesterov=nesterov),
      updates_kernel=functools.partial(adamw_kernels.adamw_updates, nesterov=nesterov),
      roles=(quant.RATIO, quant.ROOT),
      state_format=state_format,
      param_rounding=param_rounding,
      seed=seed,
      optax_scaling=optax.scale_by_adam(
          b1, b2, eps, eps_root, mu_dtype=mu_dtype, nesterov=nesterov
      ),
  )


nadamw = functools.partial(adamw, nesterov=True)
nadamw.__doc__ = """NAdamW: `adamw` with ``nesterov=True``, a drop-in for `optax.nadamw`.

Like Optax's, it is ``functools.partial(adamw, nesterov=True)``: the same
arguments, ``nesterov`` defaulting to True (Dozat, `Incorporating Nesterov
Momentum into Adam <https://openreview.net/pdf/OM0jvwB8jIp57ZJjtNEZ.pdf>`_,
2016).
"""
