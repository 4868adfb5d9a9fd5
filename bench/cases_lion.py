"""Lion: single leaves at several sizes and realistic trees (`bench.workloads`).

Three implementations per case (`harness.optimizer_case`): jitted
``optax.lion`` + ``optax.apply_updates``; ``pallasopt.optim.lion``'s Optax
path (``update`` + ``apply_updates``); its fused in-place ``apply_gradients``.

Bytes model (`bench.elementwise`, one state leaf m): the fused apply reads
g, m, p and writes p, m, 20 B/param in f32 (the apply kernel's
``pl.CostEstimate``); ``update`` + ``apply_updates`` move 32 B/param in f32
with decay. Hyperparameters follow the paper's advice against AdamW's:
a learning rate 3-10x smaller and a weight decay 3-10x larger.
"""

from __future__ import annotations

import optax

from bench import elementwise
from pallasopt.optim.lion import lion

FAMILY = "lion"
HYPERPARAMS = dict(learning_rate=3e-5, b1=0.9, b2=0.99, weight_decay=1.0)
SPEC = elementwise.ElementwiseFamily(FAMILY, 1, optax.lion, lion, HYPERPARAMS)

fused_bytes = SPEC.fused_bytes
update_bytes = SPEC.update_bytes
case = SPEC.case
cases = SPEC.cases
