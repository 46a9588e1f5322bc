"""DSCMR / FedSCMR loss terms against direct numpy loops over samples and pairs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mm import losses

SEEDS = range(3)


def _problem(seed, b=7, d=5, c=4):
  rng = np.random.default_rng(seed)
  s_img, s_txt, e_img, e_txt = (rng.normal(size=(b, d)) for _ in range(4))
  p_img, p_txt = rng.normal(size=(b, c)), rng.normal(size=(b, c))
  labels = np.eye(c)[rng.integers(0, c, b)]
  labels[0, (labels[0].argmax() + 1) % c] = 1.0  # one multi-hot row
  where = rng.random(b) < 0.7
  where[:2] = True
  return dict(
    s_img=s_img, s_txt=s_txt, e_img=e_img, e_txt=e_txt, p_img=p_img, p_txt=p_txt, labels=labels
  ), where


def _norm_mean(a, b, w):
  return sum(np.sqrt(np.sum((a[i] - b[i]) ** 2)) for i in range(len(a)) if w[i]) / w.sum()


def _np_imd(x, w):
  return _norm_mean(x["p_img"], x["labels"], w) + _norm_mean(x["p_txt"], x["labels"], w)


def _np_csd(x, w):
  total = 0.0
  for a, b in ((x["s_img"], x["s_img"]), (x["s_img"], x["s_txt"]), (x["s_txt"], x["s_txt"])):
    values = []
    for i in range(len(a)):
      for j in range(len(b)):
        if not (w[i] and w[j]):
          continue
        gamma = 0.5 * a[i] @ b[j] / (np.linalg.norm(a[i]) * np.linalg.norm(b[j]))
        delta = float(x["labels"][i] @ x["labels"][j] > 0)
        values.append(np.log1p(np.exp(gamma)) - delta * gamma)
    total += np.mean(values)
  return total


def _np_csc(x, w):
  return _norm_mean(x["s_img"], x["s_txt"], w) + _norm_mean(x["e_img"], x["e_txt"], w)


def _np_ccs(x, w):
  image = max(0.0, _norm_mean(x["e_img"], x["s_txt"], w) - _norm_mean(x["e_img"], x["s_img"], w))
  text = max(0.0, _norm_mean(x["e_txt"], x["s_img"], w) - _norm_mean(x["e_txt"], x["s_txt"], w))
  return image + text


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("masked", [False, True])
def test_each_term_matches_numpy(seed, masked, x64):
  x, where = _problem(seed)
  w = where if masked else np.ones_like(where)
  kw = {"where": where} if masked else {}
  rtol = 1e-10
  np.testing.assert_allclose(
    losses.label_space_loss(x["p_img"], x["p_txt"], x["labels"], **kw), _np_imd(x, w), rtol=rtol
  )
  np.testing.assert_allclose(
    losses.discrimination_loss(x["s_img"], x["s_txt"], x["labels"], **kw), _np_csd(x, w), rtol=rtol
  )
  args = (x["s_img"], x["s_txt"], x["e_img"], x["e_txt"])
  np.testing.assert_allclose(losses.consistency_loss(*args, **kw), _np_csc(x, w), rtol=rtol)
  np.testing.assert_allclose(losses.cross_subspace_loss(*args, **kw), _np_ccs(x, w), rtol=rtol)

  alpha, beta = 0.3, 1.7
  expected = alpha * (_np_csd(x, w) + _np_csc(x, w)) + beta * _np_ccs(x, w) + _np_imd(x, w)
  got = losses.fedscmr_loss(**x, alpha=alpha, beta=beta, **kw)
  np.testing.assert_allclose(got, expected, rtol=rtol)
  expected = _np_imd(x, w) + alpha * _np_csd(x, w) + beta * _norm_mean(x["s_img"], x["s_txt"], w)
  got = losses.dscmr_loss(
    x["s_img"], x["s_txt"], x["p_img"], x["p_txt"], x["labels"], alpha=alpha, beta=beta, **kw
  )
  np.testing.assert_allclose(got, expected, rtol=rtol)


def test_hinge_is_active_in_the_test_data_and_can_vanish(x64):
  x, where = _problem(0)
  args = (x["s_img"], x["s_txt"], x["e_img"], x["e_txt"])
  assert float(losses.cross_subspace_loss(*args)) > 0
  # S'_V = S_T and S'_T = S_V: each enhanced modality sits on the other one; nothing to pay.
  swapped = (x["s_img"], x["s_txt"], x["s_txt"], x["s_img"])
  assert float(losses.cross_subspace_loss(*swapped)) == 0.0


def test_mask_equals_dropping_the_rows(x64):
  x, where = _problem(1)
  masked = losses.fedscmr_loss(**x, alpha=0.5, beta=0.5, where=where)
  dropped = losses.fedscmr_loss(**{k: v[where] for k, v in x.items()}, alpha=0.5, beta=0.5)
  np.testing.assert_allclose(masked, dropped, rtol=1e-12)


def test_batch_size_invariance_of_per_sample_norms(x64):
  # Per-sample norms averaged: repeating the batch changes nothing (a Frobenius norm would grow).
  x, _ = _problem(2)
  twice = {k: np.concatenate([v, v]) for k, v in x.items()}
  np.testing.assert_allclose(
    losses.fedscmr_loss(**x, alpha=0.1, beta=0.1),
    losses.fedscmr_loss(**twice, alpha=0.1, beta=0.1),
    rtol=1e-12,
  )


def test_gradients_are_finite_at_coincident_features():
  # ||a - b|| has an infinite-norm gradient at a = b unless handled; here S_V = S_T exactly.
  x, _ = _problem(0)
  x = {k: jnp.asarray(v, jnp.float32) for k, v in x.items()}
  x["s_txt"] = x["s_img"]
  grads = jax.jit(jax.grad(lambda s: losses.fedscmr_loss(**(x | {"s_img": s}))))(x["s_img"])
  assert bool(jnp.all(jnp.isfinite(grads)))


def test_jit_and_vmap():
  x, where = _problem(0)
  stacked = {k: jnp.stack([jnp.asarray(v, jnp.float32)] * 3) for k, v in x.items()}
  fn = jax.jit(jax.vmap(lambda d: losses.fedscmr_loss(**d, alpha=0.1, beta=0.1)))
  single = jax.jit(losses.fedscmr_loss)(**{k: jnp.asarray(v, jnp.float32) for k, v in x.items()})
  np.testing.assert_allclose(fn(stacked), np.full(3, single), rtol=1e-5)
