"""Confusion matrix and mIoU against scikit-learn on flattened valid pixels."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn import metrics as skm

from fedjax_mm import metrics

SEEDS = range(5)
VOID = 255


def _problem(seed, n=6, size=5, num_classes=4, void_fraction=0.1):
  rng = np.random.default_rng(seed)
  # Integer logits: arg-max ties are common, and both sides take the first index.
  logits = rng.integers(0, 3, size=(n, size, size, num_classes)).astype(np.float32)
  labels = rng.integers(0, num_classes, size=(n, size, size))
  labels = np.where(rng.random(labels.shape) < void_fraction, VOID, labels)
  where = rng.random(n) < 0.7
  where[0] = True
  return logits, labels, where


def _valid_pixels(predictions, labels, where, num_classes, ignore_index=None):
  """Flattened (label, prediction) pairs that should be counted."""
  keep = np.broadcast_to(
    where.reshape(where.shape + (1,) * (labels.ndim - where.ndim)), labels.shape
  )
  keep = keep & (labels >= 0) & (labels < num_classes)
  if ignore_index is not None:
    keep = keep & (labels != ignore_index)
  return labels[keep], predictions[keep]


def _sklearn_miou(y_true, y_pred):
  present = np.union1d(y_true, y_pred)
  if present.size == 0:
    return 0.0
  return skm.jaccard_score(y_true, y_pred, labels=present, average="macro")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("ignore_index", [None, 0])
def test_confusion_matrix_matches_sklearn(seed, ignore_index):
  logits, labels, where = _problem(seed)
  num_classes = logits.shape[-1]
  predictions = logits.argmax(-1)
  y_true, y_pred = _valid_pixels(predictions, labels, where, num_classes, ignore_index)
  expected = skm.confusion_matrix(y_true, y_pred, labels=range(num_classes))
  for scores in (logits, predictions):
    got = metrics.confusion_matrix(
      scores, labels, num_classes=num_classes, where=where, ignore_index=ignore_index
    )
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("ignore_index", [None, 2, VOID])
def test_mean_iou_matches_sklearn_jaccard(seed, ignore_index):
  logits, labels, where = _problem(seed)
  num_classes = logits.shape[-1]
  y_true, y_pred = _valid_pixels(logits.argmax(-1), labels, where, num_classes, ignore_index)
  got = metrics.mean_iou(
    logits, labels, num_classes=num_classes, where=where, ignore_index=ignore_index
  )
  np.testing.assert_allclose(got, _sklearn_miou(y_true, y_pred), rtol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_pixel_mask(seed):
  logits, labels, _ = _problem(seed)
  num_classes = logits.shape[-1]
  pixel_where = np.random.default_rng(seed + 100).random(labels.shape) < 0.5
  y_true, y_pred = _valid_pixels(logits.argmax(-1), labels, pixel_where, num_classes)
  got = metrics.mean_iou(logits, labels, num_classes=num_classes, where=pixel_where)
  np.testing.assert_allclose(got, _sklearn_miou(y_true, y_pred), rtol=1e-6)


def test_absent_class_is_left_out_of_the_mean():
  # Class 2 is neither present nor predicted; class 1 is predicted but absent.
  labels = np.array([[0, 0, 0, 0]])
  predictions = np.array([[0, 0, 1, 1]])
  got = metrics.mean_iou(predictions, labels, num_classes=3)
  np.testing.assert_allclose(got, (0.5 + 0.0) / 2, rtol=1e-6)
  np.testing.assert_allclose(got, _sklearn_miou(labels.ravel(), predictions.ravel()), rtol=1e-6)


def test_nothing_valid_gives_zero():
  logits, labels, where = _problem(1)
  num_classes = logits.shape[-1]
  none = np.zeros_like(where)
  assert float(metrics.mean_iou(logits, labels, num_classes=num_classes, where=none)) == 0.0
  void = np.full_like(labels, VOID)
  assert float(metrics.mean_iou(logits, void, num_classes=num_classes)) == 0.0


def test_out_of_range_predictions_are_not_counted():
  labels = np.array([0, 1, 1, 0])
  predictions = np.array([0, 1, 7, -1])
  expected = skm.confusion_matrix(labels[:2], predictions[:2], labels=range(2))
  np.testing.assert_array_equal(
    metrics.confusion_matrix(predictions, labels, num_classes=2), expected
  )


def test_negative_labels_are_not_counted():
  # -1 must not wrap around to the last class.
  labels = np.array([[0, -1, 2, -1]])
  predictions = np.array([[0, 2, 2, 1]])
  expected = skm.confusion_matrix([0, 2], [0, 2], labels=range(3))
  np.testing.assert_array_equal(
    metrics.confusion_matrix(predictions, labels, num_classes=3), expected
  )
  np.testing.assert_allclose(metrics.mean_iou(predictions, labels, num_classes=3), 1.0)


def test_summed_batches_equal_the_whole_set():
  logits, labels, where = _problem(3, n=8)
  num_classes = logits.shape[-1]
  cm = sum(
    metrics.confusion_matrix(
      logits[i : i + 3], labels[i : i + 3], num_classes=num_classes, where=where[i : i + 3]
    )
    for i in range(0, 8, 3)
  )
  whole = metrics.mean_iou(logits, labels, num_classes=num_classes, where=where)
  np.testing.assert_allclose(metrics.mean_iou_from_confusion_matrix(cm), whole, rtol=1e-6)


def test_perfect_prediction_is_one():
  _, labels, _ = _problem(2)
  predictions = np.where(labels == VOID, 0, labels)
  np.testing.assert_allclose(metrics.mean_iou(predictions, labels, num_classes=4), 1.0)


def test_rejects_bad_shapes():
  with pytest.raises(ValueError):
    metrics.mean_iou(jnp.zeros((2, 3, 3, 4, 1)), jnp.zeros((2, 3, 3), jnp.int32), num_classes=4)
  with pytest.raises(ValueError):
    metrics.mean_iou(
      jnp.zeros((2, 3, 3)), jnp.zeros((2, 3, 3), jnp.int32), num_classes=4, where=jnp.ones(3, bool)
    )


def test_vmap_over_clients_equals_each_client_separately():
  num_clients, num_classes = 4, 4
  problems = [_problem(s, n=5) for s in range(num_clients)]
  logits, labels, where = (np.stack(x) for x in zip(*problems, strict=True))
  where[2] = False  # a padding client
  miou = functools.partial(metrics.mean_iou, num_classes=num_classes, ignore_index=VOID)
  batched = jax.jit(jax.vmap(miou))(logits, labels, where=where)
  for k in range(num_clients):
    np.testing.assert_allclose(batched[k], miou(logits[k], labels[k], where=where[k]), rtol=1e-6)
  assert float(batched[2]) == 0.0
  cms = jax.vmap(functools.partial(metrics.confusion_matrix, num_classes=num_classes))(
    logits, labels, where=where
  )
  for k in range(num_clients):
    y_true, y_pred = _valid_pixels(logits[k].argmax(-1), labels[k], where[k], num_classes)
    if y_true.size:
      expected = skm.confusion_matrix(y_true, y_pred, labels=range(num_classes))
    else:  # scikit-learn refuses empty input
      expected = np.zeros((num_classes, num_classes), int)
    np.testing.assert_array_equal(cms[k], expected)


@pytest.mark.parametrize("seed", SEEDS)
def test_dice_equals_sklearn_f1_on_the_valid_pixels(seed):
  rng = np.random.default_rng(seed)
  labels = rng.random((6, 5, 5)) < 0.3
  predictions = rng.random((6, 5, 5)) < 0.4
  where = rng.random(6) < 0.7
  where[0] = True
  keep = np.broadcast_to(where[:, None, None], labels.shape)
  want = skm.f1_score(labels[keep], predictions[keep])
  got = metrics.dice(predictions, labels, where=where)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  # A pixel mask works as a sample mask broadcast.
  np.testing.assert_allclose(metrics.dice(predictions, labels, where=keep), want, rtol=1e-6)


def test_dice_limits():
  labels = jnp.zeros((2, 3, 3), bool).at[0, 0, 0].set(True)
  assert float(metrics.dice(labels, labels)) == 1.0
  assert float(metrics.dice(~labels, labels)) == 0.0
  assert float(metrics.dice(jnp.zeros_like(labels), jnp.zeros_like(labels))) == 1.0
  # All-positive: 2 p / (1 + p) with p the foreground share (1 of 18 pixels).
  np.testing.assert_allclose(metrics.dice(jnp.ones_like(labels), labels), 2 / 19, rtol=1e-6)
  with pytest.raises(ValueError, match="must match"):
    metrics.dice(labels[:1], labels)
