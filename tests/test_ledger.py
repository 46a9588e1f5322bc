"""Tests for the communication ledger: byte counts by hand, masks, accumulation, JSON."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mm.core.ledger import (
  Ledger,
  format_bytes,
  leaf_bytes,
  per_client_bytes,
  tree_bytes,
)


def _mixed_tree():
  return {
    "w": jnp.zeros((3, 5), jnp.float32),  # 15 * 4 = 60
    "h": jnp.zeros((7,), jnp.bfloat16),  # 7 * 2 = 14
    "q": jnp.zeros((2, 3, 4), jnp.int8),  # 24 * 1 = 24
    "ids": [jnp.zeros((6,), jnp.int32), None],  # 6 * 4 = 24; None counts nothing
    "count": np.zeros((), np.int32),  # 4
  }


_MIXED_BYTES = 60 + 14 + 24 + 24 + 4


def test_tree_bytes_mixed_dtypes():
  assert tree_bytes(_mixed_tree()) == _MIXED_BYTES
  assert tree_bytes({}) == 0
  assert tree_bytes(None) == 0


def test_tree_bytes_abstract_equals_concrete():
  abstract = jax.eval_shape(_mixed_tree)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
  assert tree_bytes(abstract) == _MIXED_BYTES
  sds = jax.ShapeDtypeStruct((32, 256), jnp.bfloat16)
  assert tree_bytes(sds) == 32 * 256 * 2


def test_leaf_bytes_keys_and_scalars():
  assert leaf_bytes(jax.random.split(jax.random.key(0), 4)) == 4 * 2 * 4  # key<fry>: 2 x uint32.
  assert leaf_bytes(jax.random.PRNGKey(0)) == 8
  assert leaf_bytes(3) == 4 and leaf_bytes(1.5) == 4 and leaf_bytes(True) == 1
  assert leaf_bytes(np.float64(1.0)) == 8
  with pytest.raises(TypeError, match="str"):
    tree_bytes({"name": "x"})


def test_per_client_bytes_with_mask():
  k = 4
  stacked = {
    "w": jnp.zeros((k, 3, 5), jnp.float32),  # 60 per client
    "b": jnp.zeros((k, 5), jnp.bfloat16),  # 10 per client
    "q": jax.ShapeDtypeStruct((k, 8), jnp.int8),  # 8 per client
  }
  np.testing.assert_array_equal(per_client_bytes(stacked), [78] * k)
  mask = jnp.array([1.0, 1.0, 0.0, 1.0])
  counts = per_client_bytes(stacked, client_mask=mask)
  assert counts.dtype == np.int64
  np.testing.assert_array_equal(counts, [78, 78, 0, 78])
  # The total over real clients equals the bytes of their slices.
  real = jax.eval_shape(lambda t: jax.tree.map(lambda x: x[np.array([0, 1, 3])], t), stacked)
  assert counts.sum() == tree_bytes(real)


def test_per_client_bytes_errors():
  with pytest.raises(ValueError, match="client axis"):
    per_client_bytes({"a": jnp.zeros((4, 2)), "b": jnp.zeros((3, 2))})
  with pytest.raises(ValueError, match="scalar"):
    per_client_bytes({"a": jnp.zeros(())})
  with pytest.raises(ValueError, match="client_mask"):
    per_client_bytes({"a": jnp.zeros((4, 2))}, client_mask=jnp.ones(3))
  with pytest.raises(ValueError, match="at least one"):
    per_client_bytes({})


def test_ledger_accumulates_over_rounds_and_groups():
  ledger = Ledger.zeros(5)
  # Round 0: group A = users [0, 1, 2] with a padding client (id 0, mask 0); group B = [3, 4].
  group_a = {"z": jax.ShapeDtypeStruct((4, 8, 16), jnp.float32)}  # 512 bytes per client
  up_a = per_client_bytes(group_a, client_mask=np.array([1, 1, 1, 0]))
  ledger = ledger.add(up=up_a, down=100, user_ids=[0, 1, 2, 0], round=0)
  ledger = ledger.add(up=[7, 9], down=[1, 2], user_ids=np.array([3, 4]), round=0)
  # Round 1: everyone, default user ids, scalar broadcast.
  ledger = ledger.add(up=10, down=20, round=1)
  # Round 2, opened implicitly after round 1.
  ledger = ledger.add(up=np.array([1.0, 0, 0, 0, 2.0]), down=None)

  np.testing.assert_array_equal(ledger.up, [512 + 10 + 1, 522, 522, 17, 21])
  # User 0 appears twice in group A (real + padding): both downlinks of 100 count.
  np.testing.assert_array_equal(ledger.down, [200 + 20, 120, 120, 21, 22])
  assert ledger.up.dtype == np.int64 and ledger.down.dtype == np.int64
  assert ledger.total_up == int(ledger.up.sum())
  assert [r["round"] for r in ledger.rounds] == [0, 1, 2]
  assert ledger.round_summary(0) == {
    "round": 0,
    "up_bytes": [512, 512, 512, 7, 9],
    "down_bytes": [200, 100, 100, 1, 2],
    "total_up": 1552,
    "total_down": 403,
  }
  assert ledger.round_summary()["round"] == 2
  # Per-round records sum to the totals.
  np.testing.assert_array_equal(np.sum([r["up_bytes"] for r in ledger.rounds], 0), ledger.up)
  np.testing.assert_array_equal(np.sum([r["down_bytes"] for r in ledger.rounds], 0), ledger.down)


def test_ledger_is_immutable_and_does_not_overflow():
  ledger = Ledger.zeros(2)
  big = 3 * 2**40  # 3 TiB: far beyond int32.
  new = ledger.add(up=[big, big], down=[0, 1], round=0).add(up=[big, 0], round=1)
  assert ledger.total_up == 0 and ledger.rounds == ()
  assert new.up.tolist() == [2 * big, big]
  assert new.total_up == 3 * big
  with pytest.raises(ValueError):
    new.up[0] = 0  # Arrays are read-only.
  with pytest.raises(AttributeError):
    new.up = np.zeros(2)


def test_ledger_validation():
  ledger = Ledger.zeros(3).add(up=1, round=4)
  with pytest.raises(ValueError, match="append-only"):
    ledger.add(up=1, round=3)
  with pytest.raises(ValueError, match="user_ids"):
    ledger.add(up=[1], user_ids=[3])
  with pytest.raises(ValueError, match="shape"):
    ledger.add(up=[1, 2], user_ids=[0, 1, 2])
  with pytest.raises(ValueError, match="non-negative"):
    ledger.add(up=-1)
  with pytest.raises(KeyError):
    ledger.round_summary(0)
  with pytest.raises(ValueError):
    Ledger.zeros(0)


def test_ledger_json_round_trip():
  ledger = Ledger.zeros(3)
  ledger = ledger.add(up=np.array([4, 5, 6], np.int64), down=np.int32(7), round=0)
  ledger = ledger.add(up=jnp.array([1, 2, 3]), down=[0, 0, 2**40])
  d = ledger.to_dict()
  text = json.dumps(d)  # Plain Python types only.
  restored = Ledger.from_dict(json.loads(text))
  assert restored == ledger
  assert d["total_up"] == 21 and d["total_down"] == 21 + 2**40
  assert json.loads(json.dumps(ledger.round_summary(1)))["up_bytes"] == [1, 2, 3]


def test_format_bytes():
  assert format_bytes(0) == "0 B"
  assert format_bytes(1023) == "1023 B"
  assert format_bytes(1024) == "1.0 KiB"
  assert format_bytes(1536) == "1.5 KiB"
  assert format_bytes(1.5 * 2**20) == "1.5 MiB"
  assert format_bytes(2**20 - 1) == "1.0 MiB"
  assert format_bytes(5 * 2**30) == "5.0 GiB"
  assert format_bytes(-2048) == "-2.0 KiB"
  assert format_bytes(2**70) == "1024.0 EiB"
