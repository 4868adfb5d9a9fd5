"""RMSProp: single leaves at several sizes and realistic trees (`bench.workloads`).

Three implementations per case (`harness.optimizer_case`): jitted
``optax.rmsprop`` + ``optax.apply_updates``; ``pallasopt.optim.rmsprop``'s
Optax path (``update`` + ``apply_updates``); its fused in-place
``apply_gradients``.

Bytes model (`bench.elementwise`, one state leaf nu, no weight decay): the
fused apply reads g, nu, p and writes p, nu, 20 B/param in f32 (the apply
kernel's ``pl.CostEstimate``); ``update`` + ``apply_updates`` move 28 B/param.
"""

from __future__ import annotations

import optax

from bench import elementwise
from pallasopt.optim.rmsprop import rmsprop

FAMILY = "rmsprop"
HYPERPARAMS = dict(learning_rate=1e-3, decay=0.9, eps=1e-8)
SPEC = elementwise.ElementwiseFamily(
    FAMILY, 1, optax.rmsprop, rmsprop, HYPERPARAMS, options=(), low_bit=False
)

case = SPEC.case
cases = SPEC.cases
