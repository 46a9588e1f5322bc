"""Image-text Recall@K: the library's kernels against their predecessors, same run.

  python -m experiments.benchmarks.recall [--pairs=2048,10240] [--dim=64] [--repeats=5]

For ``n`` random pairs (one caption per image, ``--dim`` dimensions), times
:func:`fedjax_mm.metrics.retrieval.image_text_ranks`, the ranks behind
:func:`fedjax_mm.metrics.image_text_recall`, over the full set and over ``--gallery``
folds, against two former kernels computing the same ranks:

* ``per query``: as up to commit 3a12777, each query's similarities one
  matrix-vector product under ``jax.lax.map(..., batch_size=chunk_size)``, against
  every candidate, other folds masked out;
* ``masked``: as up to commit 2b6d415 (``retrieval._dense_ranks``, still the full-set
  kernel), one ``[c, d] x [d, n]`` product per block of ``--chunk_size`` queries,
  against every candidate, other folds masked out. With folds the library now forms
  each fold's own similarities only (``retrieval._folded_ranks``); over the full set
  it runs this kernel, so that row times it once.

The contenders take turns, one call each, ``--repeats`` times after an untimed call;
each printed ratio is the median of the paired (same-turn) ratios (above 1: the
library's kernel is faster). Each row also prints how many queries' ranks differ from
the per-query kernel's: the same dot products summed in another order, so a float32
near-tie may fall the other way (a handful in 10,000).
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import benchmarks
from fedjax_mm import metrics

_PAIRS = benchmarks.define_counts("pairs", ["2048", "10240"], "Numbers of image-caption pairs.")
_DIM = flags.DEFINE_integer("dim", 64, "Embedding dimension.", lower_bound=1)
_GALLERY = flags.DEFINE_integer(
  "gallery", 32, "Images per fold of the folded protocol.", lower_bound=1
)
_CHUNK = flags.DEFINE_integer("chunk_size", 1000, "Queries per block.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed turns per row.", lower_bound=1)


def _per_query_ranks(images, texts, ids, num_folds, chunk_size):
  """i2t and t2i ranks, one query at a time under ``lax.map`` (the former kernel)."""
  fold_size = images.shape[0] // num_folds
  image_fold = jnp.arange(images.shape[0], dtype=jnp.int32) // fold_size
  caption_fold = ids // fold_size

  def scores(candidates, query):
    return jnp.matmul(candidates, query, precision=jax.lax.Precision.HIGHEST)

  def image_query(query):
    embedding, index = query
    s = scores(texts, embedding)
    correct = ids == index
    best = jnp.max(jnp.where(correct, s, -jnp.inf))
    rank = jnp.sum((s > best) & (caption_fold == index // fold_size), dtype=jnp.int32)
    return jnp.where(jnp.any(correct), rank, jnp.iinfo(jnp.int32).max)

  def text_query(query):
    embedding, index = query
    s = scores(images, embedding)
    return jnp.sum((s > s[index]) & (image_fold == index // fold_size), dtype=jnp.int32)

  queries = (images, jnp.arange(images.shape[0], dtype=jnp.int32))
  i2t = jax.lax.map(image_query, queries, batch_size=chunk_size)
  return i2t, jax.lax.map(text_query, (texts, ids), batch_size=chunk_size)


def _in_turn(contenders, args, repeats):
  """Median time of each contender and median paired ratio of each to the last."""
  jax.block_until_ready([fn(*args) for fn in contenders])
  times = []
  for _ in range(repeats):
    turn = []
    for fn in contenders:
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      turn.append(time.perf_counter() - t0)
    times.append(turn)
  medians = [statistics.median(column) for column in zip(*times, strict=True)]
  ratios = [statistics.median(turn[k] / turn[-1] for turn in times) for k in range(len(contenders))]
  return medians, ratios


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  print(f"backend {jax.default_backend()}, d = {_DIM.value}, blocks of {_CHUNK.value} queries")
  print(
    f"{'pairs':>7} {'folds':>6} | {'per query':>10} | {'masked':>9} | {'library':>9} | "
    "per query / library | masked / library | ranks differing"
  )
  for n in (int(p) for p in _PAIRS.value):
    keys = jax.random.split(jax.random.key(0))
    images = jax.random.normal(keys[0], (n, _DIM.value))
    texts = images + 2.0 * jax.random.normal(keys[1], (n, _DIM.value))
    ids = jnp.arange(n, dtype=jnp.int32)
    for folds in (1, n // _GALLERY.value):
      if not folds or n % folds:
        print(f"{n:>7}: --gallery={_GALLERY.value} does not divide it; full set only")
        continue
      static = {"num_folds": folds, "chunk_size": _CHUNK.value}
      per_query = jax.jit(functools.partial(_per_query_ranks, **static))
      masked = jax.jit(functools.partial(metrics.retrieval._dense_ranks, **static))
      library = jax.jit(functools.partial(metrics.retrieval.image_text_ranks, **static))
      # Over the full set the library runs the masked kernel itself: timed once.
      contenders = [per_query, masked, library] if folds > 1 else [per_query, library]
      times, ratios = _in_turn(contenders, (images, texts, ids), _REPEATS.value)
      if folds == 1:
        times, ratios = [times[0], None, times[1]], [ratios[0], None, ratios[1]]
      differ = sum(
        int(np.sum(np.asarray(a) != np.asarray(b)))
        for a, b in zip(per_query(images, texts, ids), library(images, texts, ids), strict=True)
      )
      shown = [f"{1e3 * t:>8.1f}ms" if t is not None else f"{'=':>10}" for t in times]
      masked_ratio = f"{ratios[1]:>15.1f}x" if ratios[1] is not None else f"{'-':>16}"
      print(
        f"{n:>7} {folds:>6} | {shown[0]} | {shown[1]:>9} | {shown[2]:>9} | "
        f"{ratios[0]:>18.1f}x | {masked_ratio} | {differ} of {2 * n}"
      )


if __name__ == "__main__":
  app.run(main)
