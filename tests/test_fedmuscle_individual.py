"""SimCLR and Curriculum Labeling, each user alone: NT-Xent, views, the curriculum, one round."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mm import losses
from fedjax_mm.algorithms import pseudo_label, simclr
from fedjax_mm.core.tasks import Task


def _np_nt_xent(z1, z2, tau):
  """SimCLR's eq. (1), view by view, the mean of each sample's two views."""
  z = np.concatenate([z1, z2])
  z = z / np.linalg.norm(z, axis=1, keepdims=True)
  n, b = len(z), len(z1)
  out = np.zeros(n)
  for i in range(n):
    p = (i + b) % n
    den = sum(np.exp(z[i] @ z[k] / tau) for k in range(n) if k != i)
    out[i] = -np.log(np.exp(z[i] @ z[p] / tau) / den)
  return (out[:b] + out[b:]) / 2


def test_nt_xent_matches_numpy():
  rng = np.random.default_rng(0)
  z1, z2 = rng.normal(size=(5, 3)), rng.normal(size=(5, 3))
  got = losses.nt_xent(jnp.asarray(z1, jnp.float32), jnp.asarray(z2, jnp.float32), tau=0.3)
  np.testing.assert_allclose(got, _np_nt_xent(z1, z2, 0.3), rtol=1e-5)
  # Scale-free (cosine similarity), and matching views beat unrelated ones.
  np.testing.assert_allclose(
    losses.nt_xent(jnp.asarray(3 * z1), jnp.asarray(z2), tau=0.3), got, rtol=1e-5
  )
  assert losses.nt_xent(jnp.asarray(z1), jnp.asarray(z1), tau=0.3).mean() < got.mean()


def test_views_keep_shape_and_range_and_differ():
  image = jax.random.uniform(jax.random.key(0), (4, 32, 32, 3))
  task = Task("classification", "image", "label10", 10)
  config = simclr.SimCLRConfig()
  v1, v2 = simclr.views(task, {"image": image}, jax.random.key(1), config)
  assert v1.shape == image.shape and float(v1.min()) >= 0 and float(v1.max()) <= 1
  assert not np.allclose(v1, v2)
  # No crop, no noise: the identity or its mirror image (colour untouched).
  same = simclr.augment(jax.random.key(2), image[0], min_crop=1.0, noise=0.0)
  assert np.allclose(same, image[0], atol=1e-5) or np.allclose(same, image[0, :, ::-1], atol=1e-5)


def test_curriculum_keeps_20_more_percent_per_stage():
  config = pseudo_label.PseudoLabelConfig(num_rounds=30, step=0.2)
  got = [float(pseudo_label.kept_fraction(jnp.asarray(r), config)) for r in range(30)]
  want = [s * 0.2 for s in range(6) for _ in range(5)]  # R / 6 = 5 rounds a stage
  np.testing.assert_allclose(got, want, atol=1e-6)
  confidence = jax.random.uniform(jax.random.key(0), (50,))
  for fraction in (0.0, 0.2, 0.4, 1.0):
    keep = np.asarray(pseudo_label.keep_top(confidence, jnp.asarray(fraction)))
    assert keep.sum() == round(50 * fraction)
    if 0 < keep.sum() < 50:  # the most confident ones
      assert np.asarray(confidence)[keep].min() > np.asarray(confidence)[~keep].max()


@pytest.mark.parametrize("kind", ["classification", "multilabel"])
def test_pseudo_label_confidence(kind):
  logits = jnp.asarray([[2.0, -1.0, 0.5], [0.1, 0.0, -0.2]])
  targets, confidence = pseudo_label.pseudo_labels(Task(kind, "image", "t", 3), logits)
  if kind == "classification":
    np.testing.assert_array_equal(targets, [0, 0])
    np.testing.assert_allclose(confidence, jax.nn.softmax(logits).max(-1), rtol=1e-6)
  else:  # the probability of the predicted label set under independent sigmoids
    p = np.asarray(jax.nn.sigmoid(logits))
    np.testing.assert_array_equal(targets, p > 0.5)
    np.testing.assert_allclose(confidence, np.maximum(p, 1 - p).prod(-1), rtol=1e-5)
    assert confidence[0] > confidence[1]  # clear-cut labels beat near-1/2 ones
