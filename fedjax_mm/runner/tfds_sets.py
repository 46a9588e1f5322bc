"""Disjoint, seeded slices of TFDS splits: how the runners cut their sets from the papers' data.

A runner with ``config.data.source = "tfds"`` asks each ``(dataset, split)`` it
reads for some sets (a user's training set, a client group's pool, the public
set, a test set), each of some size. :func:`read_disjoint` reads each split once
and gives every set its own examples:

* the pool is the split's first ``data.limit`` examples (0: all of them), so a
  small ``limit`` makes a run small;
* the pool is permuted by a key of the run's seed, the dataset and the split
  (``crc32("<dataset>/<split>")``), and the sets take consecutive slices of that
  order, in the order they were asked: no example is in two sets;
* a pool smaller than the sum asked is shared in proportion (:func:`shares`:
  ``floor(asked * pool / sum)`` each, every set at least one example, else
  :class:`ConfigError`).

Each set's indices are sorted before reading (a set is unordered and the files
are read in order), and :func:`fedjax_mm.data.tfds.load` returns them in the
world's dict-of-arrays interface. FedMuscle's runner (``_tfds_sets``) and
CreamFL's (``_tfds_sets``) read their data through it; :func:`data_source` and
:func:`reader` are their shared config look-ups.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Hashable, Mapping, Sequence

import numpy as np

from fedjax_mm import data
from fedjax_mm.data import tfds as tfds_data
from fedjax_mm.runner.errors import ConfigError


def data_source(config) -> str:
  """``config.data.source``: ``"world"`` (also for a config without a ``data`` block) or ``"tfds"``."""
  block = config.get("data") if hasattr(config, "get") else None
  return "world" if block is None else block.get("source", "world")


def reader(where: str, name: str) -> tfds_data.Reader:
  """The :class:`~fedjax_mm.data.tfds.Reader` of ``name``; ``where`` names the config key in errors."""
  if name not in tfds_data.READERS:
    raise ConfigError(
      f"{where}: unknown TFDS dataset {name!r}; known: {', '.join(tfds_data.READERS)}."
    )
  return tfds_data.READERS[name]


def shares(asked: Sequence[int], pool: int, where: str, limit: int | None) -> list[int]:
  """How many examples each of the sets cut from one pool gets: what it asked, or a share.

  When the pool is smaller than the sum asked, each set gets ``floor(asked * pool /
  sum)``; a set left with none raises :class:`ConfigError`.
  """
  total = sum(asked)
  if total <= pool:
    return list(asked)
  sizes = [n * pool // total for n in asked]
  if min(sizes) < 1:
    raise ConfigError(
      f"data: {where} has {pool} examples (data.limit={limit or 0}) for {len(asked)} sets "
      f"asking {total}: too few to give each one."
    )
  return sizes


def read_disjoint(
  wants: Mapping[tuple[str, str], Sequence[tuple[Hashable, int]]],
  *,
  seed: int,
  data_dir: str | None,
  limit: int | None,
  image_size: int,
  tokenizer: Callable[[str, str], tfds_data.Tokenizer | None] = lambda name, split: None,
) -> dict[Hashable, dict[str, np.ndarray]]:
  """Reads every ``(dataset, split)`` once and cuts it in disjoint, seeded slices.

  Args:
    wants: ``(dataset, split) -> [(who, size), ...]``: the sets each split gives,
      in the order they take their slices; ``who`` names a set (unique overall).
    seed: the run's seed (with the dataset and split, the permutation's key).
    data_dir: the TFDS data folder (None: TFDS's default).
    limit: read at most the first ``limit`` examples of each split (None: all).
    image_size: the side every image is resized to.
    tokenizer: ``(dataset, split) -> Tokenizer | None``, the tokenizer a read's
      captions go through (None: the read keeps no captions).

  Returns:
    ``{who: {key: array [n_who, ...]}}``; ``n_who`` is the size asked, or a share
    of a pool smaller than the sum asked (:func:`shares`).

  Raises:
    ConfigError: a pool too small to give every set an example.
    DatasetError: a split that cannot be read (:func:`fedjax_mm.data.tfds.load`).
  """
  sets = {}
  for (name, split), asked in wants.items():
    pool = tfds_data.num_examples(name, split=split, data_dir=data_dir, limit=limit)
    sizes = shares([n for _, n in asked], pool, f"{name} {split!r}", limit)
    key = zlib.crc32(f"{name}/{split}".encode())
    order = np.random.default_rng([seed, key]).permutation(pool)
    bounds = np.cumsum([0, *sizes])
    # Each set's indices sorted: a set is unordered, and the files are read in order.
    indices = np.concatenate(
      [np.sort(order[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    )
    arrays = tfds_data.load(
      name,
      split=split,
      data_dir=data_dir,
      limit=limit,
      image_size=image_size,
      tokenizer=tokenizer(name, split),
      indices=indices,
    )
    for (who, _), a, b in zip(asked, bounds[:-1], bounds[1:], strict=True):
      sets[who] = data.take(arrays, np.arange(a, b))
  return sets


__all__ = ["data_source", "read_disjoint", "reader", "shares"]
