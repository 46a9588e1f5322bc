"""Retrieval metrics: Recall@K for image-text retrieval, mAP@N and NDCG@N.

Two protocols are covered:

* **Image-text retrieval** (CreamFL and FedMuscle on MS-COCO / Flickr30K):
  :func:`image_text_recall` ranks every caption for every image (i2t) and every
  image for every caption (t2i) by dot-product similarity, with several captions
  per image, and reports Recall@K as percentages, over the full set or averaged
  over consecutive folds (the "1K" protocol: 5 folds of 1000 images).
* **Supervised cross-modal retrieval** (FedSCMR on Pascal Sentence /
  Wikipedia): :func:`map_at_n` and :func:`ndcg_at_n` rank a database by cosine
  similarity and call an item relevant when it shares a label with the query.

Beside them, the chance levels the reports print: :func:`chance_recall` (a random
ranking's Recall@K in closed form) and :func:`random_ranking` (mAP@N and NDCG@N of
random rankings, sampled).

Queries (for Recall@K, the captions of both directions) are processed in blocks of at
most ``chunk_size`` with ``jax.lax``'s loops, so at most about ``chunk_size * N``
similarities exist at once (``N`` = number of candidates), e.g. 1000 x 5000 floats
(20 MB) for MS-COCO 5K. With folds, only each fold's own similarities are formed
(:func:`image_text_ranks`).
Similarities are computed at ``Precision.HIGHEST`` so that accelerators'
reduced-precision matmuls cannot reorder near ties. Everything imports only
``jax``. The public functions validate their arguments in Python and call a
kernel jit-compiled once per shape and keyword options (which are static), so
per-round evaluation does not recompile; they also work inside ``jit`` and
``vmap`` (e.g. over clients, with ``query_where`` / ``database_where`` masks).

References:
  - [Karpathy & Fei-Fei, 2015] Deep Visual-Semantic Alignments for Generating
    Image Descriptions (the 5K / 1K MS-COCO splits).
  - [Faghri et al., 2018] VSE++: Improving Visual-Semantic Embeddings with Hard
    Negatives (Recall@K with five captions per image).
  - CreamFL paper and FedMuscle paper, Section 6: i2t / t2i Recall@{1, 5, 10}.
  - FedSCMR paper, Section 6.1 and Tables 1-4: mAP@N and NDCG@N, N in {10, 20, 30,
    50}; it does not define mAP@N, which follows DSCMR's code (fx_calc_map_label).
  - [Jarvelin & Kekalainen, 2002] Cumulated Gain-Based Evaluation of IR
    Techniques (NDCG).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import jax
import jax.numpy as jnp

Array = jax.Array

# Rank given to a query with no correct candidate at all: never within any K.
_NEVER = jnp.iinfo(jnp.int32).max


def _scores(candidates: Array, query: Array) -> Array:
  """``[N]`` dot products of one ``[d]`` query with ``[N, d]`` candidates."""
  return jnp.matmul(candidates, query, precision=jax.lax.Precision.HIGHEST)


def _block_scores(queries: Array, candidates: Array) -> Array:
  """``[c, N]`` dot products of ``[c, d]`` queries with ``[N, d]`` candidates."""
  return jnp.matmul(queries, candidates.T, precision=jax.lax.Precision.HIGHEST)


def _check_chunk_size(chunk_size: int) -> None:
  try:
    positive = not isinstance(chunk_size, bool) and operator.index(chunk_size) >= 1
  except TypeError:
    positive = False
  if not positive:
    raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}.")


def _check_embeddings(name: str, x: Array, dim: int | None = None) -> None:
  if x.ndim != 2:
    raise ValueError(f"{name} must be an [N, d] matrix, got shape {x.shape}.")
  if dim is not None and x.shape[1] != dim:
    raise ValueError(f"{name} has dimension {x.shape[1]}, expected {dim}.")


def _fold_mean(hit: Array, fold: Array, num_folds: int) -> Array:
  """Mean over folds of the per-fold mean of ``hit`` (a fold with no query adds 0)."""
  dtype = jnp.result_type(float)
  hits = jax.ops.segment_sum(hit.astype(dtype), fold, num_segments=num_folds)
  counts = jax.ops.segment_sum(jnp.ones_like(hit, dtype), fold, num_segments=num_folds)
  return jnp.mean(hits / jnp.maximum(counts, 1))


def image_text_recall(
  image_embeddings: Array,
  text_embeddings: Array,
  caption_image_ids: Array,
  *,
  ks: Sequence[int] = (1, 5, 10),
  folds: int | None = None,
  chunk_size: int = 1000,
) -> dict[str, Array]:
  r"""Image-to-text and text-to-image Recall@K with several captions per image.

  Similarity is the dot product ``s(i, j) = image_i . text_j`` (pass
  L2-normalised embeddings for cosine similarity). The rank of a query is the
  number of candidates **strictly** more similar than its best correct
  candidate (0 = first); ties with the correct candidate are resolved in the
  query's favour (optimistic rule), so the metric does not depend on the
  order of the candidates. A query is found at ``K`` iff ``rank < K``.

  * i2t: image ``i``'s correct candidates are all captions ``j`` with
    ``caption_image_ids[j] == i``; it is found at ``K`` if ANY of them ranks
    within the top ``K``,
    ``rank_i = #{j : s(i, j) > max_{j' : id(j') = i} s(i, j')}``.
    An image without any caption is never found.
  * t2i: caption ``j`` has exactly one correct image ``caption_image_ids[j]``,
    ``rank_j = #{i : s(i, j) > s(id(j), j)}``.

  ``R@K`` is the percentage of queries found at ``K``. With ``folds=k`` the
  images are split into ``k`` consecutive folds of ``Ni / k`` images; each
  fold is evaluated on its own (its images, and the captions of its images,
  are the only candidates), and the ``k`` per-fold recalls are averaged: this
  is the MS-COCO "1K test" protocol with ``folds=5`` on the 5K test set.
  ``folds=None`` (or 1) is the full-set protocol ("5K test").

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import metrics
    >>> images = jnp.eye(2)
    >>> texts = jnp.array([[1.0, 0.0], [0.4, 0.6], [0.0, 1.0]])
    >>> r = metrics.image_text_recall(images, texts, jnp.array([0, 0, 1]), ks=(1,))
    >>> print(f"{r['i2t_R@1']:.2f} {r['t2i_R@1']:.2f}")  # caption 1 ranks image 1 first
    100.00 66.67

  Args:
    image_embeddings: ``[Ni, d]`` image embeddings.
    text_embeddings: ``[Nt, d]`` caption embeddings (e.g. ``Nt = 5 * Ni``).
    caption_image_ids: ``[Nt]`` integer index in ``[0, Ni)`` of the image each
      caption describes (any order); checked unless traced under ``jit``.
    ks: keyword-only cut-offs ``K`` (static).
    folds: keyword-only number of consecutive image folds to average over
      (static); must divide ``Ni``. ``None`` evaluates the full set.
    chunk_size: keyword-only number of captions whose similarities are formed
      at once (static); bounds memory at about ``chunk_size * Ni``. With folds, the
      images are also taken in groups of whole folds of at most ``chunk_size``
      images (one fold if a fold is larger).

  Returns:
    Dict with keys ``i2t_R@K`` and ``t2i_R@K`` for each ``K`` in ``ks``, each
    a scalar percentage in ``[0, 100]``.
  """
  images = jnp.asarray(image_embeddings)
  texts = jnp.asarray(text_embeddings)
  ids = jnp.asarray(caption_image_ids).astype(jnp.int32)
  _check_embeddings("image_embeddings", images)
  _check_embeddings("text_embeddings", texts, images.shape[1])
  num_images, num_texts = images.shape[0], texts.shape[0]
  if not num_images or not num_texts:
    raise ValueError(f"need at least one image and one caption, got {num_images} and {num_texts}.")
  _check_chunk_size(chunk_size)
  if ids.shape != (num_texts,):
    raise ValueError(f"caption_image_ids must have shape ({num_texts},), got {ids.shape}.")
  if not isinstance(ids, jax.core.Tracer):  # Under jit the values are not known here.
    low, high = int(jnp.min(ids)), int(jnp.max(ids))
    if low < 0 or high >= num_images:
      bad = low if low < 0 else high
      raise ValueError(f"caption_image_ids must lie in [0, {num_images}), got {bad}.")
  num_folds = 1 if folds is None else int(folds)
  if num_folds < 1 or num_images % num_folds:
    raise ValueError(f"folds={folds} must be a positive divisor of Ni={num_images}.")
  ks = tuple(int(k) for k in ks)
  i2t, t2i = _image_text_recall(
    images, texts, ids, ks=ks, num_folds=num_folds, chunk_size=chunk_size
  )
  # Built outside jit, which would return the keys sorted (R@1, R@10, R@5).
  recall = {f"i2t_R@{k}": i2t[i] for i, k in enumerate(ks)}
  recall.update({f"t2i_R@{k}": t2i[i] for i, k in enumerate(ks)})
  return recall


# A module-level jit: repeated evaluations (every round) reuse one compilation.
@functools.partial(jax.jit, static_argnames=("ks", "num_folds", "chunk_size"))
def _image_text_recall(
  images: Array, texts: Array, ids: Array, *, ks: tuple[int, ...], num_folds: int, chunk_size: int
) -> tuple[Array, Array]:
  """``[len(ks)]`` i2t and t2i recalls (percentages) of validated arrays."""
  i2t_rank, t2i_rank = image_text_ranks(images, texts, ids, num_folds, chunk_size)
  fold_size = images.shape[0] // num_folds
  image_fold = jnp.arange(images.shape[0], dtype=jnp.int32) // fold_size
  caption_fold = ids // fold_size
  i2t = jnp.stack([_fold_mean(i2t_rank < k, image_fold, num_folds) for k in ks])
  t2i = jnp.stack([_fold_mean(t2i_rank < k, caption_fold, num_folds) for k in ks])
  return 100 * i2t, 100 * t2i


def image_text_ranks(
  images: Array, texts: Array, ids: Array, num_folds: int, chunk_size: int
) -> tuple[Array, Array]:
  """``[Ni]`` i2t and ``[Nt]`` t2i ranks, as :func:`image_text_recall` defines them.

  Traceable, and checks nothing: the arrays are as :func:`image_text_recall` has
  validated them. An image without a caption gets the largest int32 (never found).

  Only each fold's own similarities are formed (the full set is one fold). The images
  are cut into ``G`` groups of ``W`` consecutive images: whole folds, as many as fit in
  ``chunk_size`` images, or one fold when a fold is larger. The captions, sorted by
  image, are cut into blocks of at most ``c`` captions of one group each, and every
  block is one ``[c, d] x [d, W]`` product with its group's images: about ``Nt * W``
  similarities, where comparing every query with every candidate and masking the other
  folds out forms ``Nt * Ni`` (1/G of the work; FedRGB's gallery of 32 at 100,000 pairs
  has ``W = 992``, ``G = 101``). Narrower groups would waste less: on a 2-core CPU at
  those 100,000 pairs, ``chunk_size = 32`` (one fold a group) took 58 ms against the
  default's 420 ms; the default keeps the products large, as an accelerator needs them.

  t2i reads each caption's row of its block, so a caption's comparisons, its own
  image's included, are between values of one product. i2t needs each image's best
  correct caption before it can count the captions above it, and those may lie in
  several blocks: a first pass over the blocks takes every caption's similarity to its
  own image (the t2i pass), their maximum per image is the best, and a second pass
  recomputes each block's product, the same operation on the same operands, and counts
  per image column the captions of its fold above that best, summed in place over the
  blocks. A block count that fits any distribution of captions over groups is static
  (``ceil(Nt / c) + G``); the blocks a run does not need skip their product.

  Until 2026-11-30 each block of ``chunk_size`` queries of either direction was ranked
  against every candidate, other folds masked out. At 51,200 pairs (d = 64) on a 2-core
  CPU, this kernel took 0.26 s against 10.5 s in 1,600 folds of 32, and 7.1 s against
  10.6 s over the full set (``experiments/benchmarks/recall.py``, which keeps the old
  kernel, times the two in turn).
  """
  num_images, dim = images.shape
  num_texts = texts.shape[0]
  fold_size = num_images // num_folds
  folds_per_group = max(1, min(num_folds, chunk_size // fold_size))
  width = folds_per_group * fold_size  # W images per group
  num_groups = -(-num_folds // folds_per_group)
  padded = num_groups * width
  group_images = jnp.pad(images, ((0, padded - num_images), (0, 0)))
  group_images = group_images.reshape(num_groups, width, dim)
  # Padded images have fold >= num_folds, which no caption has: never counted.
  image_fold = jnp.arange(padded, dtype=jnp.int32).reshape(num_groups, width) // fold_size

  # Captions sorted by image; those of group g are positions [start[g], start[g] + n[g]).
  order = jnp.argsort(ids, stable=True)
  rows = min(chunk_size, -(-num_texts // num_groups))  # c captions per block
  sorted_ids = jnp.pad(ids[order], (0, rows), constant_values=-1)
  sorted_texts = jnp.pad(texts[order], ((0, rows), (0, 0)))
  per_group = jnp.bincount(ids // width, length=num_groups)
  start = jnp.cumsum(per_group) - per_group
  blocks = -(-per_group // rows)
  num_blocks = -(-num_texts // rows) + num_groups
  block = jnp.arange(num_blocks)
  # Group g's blocks are [blocks_end[g] - blocks[g], blocks_end[g]).
  blocks_end = jnp.cumsum(blocks)
  group = jnp.searchsorted(blocks_end, block, side="right")
  used = group < num_groups
  group = jnp.minimum(group, num_groups - 1)
  first = start[group] + (block - (blocks_end - blocks)[group]) * rows
  end = start[group] + per_group[group]
  dtype = jnp.result_type(images.dtype, texts.dtype)

  def scores(g, first):
    """A block's image ids, ``[c, W]`` products and same-fold mask."""
    index = jax.lax.dynamic_slice_in_dim(sorted_ids, first, rows)
    s = _block_scores(jax.lax.dynamic_slice_in_dim(sorted_texts, first, rows), group_images[g])
    same_fold = (index // fold_size)[:, None] == image_fold[g][None, :]
    return index, s, same_fold

  def text_block(block):
    g, first, end, used = block

    def compute():
      index, s, same_fold = scores(g, first)
      own = jnp.take_along_axis(s, jnp.clip(index - g * width, 0, width - 1)[:, None], axis=1)
      rank = jnp.sum((s > own) & same_fold, axis=1, dtype=jnp.int32)
      # Positions past the group's captions belong to another block: dropped.
      position = first + jnp.arange(rows)
      position = jnp.where(position < end, position, num_texts).astype(jnp.int32)
      return position, rank, own[:, 0]

    skip = (
      jnp.full(rows, num_texts, jnp.int32),
      jnp.zeros(rows, jnp.int32),
      jnp.zeros(rows, dtype),
    )
    return jax.lax.cond(used, compute, lambda: skip)

  position, rank, own = jax.lax.map(text_block, (group, first, end, used))
  position = position.reshape(-1)
  t2i_sorted = jnp.zeros(num_texts, jnp.int32).at[position].set(rank.reshape(-1), mode="drop")
  own_sorted = jnp.zeros(num_texts, dtype).at[position].set(own.reshape(-1), mode="drop")
  t2i_rank = jnp.zeros(num_texts, jnp.int32).at[order].set(t2i_sorted)
  best = jax.ops.segment_max(own_sorted, sorted_ids[:num_texts], num_segments=num_images)
  best = jnp.pad(best, (0, padded - num_images), constant_values=jnp.inf)

  def image_block(b, counts):
    g = group[b]

    def count():
      index, s, same_fold = scores(g, first[b])
      image = g * width + jnp.arange(width)
      # Rows past the group's captions (the next group's, or padding) are of no fold of
      # this group. A correct caption is never above the best of them; leaving them out
      # makes that hold by construction, not through this pass's products equalling the
      # first pass's.
      counted = same_fold & (index[:, None] != image[None, :])
      above = s > jax.lax.dynamic_slice_in_dim(best, g * width, width)
      total = jax.lax.dynamic_slice_in_dim(counts, g * width, width)
      total += jnp.sum(above & counted, axis=0, dtype=jnp.int32)
      return jax.lax.dynamic_update_slice_in_dim(counts, total, g * width, 0)

    return jax.lax.cond(used[b], count, lambda: counts)

  # Summed in place: a [blocks, W] stack of the counts would hold Nt / c + G rows of W.
  counts = jax.lax.fori_loop(0, num_blocks, image_block, jnp.zeros(padded, jnp.int32))
  has_caption = jnp.bincount(ids, length=num_images) > 0
  return jnp.where(has_caption, counts[:num_images], _NEVER), t2i_rank


def _normalize(x: Array) -> Array:
  norm = jnp.linalg.norm(x, axis=-1, keepdims=True)
  return x / jnp.maximum(norm, 1e-12)


def _ranking_arrays(
  query: Array,
  database: Array,
  query_labels: Array,
  database_labels: Array,
  query_where: Array | None,
  database_where: Array | None,
) -> tuple[Array, ...]:
  """Validates the arguments of :func:`map_at_n` / :func:`ndcg_at_n` as arrays."""
  query = jnp.asarray(query)
  database = jnp.asarray(database)
  _check_embeddings("query", query)
  _check_embeddings("database", database, query.shape[1])
  num_queries, num_items = query.shape[0], database.shape[0]
  query_labels = jnp.asarray(query_labels)
  database_labels = jnp.asarray(database_labels)
  if query_labels.ndim not in (1, 2) or query_labels.ndim != database_labels.ndim:
    raise ValueError(
      "labels must be both integer [N] or both multi-hot [N, L], got shapes"
      f" {query_labels.shape} and {database_labels.shape}."
    )
  if query_labels.shape[0] != num_queries or database_labels.shape[0] != num_items:
    raise ValueError("labels must have one row per query / database item.")
  if query_labels.ndim == 2 and query_labels.shape[1] != database_labels.shape[1]:
    raise ValueError(f"label widths differ: {query_labels.shape} vs {database_labels.shape}.")
  query_valid = (
    jnp.ones(num_queries, bool) if query_where is None else jnp.asarray(query_where, bool)
  )
  item_valid = (
    jnp.ones(num_items, bool) if database_where is None else jnp.asarray(database_where, bool)
  )
  if query_valid.shape != (num_queries,) or item_valid.shape != (num_items,):
    raise ValueError("query_where / database_where must be [Nq] / [Nd] masks.")
  return query, database, query_labels, database_labels, query_valid, item_valid


@functools.partial(jax.jit, static_argnames=("n", "chunk_size", "metric"))
def _ranking_metric(
  query: Array,
  database: Array,
  query_labels: Array,
  database_labels: Array,
  query_valid: Array,
  item_valid: Array,
  *,
  n: int,
  chunk_size: int,
  metric: str,
) -> Array:
  """mAP@N (``metric="map"``) or NDCG@N (``"ndcg"``) of validated arrays."""
  if n < 1:
    raise ValueError(f"n must be positive, got {n}.")
  n = min(n, database.shape[0])
  dtype = jnp.result_type(float)
  query = _normalize(query)
  database = _normalize(database)
  if query_labels.ndim == 2:
    # Shared-label counts as a matmul avoid an [chunk, Nd, L] intermediate.
    query_labels = (query_labels != 0).astype(jnp.float32)
    database_labels = (database_labels != 0).astype(jnp.float32)

  def one(q):
    embedding, labels = q
    s = _scores(database, embedding)
    if database_labels.ndim == 1:
      relevant = database_labels == labels
    else:
      relevant = _scores(database_labels, labels) > 0
    relevant &= item_valid
    # Padded items rank last (-inf) and are never relevant, so they are inert.
    _, top = jax.lax.top_k(jnp.where(item_valid, s, -jnp.inf), n)
    return relevant[top].astype(dtype), jnp.sum(relevant).astype(dtype)

  # top: [Nq, n] relevance in ranked order; total: [Nq] relevant items overall.
  top, total = jax.lax.map(one, (query, query_labels), batch_size=chunk_size)
  if metric == "map":
    precision = jnp.cumsum(top, axis=-1) / jnp.arange(1, n + 1, dtype=dtype)
    hits = jnp.sum(top, axis=-1)
    value = jnp.where(hits > 0, jnp.sum(precision * top, axis=-1) / jnp.maximum(hits, 1), 0)
  else:
    discount = 1 / jnp.log2(jnp.arange(2, n + 2, dtype=dtype))
    dcg = jnp.sum(top * discount, axis=-1)
    ideal = jnp.sum(jnp.where(jnp.arange(n) < total[:, None], discount, 0), axis=-1)
    value = jnp.where(total > 0, dcg / jnp.where(total > 0, ideal, 1), 0)
  count = jnp.sum(query_valid)
  mean = jnp.sum(jnp.where(query_valid, value, 0)) / jnp.maximum(count, 1)
  return jnp.where(count > 0, mean, 0)


def map_at_n(
  query: Array,
  database: Array,
  query_labels: Array,
  database_labels: Array,
  *,
  n: int,
  query_where: Array | None = None,
  database_where: Array | None = None,
  chunk_size: int = 1000,
) -> Array:
  r"""Mean average precision of the top ``N`` retrieved items (mAP@N).

  The database is ranked by cosine similarity to each query, in decreasing
  order; ties go to the lower database index (``jax.lax.top_k``, the same
  order as a stable sort). Item ``j`` is relevant to query ``q`` when they
  share a label: ``label_q == label_j`` for integer labels, or
  ``any(labels_q & labels_j)`` for multi-hot labels. With ``rel_k`` the
  relevance of the item at position ``k`` and ``P@k`` the fraction of
  relevant items among the first ``k``,

  .. math::
    \mathrm{AP@N}(q) = \frac{\sum_{k=1}^{N} P@k \cdot \mathrm{rel}_k}
                            {\sum_{k=1}^{N} \mathrm{rel}_k},

  0 when no relevant item is within the top ``N`` (the normaliser counts the
  relevant items retrieved, as DSCMR's ``fx_calc_map_label`` does, not all
  relevant items). mAP@N is the mean of AP@N over valid queries.

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import metrics
    >>> q = jnp.array([[1.0, 0.0]])
    >>> db = jnp.array([[1.0, 0.1], [1.0, 0.5], [1.0, 1.0]])
    >>> m = metrics.map_at_n(q, db, jnp.array([0]), jnp.array([0, 1, 0]), n=3)
    >>> print(f"{m:.4f}")  # order 0, 1, 2; relevant 0, 2: (1 + 2/3) / 2
    0.8333

  Args:
    query: ``[Nq, d]`` query embeddings (normalised inside).
    database: ``[Nd, d]`` database embeddings (normalised inside), e.g. the
      other modality's test set for cross-modal retrieval.
    query_labels: ``[Nq]`` integer labels, or ``[Nq, L]`` multi-hot labels.
    database_labels: ``[Nd]`` or ``[Nd, L]``, of the same kind as
      ``query_labels`` (the kind is detected from ``ndim``).
    n: keyword-only cut-off ``N`` (static), clipped to ``Nd``.
    query_where: optional ``[Nq]`` boolean mask of valid queries.
    database_where: optional ``[Nd]`` boolean mask of valid database items; a
      masked item is as if removed from the database.
    chunk_size: keyword-only number of queries ranked at once (static).

  Returns:
    Scalar float in ``[0, 1]``: the mean over valid queries (0 if none).
  """
  _check_chunk_size(chunk_size)
  arrays = _ranking_arrays(
    query, database, query_labels, database_labels, query_where, database_where
  )
  return _ranking_metric(*arrays, n=n, chunk_size=chunk_size, metric="map")


def ndcg_at_n(
  query: Array,
  database: Array,
  query_labels: Array,
  database_labels: Array,
  *,
  n: int,
  query_where: Array | None = None,
  database_where: Array | None = None,
  chunk_size: int = 1000,
) -> Array:
  r"""Normalised discounted cumulative gain of the top ``N`` items (NDCG@N).

  Ranking, tie rule and relevance are those of :func:`map_at_n`. Gains are
  binary and discounted by ``log2(k + 1)`` at position ``k`` (1-based):

  .. math::
    \mathrm{DCG@N}(q) = \sum_{k=1}^{N} \frac{\mathrm{rel}_k}{\log_2(k + 1)},
    \qquad
    \mathrm{IDCG@N}(q) = \sum_{k=1}^{\min(N, R_q)} \frac{1}{\log_2(k + 1)},

  where ``R_q`` is the number of relevant items in the WHOLE database (the
  ideal ordering puts them all first). ``NDCG@N(q) = DCG / IDCG``, and 0 when
  ``R_q = 0``; this matches ``sklearn.metrics.ndcg_score(relevance,
  similarity, k=N)`` whenever the similarities have no ties (scikit-learn
  averages the gains over tied scores instead). NDCG@N is the mean over valid
  queries.

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import metrics
    >>> q = jnp.array([[1.0, 0.0]])
    >>> db = jnp.array([[1.0, 0.1], [1.0, 0.5], [1.0, 1.0]])
    >>> m = metrics.ndcg_at_n(q, db, jnp.array([0]), jnp.array([0, 1, 0]), n=3)
    >>> print(f"{m:.4f}")  # DCG = 1 + 1/2, IDCG = 1 + 1/log2(3)
    0.9197

  Args:
    query: ``[Nq, d]`` query embeddings (normalised inside).
    database: ``[Nd, d]`` database embeddings (normalised inside), e.g. the
      other modality's test set for cross-modal retrieval.
    query_labels: ``[Nq]`` integer labels, or ``[Nq, L]`` multi-hot labels.
    database_labels: ``[Nd]`` or ``[Nd, L]``, of the same kind as
      ``query_labels`` (the kind is detected from ``ndim``).
    n: keyword-only cut-off ``N`` (static), clipped to ``Nd``.
    query_where: optional ``[Nq]`` boolean mask of valid queries.
    database_where: optional ``[Nd]`` boolean mask of valid database items; a
      masked item is as if removed from the database.
    chunk_size: keyword-only number of queries ranked at once (static).

  Returns:
    Scalar float in ``[0, 1]``: the mean over valid queries (0 if none).
  """
  _check_chunk_size(chunk_size)
  arrays = _ranking_arrays(
    query, database, query_labels, database_labels, query_where, database_where
  )
  return _ranking_metric(*arrays, n=n, chunk_size=chunk_size, metric="ndcg")


def random_ranking(
  labels: Array, mask: Array, *, ns: Sequence[int], key: Array, draws: int = 32
) -> dict[str, Array]:
  """mAP@N and NDCG@N of a random ranking on ONE test set, averaged over ``ns`` and draws.

  Queries and database are i.i.d. Gaussian embeddings (cosine similarity then
  ranks the database uniformly at random), scored with the same metrics as
  the systems; both directions are the same in distribution.

  Args:
    labels: ``int [n]`` labels of the test pairs.
    mask: ``bool [n]`` valid pairs.
    ns: the ``N`` of mAP@N / NDCG@N.
    key: PRNG key.
    draws: random rankings averaged.

  Returns:
    ``{"mAP": m, "NDCG": g}``.
  """

  def one(k):
    q, d = jax.random.normal(k, (2, labels.shape[0], 8))
    kw = dict(query_where=mask, database_where=mask)
    maps = [map_at_n(q, d, labels, labels, n=n, **kw) for n in ns]
    ndcgs = [ndcg_at_n(q, d, labels, labels, n=n, **kw) for n in ns]
    return jnp.mean(jnp.stack(maps)), jnp.mean(jnp.stack(ndcgs))

  maps, ndcgs = jax.jit(jax.vmap(one))(jax.random.split(key, draws))
  return {"mAP": jnp.mean(maps), "NDCG": jnp.mean(ndcgs)}


def chance_recall(
  num_images: int, captions_per_image: int, ks: Sequence[int] = (1, 5, 10)
) -> dict[str, float]:
  """Recall@K (%) of a uniformly random ranking on ``num_images`` images x ``C`` captions.

  t2i: one correct image among ``N``, ``min(K / N, 1)``. i2t: ``C`` correct
  captions among ``C N``, found unless all ``K`` top candidates are wrong,
  ``1 - prod_{j<K} (C N - C - j) / (C N - j)`` (about ``K / N`` too).
  """
  n, c = num_images, captions_per_image
  out = {}
  for k in ks:
    miss = 1.0
    for j in range(min(k, c * n)):
      miss *= max(c * n - c - j, 0) / (c * n - j)
    out[f"i2t_R@{k}"] = 100.0 * (1.0 - miss)
  for k in ks:
    out[f"t2i_R@{k}"] = 100.0 * min(k / n, 1.0)
  return out
