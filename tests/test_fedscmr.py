"""FedSCMR: aggregation weights by hand, the round (only the common subspace is averaged),
the per-client evaluation against scikit-learn / brute force, the data split, the jitted init."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sklearn import metrics as skm

from fedjax_mm import core, data, server
from fedjax_mm.algorithms import fedscmr as alg_lib
from fedjax_mm.data.cross_modal import PairedFeatures, class_subset_split
from fedjax_mm.models.scmr import ScmrModel
from fedjax_mm.runner import fedscmr as runner
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


@functools.cache
def _setup(seed=0, k=3, n=12, d_img=6, d_txt=5, num_classes=4):
  rng = np.random.default_rng(seed)
  sizes = [n, n - 3, n - 6]
  clients = [
    {
      "image": rng.normal(size=(s, d_img)).astype(np.float32),
      "text": rng.normal(size=(s, d_txt)).astype(np.float32),
      "label": rng.integers(0, num_classes - i, s).astype(np.int32),
    }
    for i, s in enumerate(sizes[:k])
  ]
  stacked, mask = data.stack_clients(clients)
  client_data = core.make_client_data(stacked, mask, user_ids=np.arange(k))
  make = lambda rngs: ScmrModel(d_img, d_txt, num_classes, hidden=8, dim=4, rngs=rngs)
  group, state = runner.init_clients(
    make,
    tx=optax.adam(1e-2),
    task=core.Task("classification", "image", "label", num_classes),
    key=jax.random.key(seed),
    num_clients=k,
    local_epochs=2,
    batch_size=4,
  )
  return group, state, client_data, num_classes


def test_init_clients_equals_core_init_group():
  group, state, _, num_classes = _setup()
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


@pytest.fixture(scope="module")
def rounds():
  """One FedSCMR round and one round without aggregation, from the same state and key."""
  group, state, client_data, num_classes = _setup()
  out = {"data": client_data, "state": state}
  for aggregation in ("fedscmr", "none"):
    config = alg_lib.ScmrConfig(aggregation=aggregation, num_classes=num_classes, map_n=5)
    alg = alg_lib.fedscmr(group, config)
    round_fn = jax.jit(alg.round)
    new, stats = round_fn(alg.init(state, jax.random.key(1)), client_data)
    out[aggregation] = (new.groups[0].params, stats, alg, round_fn)
  return out


def test_round_averages_the_common_subspace_only(rounds):
  new, stats, _, _ = rounds["fedscmr"]
  local, _, _, _ = rounds["none"]
  lam = np.asarray(stats["weight"])
  assert lam.sum() == pytest.approx(1.0, rel=1e-5) and (lam > 0).all()
  checked = set()
  flat_new = jax.tree_util.tree_leaves_with_path(new)
  flat_local = jax.tree_util.tree_leaves_with_path(local)
  for (path, a), (_, b) in zip(flat_new, flat_local, strict=True):
    a, b = np.asarray(a), np.asarray(b)
    if "common" in _path_names(path):
      # Every client holds sum_k lambda_k W_k of the locally trained W_k.
      mean = np.tensordot(lam, b, axes=1)
      np.testing.assert_allclose(a, np.broadcast_to(mean, a.shape), rtol=1e-5, atol=1e-6)
      assert not np.allclose(b[0], b[1])  # local training had made them differ
      checked.add("common")
    else:
      np.testing.assert_array_equal(a, b)  # personal layers: exactly local training
      checked.add("personal")
  assert checked == {"common", "personal"}


def test_round_weights_use_the_clients_loss_and_train_map(rounds):
  _, stats, _, _ = rounds["fedscmr"]
  client_data = rounds["data"]
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
  state, client_data = rounds["state"], rounds["data"]
  for k in range(3):
    one = lambda tree, k=k: jax.tree.map(lambda x: x[k : k + 1], tree)
    single_state = state.replace(
      params=one(state.params), opt_state=one(state.opt_state), rng=state.rng[k : k + 1]
    )
    single_data = client_data.replace(
      arrays=one(client_data.arrays),
      sample_mask=client_data.sample_mask[k : k + 1],
      user_ids=client_data.user_ids[k : k + 1],
      client_mask=client_data.client_mask[k : k + 1],
    )
    alone, _ = round_fn(alg.init(single_state, jax.random.key(1)), single_data)
    for a, b in zip(
      jax.tree.leaves(together), jax.tree.leaves(alone.groups[0].params), strict=True
    ):
      np.testing.assert_allclose(np.asarray(a)[k], np.asarray(b)[0], rtol=2e-5, atol=1e-6)


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
  group, state, client_data, _ = _setup()
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
  f = runner.world_features(0, 40, image_dim=8, text_encoder="bow")
  assert f.image.shape == (40, 8) and f.text.shape == (40, 64) and f.labels.shape == (40,)
  again = runner.world_features(0, 40, image_dim=8, text_encoder="bow")
  np.testing.assert_array_equal(f.image, again.image)
  np.testing.assert_array_equal(f.text, again.text)
  assert set(f.take(np.arange(5)).as_dict()) == {"image", "text", "label"}
