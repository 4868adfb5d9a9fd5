"""A tiny residual-MLP stack and its sequential reference, for the pipeline tests."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

HIDDEN = 8


def layer(params, x):
  """One residual layer: ``x + tanh(x W + b)``."""
  return x + jnp.tanh(x @ params["w"] + params["b"])


def make_layers(num_layers, hidden=HIDDEN, seed=0):
  rng = np.random.default_rng(seed)
  return {
      "w": jnp.asarray(rng.standard_normal((num_layers, hidden, hidden)) * 0.4, jnp.float32),
      "b": jnp.asarray(rng.standard_normal((num_layers, hidden)) * 0.1, jnp.float32),
  }


def make_batch(num_microbatches, microbatch=4, hidden=HIDDEN, seed=1):
  rng = np.random.default_rng(seed)
  shape = (num_microbatches, microbatch, hidden)
  return (jnp.asarray(rng.standard_normal(shape), jnp.float32),
          jnp.asarray(rng.standard_normal(shape), jnp.float32))


def sequential(layer_fn, layers, inputs):
  """Every microbatch through the ``[L, ...]`` layers in order, unpipelined."""
  def one(x):
    return jax.lax.scan(lambda h, p: (layer_fn(p, h), None), x, layers)[0]
  return jax.vmap(one)(inputs)


def mse(outputs, targets):
  return jnp.mean(jnp.square(outputs - targets))


def reference_step(tx, inputs, targets):
  """One jitted step of the unpipelined model under the Optax path of `tx`.

  ``step(layers, state) -> (layers, state, loss, global gradient norm)``.
  """

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(
        lambda p: mse(sequential(layer, p, inputs), targets))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss, optax.tree.norm(grads)

  return step


def placed(step, layers, inputs, targets):
  """``(params, opt_state, (inputs, targets))`` of `layers` placed as a pipeline train step wants."""
  from pallasopt.pipeline.layout import layers_to_stages

  params = step.shard_params(layers_to_stages(layers, step.schedule))
  return params, step.init(params), step.shard_batch(inputs, targets)
