"""Client faults in the engine (core.faults): off == today's round, renormalised dropout,
exact straggler steps, Byzantine representations against Mean and GCA, seeded masks."""

import functools
import math

import engine_toys
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import rounding

from fedjax_mm import core
from fedjax_mm.algorithms.fedavg import fedavg as fedavg_alg
from fedjax_mm.core import client as client_lib
from fedjax_mm.core import faults as faults_lib
from fedjax_mm.server import gca

SIZES = [6, 9, 4, 7]


def _toy(seed=0):
  group, state = engine_toys.make_group(len(SIZES), seed=seed, same_init=True)
  arrays, mask = engine_toys.client_arrays(seed, SIZES)
  data = core.make_client_data(arrays, mask, user_ids=np.arange(len(SIZES)))
  return group, state, data


def _round(faults, seed=0):
  group, state, data = _toy(seed)
  alg = fedavg_alg([group], faults=faults)
  fed = alg.init([state], jax.random.key(7))
  new, stats = jax.jit(lambda s: alg.round(s, [data]))(fed)
  return group, state, data, new, stats


def _fault_key(round_index=0, group_index=0):
  """The key fedavg derives for group ``g``'s faults of round ``r`` (from key(7))."""
  key = jax.random.fold_in(jax.random.key(7), round_index)
  return jax.random.fold_in(jax.random.fold_in(key, faults_lib.SALT), group_index)


def _equal(a, b):
  """Bit for bit (a state passed through, or one program run twice)."""

  def raw(x):
    return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x

  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  return all(np.array_equal(raw(x), raw(y)) for x, y in pairs)


def test_faults_off_and_faults_that_draw_nobody_equal_todays_round():
  _, _, _, today, _ = _round(faults_lib.NONE)
  # Switched on, but round(0.01 * 4) = 0 clients drop: the fault path with nothing drawn
  # (another program, so equal up to float32 rounding: rounding.py).
  _, _, _, idle, stats = _round(faults_lib.Faults(dropout=0.01, stragglers=0.01))
  rounding.assert_close(today.groups, idle.groups)
  counts = stats["tiny"]["fault_counts"]
  assert {k: int(v) for k, v in counts.items()} == {"dropped": 0, "stragglers": 0, "byzantine": 0}


def test_dropout_renormalises_over_the_surviving_clients():
  faults = faults_lib.Faults(dropout=0.5)
  group, state, data, new, stats = _round(faults)
  masks = faults_lib.draw(_fault_key(), data.client_mask, faults)
  dropped = np.asarray(masks.dropped)
  assert dropped.sum() == 2 and np.array_equal(dropped, np.asarray(stats["tiny"]["faults"].dropped))
  # Every client's local training, by hand (fresh optimizer state as fedavg resets it).
  state = state.replace(opt_state=jax.vmap(group.tx.init)(state.params))
  trained, _ = jax.jit(lambda s: core.train_group(group, s, data))(state)
  n = np.asarray(SIZES, float) * ~dropped
  for got, local in zip(
    jax.tree.leaves(new.groups[0].params), jax.tree.leaves(trained.params), strict=True
  ):
    expect = np.tensordot(n / n.sum(), np.asarray(local, np.float64), axes=1)
    for k in range(len(SIZES)):  # Every client holds the survivors' weighted mean.
      np.testing.assert_allclose(np.asarray(got)[k], expect, rtol=1e-5, atol=1e-6)


def test_when_every_client_drops_the_global_model_is_unchanged():
  _, state, _, new, stats = _round(faults_lib.Faults(dropout=1.0))
  assert int(stats["tiny"]["fault_counts"]["dropped"]) == len(SIZES)
  assert _equal(new.groups[0].params, state.params)
  assert int(new.round) == 1


def _reference_steps(group, params, rng, arrays, mask, num_steps):
  """A Python loop that takes the first ``num_steps`` real steps of local_update's schedule."""
  tx, b, epochs = group.tx, group.batch_size, group.local_epochs
  objective = core.supervised_objective(group, {})
  opt_state = tx.init(params)
  n = mask.shape[0]
  per_epoch = max(1, math.ceil(n / b))
  num_valid = int(mask.sum())
  _, key = jax.random.split(rng)
  order_key, step_key = jax.random.split(key)
  orders = client_lib._epoch_orders(order_key, jnp.asarray(mask), epochs, per_epoch * b)
  positions = np.arange(per_epoch * b).reshape(per_epoch, b)
  taken = 0
  for e in range(epochs):
    for s in range(math.ceil(num_valid / b)):
      if taken == num_steps:
        return params, taken
      idx = orders[e].reshape(per_epoch, b)[s]
      batch = {name: jnp.asarray(x)[idx] for name, x in arrays.items()}
      step_rng = jax.random.fold_in(jax.random.fold_in(step_key, e), s)
      loss = functools.partial(objective, batch=batch, batch_mask=positions[s] < num_valid)
      grads = jax.grad(lambda p, f=loss, k=step_rng: f(p, key=k)[0])(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      taken += 1
  return params, taken


def test_stragglers_take_exactly_the_drawn_number_of_steps():
  group, state, data = _toy()
  faults = faults_lib.Faults(stragglers=1.0)
  masks = faults_lib.draw(jax.random.key(3), data.client_mask, faults)
  budget = faults_lib.step_budget(
    masks.work, data.num_samples, num_epochs=group.local_epochs, batch_size=group.batch_size
  )
  full = faults_lib.step_budget(
    jnp.ones(len(SIZES)), data.num_samples, num_epochs=group.local_epochs, batch_size=4
  )
  assert np.asarray(masks.straggler).all() and (np.asarray(budget) < np.asarray(full)).all()
  trained, stats = jax.jit(lambda s: core.train_group(group, s, data, max_steps=budget))(state)
  np.testing.assert_array_equal(stats["steps"], budget)
  for k in range(len(SIZES)):
    params_k = jax.tree.map(lambda x, k=k: x[k], state.params)
    arrays_k = jax.tree.map(lambda x, k=k: np.asarray(x)[k], data.arrays)
    expect, taken = _reference_steps(
      group, params_k, state.rng[k], arrays_k, np.asarray(data.sample_mask)[k], int(budget[k])
    )
    assert taken == int(budget[k])
    got = jax.tree.map(lambda x, k=k: x[k], trained.params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expect), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_byzantine_random_representations_move_the_mean_far_and_gca_little():
  rng = np.random.default_rng(0)
  num_public, dim, honest, bad = 64, 16, 6, 2
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  global_other = jnp.asarray(unit(rng.normal(size=(num_public, dim))), jnp.float32)
  # Honest clients represent each public pair close to its partner of the other modality.
  local = unit(
    np.asarray(global_other)[None] + 0.3 * rng.normal(size=(honest + bad, num_public, dim))
  )
  local = jnp.asarray(local, jnp.float32)
  byzantine = jnp.arange(honest + bad) >= honest
  faults = faults_lib.Faults(byzantine_count=bad)
  corrupted = faults_lib.corrupt_representations(jax.random.key(0), local, byzantine, faults)
  everyone = jnp.ones(honest + bad, bool)

  def shift(aggregate):
    clean = aggregate(local, ~byzantine)
    attacked = aggregate(corrupted, everyone)
    return float(jnp.linalg.norm(attacked - clean, axis=-1).mean())

  mean_shift = shift(lambda x, p: gca.client_weighted(x, p.astype(jnp.float32))[0])
  gca_shift = {
    t: shift(lambda x, p, t=t: gca.gca(x, jnp.asarray(global_other), p, temperature=t)[0])
    for t in (1.0, 0.5, 0.2)
  }
  # Mean: the 2 of 8 random matrices pull every anchor by about a quarter of a unit vector.
  # GCA scores each local representation against the global ones, so random ones weigh
  # less: already at eq. (4)'s temperature 1, and sharply so at lower temperatures.
  assert mean_shift > 0.2, mean_shift
  assert gca_shift[1.0] < 0.7 * mean_shift, (mean_shift, gca_shift)
  assert gca_shift[0.2] < 0.1 * mean_shift, (mean_shift, gca_shift)
  assert gca_shift[0.2] < gca_shift[0.5] < gca_shift[1.0], gca_shift


def test_masks_derive_from_the_key_and_corruption_vmapped_equals_a_loop():
  active = jnp.asarray([True, True, False, True, True, True, True, True, True, False])
  faults = faults_lib.Faults(dropout=0.25, stragglers=0.5, byzantine=0.25)
  a = faults_lib.draw(jax.random.key(5), active, faults)
  b = jax.jit(lambda k: faults_lib.draw(k, active, faults))(jax.random.key(5))
  assert _equal(a, b)
  c = faults_lib.draw(jax.random.key(6), active, faults)
  assert not _equal(a, c)
  # Exact counts among the 8 participants; nothing outside them; faults among survivors.
  assert {k: int(v) for k, v in a.counts().items()} == {
    "dropped": 2,
    "stragglers": 4,
    "byzantine": 2,
  }
  for m in (a.dropped, a.straggler, a.byzantine):
    assert not np.asarray(m & ~active).any()
  assert not np.asarray(a.dropped & (a.straggler | a.byzantine)).any()
  # A fixed number of Byzantine clients instead of the fraction.
  fixed = faults_lib.draw(jax.random.key(5), active, faults_lib.Faults(byzantine_count=3))
  assert int(fixed.counts()["byzantine"]) == 3

  key = jax.random.key(9)
  for mode in faults_lib.MODES:
    f = faults_lib.Faults(byzantine=0.25, byzantine_mode=mode, byzantine_scale=-10.0)
    update = {"w": jnp.arange(10 * 3.0).reshape(10, 3), "b": jnp.ones((10, 2, 2))}
    z = jnp.asarray(np.random.default_rng(1).normal(size=(10, 5, 4)), jnp.float32)
    batched = faults_lib.corrupt_update(key, update, a.byzantine, f)
    reps = faults_lib.corrupt_representations(key, z, a.byzantine, f)
    for k in range(10):
      kk = jax.random.fold_in(key, k)
      one = faults_lib.corrupt_client_update(
        kk, jax.tree.map(lambda x, k=k: x[k], update), a.byzantine[k], f
      )
      assert _equal(one, jax.tree.map(lambda x, k=k: x[k], batched))
      rep = faults_lib.corrupt_client_representations(kk, z[k], a.byzantine[k], f)
      np.testing.assert_array_equal(rep, reps[k])
    honest = ~np.asarray(a.byzantine)
    np.testing.assert_array_equal(np.asarray(reps)[honest], np.asarray(z)[honest])
    if mode == "random":
      norms = np.linalg.norm(np.asarray(reps)[~honest], axis=-1)
      np.testing.assert_allclose(norms, 1.0, rtol=1e-5)
    else:
      np.testing.assert_allclose(np.asarray(reps)[~honest], -10.0 * np.asarray(z)[~honest])


def test_byzantine_update_reaches_fedavg_and_scaled_mode_is_exact():
  faults = faults_lib.Faults(byzantine_count=1, byzantine_mode="scaled", byzantine_scale=-10.0)
  group, state, data, new, stats = _round(faults)
  byz = np.asarray(stats["tiny"]["faults"].byzantine)
  assert byz.sum() == 1
  state = state.replace(opt_state=jax.vmap(group.tx.init)(state.params))
  trained, _ = jax.jit(lambda s: core.train_group(group, s, data))(state)
  n = np.asarray(SIZES, float)
  factor = np.where(byz, -10.0, 1.0)
  for got, local, start in zip(
    jax.tree.leaves(new.groups[0].params),
    jax.tree.leaves(trained.params),
    jax.tree.leaves(state.params),
    strict=True,
  ):
    start, local = np.asarray(start, np.float64), np.asarray(local, np.float64)
    sent = start + factor.reshape((-1,) + (1,) * (local.ndim - 1)) * (local - start)
    np.testing.assert_allclose(np.asarray(got)[0], np.tensordot(n / n.sum(), sent, 1), atol=1e-5)


@pytest.mark.parametrize(
  "bad", [{"dropout": 1.5}, {"byzantine_mode": "flip"}, {"byzantine_count": -1}]
)
def test_faults_validate(bad):
  with pytest.raises(ValueError, match="faults"):
    faults_lib.Faults(**bad).validate()
  assert not faults_lib.NONE.enabled and faults_lib.Faults(byzantine_count=1).enabled


def _muscle_round(faults, num_partners):
  import test_fedmuscle  # The FedMuscle toy: three heterogeneous users, one per group.

  from fedjax_mm.algorithms import fedmuscle

  groups, states, datas, public = test_fedmuscle._setup()
  config = fedmuscle.MuscleConfig(num_partners=num_partners, batch_size=8)  # One CL batch.
  alg = fedmuscle.fedmuscle(groups, config, faults=faults)
  state = alg.init(states, jax.random.key(3))
  return state, *jax.jit(alg.round)(state, datas, public)


def test_fedmuscle_dropped_user_takes_no_part_and_byzantine_z_reach_the_partners():
  start, new, stats = _muscle_round(faults_lib.Faults(dropout=0.34), num_partners=1)
  users = jnp.ones(3, bool)
  masks = faults_lib.draw(
    jax.random.fold_in(jax.random.fold_in(jax.random.key(3), 0), faults_lib.SALT),
    users,
    faults_lib.Faults(dropout=0.34),
  )
  (gone,) = np.flatnonzero(np.asarray(masks.dropped))
  assert int(stats["fault_counts"]["dropped"]) == 1
  # No task step, no CL update: parameters and both optimizer states exactly as they were
  # (its key advances, as every client's does each round).
  assert _equal(new.groups[gone].params, start.groups[gone].params)
  assert _equal(new.groups[gone].opt_state, start.groups[gone].opt_state)
  assert _equal(new.cl_opt_state[gone], start.cl_opt_state[gone])
  assert float(stats["cl_loss"][gone]) == 0.0
  assert all(float(stats["cl_loss"][u]) > 0 for u in range(3) if u != gone)

  # What the partners' losses see is the Z that crossed the wire: scaled by 1 it is the
  # honest Z (the same losses as without faults); random unit vectors change them.
  _, _, honest = _muscle_round(faults_lib.NONE, num_partners=2)
  same = faults_lib.Faults(byzantine_count=1, byzantine_mode="scaled", byzantine_scale=1.0)
  _, _, scaled = _muscle_round(same, num_partners=2)
  _, _, noisy = _muscle_round(faults_lib.Faults(byzantine_count=1), num_partners=2)
  np.testing.assert_allclose(scaled["cl_loss"], honest["cl_loss"], rtol=1e-6)
  assert int(noisy["fault_counts"]["byzantine"]) == 1
  assert not np.allclose(noisy["cl_loss"], honest["cl_loss"], rtol=1e-3)
