"""AdamW: single leaves at several sizes and realistic trees (`bench.workloads`).

Three implementations per case (`harness.optimizer_case`): jitted
``optax.adamw`` + ``optax.apply_updates``; ``pallasopt.optim.adamw``'s Optax
path (``update`` + ``apply_updates``); its fused in-place ``apply_gradients``.

Bytes model (`bench.elementwise`, two state leaves m and v): the fused apply
reads g, m, v, p and writes p, m, v, 28 B/param in f32 (the apply kernel's
``pl.CostEstimate``); ``update`` + ``apply_updates`` move 40 B/param in f32
with decay.
"""

from __future__ import annotations

import optax

from bench import elementwise
from pallasopt.optim.adamw import adamw

FAMILY = "adamw"
HYPERPARAMS = dict(learning_rate=3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
SPEC = elementwise.ElementwiseFamily(FAMILY, 2, optax.adamw, adamw, HYPERPARAMS)

decay_mask = elementwise.decay_mask
fused_bytes = SPEC.fused_bytes
update_kernel_bytes = SPEC.update_kernel_bytes
update_bytes = SPEC.update_bytes
case = SPEC.case
cases = SPEC.cases
