"""MARS: single leaves at several sizes and realistic trees (`bench.workloads`).

Optax has no MARS; the baseline rows (``eformer-xla``) run eFormer's math as
an Optax chain in XLA: ``optax.chain(pallasopt.optim.scale_by_mars(...),
optax.scale_by_learning_rate(lr))``, the specification the fused kernel is
tested against. Then ``pallasopt.optim.mars``'s Optax path and its fused
in-place ``apply_gradients``.

Bytes model (`bench.elementwise`, three state leaves mu, nu, mog): the fused
apply reads g, mu, nu, mog, p and writes p, mu, nu, mog, 36 B/param in f32.
The cases run without the global-norm clip (``max_grad_norm=0``): eFormer's
default 1.0 adds one XLA pass over g and mog (8 B/param) before the kernels,
and on a tree mixing f32 and bf16 leaves eFormer's state then turns bf16
moments into f32 after a step, which a compiled step cannot carry.
"""

from __future__ import annotations

import optax

from bench import elementwise
from pallasopt.optim.mars import mars, scale_by_mars

FAMILY = "mars"
# eFormer's MarsConfig defaults, without the clip (see above).
HYPERPARAMS = dict(learning_rate=3e-4, b1=0.95, b2=0.99, gamma=0.025, eps=1e-8, max_grad_norm=0.0)


def _reference(learning_rate, **kwargs):
  return optax.chain(scale_by_mars(**kwargs), optax.scale_by_learning_rate(learning_rate))


SPEC = elementwise.ElementwiseFamily(
    # No mu_dtype cases: eFormer's state stores the gradients as ``mog``, so
    # its dtypes change after a step when mu_dtype differs from theirs.
    FAMILY, 3, _reference, mars, HYPERPARAMS, options=(), baseline="eformer-xla", low_bit=False,
)

case = SPEC.case
cases = SPEC.cases
