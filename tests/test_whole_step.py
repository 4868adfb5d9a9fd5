"""`pallasopt.whole_step`: the decoders train, and every form of the step computes the same step.

The compile tier (tests/test_aot_whole_step.py) compiles these steps for a TPU
and an H100; here they run on the CPU at toy widths.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pallasopt
from bench import whole_step as bench_whole_step
from helpers import assert_trees_close
from pallasopt import whole_step

# One block each: the forms and the optimizer do not depend on the depth, and
# each block is compiled anew (the bench's decoders have two or more).
_TINY = {
    "gpt2": whole_step.Decoder("gpt2", 32, 1, 4, 4, 128, 97, n_ctx=16),
    "llama": whole_step.Decoder("llama", 32, 1, 4, 2, 96, 97),
}


def _init(model, seed=0):
  return whole_step.init_params(model, jax.random.key(seed))


def _tokens(model, seed=1):
  # A sequence the model can learn: each token follows from the last.
  start = jax.random.randint(jax.random.key(seed), (4, 1), 0, model.vocab)
  return (start + 3 * jnp.arange(13)) % model.vocab


def _run(model, tx, form, steps):
  """The params after each of `steps` steps, and each step's loss."""
  step, tx = whole_step.train_step(model, tx, form)
  params = _init(model)
  state = tx.init(params)
  step = jax.jit(step)
  trajectory, losses = [], []
  for _ in range(steps):
    params, state, loss = step(params, state, _tokens(model))
    trajectory.append(params)
    losses.append(float(loss))
  return trajectory, losses


@pytest.mark.parametrize("family", sorted(_TINY))
def test_the_decoders_learn(family):
  _, losses = _run(_TINY[family], optax.adam(1e-2), "update", 30)
  assert losses[0] == pytest.approx(np.log(_TINY[family].vocab), rel=0.05)
  assert losses[-1] < 0.6 * losses[0]


class _Bigram:
  """A `whole_step.Model` written apart from the module: each token's logits looked up from the last."""

  vocab = 97

  def param_shapes(self):
    return {"table": jax.ShapeDtypeStruct((self.vocab, self.vocab), jnp.float32)}

  def loss(self, params, tokens):
    return whole_step.next_token_loss(params["table"][tokens[:, :-1]], tokens)


def test_a_model_written_elsewhere_steps_as_a_decoder_does():
  # What `bench.whole_step` measures Hugging Face's decoders through.
  model = _Bigram()
  assert isinstance(model, whole_step.Model)
  assert not isinstance(_TINY["gpt2"], whole_step.Model)
  _, losses = _run(model, optax.adam(0.1), "update", 20)
  assert losses[0] == pytest.approx(np.log(model.vocab), rel=0.05)
  assert losses[-1] < 0.5 * losses[0]


# Each fused form against the Optax form it stands for, on one decoder each
# (the forms do not depend on the model).
@pytest.mark.parametrize("family,optax_form,fused_form", [
    ("gpt2", "update", "fused"),
    # A limit of 1.0 clips these gradients (their norm is ~3 at the start).
    ("llama", "clip", "clip-fused"),
    ("llama", "clip", "clipped"),
    ("gpt2", "multi-steps-clipped", "multi-steps-clipped-fused"),
])
def test_each_fused_form_computes_its_optax_forms_step(family, optax_form, fused_form):
  model = _TINY[family]
  tx = lambda: pallasopt.optim.adamw(1e-2, weight_decay=0.1)
  want, _ = _run(model, tx(), optax_form, 3)
  got, _ = _run(model, tx(), fused_form, 3)
  assert_trees_close(got[-1], want[-1])


def test_accumulation_steps_once_every_four_calls():
  model = _TINY["llama"]
  trajectory, _ = _run(model, optax.adam(1e-2), "accumulate", 4)
  assert_trees_close(trajectory[2], _init(model))
  assert not np.allclose(trajectory[3]["head"], _init(model)["head"])


def test_unknown_forms_and_families_are_named():
  with pytest.raises(ValueError, match="form must be one of"):
    whole_step.train_step(_TINY["gpt2"], optax.adam(1e-3), "scan")
  with pytest.raises(ValueError, match="family must be 'gpt2' or 'llama'"):
    whole_step.param_shapes(whole_step.Decoder("t5", 32, 1, 4, 4, 64, 10))


def test_peak_bytes_count_donated_buffers_once():
  model = _TINY["gpt2"]
  step, tx = whole_step.train_step(model, optax.adam(1e-3), "update")
  params = whole_step.param_shapes(model)
  args = (params, jax.eval_shape(tx.init, params), jax.ShapeDtypeStruct((4, 13), jnp.int32))
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(args[:2]))
  compiled = {donate: jax.jit(step, donate_argnums=donate).lower(*args).compile()
              for donate in ((), (0, 1))}
  # Donated, the new params and state reuse the old buffers: the peak drops
  # (by less than their bytes on a CPU, whose temporaries XLA may also reuse),
  # counted either way.
  for peak in (whole_step.peak_bytes, whole_step.compiler_peak_bytes):
    assert state_bytes <= peak(compiled[(0, 1)]) < peak(compiled[()]), peak.__name__


def test_the_bench_times_each_case_against_its_baseline():
  rows = bench_whole_step.time_steps(
      "tiny", "adamw", ["fused"], 2, decoder=_TINY["llama"], batch=(2, 12), states=["int8"])
  assert [r["case"] for r in rows] == ["optax.adamw", "auto int8"]
  assert rows[0]["vs_baseline"] == 1.0
  for r in rows:
    assert 0 < r["min_ms"] <= r["median_ms"] and np.isfinite(r["loss"])
    assert r["vs_baseline"] == pytest.approx(r["median_ms"] / rows[0]["median_ms"])


@pytest.mark.parametrize("family", list(bench_whole_step.FAMILIES))
def test_the_bench_builds_every_familys_cases(family):
  # `python -m bench.whole_step --family X` builds these before compiling anything.
  cases = bench_whole_step._transforms(family)
  formats = bench_whole_step.FAMILIES[family][2]
  assert [c for c, _ in cases[1:]] == [f"auto {f or 'f32'}" for f in formats]
  params = {"w": jnp.ones((8, 256)), "b": jnp.ones((256,))}
  grads = jax.tree.map(jnp.ones_like, params)
  for _, tx in cases:
    # Traced, not run: building and tracing the cases is the contract here
    # (the compiled steps are tested above); eagerly, each op compiles alone.
    updates, _ = jax.eval_shape(lambda g, p: tx.update(g, tx.init(p), p), grads, params)
    assert jax.tree.map(jnp.shape, updates) == jax.tree.map(jnp.shape, params)

