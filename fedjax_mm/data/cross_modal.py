"""Labelled image-text feature pairs for supervised cross-modal retrieval, split by class.

Supervised cross-modal retrieval (DSCMR, FedCMR, FedSCMR) starts from *fixed*
feature vectors: the FedSCMR paper uses 4096-d VGG-19 fc7 features of the
images and 1024-d sentence-BERT features of the texts of Pascal Sentence and
Wikipedia. This module holds such features, whatever produced them:

* :class:`PairedFeatures` — ``image [n, d_img]``, ``text [n, d_txt]`` (row
  ``i`` of both is pair ``i``) and integer ``labels [n]``. Real precomputed
  features go straight in (``PairedFeatures(image=np.load(...), ...)``); the
  embedded world's are made by :func:`fedjax_mm.core.features.world_features`.
* :func:`class_subset_split` — the non-IID split of the experiments: client
  ``k`` sees only ``c_k`` of the classes (a seeded random subset, clients
  overlap) and holds ``n_k`` training pairs plus ``m`` test pairs drawn from
  those classes, disjoint across clients and between train and test.
* :func:`shared_test_split` — one test set over every class, drawn from the
  pairs no client holds, on which every client can be scored (FedCMR's
  protocol: one test set for all clients).

Everything is numpy and deterministic from an integer seed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["PairedFeatures", "class_subset_split", "class_demand", "shared_test_split"]


@dataclasses.dataclass(frozen=True)
class PairedFeatures:
  """``n`` labelled image-text pairs as feature vectors.

  Attributes:
    image: ``float32 [n, d_img]`` image features.
    text: ``float32 [n, d_txt]`` text features.
    labels: ``int32 [n]`` class of each pair, in ``[0, num_classes)``.
  """

  image: np.ndarray
  text: np.ndarray
  labels: np.ndarray

  def __post_init__(self):
    image, text, labels = (np.asarray(x) for x in (self.image, self.text, self.labels))
    if image.ndim != 2 or text.ndim != 2 or labels.ndim != 1:
      raise ValueError(
        f"expected image [n, d_img], text [n, d_txt], labels [n]; got {image.shape}, "
        f"{text.shape}, {labels.shape}."
      )
    if not image.shape[0] == text.shape[0] == labels.shape[0]:
      raise ValueError(
        f"image, text and labels must hold the same pairs, got {image.shape[0]}, "
        f"{text.shape[0]}, {labels.shape[0]} rows."
      )
    for name, x in (("image", image), ("text", text)):
      if not (np.issubdtype(x.dtype, np.number) and np.isfinite(x).all()):
        raise ValueError(f"{name} features must be finite numbers, got dtype {x.dtype} or NaN/Inf.")
    # Class indices: integers, or floats holding integers (as a float tensor saved them).
    if not (np.issubdtype(labels.dtype, np.number) and (labels == np.round(labels)).all()):
      raise ValueError(f"labels must be class indices (integers), got dtype {labels.dtype}.")
    if labels.size and labels.min() < 0:
      raise ValueError(f"labels must be class indices >= 0, got {labels.min()}.")
    object.__setattr__(self, "image", image.astype(np.float32))
    object.__setattr__(self, "text", text.astype(np.float32))
    object.__setattr__(self, "labels", labels.astype(np.int32))

  def __len__(self) -> int:
    return self.labels.shape[0]

  def take(self, idx: np.ndarray | Sequence[int]) -> PairedFeatures:
    """The pairs at ``idx``."""
    return PairedFeatures(self.image[idx], self.text[idx], self.labels[idx])

  def as_dict(self) -> dict[str, np.ndarray]:
    """``{"image", "text", "label"}``: the keys the client engine reads."""
    return {"image": self.image, "text": self.text, "label": self.labels}


def _client_classes(rng: np.random.Generator, num_classes: int, counts: Sequence[int]):
  return [np.sort(rng.choice(num_classes, size=c, replace=False)) for c in counts]


def _per_class(total: int, classes: np.ndarray) -> dict[int, int]:
  """``total`` samples spread as evenly as possible over ``classes`` (first ones get +1)."""
  base, extra = divmod(total, len(classes))
  return {int(c): base + (i < extra) for i, c in enumerate(classes)}


def class_demand(
  num_classes: int, classes_per_client: Sequence[int], sizes: Sequence[int], *, seed: int
) -> np.ndarray:
  """``int [num_classes]`` pairs :func:`class_subset_split` takes from each class."""
  rng = np.random.default_rng(seed)
  demand = np.zeros(num_classes, np.int64)
  for classes, size in zip(
    _client_classes(rng, num_classes, classes_per_client), sizes, strict=True
  ):
    for c, count in _per_class(size, classes).items():
      demand[c] += count
  return demand


def class_subset_split(
  labels: np.ndarray,
  *,
  num_classes: int,
  classes_per_client: Sequence[int],
  train_sizes: Sequence[int],
  test_size: int,
  seed: int,
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
  """Splits a pool of labelled pairs into per-client train / test sets over class subsets.

  Client ``k`` draws ``c_k = classes_per_client[k]`` distinct classes uniformly
  at random (seeded; different clients may share classes), then takes
  ``train_sizes[k] + test_size`` pairs of those classes, as evenly over its
  classes as the counts allow, without replacement from a shuffled pool, and
  splits them at random into train and test. No pair goes to two clients or
  to both train and test.

  Examples:
    >>> labels = np.repeat(np.arange(4), 10)
    >>> train, test, classes = class_subset_split(
    ...   labels, num_classes=4, classes_per_client=[2, 3], train_sizes=[6, 9], test_size=3,
    ...   seed=0)
    >>> [len(t) for t in train], [len(t) for t in test], [len(c) for c in classes]
    ([6, 9], [3, 3], [2, 3])

  Args:
    labels: ``int [n]`` labels of the pool.
    num_classes: number of classes ``C``.
    classes_per_client: ``c_k`` for each client, each in ``[1, C]``.
    train_sizes: ``n_k`` for each client.
    test_size: test pairs per client.
    seed: integer seed.

  Returns:
    ``(train, test, classes)``: per client, sorted ``int64`` indices into the
    pool, and the client's classes.

  Raises:
    ValueError: sizes do not match, a ``c_k`` is out of range, or the pool
      holds too few pairs of some class.
  """
  labels = np.asarray(labels)
  if len(classes_per_client) != len(train_sizes):
    raise ValueError("classes_per_client and train_sizes need one entry per client.")
  for c in classes_per_client:
    if not 1 <= c <= num_classes:
      raise ValueError(f"classes per client must be in [1, {num_classes}], got {c}.")
  rng = np.random.default_rng(seed)
  client_classes = _client_classes(rng, num_classes, classes_per_client)
  pools = {c: rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)}
  taken = dict.fromkeys(range(num_classes), 0)
  train, test = [], []
  for classes, size in zip(client_classes, train_sizes, strict=True):
    chosen = []
    for c, count in _per_class(size + test_size, classes).items():
      if taken[c] + count > len(pools[c]):
        raise ValueError(
          f"class {c} has {len(pools[c])} pairs in the pool; the split needs more than that."
        )
      chosen.append(pools[c][taken[c] : taken[c] + count])
      taken[c] += count
    chosen = rng.permutation(np.concatenate(chosen))
    train.append(np.sort(chosen[:size]))
    test.append(np.sort(chosen[size:]))
  return train, test, client_classes


def shared_test_split(
  labels: np.ndarray,
  *,
  num_classes: int,
  size: int,
  exclude: Sequence[np.ndarray] = (),
  seed: int,
) -> np.ndarray:
  """``size`` pairs over every class, as evenly as the count allows, none of them in ``exclude``.

  The pairs come from the same pool as the clients' (so the same
  distribution given the class), uniformly at random among the pairs of each
  class that are not excluded (the clients' train and test indices).

  Examples:
    >>> labels = np.repeat(np.arange(3), 4)
    >>> test = shared_test_split(labels, num_classes=3, size=5, exclude=[np.arange(2)], seed=0)
    >>> np.bincount(labels[test]).tolist(), bool(set(test) & {0, 1})
    ([2, 2, 1], False)

  Args:
    labels: ``int [n]`` labels of the pool.
    num_classes: number of classes ``C``.
    size: number of pairs; ``size // C`` or one more of each class.
    exclude: index arrays of pairs already taken.
    seed: integer seed.

  Returns:
    sorted ``int64`` indices into the pool.

  Raises:
    ValueError: ``size < C`` or some class has too few pairs left.
  """
  labels = np.asarray(labels)
  if size < num_classes:
    raise ValueError(f"a shared test set over {num_classes} classes needs >= {num_classes} pairs.")
  taken = np.zeros(labels.shape[0], bool)
  for idx in exclude:
    taken[np.asarray(idx, np.int64)] = True
  rng = np.random.default_rng([seed, 13])
  chosen = []
  for c, count in _per_class(size, np.arange(num_classes)).items():
    free = np.flatnonzero((labels == c) & ~taken)
    if len(free) < count:
      raise ValueError(
        f"class {c} has {len(free)} pairs left for the shared test set; it needs {count}."
      )
    chosen.append(rng.choice(free, size=count, replace=False))
  return np.sort(np.concatenate(chosen))
