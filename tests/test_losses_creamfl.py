"""CreamFL's inter/intra-modal contrasts and distillation distance against direct numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from fedjax_mm import losses


def _unit(rng, *shape):
  x = rng.normal(size=shape)
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _numpy_inter(local, global_other, index, tau):
  out = []
  for b, k in enumerate(index):
    s = np.array([local[b] @ g / tau for g in global_other])
    out.append(-(s[k] - np.log(np.sum(np.exp(s)))))
  return np.array(out)


def _numpy_intra(local, global_same, previous, tau):
  pos = np.exp(np.sum(local * global_same, -1) / tau)
  neg = np.exp(np.sum(local * previous, -1) / tau)
  return -np.log(pos / (pos + neg))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tau", [0.5, 1.0])
def test_inter_modal_contrast_matches_numpy(seed, tau, x64):
  rng = np.random.default_rng(seed)
  local, global_other = _unit(rng, 5, 7), _unit(rng, 11, 7)
  index = rng.choice(11, 5, replace=False)
  got = losses.inter_modal_contrast(local, global_other, jnp.asarray(index), temperature=tau)
  np.testing.assert_allclose(got, _numpy_inter(local, global_other, index, tau), rtol=1e-10)
  where = np.array([True, False, True, True, False])
  masked = losses.inter_modal_contrast(
    local, global_other, jnp.asarray(index), temperature=tau, where=jnp.asarray(where)
  )
  np.testing.assert_allclose(masked, np.where(where, got, 0.0), rtol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_intra_modal_contrast_matches_numpy(seed, x64):
  rng = np.random.default_rng(seed)
  local, global_same, previous = _unit(rng, 6, 5), _unit(rng, 6, 5), _unit(rng, 6, 5)
  got = losses.intra_modal_contrast(local, global_same, previous, temperature=0.5)
  np.testing.assert_allclose(got, _numpy_intra(local, global_same, previous, 0.5), rtol=1e-10)
  # eq. (2) as printed has no temperature: tau = 1.
  np.testing.assert_allclose(
    losses.intra_modal_contrast(local, global_same, previous, temperature=1.0),
    _numpy_intra(local, global_same, previous, 1.0),
    rtol=1e-10,
  )


def test_representation_distance_and_its_gradient(x64):
  rng = np.random.default_rng(0)
  a, b = rng.normal(size=(4, 3)), rng.normal(size=(4, 3))
  got = losses.representation_distance(a, b)
  np.testing.assert_allclose(got, np.linalg.norm(a - b, axis=-1), rtol=1e-12)
  grad = jax.grad(lambda x: losses.representation_distance(x, jnp.asarray(a)).sum())(jnp.asarray(a))
  assert np.all(np.isfinite(grad)) and np.all(grad == 0)  # identical rows: zero, not NaN
  where = jnp.array([True, False, True, False])
  np.testing.assert_allclose(
    losses.representation_distance(a, b, where=where), np.where(where, got, 0.0)
  )


def test_gradients_are_correct(x64):
  rng = np.random.default_rng(1)
  local, g, p = _unit(rng, 3, 4), _unit(rng, 5, 4), _unit(rng, 3, 4)
  index = jnp.array([4, 0, 2])
  check_grads(
    lambda z: losses.inter_modal_contrast(z, jnp.asarray(g), index).sum(),
    (jnp.asarray(local),),
    order=1,
    modes=("rev",),
  )
  check_grads(
    lambda z: losses.intra_modal_contrast(z, jnp.asarray(g[:3]), jnp.asarray(p)).sum(),
    (jnp.asarray(local),),
    order=1,
    modes=("rev",),
  )


def test_shape_errors():
  with pytest.raises(ValueError, match="index"):
    losses.inter_modal_contrast(jnp.ones((2, 3)), jnp.ones((4, 3)), jnp.ones((2, 1), jnp.int32))
  with pytest.raises(ValueError, match="previous"):
    losses.intra_modal_contrast(jnp.ones((2, 3)), jnp.ones((2, 3)), jnp.ones(3))
