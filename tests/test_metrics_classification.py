"""Accuracy and micro-F1 against scikit-learn on random, masked and edge-case data."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn import metrics as skm

from fedjax_mm import metrics

SEEDS = range(5)


def _classification_problem(seed, n=40, num_classes=5):
  rng = np.random.default_rng(seed)
  # Small integer logits make arg-max ties frequent (both sides take the first).
  logits = rng.integers(-2, 3, size=(n, num_classes)).astype(np.float32)
  labels = rng.integers(0, num_classes, size=n)
  where = rng.random(n) < 0.7
  return logits, labels, where


def _multilabel_problem(seed, n=30, num_labels=6):
  rng = np.random.default_rng(seed)
  # Quarter-integer logits put some entries exactly on the threshold 0.
  logits = rng.integers(-4, 5, size=(n, num_labels)).astype(np.float32) / 4
  targets = (rng.random((n, num_labels)) < 0.3).astype(np.int32)
  where = rng.random(n) < 0.7
  return logits, targets, where


@pytest.mark.parametrize("seed", SEEDS)
def test_accuracy_matches_sklearn(seed):
  logits, labels, where = _classification_problem(seed)
  got = metrics.accuracy(logits, labels)
  np.testing.assert_allclose(got, skm.accuracy_score(labels, logits.argmax(-1)), rtol=1e-6)
  got = metrics.accuracy(logits, labels, where=where)
  expected = skm.accuracy_score(labels[where], logits[where].argmax(-1))
  np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_accuracy_ties_go_to_the_lowest_class():
  logits = jnp.array([[1.0, 1.0, 0.0], [0.0, 2.0, 2.0]])
  np.testing.assert_allclose(metrics.accuracy(logits, jnp.array([0, 1])), 1.0)
  np.testing.assert_allclose(metrics.accuracy(logits, jnp.array([1, 2])), 0.0)


def test_accuracy_with_no_valid_row_is_zero():
  logits, labels, _ = _classification_problem(0, n=4)
  got = metrics.accuracy(logits, labels, where=np.zeros(4, bool))
  assert float(got) == 0.0


def test_accuracy_rejects_mismatched_shapes():
  with pytest.raises(ValueError):
    metrics.accuracy(jnp.zeros((3, 2)), jnp.zeros(4, jnp.int32))
  with pytest.raises(ValueError):
    metrics.accuracy(jnp.zeros((3, 2)), jnp.zeros(3, jnp.int32), where=jnp.ones(4, bool))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("threshold", [0.0, 0.25, -0.5])
def test_micro_f1_matches_sklearn(seed, threshold):
  logits, targets, where = _multilabel_problem(seed)
  predictions = (logits > threshold).astype(np.int32)
  got = metrics.micro_f1(logits, targets, threshold=threshold)
  expected = skm.f1_score(targets, predictions, average="micro", zero_division=0)
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  got = metrics.micro_f1(logits, targets, threshold=threshold, where=where)
  expected = skm.f1_score(targets[where], predictions[where], average="micro", zero_division=0)
  np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_micro_f1_threshold_is_strict():
  # sigmoid(0) = 0.5 is not a positive prediction.
  logits = jnp.array([[0.0, 1.0]])
  np.testing.assert_allclose(metrics.micro_f1(logits, jnp.array([[1, 1]])), 2 / 3, rtol=1e-6)


def test_micro_f1_probabilities_with_threshold_half():
  logits, targets, _ = _multilabel_problem(3)
  probabilities = jax.nn.sigmoid(logits)
  np.testing.assert_allclose(
    metrics.micro_f1(probabilities, targets, threshold=0.5),
    metrics.micro_f1(logits, targets),
    rtol=1e-6,
  )


@pytest.mark.parametrize("logit", [-1.0, 1.0])
def test_micro_f1_all_negative_targets(logit):
  # No positive target: 0 with or without false positives (sklearn zero_division=0).
  logits = jnp.full((4, 3), logit)
  targets = np.zeros((4, 3), np.int32)
  expected = skm.f1_score(
    targets, np.asarray(logits > 0, np.int32), average="micro", zero_division=0
  )
  assert float(metrics.micro_f1(logits, targets)) == expected == 0.0


def test_micro_f1_masked_rows_are_inert():
  logits, targets, where = _multilabel_problem(7)
  garbage = np.where(where[:, None], logits, 100.0)  # padded rows predict everything
  np.testing.assert_allclose(
    metrics.micro_f1(garbage, targets, where=where),
    metrics.micro_f1(logits[where], targets[where]),
    rtol=1e-6,
  )
  assert float(metrics.micro_f1(logits, targets, where=np.zeros_like(where))) == 0.0


def test_micro_f1_perfect_prediction_is_one():
  _, targets, _ = _multilabel_problem(2)
  logits = np.where(targets > 0, 3.0, -3.0)
  np.testing.assert_allclose(metrics.micro_f1(logits, targets), 1.0)


def test_vmap_over_clients_equals_each_client_separately():
  num_clients = 4
  problems = [_classification_problem(s, n=25) for s in range(num_clients)]
  logits, labels, where = (np.stack(x) for x in zip(*problems, strict=True))
  where[3] = False  # a padding client
  batched = jax.jit(jax.vmap(metrics.accuracy))(logits, labels, where=where)
  for k in range(num_clients):
    single = metrics.accuracy(logits[k], labels[k], where=where[k])
    np.testing.assert_allclose(batched[k], single, rtol=1e-6)
  assert float(batched[3]) == 0.0

  problems = [_multilabel_problem(s, n=25) for s in range(num_clients)]
  logits, targets, where = (np.stack(x) for x in zip(*problems, strict=True))
  where[1] = False
  f1 = jax.jit(jax.vmap(functools.partial(metrics.micro_f1, threshold=0.25)))
  batched = f1(logits, targets, where=where)
  for k in range(num_clients):
    single = metrics.micro_f1(logits[k], targets[k], threshold=0.25, where=where[k])
    np.testing.assert_allclose(batched[k], single, rtol=1e-6)


def test_jit_matches_eager_and_float64(x64):
  logits, targets, where = _multilabel_problem(4)
  eager = metrics.micro_f1(logits, targets, where=where)
  assert eager.dtype == jnp.float64
  np.testing.assert_allclose(jax.jit(metrics.micro_f1)(logits, targets, where=where), eager)
  logits, labels, where = _classification_problem(4)
  eager = metrics.accuracy(logits, labels, where=where)
  np.testing.assert_allclose(jax.jit(metrics.accuracy)(logits, labels, where=where), eager)
  expected = skm.accuracy_score(labels[where], logits[where].argmax(-1))
  np.testing.assert_allclose(eager, expected, rtol=1e-12)
