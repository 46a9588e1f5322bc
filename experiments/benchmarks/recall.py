"""Image-text Recall@K: the block kernel against one query at a time, same run.

  python -m experiments.benchmarks.recall [--pairs=2048,10240] [--dim=64] [--repeats=5]

For ``n`` random pairs (one caption per image, ``--dim`` dimensions), times
:func:`fedjax_mm.metrics.image_text_recall` (full set and ``--gallery`` folds) and
``per query``: the same ranks computed as the metric computed them up to commit
3a12777, each query's similarities one matrix-vector product under
``jax.lax.map(..., batch_size=chunk_size)``. Both rank every query against every
candidate in blocks of ``--chunk_size``, so their work is the same; what differs is
the shape of the program (one ``[c, d] x [d, n]`` product per block, against a
vmapped product per query and the reductions that follow it).

The two take turns, one call each, ``--repeats`` times after an untimed call; the
printed ratio is the median of the paired (same-turn) ratios (above 1: the block
kernel is faster). Each row also prints how many queries' ranks differ between the
two: they compute the same dot products in another order, so a float32 near-tie may
fall the other way (a handful in 10,000).
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


def _paired(first, second, args, repeats):
  jax.block_until_ready((first(*args), second(*args)))
  ratios, times = [], []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(first(*args))
    t1 = time.perf_counter()
    jax.block_until_ready(second(*args))
    t2 = time.perf_counter()
    ratios.append((t1 - t0) / (t2 - t1))
    times.append((t1 - t0, t2 - t1))
  return statistics.median(ratios), [statistics.median(t) for t in zip(*times, strict=True)]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  print(f"backend {jax.default_backend()}, d = {_DIM.value}, blocks of {_CHUNK.value} queries")
  print(f"{'pairs':>7} {'folds':>6} | {'per query':>10} | {'block':>9} | ratio | ranks differing")
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
      old = jax.jit(functools.partial(_per_query_ranks, **static))
      new = jax.jit(functools.partial(metrics.retrieval.image_text_ranks, **static))
      ratio, (t_old, t_new) = _paired(old, new, (images, texts, ids), _REPEATS.value)
      differ = sum(
        int(np.sum(np.asarray(a) != np.asarray(b)))
        for a, b in zip(old(images, texts, ids), new(images, texts, ids), strict=True)
      )
      print(
        f"{n:>7} {folds:>6} | {1e3 * t_old:>8.1f}ms | {1e3 * t_new:>7.1f}ms | "
        f"{ratio:4.1f}x | {differ} of {2 * n}"
      )


if __name__ == "__main__":
  app.run(main)
