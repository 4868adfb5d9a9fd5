"""Records eFormer's factory trajectories into eformer_factory.json (not run in CI).

Run in a scratch environment with the eformer 0.0.101 wheel unpacked (its
package imports ray and cloud SDKs; only ``eformer.optimizers`` is needed, so
the top-level package is bypassed)::

  pip install chex && pip download eformer==0.0.101 --no-deps && unzip eformer-*.whl -d /tmp/ef
  python tests/data/record_eformer_factory.py /tmp/ef [optimizer ...]

For each optimizer and gradient_accumulation_steps in (1, 2) it builds
``OptimizerFactory.create(name, cosine warmup schedule, config,
weight_decay=0.1, weight_decay_mask=MASK, clip_grad=1.0, ...)`` and records
the params and every opt_state leaf (by key path) after 5 applied steps of
the gradients `tests/test_factory.py` uses.
"""

import contextlib
import json
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.modules.setdefault("contextlib2", contextlib)  # eformer.pytree imports it
jax.tree_map = getattr(jax, "tree_map", jax.tree.map)  # eformer 0.0.101 still calls it
warnings.filterwarnings("ignore")
package = types.ModuleType("eformer")
package.__path__ = [f"{sys.argv[1]}/eformer"]
sys.modules["eformer"] = package
import eformer.optimizers as efo  # noqa: E402
from eformer.optimizers._tx import white_kron as _white_kron  # noqa: E402

# eFormer's White-Kron update writes its new state into the state dict it was
# given. Under optax.MultiSteps (gradient_accumulation_steps > 1) that dict is
# also the "unchanged" state MultiSteps keeps on the calls that do not apply,
# so its preconditioners, momentum and count advance on every call. The
# recording gives the update a copy of the state (rebuilt containers, same
# arrays), which records eFormer's math with accumulation as MultiSteps means
# it; pallasopt's quad/skew match that (README: Coming from eFormer).
_def_scale = _white_kron._def_scale


def _copying_def_scale(*args, **kwargs):
  tx = _def_scale(*args, **kwargs)
  return tx._replace(update=lambda u, state, params=None: tx.update(u, jax.tree.map(lambda x: x, state), params))


_white_kron._def_scale = _copying_def_scale

# Run name -> (optimizer, config). White-Kron runs use blocks of 4 (so the
# 6x10 and 8x24 leaves span several padded blocks) and max_size_dense=16 (so
# the 8x24 leaf takes the row-blocked, diagonal-right route): f32, and
# eFormer's default bf16.
WHITE_KRON = dict(block_size=4, max_size_dense=16)
CONFIGS = {
    "adamw": ("adamw", {}), "lion": ("lion", {}),
    "adafactor": ("adafactor", dict(weight_decay_rate=0.01, min_dim_size_to_factor=6)),
    "rmsprop": ("rmsprop", dict(momentum=0.9)), "muon": ("muon", dict(weight_decay=0.02)),
    "mars": ("mars", {}),
    "quad": ("quad", dict(WHITE_KRON, dtype="float32")),
    "skew": ("skew", dict(WHITE_KRON, dtype="float32")),
    "quad_bf16": ("quad", WHITE_KRON), "skew_bf16": ("skew", WHITE_KRON),
}
SCHEDULER = dict(scheduler_type="cosine", learning_rate=1e-2, learning_rate_end=1e-3,
                 warmup_steps=2, steps=10)
MASK = {"b": False, "k": True, "w": True}


def initial_params():
  rng = np.random.default_rng(0)
  return {"b": np.ones(8, np.float32), "k": (rng.standard_normal((6, 10)) * 0.3).astype(np.float32),
          "w": (rng.standard_normal((8, 24)) * 0.1).astype(np.float32)}


def grads(params, i):
  return jax.tree.map(lambda x: jnp.cos(x * (i + 1)) * 0.5, params)


def compact(x):
  a = np.asarray(x)
  if a.dtype.kind == "f":
    return np.vectorize(lambda v: float(format(v, ".9g")))(a).tolist() if a.shape else float(format(float(a), ".9g"))
  return a.tolist()


def main():
  runs = sys.argv[2:] or list(CONFIGS)
  params = initial_params()
  out = {"eformer": "0.0.101", "params": {k: compact(v) for k, v in params.items()}, "mask": MASK,
         "scheduler": SCHEDULER, "weight_decay": 0.1, "clip_grad": 1.0, "steps": 5, "runs": {}}
  for run in runs:
    name, fields = CONFIGS[run]
    for k in (1, 2):
      config = efo.OptimizerFactory._get_config_class(name)(**fields)
      tx, _ = efo.OptimizerFactory.create(
          name, efo.SchedulerConfig(**SCHEDULER), config, weight_decay=0.1, weight_decay_mask=MASK,
          clip_grad=1.0, gradient_accumulation_steps=k)
      p = jax.tree.map(jnp.asarray, params)
      state = tx.init(p)
      for i in range(5 * k):
        updates, state = tx.update(grads(p, i), state, p)
        p = optax.apply_updates(p, updates)
      leaves = jax.tree_util.tree_flatten_with_path(state)[0]
      out["runs"][f"{run}/k{k}"] = {
          "optimizer": name,
          "config": fields,
          "params": {key: compact(value) for key, value in p.items()},
          "state": {jax.tree_util.keystr(path): compact(x) for path, x in leaves},
          "state_dtypes": {jax.tree_util.keystr(path): str(np.asarray(x).dtype) for path, x in leaves},
      }
  with open("tests/data/eformer_factory.json", "w") as f:
    json.dump(out, f, separators=(",", ":"))


if __name__ == "__main__":
  main()
