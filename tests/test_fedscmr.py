"""FedSCMR: aggregation weights by hand and FedCMR's rule against a loop, the rounds (common
subspace or whole model averaged, FedCMR's 80/20 round, validation mAP, Byzantine reports),
the per-client evaluation against scikit-learn / brute force, the data split, the jitted init."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import rounding
from sklearn import metrics as skm

from experiments import fedscmr as fedscmr_config
from fedjax_mm import core, data, metrics, server
from fedjax_mm.algorithms import fedscmr as alg_lib
from fedjax_mm.core import faults as faults_lib
from fedjax_mm.core import features as features_lib
from fedjax_mm.data.cross_modal import PairedFeatures, class_subset_split, shared_test_split
from fedjax_mm.models.scmr import ScmrModel
from fedjax_mm.runner import fedscmr as runner
from fedjax_mm.runner.errors import ConfigError
from fedjax_mm.server import fedscmr as weights

# ----------------------------------------------------------------------------
# Aggregation weights (eqs. 10-13) and FedCMR's, against values computed by hand.

N = np.array([100, 300, 0, 200])  # client 2 is padding
C = np.array([5, 3, 0, 2])
L = np.array([1.0, 2.0, 9.0, 3.0])
V = np.array([0.5, 0.25, 0.9, 0.25])
WHERE = np.array([True, True, False, True])


def test_data_share_eq10():
  # n shares 1/6, 3/6, 2/6; c shares 5/10, 3/10, 2/10.
  expected = [1 / 6 * 5 / 10, 3 / 6 * 3 / 10, 0.0, 2 / 6 * 2 / 10]
  np.testing.assert_allclose(weights.data_share(N, C, where=WHERE), expected, rtol=1e-6)


def test_loss_term_eq11():
  mean = (1 + 2 + 3) / 3
  expected = [math.exp(-1 / mean), math.exp(-2 / mean), 0.0, math.exp(-3 / mean)]
  np.testing.assert_allclose(weights.loss_term(L, where=WHERE), expected, rtol=1e-6)


def test_map_share_eq12():
  np.testing.assert_allclose(weights.map_share(V, where=WHERE), [0.5, 0.25, 0, 0.25], rtol=1e-6)


@pytest.mark.parametrize("gamma", [0.0, 30.0])
def test_fedscmr_weights_eq13(gamma):
  omega = [1 / 12, 3 / 20, 1 / 15]
  psi = [math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)]
  phi = [0.5, 0.25, 0.25]
  scores = [math.exp(o + p + gamma * f) for o, p, f in zip(omega, psi, phi, strict=True)]
  expected = [s / sum(scores) for s in scores]
  expected.insert(2, 0.0)
  got = weights.fedscmr_weights(N, C, L, V, gamma=gamma, where=WHERE)
  np.testing.assert_allclose(got, expected, rtol=1e-5)
  assert float(got.sum()) == pytest.approx(1.0)


def _fedcmr_loop(n, c, summed_losses, where):
  """FedCMR's rule as its authors' code runs it (utils.parameterCooperation), in plain Python."""
  ks = [k for k in range(len(n)) if where[k]]
  weights = {k: n[k] * c[k] / sum(c[j] for j in ks) for k in ks}  # main.py
  total = sum(weights.values())
  mean = sum(summed_losses[k] for k in ks) / len(ks)
  factor = {
    k: weights[k] / total + 100.0 * math.exp(-math.exp(summed_losses[k] / mean)) for k in ks
  }
  z = sum(math.exp(f) for f in factor.values())
  return [math.exp(factor[k]) / z if where[k] else 0.0 for k in range(len(n))]


@pytest.mark.parametrize("seed", range(4))
def test_fedcmr_weights_equal_a_loop_over_clients(seed):
  rng = np.random.default_rng(seed)
  n = rng.integers(1, 500, 5)
  c = rng.integers(1, 10, 5)
  losses = rng.uniform(5.0, 50.0, 5)  # summed over the round's steps
  where = rng.random(5) < 0.8
  where[0] = True
  got = weights.fedcmr_weights(n, c, losses, where=where)
  np.testing.assert_allclose(got, _fedcmr_loop(n, c, losses, where), rtol=1e-5, atol=1e-7)
  assert float(got.sum()) == pytest.approx(1.0, rel=1e-6)
  # The masked clients' values enter nothing.
  other = weights.fedcmr_weights(n, c, np.where(where, losses, 1e6), where=where)
  np.testing.assert_array_equal(got, other)


def test_fedcmr_weights_leave_out_the_masked_client():
  np.testing.assert_allclose(
    weights.fedcmr_weights(N, C, L, where=WHERE), _fedcmr_loop(N, C, L, WHERE), rtol=1e-5
  )
  assert server.fedcmr_weights is weights.fedcmr_weights  # exported by fedjax_mm.server


def test_fedcmr_correction():
  aggregated = {"w": jnp.full((3, 2), 1.0)}
  trained = {"w": jnp.array([[3.0, 3.0], [1.0, 1.0], [0.0, 0.0]])}
  start = {"w": jnp.array([[1.0, 1.0], [1.0, 1.0], [2.0, 2.0]])}
  where = np.array([True, True, False])
  got = weights.fedcmr_correction(aggregated, trained, start, scale=0.5, where=where)
  # W - 0.5 (W_k - W_k_start): 1 - 1, 1 - 0; client 2 received nothing.
  np.testing.assert_allclose(got["w"], [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])


def test_num_categories():
  labels = jnp.array([3, 3, 1, 7, 7, 0])
  mask = jnp.array([True, True, True, False, True, False])
  assert int(weights.num_categories(labels, mask, 10)) == 3  # 3, 1, 7 (0 is masked)


# ----------------------------------------------------------------------------
# A tiny group of three clients.


def _clients(rng, sizes, d_img, d_txt, num_classes):
  clients = [
    {
      "image": rng.normal(size=(s, d_img)).astype(np.float32),
      "text": rng.normal(size=(s, d_txt)).astype(np.float32),
      "label": rng.integers(0, num_classes - i, s).astype(np.int32),
    }
    for i, s in enumerate(sizes)
  ]
  stacked, mask = data.stack_clients(clients)
  return core.make_client_data(stacked, mask, user_ids=np.arange(len(sizes)))


@functools.cache
def _setup(seed=0, k=3, n=12, d_img=6, d_txt=5, num_classes=4):
  """A group of three clients, their training data and their validation data."""
  rng = np.random.default_rng(seed)
  client_data = _clients(rng, [n, n - 3, n - 6][:k], d_img, d_txt, num_classes)
  val_data = _clients(rng, [8, 7, 6][:k], d_img, d_txt, num_classes)
  make = lambda rngs: ScmrModel(d_img, d_txt, num_classes, hidden=8, dim=4, rngs=rngs)
  group, state = core.client.init_identical_group(
    make,
    tx=optax.adam(1e-2),
    task=core.Task("classification", "image", "label", num_classes),
    key=jax.random.key(seed),
    num_clients=k,
    local_epochs=2,
    batch_size=4,
  )
  return group, state, client_data, val_data, num_classes


def test_init_identical_group_equals_core_init_group():
  group, state, _, _, num_classes = _setup()
  make = lambda rngs: ScmrModel(6, 5, num_classes, hidden=8, dim=4, rngs=rngs)
  init = lambda key: core.init_group(
    make, name="x", tx=group.tx, task=group.task, key=key, num_clients=3, same_init=True
  )[1]
  reference = jax.jit(init)(jax.random.key(0))  # jitted: eager init compiles op by op
  assert jax.tree.structure(state) == jax.tree.structure(reference)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(reference), strict=True):
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    np.testing.assert_array_equal(a, b)


def _path_names(path):
  return {str(getattr(p, "key", p)) for p in path}


#: name -> ScmrConfig fields of the rounds run once from the same state and key.
SYSTEMS = {
  "fedscmr": dict(loss="fedscmr", aggregation="fedscmr"),
  "none": dict(loss="fedscmr", aggregation="none"),
  "dscmr": dict(loss="dscmr", aggregation="none"),
  "fedavg": dict(loss="dscmr", aggregation="fedavg", federated="all"),
  "fedavg_common": dict(loss="dscmr", aggregation="fedavg"),
}


@pytest.fixture(scope="module")
def rounds():
  """One round of each system of SYSTEMS, from the same state and key."""
  group, state, client_data, val_data, num_classes = _setup()
  out = {"data": client_data, "val": val_data, "state": state, "group": group}
  for name, fields in SYSTEMS.items():
    config = alg_lib.ScmrConfig(num_classes=num_classes, map_n=5, **fields)
    alg = alg_lib.fedscmr(group, config)
    round_fn = jax.jit(alg.round)
    new, stats = round_fn(alg.init(state, jax.random.key(1)), client_data, val_data)
    out[name] = (new.groups[0].params, stats, alg, round_fn)
  return out


def _check_averaged(new, local, lam, federated):
  """``federated`` leaves hold sum_k lambda_k W_k of the locally trained W_k; the rest is local."""
  checked = set()
  flat_new = jax.tree_util.tree_leaves_with_path(new)
  flat_local = jax.tree_util.tree_leaves_with_path(local)
  for (path, a), (_, b) in zip(flat_new, flat_local, strict=True):
    a, b = np.asarray(a), np.asarray(b)
    if federated(path):
      mean = np.tensordot(lam, b, axes=1)
      np.testing.assert_allclose(a, np.broadcast_to(mean, a.shape), rtol=1e-5, atol=1e-6)
      for k in range(1, a.shape[0]):
        np.testing.assert_array_equal(a[k], a[0])  # every client holds the same values
      checked.add("federated")
    else:
      rounding.assert_close(a, b)  # personal layers: local training (rounding.py)
      checked.add("personal")
  return checked


def test_round_averages_the_common_subspace_only(rounds):
  new, stats, _, _ = rounds["fedscmr"]
  local, _, _, _ = rounds["none"]
  lam = np.asarray(stats["weight"])
  assert lam.sum() == pytest.approx(1.0, rel=1e-5) and (lam > 0).all()
  common = lambda path: "common" in _path_names(path)
  assert _check_averaged(new, local, lam, common) == {"federated", "personal"}
  for path, b in jax.tree_util.tree_leaves_with_path(local):
    if common(path):
      assert not np.allclose(b[0], b[1])  # local training had made them differ


def test_whole_model_fedavg_leaves_every_client_identical(rounds):
  new, stats, _, _ = rounds["fedavg"]
  local, _, _, _ = rounds["dscmr"]
  counts = np.asarray(rounds["data"].num_samples, np.float64)
  lam = np.asarray(stats["weight"])
  np.testing.assert_allclose(lam, counts / counts.sum(), rtol=1e-6)
  assert _check_averaged(new, local, lam, lambda path: True) == {"federated"}
  # Whole-model FedAvg covers the BaseNets, the common layer and the classifier.
  names = set().union(*(_path_names(p) for p, _ in jax.tree_util.tree_leaves_with_path(new)))
  assert {"image_base", "text_base", "common", "classifier"} <= names


def test_common_fedavg_averages_only_the_common_layer(rounds):
  new, stats, _, _ = rounds["fedavg_common"]
  local, _, _, _ = rounds["dscmr"]
  lam = np.asarray(stats["weight"])
  common = lambda path: "common" in _path_names(path)
  assert _check_averaged(new, local, lam, common) == {"federated", "personal"}
  for path, a in jax.tree_util.tree_leaves_with_path(new):
    if "image_base" in _path_names(path):
      assert not np.allclose(np.asarray(a)[0], np.asarray(a)[1])  # stays personal


def test_round_weights_use_the_clients_loss_and_validation_map(rounds):
  _, stats, _, _ = rounds["fedscmr"]
  local, _, _, _ = rounds["none"]  # the same local training, before aggregation
  client_data, val_data, group = rounds["data"], rounds["val"], rounds["group"]
  shared = rounds["state"].shared
  on = lambda d: jax.vmap(functools.partial(alg_lib.retrieval_map, group, n=5), (0, None, 0, 0))(
    local, shared, d.arrays, d.sample_mask
  )
  np.testing.assert_allclose(stats["map"], on(val_data), rtol=1e-6)
  assert not np.allclose(on(val_data), on(client_data))  # not the training pairs
  counts = np.asarray(client_data.num_samples)
  labels = np.asarray(client_data.arrays["label"])
  categories = np.array([len(np.unique(labels[k][:n])) for k, n in enumerate(counts)])
  assert len(set(categories)) > 1 and len(set(counts)) > 1  # the data terms do discriminate
  expected = weights.fedscmr_weights(counts, categories, stats["loss"], stats["map"], gamma=30.0)
  np.testing.assert_allclose(stats["weight"], expected, rtol=1e-5)


def test_vmapped_round_equals_each_client_alone(rounds):
  # The round trains clients with one vmap; without aggregation, client k's result must not
  # depend on the others: run it as a group of one and compare.
  together, _, alg, round_fn = rounds["none"]
  state, client_data, val_data = rounds["state"], rounds["data"], rounds["val"]
  for k in range(3):
    one = lambda tree, k=k: jax.tree.map(lambda x: x[k : k + 1], tree)
    single_state = state.replace(
      params=one(state.params), opt_state=one(state.opt_state), rng=state.rng[k : k + 1]
    )
    single = lambda d, k=k, one=one: d.replace(
      arrays=one(d.arrays),
      sample_mask=d.sample_mask[k : k + 1],
      user_ids=d.user_ids[k : k + 1],
      client_mask=d.client_mask[k : k + 1],
    )
    alone, _ = round_fn(
      alg.init(single_state, jax.random.key(1)), single(client_data), single(val_data)
    )
    for a, b in zip(
      jax.tree.leaves(together), jax.tree.leaves(alone.groups[0].params), strict=True
    ):
      np.testing.assert_allclose(np.asarray(a)[k], np.asarray(b)[0], rtol=2e-5, atol=1e-6)


# ----------------------------------------------------------------------------
# FedCMR's round: 80% before aggregation, its weights, the 0.5 step back, 20% after.


def test_split_samples_is_a_seeded_partition_of_the_valid_samples():
  mask = jnp.arange(12) < 10
  first, second = alg_lib.split_samples(jax.random.key(3), mask, 0.8)
  assert int(first.sum()) == 8 and int(second.sum()) == 2
  assert not bool((first & second).any()) and bool(((first | second) == mask).all())
  # Padding samples change nothing.
  padded = alg_lib.split_samples(jax.random.key(3), jnp.arange(20) < 10, 0.8)
  np.testing.assert_array_equal(padded[0][:12], first)
  for n in (360, 300, 240, 7):  # ceil(0.8 n), without float32 rounding up 288.00001
    got = alg_lib.split_samples(jax.random.key(0), jnp.ones(n, bool), 0.8)[0]
    assert int(got.sum()) == math.ceil(round(0.8 * n, 6))


def test_fedcmr_round_equals_its_steps_done_by_hand():
  group, state, client_data, val_data, num_classes = _setup()
  config = alg_lib.ScmrConfig(
    loss="dscmr", aggregation="fedcmr", split=0.8, correction=0.5, num_classes=num_classes,
    map_n=5,
  )  # fmt: skip
  alg = alg_lib.fedscmr(group, config)
  key = jax.random.key(1)
  new, stats = jax.jit(alg.round)(alg.init(state, key), client_data, val_data)

  # By hand: a Python loop over clients for the split, then the engine's passes.
  split_key = jax.random.fold_in(jax.random.fold_in(key, 0), alg_lib.SPLIT_SALT)
  parts = [
    alg_lib.split_samples(jax.random.fold_in(split_key, k), client_data.sample_mask[k], 0.8)
    for k in range(3)
  ]
  first = jnp.stack([p[0] for p in parts])
  second = jnp.stack([p[1] for p in parts])
  objective_fn = alg_lib.scmr_objective(config)
  start = state.replace(opt_state=jax.vmap(group.tx.init)(state.params))
  train = jax.jit(
    lambda s, m: core.train_group(
      group, s, client_data.replace(sample_mask=m), objective_fn=objective_fn
    )
  )
  trained, pass_stats = train(start, first)
  counts = np.asarray(client_data.num_samples)
  labels = np.asarray(client_data.arrays["label"])
  categories = [len(np.unique(labels[k][:n])) for k, n in enumerate(counts)]
  summed = np.asarray(pass_stats["loss"]) * np.asarray(pass_stats["steps"])
  np.testing.assert_array_equal(pass_stats["steps"], [6, 4, 4])  # 2 epochs of ceil(0.8 n / 4)
  lam = _fedcmr_loop(counts, categories, summed, [True] * 3)
  np.testing.assert_allclose(stats["weight"], lam, rtol=1e-5)

  def after_aggregation(path, w, w0):
    w, w0 = np.asarray(w), np.asarray(w0)
    if "common" not in _path_names(path):
      return w
    return np.tensordot(lam, w, axes=1)[None] - 0.5 * (w - w0)

  params = jax.tree_util.tree_map_with_path(after_aggregation, trained.params, state.params)
  final, _ = train(trained.replace(params=params), second)
  for a, b in zip(
    jax.tree.leaves(new.groups[0].params), jax.tree.leaves(final.params), strict=True
  ):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


# ----------------------------------------------------------------------------
# Byzantine clients lie to the adaptive weights.


def test_byzantine_reports_are_the_weight_maximising_values():
  losses, maps = jnp.array([1.0, 2.0, 3.0]), jnp.array([0.5, 0.75, 0.25])
  byz = jnp.array([False, True, False])
  got_losses, got_maps = alg_lib.byzantine_reports(losses, maps, byz)
  np.testing.assert_array_equal(got_losses, [1.0, 0.0, 3.0])
  np.testing.assert_array_equal(got_maps, [0.5, 1.0, 0.25])
  # No other report gives client 1 a larger weight under eq. (13) or FedCMR's rule.
  n, c = jnp.array([10, 10, 10]), jnp.array([3, 3, 3])
  lie = weights.fedscmr_weights(n, c, got_losses, got_maps, gamma=30.0)[1]
  lie_cmr = weights.fedcmr_weights(n, c, got_losses)[1]
  for loss in (0.1, 1.0, 2.0, 5.0):
    for m in (0.0, 0.5, 0.99):
      honest = (losses.at[1].set(loss), maps.at[1].set(m))
      assert weights.fedscmr_weights(n, c, *honest, gamma=30.0)[1] < lie
      assert weights.fedcmr_weights(n, c, honest[0])[1] <= lie_cmr  # saturates at 1 in float32


@pytest.mark.parametrize("aggregation", ["fedscmr", "fedcmr"])
def test_a_byzantine_client_reports_loss_0_and_map_1(aggregation):
  group, state, client_data, val_data, num_classes = _setup()
  config = alg_lib.ScmrConfig(aggregation=aggregation, num_classes=num_classes, map_n=5)
  faults = faults_lib.Faults(byzantine_count=1)
  alg = alg_lib.fedscmr(group, config, faults=faults)
  key = jax.random.key(1)
  _, stats = jax.jit(alg.round)(alg.init(state, key), client_data, val_data)
  where = np.asarray(client_data.client_mask)
  fault_key = jax.random.fold_in(jax.random.fold_in(key, 0), faults_lib.SALT)
  byz = np.asarray(faults_lib.draw(fault_key, jnp.asarray(where), faults).byzantine)
  assert byz.sum() == 1 and int(stats["fault_counts"]["byzantine"]) == 1
  counts = np.asarray(client_data.num_samples)
  labels = np.asarray(client_data.arrays["label"])
  categories = np.array([len(np.unique(labels[k][:n])) for k, n in enumerate(counts)])
  if aggregation == "fedscmr":
    expected = weights.fedscmr_weights(
      counts, categories, np.where(byz, 0.0, stats["loss"]), np.where(byz, 1.0, stats["map"]),
      gamma=30.0,
    )  # fmt: skip
    honest = weights.fedscmr_weights(counts, categories, stats["loss"], stats["map"], gamma=30.0)
    np.testing.assert_allclose(stats["weight"], expected, rtol=1e-5)
  else:
    # The summed loss is what FedCMR's rule reads; the liar's is 0.
    steps = 2 * np.ceil(counts / 4)
    honest = weights.fedcmr_weights(counts, categories, np.asarray(stats["loss"]) * steps)
    expected = weights.fedcmr_weights(
      counts, categories, np.where(byz, 0.0, np.asarray(stats["loss"]) * steps)
    )
    np.testing.assert_allclose(stats["weight"], expected, rtol=1e-5)
  assert np.argmax(stats["weight"]) == np.argmax(byz)
  assert float(stats["weight"][byz][0]) > float(np.asarray(honest)[byz][0])


# ----------------------------------------------------------------------------
# Evaluation: mAP@N and NDCG@N per client against brute force and scikit-learn.


def _brute_map(query, database, q_labels, d_labels, n):
  sim = (
    query @ database.T / np.outer(np.linalg.norm(query, axis=1), np.linalg.norm(database, axis=1))
  )
  aps = []
  for q in range(len(query)):
    order = np.argsort(-sim[q], kind="stable")[:n]
    rel = d_labels[order] == q_labels[q]
    precision = np.cumsum(rel) / np.arange(1, len(order) + 1)
    aps.append((precision * rel).sum() / rel.sum() if rel.any() else 0.0)
  return np.mean(aps)


def test_evaluate_group_matches_brute_force_and_sklearn(x64):
  group, state, client_data, _, _ = _setup()
  ns = (3, 50)
  got = jax.jit(functools.partial(alg_lib.evaluate_group, group, ns=ns))(state, client_data)
  for k in range(3):
    n_k = int(client_data.num_samples[k])
    params = jax.tree.map(lambda x, k=k: x[k], state.params)
    arrays = {key: np.asarray(v[k][:n_k]) for key, v in client_data.arrays.items()}
    s_img, s_txt = map(
      np.asarray, group.merge(params, state.shared).embed(arrays["image"], arrays["text"])
    )
    labels = arrays["label"]
    for n in ns:
      for direction, (q, db) in {"img2txt": (s_img, s_txt), "txt2img": (s_txt, s_img)}.items():
        expected = _brute_map(q, db, labels, labels, n)
        np.testing.assert_allclose(got[f"mAP@{n}/{direction}"][k], expected, rtol=1e-6)
        relevance = (labels[:, None] == labels[None, :]).astype(float)
        similarity = q @ db.T / np.outer(np.linalg.norm(q, axis=1), np.linalg.norm(db, axis=1))
        expected = skm.ndcg_score(relevance, similarity, k=n)
        np.testing.assert_allclose(got[f"NDCG@{n}/{direction}"][k], expected, rtol=1e-6)


def test_evaluate_shared_scores_every_client_on_one_test_set():
  group, state, client_data, val_data, _ = _setup()
  arrays = jax.tree.map(lambda x: x[0][:8], val_data.arrays)  # one test set, no client axis
  mask = jnp.ones(8, bool)
  ns = (3, 5)
  got = alg_lib.evaluate_shared(group, state, arrays, mask, ns=ns)
  # The same as evaluating each client on a copy of it.
  copies = client_data.replace(
    arrays=jax.tree.map(lambda x: jnp.broadcast_to(x, (3,) + x.shape), arrays),
    sample_mask=jnp.ones((3, 8), bool),
  )
  expected = alg_lib.evaluate_group(group, state, copies, ns=ns)
  for k in expected:
    np.testing.assert_allclose(got[k], expected[k], rtol=1e-6)


def test_chance_level_is_the_metric_of_a_random_ranking():
  labels = jnp.repeat(jnp.arange(10), 30)
  chance = metrics.retrieval.random_ranking(
    labels, jnp.ones(300, bool), ns=(300,), key=jax.random.key(0)
  )
  # mAP@all of a random ranking with 30 relevant of 300: about the mean precision, 0.1, a
  # little higher from the early ranks.
  assert 0.1 < float(chance["mAP"]) < 0.15
  one_class = metrics.retrieval.random_ranking(
    jnp.zeros(20, int), jnp.ones(20, bool), ns=(5,), key=jax.random.key(0)
  )
  assert float(one_class["mAP"]) == pytest.approx(1.0)


# ----------------------------------------------------------------------------
# Data: the class-subset split and the features.


def test_class_subset_split_is_disjoint_and_within_classes():
  labels = np.random.default_rng(0).integers(0, 10, 2000)
  train, test, classes = class_subset_split(
    labels, num_classes=10, classes_per_client=[7, 6, 5], train_sizes=[90, 60, 30], test_size=20,
    seed=3,
  )  # fmt: skip
  everything = np.concatenate(train + test)
  assert len(np.unique(everything)) == len(everything)
  for tr, te, cl, size in zip(train, test, classes, [90, 60, 30], strict=True):
    assert len(tr) == size and len(te) == 20
    assert set(labels[tr]) == set(cl) and set(labels[te]) <= set(cl)
    counts = np.bincount(labels[np.concatenate([tr, te])], minlength=10)[cl]
    assert counts.max() - counts.min() <= 1  # as even over the client's classes as possible
  with pytest.raises(ValueError, match="class"):
    class_subset_split(labels[:50], num_classes=10, classes_per_client=[2], train_sizes=[40],
                       test_size=5, seed=0)  # fmt: skip


def test_paired_features_interface():
  with pytest.raises(ValueError, match="same pairs"):
    PairedFeatures(np.zeros((3, 2)), np.zeros((4, 2)), np.zeros(3))
  with pytest.raises(
    ValueError, match=r"labels must be class indices \(integers\), got dtype float"
  ):
    PairedFeatures(np.zeros((3, 2)), np.zeros((3, 2)), np.array([0.0, 1.5, 2.0]))
  with pytest.raises(ValueError, match="labels must be class indices >= 0, got -1"):
    PairedFeatures(np.zeros((3, 2)), np.zeros((3, 2)), np.array([0, -1, 2]))
  with pytest.raises(ValueError, match="text features must be finite numbers"):
    PairedFeatures(np.zeros((3, 2)), np.array([[0.0, np.inf]] * 3), np.zeros(3, int))
  # Labels saved as floats that hold integers are class indices.
  assert (
    PairedFeatures(np.zeros((3, 2)), np.zeros((3, 2)), np.array([0.0, 1.0, 2.0])).labels.dtype
    == np.int32
  )
  f = features_lib.world_features(0, 40, image_dim=8, text_encoder="bow")
  assert f.image.shape == (40, 8) and f.text.shape == (40, 64) and f.labels.shape == (40,)
  again = features_lib.world_features(0, 40, image_dim=8, text_encoder="bow")
  np.testing.assert_array_equal(f.image, again.image)
  np.testing.assert_array_equal(f.text, again.text)
  assert set(f.take(np.arange(5)).as_dict()) == {"image", "text", "label"}


def test_a_feature_file_that_does_not_fit_is_a_config_error_naming_it(tmp_path):
  r = np.random.default_rng(0)
  image, text, labels = r.normal(size=(6, 4)), r.normal(size=(6, 3)), np.arange(6) % 3
  cases = {
    "ok.npz": (dict(image=image, text=text, labels=labels), None),
    "two.npz": (
      dict(image=image, text=text),
      r"must hold arrays image \[n, d_img\], text \[n, d_txt\] and labels \[n\]; it holds "
      r"\['image', 'text'\]\.$",
    ),
    "rows.npz": (dict(image=image, text=text[:5], labels=labels), r": image, text and labels"),
    "float.npz": (dict(image=image, text=text, labels=labels + 0.5), r": labels must be class"),
    "empty.npz": (dict(image=image[:0], text=text[:0], labels=labels[:0]), r" holds no pairs\.$"),
  }
  for name, (arrays, _) in cases.items():
    np.savez(tmp_path / name, **arrays)
  np.save(tmp_path / "one.npy", image)
  (tmp_path / "text.npz").write_text("not an archive")
  cases["one.npy"] = (None, r"it holds one array \(an \.npy\)\.$")
  cases["text.npz"] = (None, r"is not a readable \.npz \(")
  cases["nowhere.npz"] = (None, r"is not a readable \.npz \(\[Errno 2\] No such file")
  for name, (_, message) in cases.items():
    path = str(tmp_path / name)
    if message is None:
      pool, num_classes = runner._feature_file(path)
      assert num_classes == 3 and len(pool) == 6
      continue
    with pytest.raises(ConfigError, match=rf"^features\.path {re.escape(repr(path))}.*{message}"):
      runner._feature_file(path)


def test_shared_test_split_holds_every_class_and_no_client_pair():
  labels = np.random.default_rng(0).integers(0, 10, 2000)
  train, test, _ = class_subset_split(
    labels, num_classes=10, classes_per_client=[7, 6, 5], train_sizes=[90, 60, 30], test_size=20,
    seed=3,
  )  # fmt: skip
  shared = shared_test_split(labels, num_classes=10, size=105, exclude=train + test, seed=3)
  assert len(shared) == 105 and len(np.unique(shared)) == 105
  counts = np.bincount(labels[shared], minlength=10)
  assert (counts >= 10).all() and counts.max() - counts.min() <= 1  # every class, evenly
  assert not set(shared) & set(np.concatenate(train + test))
  with pytest.raises(ValueError, match="pairs left"):
    shared_test_split(labels[:30], num_classes=10, size=100, seed=0)


def test_build_gives_each_client_train_val_test_and_one_shared_test_over_every_class():
  config = fedscmr_config.get_config("smoke")
  setup = runner.build(config)
  shared = np.asarray(setup.shared_test["label"])
  assert len(shared) == config.global_test_size
  assert set(shared.tolist()) == set(range(setup.num_classes))  # every class
  for k, classes in enumerate(setup.classes):
    parts = {}
    for name, d in (("train", setup.train), ("val", setup.val), ("test", setup.test)):
      mask = np.asarray(d.sample_mask[k])
      parts[name] = np.asarray(d.arrays["image"][k])[mask]
      assert set(np.asarray(d.arrays["label"][k])[mask].tolist()) <= set(classes.tolist())
    assert len(parts["val"]) == config.val_size and len(parts["test"]) == config.test_size
    # No pair is in two parts (or in the shared test set): compare the image features.
    rows = np.concatenate([*parts.values(), np.asarray(setup.shared_test["image"])])
    assert len(np.unique(rows, axis=0)) == len(rows)
