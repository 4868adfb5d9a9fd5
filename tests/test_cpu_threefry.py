"""The tests' CPU Threefry (`cpu_threefry`, installed by conftest) draws JAX's bits."""

import functools
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cpu_threefry
from pallasopt.kernels._compat import shard_map

# Random123's known answers for Threefry-2x32 with 20 rounds (kat_vectors):
# (key, counter) -> output.
_KNOWN_ANSWERS = [
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
]


def _uses_the_callback(compiled) -> bool:
  return re.search(r'custom_call_target="[^"]*callback', compiled.as_text()) is not None


@pytest.mark.parametrize("key,count,want", _KNOWN_ANSWERS)
def test_known_answers(key, count, want):
  got = cpu_threefry.threefry2x32(*map(np.uint32, key + count))
  assert tuple(int(x) for x in got) == want


def test_keys_broadcast_against_the_counts():
  counts = np.arange(10, dtype=np.uint32)
  got = cpu_threefry.threefry2x32(np.uint32(7), np.uint32(9), counts, counts[::-1])
  for i in range(10):
    one = cpu_threefry.threefry2x32(np.uint32(7), np.uint32(9), counts[i], counts[9 - i])
    assert (got[0][i], got[1][i]) == one


def test_unpartitioned_programs_draw_jaxs_bits_from_the_callback():
  # A program over 8 devices keeps JAX's own straight-line rule (module doc):
  # the same key gives the same bits either way.
  draw = lambda key: (jax.random.bits(key, (64, 32)), jax.random.normal(key, (8, 5)))
  key = jax.random.key(3)
  single = jax.jit(draw).lower(key).compile()
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  sharded = jax.jit(draw, out_shardings=(NamedSharding(mesh, P("data")),) * 2).lower(key).compile()
  assert _uses_the_callback(single) and not _uses_the_callback(sharded)
  for got, want in zip(single(key), sharded(key)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_shard_map_over_every_axis_draws_per_device():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))

  @jax.jit
  @functools.partial(shard_map, mesh=mesh, in_specs=P(), out_specs=P("data"), check_vma=False)
  def per_device(key):
    return jax.random.bits(jax.random.fold_in(key, jax.lax.axis_index("data")), (1, 4))

  key = jax.random.key(5)
  compiled = per_device.lower(key).compile()
  assert _uses_the_callback(compiled)
  got = np.asarray(compiled(key))
  # One single-device program for every index (JAX caches no program with a
  # host callback across jits, so a jit per device would compile eight).
  one_device = jax.jit(lambda k, i: jax.random.bits(jax.random.fold_in(k, i), (1, 4)))
  for device in range(8):
    np.testing.assert_array_equal(got[device:device + 1], np.asarray(one_device(key, device)))
