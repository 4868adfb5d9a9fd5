"""Lion as a drop-in for `optax.lion`, backed by the fused Lion kernel."""

from typing import Any

import optax

from pallasopt.kernels import lion as lion_kernels
from pallasopt.kernels import quant
from pallasopt.optim._base import FusedGradientTransformation
from pallasopt.optim._elementwise_tx import elementwise_transform
from pallasopt.optim._types import MaskOrFn, Numeric, ScalarOrSchedule

__all__ = ["lion"]


def lion(
    learning_rate: ScalarOrSchedule,
    b1: Numeric = 0.9,
    b2: Numeric = 0.99,
    mu_dtype: Any | None = None,
    weight_decay: ScalarOrSchedule = 1e-3,
    mask: MaskOrFn = None,
    *,
    state_format: str | None = None,
    param_rounding: str = "nearest",
    seed: int | None = None,
    impl: str = "auto",
) -> FusedGradientTransformation:
  r"""Lion, one fused kernel per leaf.

  Same arguments, math and state as `optax.lion` (Chen et al., `Symbolic
  Discovery of Optimization Algorithms <https://arxiv.org/abs/2302.06675>`_,
  2023). With gradient :math:`g`, parameter :math:`p`, learning rate
  :math:`\eta_t` and weight decay :math:`\lambda_t`:

  .. math::

    c_t = \beta_1 m_{t-1} + (1-\beta_1) g, \quad
    u_t = -\eta_t \left(\operatorname{sign}(c_t) + \lambda_t p\right), \quad
    m_t = \beta_2 m_{t-1} + (1-\beta_2) g.

  Lion tracks one moment only, and every update coordinate has magnitude
  :math:`\eta_t` before decay; the paper suggests a learning rate 3-10x
  smaller and a weight decay 3-10x larger than AdamW's.

  The state is exactly ``optax.lion(...).init(params)``'s: a tuple of
  ``ScaleByLionState(count, mu)``, the weight-decay state and the
  learning-rate state. A checkpoint written with one restores into the other.

  ``update`` returns Optax updates (one kernel per leaf writes ``u`` and
  ``m``). ``apply_gradients`` (or `pallasopt.optim.apply_gradients`) writes
  ``p + u`` and ``m`` in place instead: 20 bytes per f32 parameter against
  32 for ``update`` followed by ``optax.apply_updates``.

  Low-bit state (``state_format``, ``param_rounding``, ``seed``) works as in
  `pallasopt.optim.adamw`: ``"bf16"`` keeps the momentum in bfloat16 with
  stochastic rounding, ``"int8"`` as 8-bit blockwise codes on the signed map
  (~1.02 bytes per param), ``"fp8"`` as e4m3 values, ``"int4"`` as 4-bit
  codes on a linear map (~0.52 bytes per param), for leaves of at least 4096
  elements.

  Dtypes: leaves whose params, grads and moments are float32 or bfloat16 run
  the fused kernel (f32 math inside); any other leaf Optax accepts (float16,
  float64, complex, ...) runs Optax's own scaling for that leaf, in its
  dtype, in every ``impl``, so its numbers and state dtypes are Optax's.

  Args:
    learning_rate: a scalar or an ``optax`` schedule of the step count.
    b1: interpolation between momentum and gradient for the sign, in [0, 1).
    b2: decay of the momentum, in [0, 1).
    mu_dtype: dtype of the momentum (None: the params' dtype); with a
      ``state_format``, as in `pallasopt.optim.adamw`.
    weight_decay: weight decay (scalar or schedule), scaled by the
      learning rate like Optax's.
    mask: which leaves decay: bools in the params' tree (or a prefix of it),
      or a function of the params that returns them.
    state_format: how the momentum is stored: ``None`` (Optax's state),
      ``"bf16"``, ``"int8"``, ``"fp8"`` or ``"int4"``.
    param_rounding: ``"nearest"`` or ``"stochastic"``: how
      ``apply_gradients`` rounds bfloat16 params. ``update`` returns
      updates, which ``optax.apply_updates`` rounds to nearest, so with
      ``"stochastic"`` it raises for bfloat16 params.
    seed: seed of the stochastic roundings (an int; None means 0, and keeps
      ``optax.inject_hyperparams``' state tree Optax's).
    impl: which kernels run, ``"auto" | "pallas" | "interpret" | "xla"``
      (see `pallasopt.kernels.use_impl`).

  Returns:
    A `FusedGradientTransformation` (an Optax transform with
    ``apply_gradients``).

  Raises:
    ValueError: for a concrete hyperparameter outside its range or NaN, and,
      when stepping, for grads, params or state whose trees or shapes differ.
  """
  return elementwise_transform(
      "pallasopt.optim.lion", learning_rate, weight_decay, mask, mu_dtype, impl,
      betas={"b1": b1, "b2": b2},
      state_cls=optax.ScaleByLionState,
      scalars=lambda count, lr, wd, grad_scale: lion_kernels.lion_scalars(lr, b1, b2, wd, grad_scale),
      apply_kernel=lion_kernels.lion_apply,
      updates_kernel=lion_kernels.lion_updates,
      roles=(quant.SIGNED,),
      state_format=state_format,
      param_rounding=param_rounding,
      seed=seed,
      optax_scaling=optax.scale_by_lion(b1, b2, mu_dtype),
  )
