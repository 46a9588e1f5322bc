"""FedRGB's FedX and FedMAE rows: their loss terms against numpy, FedX's distillation at
local == global, FedMAE's reconstruction learning, and their rounds."""

import dataclasses

import fedrgb_toys
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_mm import losses
from fedjax_mm.algorithms import fedrgb as rgb


def _np_softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _np_unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _np_relational(x1, x2, anchors, t, t2):
  """FedX's js_loss per sample, written out: KL(m || r1) and KL(m || r2), averaged."""
  a = _np_unit(anchors)
  s1, s2 = _np_unit(x1) @ a.T, _np_unit(x2) @ a.T
  r1, r2 = _np_softmax(s1 / t), _np_softmax(s2 / t)
  m = 0.5 * (_np_softmax(s1 / t2) + _np_softmax(s2 / t2))
  kl = lambda r: np.sum(m * (np.log(m) - np.log(r)), -1)
  return 0.5 * (kl(r1) + kl(r2))


@pytest.mark.parametrize("t2", [0.1, 0.05])
def test_relational_loss_matches_numpy(t2):
  rng = np.random.default_rng(0)
  x1, x2, anchors = rng.normal(size=(5, 4)), rng.normal(size=(5, 4)), rng.normal(size=(7, 4))
  got = losses.relational_loss(*map(jnp.asarray, (x1, x2, anchors)), tau=0.1, target_tau=t2)
  np.testing.assert_allclose(got, _np_relational(x1, x2, anchors, 0.1, t2), rtol=1e-4, atol=1e-6)
  # Masked anchors are the same as anchors left out.
  where = jnp.asarray([True, False, True, True, False, True, True])
  got = losses.relational_loss(*map(jnp.asarray, (x1, x2, anchors)), where=where)
  want = _np_relational(x1, x2, anchors[np.asarray(where)], 0.1, 0.1)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_fedx_terms_match_numpy_and_distillation_vanishes_at_the_global_model():
  rng = np.random.default_rng(1)
  z_i, z_t, g_i, g_t = (_np_unit(rng.normal(size=(4, 6))) for _ in range(4))
  la, ga = rng.normal(size=(8, 6)), rng.normal(size=(8, 6))
  got = losses.fedx_terms(*map(jnp.asarray, (z_i, z_t, g_i, g_t, la, ga)), task_tau=0.07)
  s = z_i @ z_t.T / 0.07
  ce = lambda s: np.log(np.exp(s).sum(1)) - np.diag(s)
  np.testing.assert_allclose(got["local_contrastive"], ce(s) + ce(s.T), rtol=1e-4)
  np.testing.assert_allclose(
    got["local_relational"], _np_relational(z_i, z_t, la, 0.1, 0.1), rtol=1e-4, atol=1e-6
  )
  want = 0.5 * (_np_relational(z_i, g_i, ga, 0.1, 0.1) + _np_relational(z_t, g_t, ga, 0.1, 0.1))
  np.testing.assert_allclose(got["global_relational"], want, rtol=1e-4, atol=1e-6)
  assert np.all(np.asarray(got["global_relational"]) > 1e-4)  # not trivially 0
  want = 0.5 * (
    losses.nt_xent(jnp.asarray(z_i), jnp.asarray(g_t), tau=0.1)
    + losses.nt_xent(jnp.asarray(z_t), jnp.asarray(g_i), tau=0.1)
  )
  np.testing.assert_allclose(got["global_contrastive"], want, rtol=1e-5)
  # Local == global embeddings: the relational distillation is 0 (FedX's t == t2).
  same = losses.fedx_terms(*map(jnp.asarray, (z_i, z_t, z_i, z_t, la, ga)), task_tau=0.07)
  np.testing.assert_allclose(same["global_relational"], 0.0, atol=1e-6)


def test_fedx_client_distillation_is_zero_before_training_and_not_after():
  """At the received model (local == global) the global relational term is 0; after a
  round of local training it is not."""
  alg, state, arrays, mask, _ = fedrgb_toys.tiny("fedx")
  batch = jax.tree.map(lambda x: x[0], arrays)  # 8 pairs = 4 + 4 anchors
  params = {"encoder": {}, "aligner": state.aligner}
  terms = jax.jit(alg.fedx_terms)(params, state.encoder, state.aligner, batch)
  np.testing.assert_allclose(terms["global_relational"], 0.0, atol=1e-6)
  assert float(terms["local_relational"].mean()) > 0
  enc, al, _, loss = jax.jit(alg.ssl_client)(
    state.encoder, state.aligner, None, jax.random.key(3), batch, mask[0]
  )
  assert np.isfinite(float(loss))
  trained = jax.jit(alg.fedx_terms)(
    {"encoder": {}, "aligner": al}, state.encoder, state.aligner, batch
  )
  assert float(trained["global_relational"].mean()) > 1e-6


def test_patchify_and_reconstruction_loss_match_numpy():
  rng = np.random.default_rng(2)
  images = rng.normal(size=(2, 8, 8, 3)).astype(np.float32)
  patches = np.asarray(losses.patchify(jnp.asarray(images), 4))
  assert patches.shape == (2, 4, 48)
  for gy in range(2):
    for gx in range(2):
      want = images[:, 4 * gy : 4 * gy + 4, 4 * gx : 4 * gx + 4].reshape(2, -1)
      np.testing.assert_array_equal(patches[:, 2 * gy + gx], want)
  np.testing.assert_array_equal(losses.unpatchify(jnp.asarray(patches), 4, 3), images)
  pred = rng.normal(size=patches.shape).astype(np.float32)
  mask = np.array([[1, 0, 1, 1], [0, 0, 1, 0]], bool)
  for norm_pix in (False, True):
    target = patches
    if norm_pix:
      mu, var = patches.mean(-1, keepdims=True), patches.var(-1, keepdims=True, ddof=1)
      target = (patches - mu) / np.sqrt(var + 1e-6)
    err = ((pred - target) ** 2).mean(-1)
    want = (err * mask).sum(-1) / mask.sum(-1)
    got = losses.masked_reconstruction_loss(
      jnp.asarray(pred), jnp.asarray(patches), jnp.asarray(mask), norm_pix=norm_pix
    )
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_patch_mask_and_masked_images():
  m = rgb.random_patch_mask(jax.random.key(0), 16, 0.75)
  assert int(m.sum()) == 12
  images = jnp.ones((1, 16, 16, 3))
  out = np.asarray(rgb.mask_images(images, m[None], 4))
  patches = np.asarray(losses.patchify(jnp.asarray(out), 4))[0]
  np.testing.assert_array_equal(patches.sum(-1) == 0, np.asarray(m))


def test_fedmae_reconstruction_loss_decreases_on_a_toy_batch():
  """Adam steps on L_rec alone (fixed batch and masks): the decoder and the image
  aligner learn to reconstruct the masked patches."""
  alg, state, arrays, _, _ = fedrgb_toys.tiny("fedmae")
  batch = jax.tree.map(lambda x: x[0], arrays)
  key = jax.random.key(5)
  params = {"encoder": {}, "aligner": state.aligner, "decoder": state.decoder}
  rec = lambda p: alg.mae_terms(p, state.encoder, batch, key)[1]
  tx = optax.adam(3e-3)

  @jax.jit
  def steps(params):
    def step(carry, _):
      p, o = carry
      loss, g = jax.value_and_grad(rec)(p)
      u, o = tx.update(g, o, p)
      return (optax.apply_updates(p, u), o), loss

    (_, _), trace = jax.lax.scan(step, (params, tx.init(params)), None, length=30)
    return trace

  trace = np.asarray(steps(params))
  assert np.all(np.isfinite(trace))
  assert trace[-1] < 0.8 * trace[0], trace


@pytest.mark.parametrize("method", ["fedx", "fedmae"])
def test_rounds_are_fedavg_of_the_clients(method):
  """One round: data-size weights; FedMAE's decoder averaged and sent, FedX's traffic
  FedAvg's; the decoder is not part of the evaluated model."""
  alg, state, arrays, mask, _ = fedrgb_toys.tiny(method)
  new, metrics = jax.jit(alg.round)(state, arrays, mask)
  assert int(new.round) == 1
  np.testing.assert_allclose(metrics["weights"], np.array([8, 6, 5]) / 19, rtol=1e-6)
  assert np.all(np.isfinite(np.asarray(metrics["stage1_loss"])))
  fedavg = rgb.FedRGB(
    dataclasses.replace(alg.config, method="fedavg"), alg.encoder_def, alg.aligner_def
  )
  traffic, base = rgb.stage_traffic(alg, state), rgb.stage_traffic(fedavg, state)
  if method == "fedx":
    assert new.decoder is None and traffic == base
  else:
    size = sum(x.size * 4 for x in jax.tree.leaves(state.decoder))
    assert (
      traffic["stage1"] == base["stage1"] + size and traffic["full_model"] == base["full_model"]
    )
    moved = [
      np.abs(a - b).max()
      for a, b in zip(*map(jax.tree.leaves, (new.decoder, state.decoder)), strict=True)
    ]
    assert max(moved) > 0


def test_config_checks():
  with pytest.raises(ValueError, match="mae_ratio"):
    rgb.RgbConfig(method="fedmae", mae_ratio=1.0)
  with pytest.raises(ValueError, match="mae_contrast"):
    rgb.RgbConfig(method="fedmae", mae_contrast="both")
  with pytest.raises(ValueError, match="fedx_weight"):
    rgb.RgbConfig(method="fedx", fedx_weight=-1.0)
  with pytest.raises(ValueError, match="fedx_tau"):
    rgb.RgbConfig(method="fedx", fedx_target_tau=0.0)
  alg, state, *_ = fedrgb_toys.tiny("fedavg")
  with pytest.raises(ValueError, match="decoder"):
    rgb.FedRGB(
      dataclasses.replace(alg.config, method="fedmae"), alg.encoder_def, alg.aligner_def
    ).init(state.rng, state.encoder, state.aligner, 3)


@pytest.mark.parametrize(
  ("method", "weight", "floor"), [("fedx", "fedx_weight", 0.05), ("fedmae", "mae_weight", 1e-3)]
)
def test_the_baselines_terms_are_what_sets_their_step_apart_from_fedavgs(method, weight, floor):
  """A client's first step from the received model, on FedAvg's batch: with the method's own
  terms weighed 0 its gradient is FedAvg's (L_task's), with their weight it is not; FedMAE
  with L_task on the masked images is not FedAvg's even at weight 0. (Rounds are compared
  at the run level: Adam turns float32 rounding of one program against another into steps
  of the learning rate on the parameters with the smallest gradients.) FedMAE's
  reconstruction moves the aligner's gradient little: 0.6% in norm here, 3.7% at the
  default config (docs/results/fedrgb.md)."""
  _, state, arrays, _, _ = fedrgb_toys.tiny("fedavg")
  batch = jax.tree.map(lambda x: x[0], arrays)  # FedX: 4 pairs + 4 anchors; FedMAE: 4 + 4
  b = 4
  frozen = jax.lax.stop_gradient(state.encoder)
  fedavg = fedrgb_toys.tiny("fedavg")[0]

  def fedavg_loss(p):  # FedAvg's client loss (stage1_client): L_task of the batch
    z_i, z_t = fedavg.embed(frozen, p["aligner"], batch["images"][:b], batch["captions"][:b])
    return losses.task_loss(z_i, z_t, tau=fedavg.config.tau).mean()

  def grad_of(**kw):
    alg, own, *_ = fedrgb_toys.tiny(method, **kw)  # the same aligner as FedAvg's state
    params = {"encoder": {}, "aligner": own.aligner}
    if method == "fedx":
      return jax.grad(lambda p: alg.fedx_objective(p, state.encoder, state.aligner, batch))(params)
    params["decoder"] = own.decoder
    first = jax.tree.map(lambda x: x[:b], batch)
    g = jax.grad(lambda p: alg.mae_objective(p, state.encoder, first, jax.random.key(1)))(params)
    return {"encoder": {}, "aligner": g["aligner"]}

  want = jax.grad(fedavg_loss)({"encoder": {}, "aligner": state.aligner})
  norm = lambda t: float(optax.global_norm(t))
  gap = lambda g: norm(jax.tree.map(jnp.subtract, g, want)) / norm(want)
  assert gap(grad_of(**{weight: 0.0})) < 1e-5
  assert gap(grad_of()) > floor
  if method == "fedmae":
    assert gap(grad_of(mae_weight=0.0, mae_contrast="masked")) > 0.05
