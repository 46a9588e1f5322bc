"""Trivial baselines of every task kind, against scikit-learn's and a direct count."""

import jax
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


def test_segmentation_ignores_void_pixels():
  """Void (255, or anything outside [0, C)) adds nothing to the loss, mIoU or the trivial count."""
  rng = np.random.default_rng(3)
  task = core.Task("segmentation", "image", "mask", 4)
  logits = rng.normal(size=(3, 5, 5, 4)).astype(np.float32)
  labels = rng.integers(0, 4, (3, 5, 5))
  void = rng.random((3, 5, 5)) < 0.3
  void[2] = True  # an example with no labelled pixel
  masked = np.where(void, 255, labels)
  masked[0, 0, :2] = -1  # negative labels are void too
  void[0, 0, :2] = True
  loss = np.asarray(task.per_example_loss(logits, masked))
  log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  nll = -np.take_along_axis(log_p, labels[..., None], -1)[..., 0]
  for i in range(2):  # the mean over the labelled pixels only
    assert loss[i] == pytest.approx(nll[i][~void[i]].mean(), rel=1e-5)
  assert loss[2] == 0.0 and np.isfinite(loss).all()
  assert np.isfinite(float(task.loss(logits, masked, np.ones(3, bool))))
  pred = logits.argmax(-1)
  expected = jaccard_score(labels[~void], pred[~void], average="macro", labels=np.arange(4))
  assert float(task.metric(logits, masked, np.ones(3, bool))) == pytest.approx(expected, abs=1e-6)
  # The trivial baseline counts labelled pixels only: void outnumbers class 3 but is no class.
  train = np.full((2, 4, 4), 255)
  train[:, 0, :3] = 3
  train[:, 1, :2] = 1
  got = float(task.trivial_metric(train, masked))
  threes, present = np.full(labels[~void].shape, 3), np.union1d(labels[~void], [3])
  expected = jaccard_score(labels[~void], threes, average="macro", labels=present)
  assert got == pytest.approx(expected, abs=1e-6)
  # The gradient is finite and void pixels get none.
  grad = np.asarray(jax.grad(lambda o: task.loss(o, masked, np.ones(3, bool)))(logits))
  assert np.isfinite(grad).all()
  assert not grad[void].any() and grad[~void].any()
