"""Recall@K, mAP@N and NDCG@N against brute-force Python loops and scikit-learn.

Random comparisons run in float64 (the ``x64`` fixture) so that float rounding
cannot swap two nearly tied candidates between the two implementations; exact
ties are built from small integers (recall) or from vectors whose normalised
entries are 0 and 1/2 (mAP, NDCG), whose dot products are exact in float32.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn import metrics as skm

from fedjax_mm import metrics

SEEDS = range(4)


# ----------------------------------------------------------------------------
# Recall@K


def _brute_ranks(sim, correct):
  """0-based position of the first correct candidate, ties broken in its favour.

  ``sim[q]`` holds the similarities of query ``q`` to every candidate and
  ``correct[q]`` the boolean correctness of each. Sorting by (similarity
  descending, correct first) and reading off the first correct position is the
  optimistic rule, computed differently from the library's strict count.
  """
  ranks = []
  for s, c in zip(sim, correct, strict=True):
    order = sorted(range(len(s)), key=lambda j, s=s, c=c: (-s[j], not c[j]))
    positions = [p for p, j in enumerate(order) if c[j]]
    ranks.append(positions[0] if positions else None)
  return ranks


def _brute_rank_arrays(images, texts, ids, folds):
  """Each image's and caption's rank within its fold, by the literal sort of ``_brute_ranks``."""
  images, texts, ids = np.asarray(images), np.asarray(texts), np.asarray(ids)
  size = len(images) // folds
  i2t = np.full(len(images), np.iinfo(np.int32).max)
  t2i = np.zeros(len(texts), int)
  for f in range(folds):
    mine = np.arange(f * size, (f + 1) * size)
    captions = np.flatnonzero(ids // size == f)
    sim = images[mine] @ texts[captions].T
    correct = ids[captions][None, :] == mine[:, None]
    for i, rank in zip(mine, _brute_ranks(sim, correct), strict=True):
      i2t[i] = i2t[i] if rank is None else rank
    t2i[captions] = _brute_ranks(sim.T, correct.T)
  return i2t, t2i


def _brute_recall(images, texts, ids, ks, folds):
  """Literal 1K protocol: each fold's Recall@K from its own ranks, averaged over folds."""
  folds = folds or 1
  i2t, t2i = _brute_rank_arrays(images, texts, ids, folds)
  size = len(images) // folds
  image_fold, text_fold = np.arange(len(images)) // size, np.asarray(ids) // size
  out = {}
  for name, ranks, fold in (("i2t", i2t, image_fold), ("t2i", t2i, text_fold)):
    for k in ks:
      out[f"{name}_R@{k}"] = np.mean([100 * np.mean(ranks[fold == f] < k) for f in range(folds)])
  return out


def _recall_problem(seed, num_images=20, captions_per_image=3, dim=6, integer=False, ragged=False):
  rng = np.random.default_rng(seed)
  if ragged:  # uneven captions per image, two images without any
    captioned = rng.permutation(num_images)[2:]
    ids = rng.choice(
      captioned, captions_per_image * num_images, p=rng.dirichlet(np.ones(len(captioned)))
    )
  else:
    ids = np.repeat(np.arange(num_images), captions_per_image)
    rng.shuffle(ids)
  if integer:
    images = rng.integers(-1, 2, size=(num_images, dim)).astype(np.float32)
    texts = rng.integers(-1, 2, size=(len(ids), dim)).astype(np.float32)
  else:
    images = rng.normal(size=(num_images, dim))
    texts = images[ids] + 1.5 * rng.normal(size=(len(ids), dim))  # weakly aligned
    images /= np.linalg.norm(images, axis=1, keepdims=True)
    texts /= np.linalg.norm(texts, axis=1, keepdims=True)
  return images, texts, ids


def _assert_recall_equal(got, expected):
  assert set(got) == set(expected)
  for key in expected:
    np.testing.assert_allclose(got[key], expected[key], rtol=1e-6, atol=1e-9, err_msg=key)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("folds", [None, 2, 4])
@pytest.mark.parametrize("ragged", [False, True])
def test_recall_matches_brute_force(seed, folds, ragged, x64):
  images, texts, ids = _recall_problem(seed, ragged=ragged)
  if ragged:
    assert np.bincount(ids, minlength=len(images)).min() == 0
    if folds:  # folds hold different numbers of captions
      per_fold = np.bincount(ids // (len(images) // folds))
      assert per_fold.min() < per_fold.max()
  ks = (1, 2, 5, 10)
  got = metrics.image_text_recall(images, texts, ids, ks=ks, folds=folds, chunk_size=7)
  _assert_recall_equal(got, _brute_recall(images, texts, ids, ks, folds))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("folds, chunk_size", [(None, 1000), (2, 1000), (4, 3)])
def test_recall_with_exact_ties_uses_the_optimistic_rule(seed, folds, chunk_size):
  images, texts, ids = _recall_problem(seed, integer=True)
  sim = images @ texts.T
  # The integer data must really contain ties that involve a correct candidate.
  assert any(np.sum(sim[i] == sim[i, j]) > 1 for j, i in enumerate(ids)), "test data has no ties"
  ks = (1, 3, 5)
  got = metrics.image_text_recall(images, texts, ids, ks=ks, folds=folds, chunk_size=chunk_size)
  _assert_recall_equal(got, _brute_recall(images, texts, ids, ks, folds))


def test_recall_tie_rule_by_hand():
  # Image 0's caption ties with image 1's caption; caption 1 ties between images.
  images = jnp.array([[1.0, 0.0], [1.0, 0.0]])
  texts = jnp.array([[1.0, 0.0], [1.0, 0.0], [-1.0, 0.0]])
  got = metrics.image_text_recall(images, texts, jnp.array([0, 1, 1]), ks=(1,))
  # i2t: both images find a tied correct caption first. t2i: captions 0 and 1
  # tie between the two images, caption 2 ties as well (both -1).
  assert float(got["i2t_R@1"]) == 100.0
  assert float(got["t2i_R@1"]) == 100.0


def test_image_without_captions_is_never_found():
  images = jnp.eye(3)
  texts = jnp.eye(3)[:2]
  got = metrics.image_text_recall(images, texts, jnp.array([0, 1]), ks=(1, 10))
  np.testing.assert_allclose(got["i2t_R@1"], 200 / 3, rtol=1e-6)
  np.testing.assert_allclose(got["i2t_R@10"], 200 / 3, rtol=1e-6)
  np.testing.assert_allclose(got["t2i_R@1"], 100.0)


def test_recall_is_independent_of_chunk_size_and_jits():
  images, texts, ids = _recall_problem(5, num_images=30)
  reference = metrics.image_text_recall(images, texts, ids, folds=3, chunk_size=1000)
  for chunk_size in (1, 7, 90):
    _assert_recall_equal(
      metrics.image_text_recall(images, texts, ids, folds=3, chunk_size=chunk_size), reference
    )
  jitted = jax.jit(
    functools.partial(metrics.image_text_recall, ks=(1, 5, 10), folds=3, chunk_size=16)
  )
  _assert_recall_equal(jitted(images, texts, ids), reference)


def _folded_problem(seed, num_images, integer):
  """A ragged problem (uneven folds, images without captions), captions in any order."""
  images, texts, ids = _recall_problem(
    seed, num_images=num_images, captions_per_image=2, integer=integer, ragged=True
  )
  return jnp.asarray(images), jnp.asarray(texts), jnp.asarray(ids, jnp.int32)


# (folds of 24 images, chunk_size): the full set in one block and in blocks of one to
# nine captions; one fold a group and one caption a block; several blocks a group;
# several folds a group, the last group part padding; one group.
_RANK_CASES = [(1, 1000), (1, 1), (1, 9), (2, 1), (3, 5), (4, 7), (6, 9), (8, 16), (12, 5)]
_RANK_CASES += [(4, 1000), (24, 1000)]


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("integer", [False, True])
def test_ranks_equal_a_literal_sort_in_every_layout_of_groups_and_blocks(seed, integer, x64):
  # The kernel forms each fold's own similarities only, captions sorted by image in
  # blocks against groups of whole folds. Integer data holds exact ties.
  from fedjax_mm.metrics import retrieval

  images, texts, ids = _folded_problem(seed, 24, integer)
  for folds, chunk_size in _RANK_CASES:
    static = {"num_folds": folds, "chunk_size": chunk_size}
    got = jax.jit(functools.partial(retrieval.image_text_ranks, **static))(images, texts, ids)
    want = _brute_rank_arrays(images, texts, ids, folds)
    never = want[0] == np.iinfo(np.int32).max  # images without a caption
    assert never.any() and not never.all()
    for name, g, w in zip(("i2t", "t2i"), got, want, strict=True):
      np.testing.assert_array_equal(g, w, err_msg=f"{name} {folds=} {chunk_size=}")


def test_ranks_under_vmap_equal_each_problem_alone():
  # As FedRGB's rows run them: one problem per client, stacked.
  from fedjax_mm.metrics import retrieval

  problems = [_folded_problem(seed, 24, integer=True) for seed in range(3)]
  stacked = [jnp.stack(parts) for parts in zip(*problems, strict=True)]
  for folds in (1, 4):
    kernel = functools.partial(retrieval.image_text_ranks, num_folds=folds, chunk_size=5)
    batched = jax.jit(jax.vmap(kernel))(*stacked)
    for k, problem in enumerate(problems):
      for got, want in zip(batched, kernel(*problem), strict=True):
        np.testing.assert_array_equal(got[k], want)


def test_recall_rejects_caption_ids_out_of_range():
  images, texts, ids = _recall_problem(0, num_images=10)
  for bad in (10, -1):
    wrong = np.array(ids).copy()
    wrong[3] = bad
    with pytest.raises(ValueError, match=f"caption_image_ids must lie in \\[0, 10\\), got {bad}"):
      metrics.image_text_recall(images, texts, wrong, folds=2)


def test_recall_perfect_embeddings_and_keys():
  images = jnp.eye(4)
  ids = jnp.array([0, 1, 2, 3, 0, 1, 2, 3])
  got = metrics.image_text_recall(images, images[ids], ids)
  assert list(got) == ["i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10"]
  for value in got.values():
    assert float(value) == 100.0


def test_recall_rejects_bad_folds():
  images, texts, ids = _recall_problem(0, num_images=10)
  with pytest.raises(ValueError):
    metrics.image_text_recall(images, texts, ids, folds=3)
  with pytest.raises(ValueError):
    metrics.image_text_recall(images, texts, ids[:-1])


@pytest.mark.parametrize("chunk_size", [0, -3, 2.5, True])
def test_bad_chunk_size_is_one_value_error(chunk_size):
  images, texts, ids = _recall_problem(0, num_images=10)
  with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
    metrics.image_text_recall(images, texts, ids, chunk_size=chunk_size)
  query, database, query_labels, database_labels = _ranking_problem(0)
  for fn in (metrics.map_at_n, metrics.ndcg_at_n):
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
      fn(query, database, query_labels, database_labels, n=5, chunk_size=chunk_size)


def test_recall_of_an_empty_set_is_refused():
  with pytest.raises(ValueError, match="at least one image and one caption"):
    metrics.image_text_recall(np.zeros((0, 4)), np.zeros((0, 4)), np.zeros(0, int))


# ----------------------------------------------------------------------------
# mAP@N and NDCG@N


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _relevance(query_labels, database_labels):
  if query_labels.ndim == 1:
    return query_labels[:, None] == database_labels[None, :]
  return np.array([[np.any(q & d) for d in database_labels] for q in query_labels])


def _brute_map_ndcg(query, database, query_labels, database_labels, n):
  """Loops over queries; ranking by (similarity descending, database index)."""
  sim = _unit(query) @ _unit(database).T
  if query_labels.ndim == 2:
    rel = _relevance(query_labels != 0, database_labels != 0)
  else:
    rel = _relevance(query_labels, database_labels)
  aps, ndcgs = [], []
  for q in range(len(query)):
    order = sorted(range(len(database)), key=lambda j, q=q: (-sim[q, j], j))[:n]
    hits, precision_sum, dcg = 0, 0.0, 0.0
    for position, j in enumerate(order, start=1):
      if rel[q, j]:
        hits += 1
        precision_sum += hits / position
        dcg += 1 / np.log2(position + 1)
    aps.append(precision_sum / hits if hits else 0.0)
    total = int(rel[q].sum())
    ideal = sum(1 / np.log2(p + 1) for p in range(1, min(n, total) + 1))
    ndcgs.append(dcg / ideal if total else 0.0)
  return np.mean(aps), np.mean(ndcgs)


def _ranking_problem(seed, num_queries=15, num_items=40, dim=5, num_labels=4, multi_hot=False):
  rng = np.random.default_rng(seed)
  if multi_hot:
    query_labels = (rng.random((num_queries, num_labels)) < 0.3).astype(np.int32)
    database_labels = (rng.random((num_items, num_labels)) < 0.3).astype(np.int32)
    centers = rng.normal(size=(num_labels, dim))
    query = query_labels @ centers + rng.normal(size=(num_queries, dim))
    database = database_labels @ centers + rng.normal(size=(num_items, dim))
  else:
    query_labels = rng.integers(0, num_labels, num_queries)
    database_labels = rng.integers(0, num_labels, num_items)
    centers = rng.normal(size=(num_labels, dim))
    query = centers[query_labels] + rng.normal(size=(num_queries, dim))
    database = centers[database_labels] + rng.normal(size=(num_items, dim))
  # Unnormalised on purpose: the metrics normalise inside.
  scale = rng.uniform(0.5, 3.0, size=(num_items, 1))
  return query, database * scale, query_labels, database_labels


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("multi_hot", [False, True])
@pytest.mark.parametrize("n", [1, 5, 17, 40, 100])
def test_map_and_ndcg_match_brute_force(seed, multi_hot, n, x64):
  query, database, query_labels, database_labels = _ranking_problem(seed, multi_hot=multi_hot)
  expected_map, expected_ndcg = _brute_map_ndcg(query, database, query_labels, database_labels, n)
  args = (query, database, query_labels, database_labels)
  np.testing.assert_allclose(metrics.map_at_n(*args, n=n, chunk_size=4), expected_map, rtol=1e-9)
  np.testing.assert_allclose(metrics.ndcg_at_n(*args, n=n, chunk_size=4), expected_ndcg, rtol=1e-9)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", [3, 10, 40])
def test_ndcg_matches_sklearn_without_ties(seed, n, x64):
  query, database, query_labels, database_labels = _ranking_problem(seed)
  relevance = _relevance(query_labels, database_labels).astype(float)
  similarity = _unit(query) @ _unit(database).T
  expected = skm.ndcg_score(relevance, similarity, k=n)
  got = metrics.ndcg_at_n(query, database, query_labels, database_labels, n=n)
  np.testing.assert_allclose(got, expected, rtol=1e-9)


def _tied_problem(seed, num_queries=12, num_items=30, num_labels=3):
  """Vectors of four ones in eight dimensions: normalised entries are 0 or 1/2,
  so every cosine is an exact multiple of 1/4 and ties are exact."""
  rng = np.random.default_rng(seed)

  def vectors(count):
    x = np.zeros((count, 8), np.float32)
    for row in x:
      row[rng.choice(8, 4, replace=False)] = 1.0
    return x

  return (
    vectors(num_queries),
    vectors(num_items),
    rng.integers(0, num_labels, num_queries),
    rng.integers(0, num_labels, num_items),
  )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", [1, 4, 10, 30])
def test_map_and_ndcg_ties_go_to_the_lower_index(seed, n):
  query, database, query_labels, database_labels = _tied_problem(seed)
  sim = _unit(query) @ _unit(database).T
  assert len(np.unique(sim)) <= 5  # only 0, 1/4, ..., 1: many exact ties
  expected_map, expected_ndcg = _brute_map_ndcg(query, database, query_labels, database_labels, n)
  args = (query, database, query_labels, database_labels)
  np.testing.assert_allclose(metrics.map_at_n(*args, n=n), expected_map, rtol=1e-6)
  np.testing.assert_allclose(metrics.ndcg_at_n(*args, n=n), expected_ndcg, rtol=1e-6)


def test_map_tie_rule_by_hand():
  # Both items tie; the lower index (irrelevant) comes first: AP@2 = 1/2.
  query = jnp.array([[1.0, 0.0]])
  database = jnp.array([[1.0, 0.0], [2.0, 0.0]])
  got = metrics.map_at_n(query, database, jnp.array([0]), jnp.array([1, 0]), n=2)
  np.testing.assert_allclose(got, 0.5, rtol=1e-6)
  got = metrics.ndcg_at_n(query, database, jnp.array([0]), jnp.array([1, 0]), n=2)
  np.testing.assert_allclose(got, 1 / np.log2(3), rtol=1e-6)


def test_no_relevant_item_scores_zero():
  query, database, _, _ = _ranking_problem(0)
  query_labels = np.zeros(len(query), int)
  database_labels = np.ones(len(database), int)
  args = (query, database, query_labels, database_labels)
  assert float(metrics.map_at_n(*args, n=5)) == 0.0
  assert float(metrics.ndcg_at_n(*args, n=5)) == 0.0


@pytest.mark.parametrize("seed", range(2))
def test_masks_equal_removing_the_rows(seed, x64):
  query, database, query_labels, database_labels = _ranking_problem(seed)
  rng = np.random.default_rng(seed + 50)
  query_where = rng.random(len(query)) < 0.6
  database_where = rng.random(len(database)) < 0.6
  masked = (query, database, query_labels, database_labels)
  sliced = (
    query[query_where],
    database[database_where],
    query_labels[query_where],
    database_labels[database_where],
  )
  for fn in (metrics.map_at_n, metrics.ndcg_at_n):
    for n in (5, 40):  # 40 exceeds the number of valid items
      got = fn(*masked, n=n, query_where=query_where, database_where=database_where)
      np.testing.assert_allclose(got, fn(*sliced, n=n), rtol=1e-9)


def test_vmap_over_clients_equals_each_client_separately():
  num_clients = 3
  problems = [_ranking_problem(s) for s in range(num_clients)]
  query, database, query_labels, database_labels = (
    np.stack(x) for x in zip(*problems, strict=True)
  )
  rng = np.random.default_rng(0)
  query_where = rng.random(query.shape[:2]) < 0.7
  database_where = rng.random(database.shape[:2]) < 0.7
  for fn in (metrics.map_at_n, metrics.ndcg_at_n):
    batched = jax.jit(jax.vmap(functools.partial(fn, n=10, chunk_size=4)))(
      query,
      database,
      query_labels,
      database_labels,
      query_where=query_where,
      database_where=database_where,
    )
    for k in range(num_clients):
      single = fn(
        query[k],
        database[k],
        query_labels[k],
        database_labels[k],
        n=10,
        query_where=query_where[k],
        database_where=database_where[k],
      )
      np.testing.assert_allclose(batched[k], single, rtol=1e-6)


def test_ranking_rejects_mixed_label_kinds():
  query, database, query_labels, _ = _ranking_problem(0)
  with pytest.raises(ValueError):
    metrics.map_at_n(query, database, query_labels, np.zeros((len(database), 3)), n=5)
  with pytest.raises(ValueError):
    metrics.ndcg_at_n(query, database, query_labels, np.zeros(len(database) + 1), n=5)
