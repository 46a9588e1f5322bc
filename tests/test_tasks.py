"""Trivial baselines of every task kind, against scikit-learn's and a direct count."""

import numpy as np
import pytest
from sklearn.dummy import DummyClassifier
from sklearn.metrics import f1_score, jaccard_score

from fedjax_mm import core


def test_majority_class_equals_sklearn_dummy():
  rng = np.random.default_rng(0)
  train, test = rng.integers(0, 5, 200), rng.integers(0, 5, 80)
  task = core.Task("classification", "image", "label10", 5)
  dummy = DummyClassifier(strategy="most_frequent").fit(np.zeros((200, 1)), train)
  assert float(task.trivial_metric(train, test)) == pytest.approx(
    dummy.score(np.zeros((80, 1)), test)
  )


def test_all_positive_micro_f1_equals_sklearn():
  rng = np.random.default_rng(1)
  test = (rng.random((60, 10)) < 0.15).astype(np.float32)
  task = core.Task("multilabel", "image", "multilabel", 10)
  expected = f1_score(test, np.ones_like(test), average="micro")
  assert float(task.trivial_metric(test, test)) == pytest.approx(expected, abs=1e-6)


def test_segmentation_majority_pixel_class_miou():
  rng = np.random.default_rng(2)
  train = np.where(rng.random((4, 8, 8)) < 0.7, 0, rng.integers(1, 4, (4, 8, 8)))
  test = np.where(rng.random((3, 8, 8)) < 0.6, 0, rng.integers(1, 4, (3, 8, 8)))
  task = core.Task("segmentation", "image", "mask", 4)
  # mIoU over the classes present (in the targets or the predictions): background alone
  # has IoU = its pixel share; every other class has IoU 0.
  present = np.unique(test)
  ious = jaccard_score(test.ravel(), np.zeros(test.size, int), average=None, labels=present)
  assert float(task.trivial_metric(train, test)) == pytest.approx(ious.mean(), abs=1e-6)
