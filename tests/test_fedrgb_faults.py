"""Client faults in FedRGB's rounds (core.faults): a straggler's budget, dropout that
renormalises the aggregation but not the DRO weights, Byzantine updates and the DRO report
that takes the most weight the ball allows."""

import dataclasses

import fedrgb_toys
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_mm import server
from fedjax_mm.algorithms import fedrgb as rgb
from fedjax_mm.core import faults as faults_lib


def _with(alg, faults):
  return dataclasses.replace(alg, faults=faults)


def _masks(alg, state, mask):
  """The masks the round draws (its fault key: fold_in(fold_in(rng, round), SALT))."""
  key = jax.random.fold_in(jax.random.fold_in(state.rng, state.round), faults_lib.SALT)
  return faults_lib.draw(key, jnp.any(mask, axis=1), alg.faults)


def _stage1_keys(state, k):
  key = jax.random.fold_in(state.rng, state.round)
  return jax.random.split(jax.random.split(key, 3)[1], k)


def _leaves_close(a, b, **tol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


def _embeddings_close(alg, arrays, got, want, atol):
  """The models' embeddings of client 0's pairs agree (parameters the output is blind to,
  e.g. attention key biases, get zero gradients that Adam turns into noise-sized steps
  of either sign in any other program: test_fedrgb.py's vmapped == looped test)."""
  embed = jax.jit(alg.embed)
  images, captions = arrays["images"][0], arrays["captions"][0]
  for a, b in zip(embed(*got, images, captions), embed(*want, images, captions), strict=True):
    np.testing.assert_allclose(a, b, atol=atol)


@pytest.fixture(scope="module")
def fedavg():
  alg, state, arrays, mask, _ = fedrgb_toys.tiny(method="fedavg")
  new, metrics = jax.jit(alg.round)(state, arrays, mask)
  return alg, state, arrays, mask, new, metrics


def test_faults_that_draw_nobody_leave_the_round_as_it_was(fedavg):
  alg, state, arrays, mask, today, today_metrics = fedavg
  # round(0.1 * 3) = 0 of each fault: the fault machinery runs but draws nobody.
  idle = _with(alg, faults_lib.Faults(dropout=0.1, stragglers=0.1, byzantine=0.1))
  new, metrics = jax.jit(idle.round)(state, arrays, mask)
  assert {k: int(v) for k, v in metrics["fault_counts"].items()} == {
    "dropped": 0,
    "stragglers": 0,
    "byzantine": 0,
  }
  # Two programs' float32 rounding: a fresh-clone run on a loaded 2-core machine differed by
  # 1.29e-6 in one of 64 entries (about 10 ulps of a value of 0.12); a fault that acted
  # would move them by orders more.
  _embeddings_close(alg, arrays, (new.encoder, new.aligner), (today.encoder, today.aligner), 1e-5)
  np.testing.assert_allclose(metrics["weights"], today_metrics["weights"], rtol=1e-6)
  # The budgeted mean (sum over the steps taken / their count) may round differently.
  np.testing.assert_allclose(metrics["stage1_loss"], today_metrics["stage1_loss"], rtol=1e-6)


def test_dropout_stragglers_and_a_scaled_byzantine_reach_the_average_exactly(fedavg):
  alg, state, arrays, mask, *_ = fedavg
  k = mask.shape[0]
  faulty = _with(
    alg,
    faults_lib.Faults(
      dropout=0.34,
      stragglers=0.5,
      byzantine_count=1,
      byzantine_mode="scaled",
      byzantine_scale=-10.0,
    ),
  )
  new, metrics = jax.jit(faulty.round)(state, arrays, mask)
  masks = _masks(faulty, state, mask)
  dropped, byz = np.asarray(masks.dropped), np.asarray(masks.byzantine)
  assert dropped.sum() == 1 and byz.sum() == 1 and np.asarray(masks.straggler).sum() == 2
  # Every surviving client straggles: its budget of stage 1's steps is floor(u * 2).
  budget = np.floor(np.asarray(masks.work) * alg.config.stage1_steps).astype(np.int32)
  assert set(budget[~dropped].tolist()) <= {0, 1}

  # Reference: each client's stage 1 alone, on its budget, from the same keys.
  keys = _stage1_keys(state, k)
  one = jax.jit(
    lambda kk, a, m, b: alg.stage1_client(
      state.encoder, state.aligner, state.teacher, kk, a, m, max_steps=b
    )
  )
  client = lambda c: jax.tree.map(lambda x: x[c], arrays)  # noqa: E731
  trained = [one(keys[c], client(c), mask[c], jnp.int32(budget[c]))[1] for c in range(k)]
  for c in range(k):
    if budget[c] == 0:  # a straggler that took no step sends back what it received
      _leaves_close(trained[c], state.aligner, rtol=0, atol=0)
  scale = faulty.faults.byzantine_scale
  sent = [
    jax.tree.map(lambda g, t: g + scale * (t - g), state.aligner, trained[c])
    if byz[c]
    else trained[c]
    for c in range(k)
  ]
  w = np.where(dropped, 0.0, np.asarray(rgb.data_size_weights(mask)))
  w = w / w.sum()
  np.testing.assert_allclose(metrics["weights"], w, rtol=1e-6)
  want = jax.tree.map(lambda *xs: sum(wc * x for wc, x in zip(w, xs, strict=True)), *sent)
  _embeddings_close(alg, arrays, (new.encoder, new.aligner), (state.encoder, want), 1e-4)
  assert {k_: int(v) for k_, v in metrics["fault_counts"].items()} == {
    "dropped": 1,
    "stragglers": 2,
    "byzantine": 1,
  }


def test_when_every_client_drops_the_global_model_stays(fedavg):
  alg, state, arrays, mask, *_ = fedavg
  gone = _with(alg, faults_lib.Faults(dropout=1.0))
  new, metrics = jax.jit(gone.round)(state, arrays, mask)
  _leaves_close(
    (new.encoder, new.aligner, new.teacher),
    (state.encoder, state.aligner, state.teacher),
    rtol=0,
    atol=0,
  )
  assert int(new.round) == 1 and int(metrics["fault_counts"]["dropped"]) == 3
  np.testing.assert_array_equal(metrics["weights"], np.zeros(3))


def test_fedrgb_dropout_keeps_the_dro_step_and_a_byzantine_report_takes_the_top_weight():
  alg, state, arrays, mask, _ = fedrgb_toys.tiny()
  faulty = _with(alg, faults_lib.Faults(dropout=0.34, byzantine_count=1))
  new, metrics = jax.jit(faulty.round)(state, arrays, mask)
  masks = _masks(faulty, state, mask)
  dropped, byz = np.asarray(masks.dropped), np.asarray(masks.byzantine)
  v = np.asarray(metrics["dro_loss_start"])  # what arrived
  honest = v[~byz]
  np.testing.assert_allclose(
    v[byz], honest.max() + rgb.DRO_SATURATION / alg.config.gamma, rtol=1e-6
  )
  # The DRO weights are eq. (5) of every report, the dropped client's included (it
  # reported before it dropped), and stay in the state; the aggregation renormalises them
  # over the clients whose teachers arrived.
  dro = server.dro_update(state.weights, v, gamma=alg.config.gamma, rho=alg.config.rho)
  np.testing.assert_allclose(new.weights, dro, atol=1e-6)
  assert new.weights[byz][0] == pytest.approx(new.weights.max())
  received = np.where(dropped, 0.0, np.asarray(dro))
  np.testing.assert_allclose(metrics["weights"], received / received.sum(), atol=1e-6)
  assert metrics["weights"][dropped][0] == 0.0
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(new.teacher))


@pytest.mark.parametrize("seed", range(4))
def test_the_byzantine_dro_report_takes_the_most_weight_any_report_could(seed):
  rng = np.random.default_rng(seed)
  k, gamma, rho = 5, float(rng.uniform(0.2, 3.0)), float(rng.uniform(0.05, 2.0))
  w = server.dro_update(jnp.full(k, 1 / k), jnp.asarray(rng.uniform(0, 3, k)), gamma=gamma, rho=rho)
  v = jnp.asarray(rng.uniform(0, 5, k), jnp.float32)
  byz = jnp.asarray(np.arange(k) == seed % k)
  b = int(np.argmax(np.asarray(byz)))
  lie = rgb.byzantine_dro_reports(v, byz, gamma)
  np.testing.assert_array_equal(np.asarray(lie)[~np.asarray(byz)], np.asarray(v)[~np.asarray(byz)])
  update = jax.jit(lambda v: server.dro_update(w, v, gamma=gamma, rho=rho)[b])
  top = float(update(lie))
  others = np.asarray(jax.vmap(lambda x: update(v.at[b].set(x)))(jnp.linspace(-5.0, 60.0, 131)))
  assert np.all(others <= top + 1e-6), (others.max(), top)
  assert top >= float(update(v))
  # gamma = 0: the weights do not read the reports, which stay honest.
  np.testing.assert_array_equal(rgb.byzantine_dro_reports(v, byz, 0.0), v)


def test_a_stragglers_budget_stops_its_steps_and_keeps_every_draw():
  """FedRGB._train(max_steps=b) == the first b steps of the full run (same batch draws)."""
  alg, *_ = fedrgb_toys.tiny(method="fedavg")
  rng = np.random.default_rng(0)
  arrays = {"x": jnp.asarray(rng.normal(size=(10, 3)), jnp.float32)}
  arrays["y"] = arrays["x"] @ jnp.asarray([1.0, -2.0, 0.5])
  mask = jnp.asarray(np.arange(10) < 8)
  params = {"w": jnp.zeros(3)}

  def loss_fn(p, batch):
    return jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2)

  key, steps = jax.random.key(4), 5
  # Reference: the loop of AdamW steps over the same per-step keys, stopped after b.
  tx = alg.tx
  keys = jax.random.split(key, steps)
  probs = mask / jnp.sum(mask)
  p, opt, losses = params, tx.init(params), []
  path = [p]
  for i in range(steps):
    idx = jax.random.choice(keys[i], 10, (alg.config.batch_size,), p=probs)
    batch = {name: x[idx] for name, x in arrays.items()}
    loss, grads = jax.value_and_grad(loss_fn)(p, batch)
    updates, opt = tx.update(grads, opt, p)
    p = optax.apply_updates(p, updates)
    path.append(p)
    losses.append(float(loss))
  train = jax.jit(lambda b: alg._train(loss_fn, params, key, arrays, mask, steps, max_steps=b))
  for b in range(steps + 1):
    got, mean_loss = train(jnp.int32(b))
    np.testing.assert_allclose(got["w"], path[b]["w"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(mean_loss, np.mean(losses[:b]) if b else 0.0, rtol=1e-5)
