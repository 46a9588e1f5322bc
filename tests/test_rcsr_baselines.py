"""RCSR's Table 1 MFCPL, FedMEKT and CreamFL, pure parts: each client loss against numpy, the
server's class-prototype and proxy-embedding averages and GCA + EMA against hand computations, and the
ledger's bytes."""

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mm.algorithms import rcsr as alg
from fedjax_mm.losses import fedmekt as F
from fedjax_mm.losses import mfcpl as M
from fedjax_mm.server import rcsr as S

RNG = np.random.default_rng(0)


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_class_prototypes_and_complete_prototypes():
  z = RNG.normal(size=(7, 4)).astype(np.float32)
  labels = np.array([0, 2, 2, 0, 1, 2, 0])
  where = np.array([1, 1, 1, 0, 1, 1, 1], bool)
  protos, counts = M.class_prototypes(jnp.asarray(z), jnp.asarray(labels), 4, where=where)
  for c in range(4):
    rows = z[(labels == c) & where]
    np.testing.assert_allclose(counts[c], len(rows))
    want = _unit(rows.mean(0)) if len(rows) else np.zeros(4)
    np.testing.assert_allclose(protos[c], want, rtol=1e-5, atol=1e-7)
  # The complete prototype: the mean over the modalities whose prototype exists.
  two = np.stack([np.asarray(protos), _unit(RNG.normal(size=(4, 4)))]).astype(np.float32)
  two[1, 2] = 0.0  # class 2 has no text prototype
  got = M.complete_prototypes(jnp.asarray(two))
  np.testing.assert_allclose(got[0], (two[0, 0] + two[1, 0]) / 2, rtol=1e-6)
  np.testing.assert_allclose(got[2], two[0, 2], rtol=1e-6)  # image alone
  np.testing.assert_allclose(got[3], two[1, 3], rtol=1e-6)  # class 3: text alone


def test_cmpc_against_numpy():
  tau = 0.07
  z = _unit(RNG.normal(size=(6, 5))).astype(np.float32)
  protos = _unit(RNG.normal(size=(4, 5))).astype(np.float32)
  protos[3] = 0.0  # class 3 has no prototype: out of every softmax
  labels = np.array([0, 1, 2, 1, 3, 0])
  where = np.array([1, 1, 1, 1, 1, 0], bool)
  got = M.prototype_contrastive(
    jnp.asarray(z), jnp.asarray(labels), jnp.asarray(protos), temperature=tau, where=where
  )
  want = np.zeros(6)
  for i in range(6):
    if not where[i] or labels[i] == 3:
      continue  # padding; a class without a prototype
    logits = np.array([z[i] @ protos[c] / tau for c in range(3)])
    want[i] = np.log(np.exp(logits).sum()) - logits[labels[i]]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  grads = jax.grad(
    lambda x: M.prototype_contrastive(x, jnp.asarray(labels), jnp.asarray(protos)).sum()
  )(jnp.asarray(z))
  assert np.isfinite(np.asarray(grads)).all()


def test_cmpr_and_cma_against_numpy():
  zi = _unit(RNG.normal(size=(5, 3))).astype(np.float32)
  zt = _unit(RNG.normal(size=(5, 3))).astype(np.float32)
  complete = RNG.normal(size=(2, 3)).astype(np.float32)
  labels = np.array([0, 1, 1, 0, 1])
  where = np.array([1, 1, 0, 1, 1], bool)
  got = M.prototype_regularization(
    jnp.asarray(zi), jnp.asarray(labels), jnp.asarray(complete), where=where
  )
  want = np.where(where, ((zi - complete[labels]) ** 2).sum(1), 0.0)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  got = M.cross_modal_alignment(jnp.asarray(zi), jnp.asarray(zt), where=where)
  np.testing.assert_allclose(got, np.where(where, 1 - (zi * zt).sum(1), 0.0), rtol=1e-5, atol=1e-6)


def test_mfcpl_terms_by_modality():
  """The client's MFCPL term: mean over held modalities of CMPC + CMPR, + CMA if paired."""
  spec = alg.RcsrDef(graphdef=None, num_clients=2, per_round=1, rounds=1, num_classes=3)
  zi = _unit(RNG.normal(size=(4, 5))).astype(np.float32)
  zt = _unit(RNG.normal(size=(4, 5))).astype(np.float32)
  protos = _unit(RNG.normal(size=(2, 3, 5))).astype(np.float32)
  labels = jnp.asarray([0, 1, 2, 1])
  mask = jnp.asarray([True, True, True, False])
  complete = M.complete_prototypes(jnp.asarray(protos))

  def one(z, other):
    c = M.prototype_contrastive(z, labels, other, temperature=spec.mfcpl_temperature, where=mask)
    r = M.prototype_regularization(z, labels, complete, where=mask)
    return float((c + r).sum() / 3)

  t_i, t_t = one(jnp.asarray(zi), protos[1]), one(jnp.asarray(zt), protos[0])
  cma = float(M.cross_modal_alignment(jnp.asarray(zi), jnp.asarray(zt), where=mask).sum() / 3)
  for mod, want in (([1, 1], (t_i + t_t) / 2 + cma), ([1, 0], t_i), ([0, 1], t_t)):
    got = alg.mfcpl_terms(spec, zi, zt, labels, mask, jnp.asarray(mod, bool), protos)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_embedding_distillation_against_numpy():
  s = RNG.normal(size=(4, 6)).astype(np.float32)
  t = RNG.normal(size=(4, 6)).astype(np.float32)
  temp = 3.0

  def softmax(x):
    e = np.exp(x - x.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)

  p, q = softmax(t / temp), softmax(s / temp)
  want = temp**2 * (p * (np.log(p) - np.log(q))).sum(1)
  got = F.embedding_distillation(jnp.asarray(s), jnp.asarray(t), temperature=temp)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
  where = np.array([1, 0, 1, 1], bool)
  got = F.embedding_distillation(jnp.asarray(s), jnp.asarray(t), where=jnp.asarray(where))
  np.testing.assert_allclose(got, np.where(where, want, 0.0), rtol=1e-4, atol=1e-7)


def test_class_prototype_average_by_hand():
  # 3 clients, 2 modalities, 3 classes, d = 2; client 2 is not sampled.
  protos = _unit(RNG.normal(size=(3, 2, 3, 2))).astype(np.float32)
  counts = np.array(
    [
      [[2, 0, 1], [2, 0, 1]],  # paired client
      [[1, 3, 0], [0, 0, 0]],  # image-only client
      [[5, 5, 5], [5, 5, 5]],  # not sampled
    ],
    np.float32,
  )
  previous = _unit(RNG.normal(size=(2, 3, 2))).astype(np.float32)
  where = np.array([True, True, False])
  got = np.asarray(S.class_prototype_average(protos, counts, previous, where))
  np.testing.assert_allclose(got[0, 0], _unit((2 * protos[0, 0, 0] + protos[1, 0, 0]) / 3), 1e-5)
  np.testing.assert_allclose(got[0, 1], protos[1, 0, 1], rtol=1e-5)  # client 1's alone
  np.testing.assert_allclose(got[0, 2], protos[0, 0, 2], rtol=1e-5)  # client 0's alone
  np.testing.assert_allclose(got[1, 0], protos[0, 1, 0], rtol=1e-5)
  np.testing.assert_array_equal(got[1, 1], previous[1, 1])  # nobody reported it
  np.testing.assert_allclose(got[1, 2], protos[0, 1, 2], rtol=1e-5)


def test_embedding_average_by_hand():
  emb = RNG.normal(size=(4, 2, 3, 2)).astype(np.float32)
  modality = np.array([[1, 1], [1, 0], [1, 0], [0, 1]], bool)
  previous = RNG.normal(size=(2, 3, 2)).astype(np.float32)
  where = np.array([True, True, False, False])
  got = np.asarray(S.embedding_average(emb, modality, previous, where))
  np.testing.assert_allclose(got[0], (emb[0, 0] + emb[1, 0]) / 2, rtol=1e-6)
  np.testing.assert_allclose(got[1], emb[0, 1], rtol=1e-6)  # client 0 alone holds text
  where = np.array([False, True, True, False])  # no sampled client holds text
  got = np.asarray(S.embedding_average(emb, modality, previous, where))
  np.testing.assert_allclose(got[0], (emb[1, 0] + emb[2, 0]) / 2, rtol=1e-6)
  np.testing.assert_array_equal(got[1], previous[1])


def test_traffic_bytes_of_mfcpl_and_fedmekt():
  params = {"w": jnp.zeros((10, 10)), "b": jnp.zeros(10)}
  model, d = 110 * 4, 8
  base = alg.traffic_bytes("fedavg", params, d)
  assert base == (model + 2 * d * 4, model + 2 * d * 4)
  for held in (1, 2):
    up, down = alg.traffic_bytes("mfcpl", params, d, held=held, num_classes=10)
    assert up == base[0] + held * 10 * (d + 1) * 4 and down == base[1] + 2 * 10 * d * 4
    up, down = alg.traffic_bytes("fedmekt", params, d, held=held, public_size=32)
    assert up == base[0] + held * 32 * d * 4 and down == base[1] + 2 * 32 * d * 4
  # The other methods do not depend on the number of held modalities.
  assert alg.traffic_bytes("fedavg", params, d, held=1, num_classes=10, public_size=32) == base


def _gca_numpy(local, global_other, present):
  """CreamFL eqs. (4)-(6) by hand: ``local [C, P, d]`` -> ``[P, d]`` (tau = 1)."""
  c, p, _ = local.shape
  agg = np.zeros(local.shape[1:])
  for k in range(p):
    scores = []
    for j in range(c):
      sims = global_other @ local[j, k]
      negatives = np.log(np.exp(np.delete(sims, k)).sum())
      scores.append(sims[k] - negatives)
    e = np.where(present, np.exp(np.array(scores) - max(np.array(scores)[present])), 0.0)
    agg[k] = (e / e.sum()) @ local[:, k]
  return agg


def test_representation_ema_by_hand():
  """CreamFL's server: GCA per modality over the clients holding it (a single-modality
  client's unsent rows, here NaN, never reach it), then g <- 0.9 g + 0.1 a; a modality
  no sampled client holds keeps g."""
  local = _unit(RNG.normal(size=(4, 2, 5, 3))).astype(np.float32)
  modality = np.array([[1, 1], [1, 0], [0, 1], [1, 1]], bool)
  local[1, 1] = np.nan  # the image-only client sent no text
  local[2, 0] = np.nan  # the text-only client sent no image
  previous = _unit(RNG.normal(size=(2, 5, 3))).astype(np.float32)
  where = np.array([True, True, True, False])  # client 3 not sampled
  got, weights = S.representation_ema(local, modality, previous, where, decay=0.9)
  assert np.isfinite(np.asarray(got)).all()
  for v in range(2):
    present = modality[:, v] & where
    rows = np.where(present[:, None, None], local[:, v], 0.0)
    a = _gca_numpy(rows.astype(np.float64), previous[1 - v].astype(np.float64), present)
    np.testing.assert_allclose(got[v], 0.9 * previous[v] + 0.1 * a, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(weights[v])[~present], 0.0)
  where = np.array([False, True, False, False])  # only the image-only client: no text
  got, _ = S.representation_ema(local, modality, previous, where, decay=0.9)
  np.testing.assert_array_equal(got[1], previous[1])
  assert not np.allclose(got[0], previous[0])


def test_cream_terms_by_modality():
  """The client's CreamFL regulariser: eq. (1) against every global rep of the other
  modality + eq. (2) (own global positive, start-of-round negative), mean over the public
  set, summed over the held modalities."""
  spec = alg.RcsrDef(graphdef=None, num_clients=2, per_round=1, rounds=1)
  tau = spec.cream_temperature
  z = _unit(RNG.normal(size=(2, 4, 5))).astype(np.float32)
  g = _unit(RNG.normal(size=(2, 4, 5))).astype(np.float32)
  start = _unit(RNG.normal(size=(2, 4, 5))).astype(np.float32)

  def one(v):
    logits = z[v] @ g[1 - v].T / tau
    inter = np.log(np.exp(logits).sum(1)) - np.diag(logits)
    pos, neg = (z[v] * g[v]).sum(1) / tau, (z[v] * start[v]).sum(1) / tau
    intra = np.log(np.exp(pos) + np.exp(neg)) - pos
    return inter.mean() + intra.mean()

  for mod, want in (([1, 1], one(0) + one(1)), ([1, 0], one(0)), ([0, 1], one(1))):
    got = alg.cream_terms(spec, z[0], z[1], g, start, jnp.asarray(mod, bool))
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_traffic_bytes_of_creamfl():
  """CreamFL: the adapters + heads both ways, plus the public-set representations of
  each held modality up and both modalities' global representations down."""
  params = {"w": jnp.zeros((10, 10)), "b": jnp.zeros(10)}
  d = 8
  base = alg.traffic_bytes("fedavg", params, d)
  for held in (1, 2):
    up, down = alg.traffic_bytes("creamfl", params, d, held=held, public_size=32)
    assert up == base[0] + held * 32 * d * 4 and down == base[1] + 2 * 32 * d * 4
