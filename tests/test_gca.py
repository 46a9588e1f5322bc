"""GCA (CreamFL eqs. (4)-(6)) against a direct numpy loop; chunked == unchunked."""

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mm.server import gca


def _unit(rng, *shape):
  x = rng.normal(size=shape)
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _numpy_gca(local, global_other, present, tau=1.0):
  """Literal eqs. (4)-(6): loops over samples k and clients c."""
  num_clients, num_public, _ = local.shape
  scores = np.full((num_clients, num_public), -np.inf)
  for c in range(num_clients):
    if not present[c]:
      continue
    for k in range(num_public):
      num = np.exp(local[c, k] @ global_other[k] / tau)
      den = sum(np.exp(local[c, k] @ global_other[j] / tau) for j in range(num_public) if j != k)
      scores[c, k] = np.log(num / den)
  weights = np.zeros_like(scores)
  agg = np.zeros(local.shape[1:])
  for k in range(num_public):
    s = scores[present, k]
    w = np.exp(s - s.max())
    weights[present, k] = w / w.sum()
    agg[k] = np.einsum("c,cd->d", weights[:, k], local[:, k])
  return agg, weights, scores


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tau", [1.0, 0.5])
def test_gca_matches_numpy(seed, tau, x64):
  rng = np.random.default_rng(seed)
  local, global_other = _unit(rng, 5, 9, 4), _unit(rng, 9, 4)
  present = np.array([True, False, True, True, False])
  agg, weights = gca.gca(local, global_other, jnp.asarray(present), temperature=tau)
  ref_agg, ref_weights, ref_scores = _numpy_gca(local, global_other, present, tau)
  np.testing.assert_allclose(weights, ref_weights, rtol=1e-10, atol=1e-14)
  np.testing.assert_allclose(agg, ref_agg, rtol=1e-10, atol=1e-14)
  np.testing.assert_allclose(weights.sum(0), 1.0, rtol=1e-12)
  scores = gca.contrastive_scores(local, global_other, temperature=tau)
  np.testing.assert_allclose(scores[present], ref_scores[present], rtol=1e-10)


@pytest.mark.parametrize("chunk_size", [1, 4, 13])
def test_chunked_equals_unchunked(chunk_size, x64):
  rng = np.random.default_rng(7)
  local, global_other = _unit(rng, 6, 13, 8), _unit(rng, 13, 8)
  present = jnp.array([True, True, False, True, True, True])
  whole = gca.gca(local, global_other, present, chunk_size=13)
  chunked = gca.gca(local, global_other, present, chunk_size=chunk_size)
  for a, b in zip(whole, chunked, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)


def test_better_aligned_client_weighs_more():
  rng = np.random.default_rng(0)
  g_other = _unit(rng, 6, 5)
  noise = _unit(rng, 6, 5)
  good = g_other + 0.1 * noise
  local = jnp.asarray(np.stack([good / np.linalg.norm(good, axis=-1, keepdims=True), noise]))
  _, weights = gca.gca(local, jnp.asarray(g_other), jnp.array([True, True]))
  assert np.all(np.asarray(weights[0]) > 0.5)


def test_client_weighted_and_absent_clients(x64):
  rng = np.random.default_rng(3)
  local = rng.normal(size=(3, 4, 2))
  agg, weights = gca.client_weighted(local, jnp.array([2.0, 0.0, 6.0]))
  np.testing.assert_allclose(agg, 0.25 * local[0] + 0.75 * local[2], rtol=1e-12)
  np.testing.assert_allclose(weights[:, 0], [0.25, 0.0, 0.75])
  nobody = jnp.zeros(3, bool)
  agg, weights = gca.gca(local, rng.normal(size=(4, 2)), nobody)
  assert np.all(np.asarray(agg) == 0) and np.all(np.asarray(weights) == 0)


def test_default_chunk_bounds_memory():
  chunk = gca.default_chunk_size(10, 50_000)
  assert 10 * chunk * 50_000 <= gca.DEFAULT_CHUNK_ELEMENTS and chunk >= 1
  assert gca.default_chunk_size(2, 8) == 8
  with pytest.raises(ValueError, match="global_other"):
    gca.gca(jnp.ones((2, 3, 4)), jnp.ones((3, 5)), jnp.ones(2, bool))
