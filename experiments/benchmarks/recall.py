"""Image-text Recall@K: the library's kernel against its two predecessors, same run.

  python -m experiments.benchmarks.recall [--pairs=2048,10240] [--dim=64] [--repeats=5]

For ``n`` random pairs (one caption per image, ``--dim`` dimensions), times
:func:`fedjax_mm.metrics.retrieval.image_text_ranks`, the ranks behind
:func:`fedjax_mm.metrics.image_text_recall`, over the full set and over ``--gallery``
folds, against two former kernels that compute the same ranks:

* ``per query``: the kernel up to commit 3a12777, each query's similarities one
  matrix-vector product under ``jax.lax.map(..., batch_size=chunk_size)``, against
  every candidate, other folds masked out;
* ``masked``: the kernel up to commit be7ff60 for the full set (and up to 2b6d415 for
  folds), one ``[c, d] x [d, n]`` product per block of ``--chunk_size`` queries of
  either direction, against every candidate, other folds masked out.

The library now sorts the captions by image and forms, block by block, only their
similarities to their own fold's images (the full set is one fold).

The three take turns, one call each, ``--repeats`` times after an untimed call; each
printed ratio is the median of the paired (same-turn) ratios (above 1: the library's
kernel is faster). Each row also prints how many queries' ranks differ from the
per-query kernel's: the same dot products summed in another order, so a float32
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


def _map_blocks(fn, xs, chunk_size):
  """``fn`` over blocks of at most ``chunk_size`` rows of ``xs`` (equal, the last padded)."""
  m = jax.tree.leaves(xs)[0].shape[0]
  num_blocks = max(1, -(-m // chunk_size))
  c = -(-m // num_blocks)

  def blocks(x):
    x = jnp.pad(x, [(0, num_blocks * c - m)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape(num_blocks, c, *x.shape[1:])

  return jax.lax.map(fn, jax.tree.map(blocks, xs)).reshape(num_blocks * c)[:m]


def _masked_ranks(images, texts, ids, num_folds, chunk_size):
  """i2t and t2i ranks, a block of queries against every candidate (the former kernel)."""
  fold_size = images.shape[0] // num_folds
  image_fold = jnp.arange(images.shape[0], dtype=jnp.int32) // fold_size
  caption_fold = ids // fold_size

  def scores(queries, candidates):
    return jnp.matmul(queries, candidates.T, precision=jax.lax.Precision.HIGHEST)

  def image_block(block):
    embedding, index = block
    s = scores(embedding, texts)
    correct = ids[None, :] == index[:, None]
    best = jnp.max(jnp.where(correct, s, -jnp.inf), axis=1, keepdims=True)
    same_fold = caption_fold[None, :] == (index // fold_size)[:, None]
    rank = jnp.sum((s > best) & same_fold, axis=1, dtype=jnp.int32)
    return jnp.where(jnp.any(correct, axis=1), rank, jnp.iinfo(jnp.int32).max)

  def text_block(block):
    embedding, index = block
    s = scores(embedding, images)
    own = jnp.take_along_axis(s, index[:, None], axis=1)
    same_fold = image_fold[None, :] == (index // fold_size)[:, None]
    return jnp.sum((s > own) & same_fold, axis=1, dtype=jnp.int32)

  queries = (images, jnp.arange(images.shape[0], dtype=jnp.int32))
  return _map_blocks(image_block, queries, chunk_size), _map_blocks(
    text_block, (texts, ids), chunk_size
  )


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
      masked = jax.jit(functools.partial(_masked_ranks, **static))
      library = jax.jit(functools.partial(metrics.retrieval.image_text_ranks, **static))
      times, ratios = _in_turn([per_query, masked, library], (images, texts, ids), _REPEATS.value)
      differ = sum(
        int(np.sum(np.asarray(a) != np.asarray(b)))
        for a, b in zip(per_query(images, texts, ids), library(images, texts, ids), strict=True)
      )
      print(
        f"{n:>7} {folds:>6} | {1e3 * times[0]:>8.1f}ms | {1e3 * times[1]:>7.1f}ms | "
        f"{1e3 * times[2]:>7.1f}ms | {ratios[0]:>18.1f}x | {ratios[1]:>15.1f}x | "
        f"{differ} of {2 * n}"
      )


if __name__ == "__main__":
  app.run(main)
