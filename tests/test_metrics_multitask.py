"""Delta against a literal loop over users."""

import jax
import numpy as np
import pytest

from fedjax_mm import metrics


def _literal_delta(alg, local, where):
  terms = [(a - l) / l for a, l, w in zip(alg, local, where, strict=True) if w]
  return sum(terms) / len(terms) if terms else 0.0


@pytest.mark.parametrize("seed", range(5))
def test_delta_matches_literal_loop(seed):
  rng = np.random.default_rng(seed)
  num_users = 9
  alg = rng.uniform(0.1, 1.0, num_users)
  local = rng.uniform(0.1, 1.0, num_users)
  where = rng.random(num_users) < 0.6
  where[0] = True
  all_users = np.ones(num_users, bool)
  np.testing.assert_allclose(
    metrics.delta(alg, local), _literal_delta(alg, local, all_users), rtol=1e-5
  )
  np.testing.assert_allclose(
    metrics.delta(alg, local, where=where), _literal_delta(alg, local, where), rtol=1e-5
  )
  # A ratio: the same in percentages as in fractions.
  np.testing.assert_allclose(
    metrics.delta(100 * alg, 100 * local, where=where),
    metrics.delta(alg, local, where=where),
    rtol=1e-5,
  )


def test_delta_masked_user_with_zero_local_metric_is_inert():
  got = metrics.delta(np.array([0.6, 0.3]), np.array([0.5, 0.0]), where=np.array([True, False]))
  np.testing.assert_allclose(got, 0.2, rtol=1e-6)
  assert np.isinf(float(metrics.delta(np.array([0.6, 0.3]), np.array([0.5, 0.0]))))


def test_delta_padding_users_create_no_nan():
  # Padding users typically carry zeros for both metrics (0 / 0).
  alg, local = np.array([0.6, 0.0]), np.array([0.5, 0.0])
  with jax.debug_nans(True):
    got = metrics.delta(alg, local, where=np.array([True, False]))
  np.testing.assert_allclose(got, 0.2, rtol=1e-6)


def test_delta_of_local_training_against_itself_is_zero_and_no_users_is_zero():
  local = np.array([0.3, 0.7, 0.9])
  assert float(metrics.delta(local, local)) == 0.0
  assert float(metrics.delta(local + 1, local, where=np.zeros(3, bool))) == 0.0


def test_delta_under_jit_and_vmap():
  rng = np.random.default_rng(0)
  alg, local = rng.uniform(0.1, 1, (2, 3, 5))
  where = rng.random((3, 5)) < 0.7
  batched = jax.jit(jax.vmap(metrics.delta))(alg, local, where=where)
  for r in range(3):
    np.testing.assert_allclose(batched[r], _literal_delta(alg[r], local[r], where[r]), rtol=1e-5)
