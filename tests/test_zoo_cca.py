"""CCA: the definition holds (correlated pairs, uncorrelated within a side), sklearn agrees."""

import numpy as np
import pytest

from fedjax_mm.zoo import cca as cca_lib


def _views(n=2000, seed=0):
  rng = np.random.default_rng(seed)
  shared = rng.normal(size=(n, 3))  # three latent factors both views see, with noise
  x = shared @ rng.normal(size=(3, 6)) + 0.5 * rng.normal(size=(n, 6))
  y = shared @ rng.normal(size=(3, 5)) + 0.5 * rng.normal(size=(n, 5))
  return x, y


def test_projections_are_canonical():
  x, y = _views()
  fit = cca_lib.cca(x, y, 4, ridge=0.0)
  u, v = fit.project_x(x), fit.project_y(y)
  c = np.corrcoef(np.concatenate([u, v], 1), rowvar=False)
  np.testing.assert_allclose(np.diag(c[:4, 4:]), fit.correlations, atol=1e-10)
  np.testing.assert_allclose(c[:4, :4], np.eye(4), atol=1e-10)  # uncorrelated, unit variance
  np.testing.assert_allclose(c[4:, 4:], np.eye(4), atol=1e-10)
  off = c[:4, 4:] - np.diag(np.diag(c[:4, 4:]))
  np.testing.assert_allclose(off, 0.0, atol=1e-10)
  # Three shared factors: three strong correlations, then noise.
  assert np.all(np.diff(fit.correlations) <= 0)
  assert fit.correlations[2] > 0.5 and fit.correlations[3] < 0.2


def test_first_correlation_matches_sklearn():
  from sklearn.cross_decomposition import CCA

  x, y = _views(seed=1)
  ours = cca_lib.cca(x, y, 1, ridge=0.0).correlations[0]
  u, v = CCA(n_components=1, max_iter=2000, tol=1e-10).fit_transform(x, y)
  assert ours == pytest.approx(abs(np.corrcoef(u[:, 0], v[:, 0])[0, 1]), abs=1e-6)


def test_shared_probe_reads_what_the_views_share():
  rng = np.random.default_rng(2)
  n = 1200
  label = rng.integers(0, 4, n)
  onehot = np.eye(4)[label]
  # Both views see the label; view x also carries noise directions of high variance.
  x = np.concatenate([onehot * 3 + 0.3 * rng.normal(size=(n, 4)), 5 * rng.normal(size=(n, 6))], 1)
  y = onehot @ rng.normal(size=(4, 5)) + 0.3 * rng.normal(size=(n, 5))
  split = lambda a, b: (x[a:b], y[a:b], label[a:b])
  out = cca_lib.shared_probe(x[:400], y[:400], split(400, 800), split(800, n), num_classes=4, k=3)
  assert out["min"] > 90 and out["min"] == min(out["x"], out["y"])


def test_bad_input_is_refused():
  with pytest.raises(ValueError, match="paired"):
    cca_lib.cca(np.zeros((5, 2)), np.zeros((4, 2)), 1)
  with pytest.raises(ValueError, match="k must be in"):
    cca_lib.cca(np.ones((5, 2)), np.ones((5, 3)), 3)
