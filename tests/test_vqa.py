"""The VQA fusion head: it learns what the features say, no more; metrics == numpy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mm.algorithms import vqa

TYPES, ANSWERS = 3, 12
HEAD = {"hidden": 32, "steps": 300, "batch_size": 64, "learning_rate": 3e-3}
#: Training questions: enough that the head cannot memorise noise (it can at a few hundred).
N_TRAIN = 3000
# One compiled program for every test here (same shapes and hyperparameters).
evaluate = jax.jit(functools.partial(vqa.evaluate, num_types=TYPES, num_answers=ANSWERS, **HEAD))


def _qa(seed, n, image_from_answer):
  """``n`` questions; type k's answers lie in [4k, 4k + 4), skewed towards the first.

  ``image_from_answer``: the image feature is the answer's one-hot plus noise
  (it says the answer); otherwise pure noise.
  """
  rng = np.random.default_rng(seed)
  qtype = rng.integers(0, TYPES, n)
  answer = 4 * qtype + rng.choice(4, size=n, p=[0.55, 0.25, 0.15, 0.05])
  noise = rng.normal(size=(n, ANSWERS)).astype(np.float32)
  image = 0.2 * noise + (np.eye(ANSWERS, dtype=np.float32)[answer] if image_from_answer else 0)
  text = rng.normal(size=(n, 6)).astype(np.float32)
  return vqa.QASet(*(jnp.asarray(x) for x in (image, text, qtype, answer)))


def _majority_numpy(train, test):
  """Per type, the most frequent training answer (lowest on ties), scored on ``test``."""
  qtype, answer = np.asarray(train.qtype), np.asarray(train.answer)
  best = [np.bincount(answer[qtype == t], minlength=ANSWERS).argmax() for t in range(TYPES)]
  return np.mean(np.asarray(best)[np.asarray(test.qtype)] == np.asarray(test.answer))


def test_features_that_say_the_answer_are_learnt_and_the_blind_head_cannot_read_them():
  train, test = _qa(0, N_TRAIN, True), _qa(1, 1000, True)
  out = evaluate(jax.random.key(0), train, test)
  assert float(out["accuracy"]) > 0.97
  np.testing.assert_allclose(out["per_type"], 1.0, atol=0.05)
  # Blind, the image's answer is out of reach: the head falls back on the type's prior.
  majority = _majority_numpy(train, test)
  assert float(out["majority_accuracy"]) == pytest.approx(majority)
  assert abs(float(out["blind_accuracy"]) - majority) < 0.05


def test_random_features_score_about_the_majority():
  train, test = _qa(2, N_TRAIN, False), _qa(3, 2000, False)
  out = evaluate(jax.random.key(0), train, test)
  majority = float(out["majority_accuracy"])
  assert majority == pytest.approx(_majority_numpy(train, test))
  for key in ("accuracy", "blind_accuracy"):
    assert majority - 0.05 < float(out[key]) < majority + 0.03, key


def test_blind_head_never_reads_the_image_and_fits_are_deterministic():
  train, test = _qa(4, N_TRAIN, True), _qa(5, 1000, True)
  fit = jax.jit(
    lambda key, qa, sees: vqa.fit_head(
      key, qa, num_types=TYPES, num_answers=ANSWERS, sees_image=sees, **HEAD
    )
  )
  blind = fit(jax.random.key(1), train, 0.0)
  other = test._replace(image=jnp.asarray(np.random.default_rng(9).normal(size=test.image.shape)))
  np.testing.assert_array_equal(vqa.predict(blind, test), vqa.predict(blind, other))
  head = fit(jax.random.key(1), train, 1.0)
  assert not np.array_equal(vqa.predict(head, test), vqa.predict(head, other))
  again = fit(jax.random.key(1), train, 1.0)
  for a, b in zip(jax.tree.leaves(head), jax.tree.leaves(again), strict=True):
    np.testing.assert_array_equal(a, b)


def test_accuracy_by_type_matches_numpy():
  rng = np.random.default_rng(0)
  n, types = 500, 5
  logits = rng.normal(size=(n, ANSWERS)).astype(np.float32)
  answer = rng.integers(0, ANSWERS, n)
  answer[:200] = logits[:200].argmax(1)  # some right
  qtype = rng.choice([0, 1, 3, 4], n)  # type 2 never asked: scores 0
  overall, per_type = vqa.accuracy_by_type(
    jnp.asarray(logits), jnp.asarray(answer), jnp.asarray(qtype), num_types=types
  )
  right = logits.argmax(1) == answer
  assert float(overall) == pytest.approx(right.mean())
  expected = [right[qtype == t].mean() if (qtype == t).any() else 0.0 for t in range(types)]
  np.testing.assert_allclose(per_type, expected, rtol=1e-6)


def test_majority_logits_match_numpy_ties_to_the_lowest_answer():
  train_type = jnp.array([0, 0, 0, 1, 1, 2, 2])
  train_answer = jnp.array([3, 3, 5, 7, 6, 9, 9])
  logits = vqa.majority_logits(
    train_type, train_answer, jnp.array([2, 1, 0, 0]), num_types=TYPES, num_answers=ANSWERS
  )
  np.testing.assert_array_equal(np.asarray(logits).argmax(1), [9, 6, 3, 3])
  assert logits.shape == (4, ANSWERS)
