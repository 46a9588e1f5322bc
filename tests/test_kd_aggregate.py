"""FedET's and FedGEMS's weights on representations against per-sample, per-client loops.

The rules run in chunks of public samples; every chunk size (dividing ``P`` or not,
``>= P``) must give the loops' values, absent clients included. FedET's diversity
ensemble and regulariser are checked against a literal loop too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mm import losses
from fedjax_mm.server import kd_aggregate

TAU = 0.5
# P = 12 public samples in _data: chunks of 1, of sizes that do not divide P, of P, beyond P.
CHUNKS = [1, 5, 7, 12, 20]


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _probabilities(l, g):
  """One client's softmax over j of l_k . g_j / tau: [P, P]."""
  logits = l @ g.T / TAU
  e = np.exp(logits - logits.max(axis=1, keepdims=True))
  return e / e.sum(axis=1, keepdims=True)


def _fedet_loop(local, g_other, present):
  """(consensus, its weights, diversity ensemble, its weights), one sample at a time."""
  num_clients, num_public, _ = local.shape
  probs = [_probabilities(local[c], g_other) for c in range(num_clients)]
  weights = np.zeros((num_clients, num_public))
  beta = np.zeros((num_clients, num_public))
  for k in range(num_public):
    votes = {c: int(np.argmax(probs[c][k])) for c in range(num_clients) if present[c]}
    if not votes:
      continue
    counts = {c: sum(v == votes[c] for v in votes.values()) for c in votes}
    top = max(counts.values())
    kept = [c for c in votes if counts[c] == top]
    var = {c: np.var(probs[c][k]) for c in kept}
    for c in kept:
      weights[c, k] = var[c] / sum(var.values())
    # The diversity ensemble: the present clients outside the majority, by variance.
    outside = [c for c in votes if c not in kept]
    var = {c: np.var(probs[c][k]) for c in outside}
    for c in outside:
      beta[c, k] = var[c] / sum(var.values())
  return (
    np.einsum("ck,ckd->kd", weights, local),
    weights,
    np.einsum("ck,ckd->kd", beta, local),
    beta,
  )


def _fedgems_loop(local, g_same, g_other, present):
  num_clients, num_public, _ = local.shape
  probs = [_probabilities(local[c], g_other) for c in range(num_clients)]
  weights = np.zeros((num_clients, num_public))
  agg = np.zeros(local.shape[1:])
  for k in range(num_public):
    if np.argmax(g_same[k] @ g_other.T) == k:  # S_correct: the server's own representation
      agg[k] = g_same[k]
      continue
    chosen = [c for c in range(num_clients) if present[c] and np.argmax(probs[c][k]) == k]
    if not chosen:
      chosen = [c for c in range(num_clients) if present[c]]
    entropy = {c: -np.sum(probs[c][k] * np.log(probs[c][k])) for c in chosen}
    z = sum(np.exp(-h) for h in entropy.values())
    for c in chosen:
      weights[c, k] = np.exp(-entropy[c]) / z
      agg[k] += weights[c, k] * local[c, k]
  return agg, weights


def _data(seed, num_clients=5, num_public=12, dim=6):
  rng = np.random.default_rng(seed)
  g_other = _unit(rng.normal(size=(num_public, dim)))
  g_same = _unit(g_other + 1.2 * rng.normal(size=(num_public, dim)))
  # Clients near the server's other modality (some agree), plus two near-copies for majorities.
  local = _unit(g_other[None] + rng.normal(scale=0.9, size=(num_clients, num_public, dim)))
  local[1] = _unit(local[0] + 0.05 * rng.normal(size=(num_public, dim)))
  return local, g_same, g_other


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("present", [[1, 1, 1, 1, 1], [1, 1, 0, 1, 0], [0, 0, 0, 1, 0]])
def test_fedet_matches_a_loop(x64, seed, present):
  local, _, g_other = _data(seed)
  present = np.asarray(present, bool)
  agg, w = kd_aggregate.fedet(local, g_other, present, temperature=TAU)
  want_agg, want_w, _, _ = _fedet_loop(local, g_other, present)
  np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-9, atol=1e-12)
  np.testing.assert_allclose(np.asarray(agg), want_agg, rtol=1e-9, atol=1e-12)
  # Absent clients weigh 0; every sample's weights sum to 1 over the present clients.
  assert np.all(np.asarray(w)[~present] == 0)
  np.testing.assert_allclose(np.asarray(w).sum(0), 1.0, rtol=1e-9)


def test_fedet_majority_excludes_the_dissenting_client():
  """Two clients vote for sample 0's pair, one for another sample: the third weighs 0."""
  g = jnp.eye(3)
  local = jnp.stack([g, g * 0.9 + 0.01, jnp.roll(g, 1, axis=0)])
  _, w = kd_aggregate.fedet(local, g, jnp.array([True, True, True]), temperature=0.1)
  w = np.asarray(w)
  assert np.all(w[2] == 0) and np.all(w[:2] > 0)
  # The more peaked (confident) client weighs more.
  assert np.all(w[0] > w[1])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("present", [[1, 1, 1, 1, 1], [0, 1, 1, 0, 1], [0, 0, 0, 0, 0]])
def test_fedgems_matches_a_loop(x64, seed, present):
  local, g_same, g_other = _data(seed)
  present = np.asarray(present, bool)
  agg, w = kd_aggregate.fedgems(local, g_same, g_other, present, temperature=TAU)
  want_agg, want_w = _fedgems_loop(local, g_same, g_other, present)
  np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-9, atol=1e-12)
  np.testing.assert_allclose(np.asarray(agg), want_agg, rtol=1e-9, atol=1e-12)
  keep = np.asarray(kd_aggregate.server_correct(g_same, g_other))
  # Both S_correct and S_incorrect occur in the data, so both branches are tested.
  assert 0 < keep.sum() < len(keep)
  if present.any():
    np.testing.assert_allclose(np.asarray(w).sum(0)[~keep], 1.0, rtol=1e-9)


def test_fedgems_prefers_correct_clients_and_keeps_the_servers_right_answers():
  g_other = jnp.eye(3)
  g_same = jnp.asarray(np.roll(np.eye(3), 1, axis=0)).at[0].set(jnp.array([1.0, 0, 0]))
  # The server retrieves sample 0's pair only. Client 0 is right everywhere, client 1 nowhere.
  local = jnp.stack([g_other, jnp.roll(g_other, 1, axis=0)])
  agg, w = kd_aggregate.fedgems(local, g_same, g_other, jnp.array([True, True]))
  np.testing.assert_array_equal(np.asarray(kd_aggregate.server_correct(g_same, g_other)), [1, 0, 0])
  np.testing.assert_allclose(np.asarray(agg)[0], np.asarray(g_same)[0])
  np.testing.assert_allclose(np.asarray(w), [[0, 1, 1], [0, 0, 0]])
  np.testing.assert_allclose(np.asarray(agg)[1:], np.asarray(g_other)[1:])


def test_rules_jit_and_run_in_float32():
  local, g_same, g_other = (jnp.asarray(x, jnp.float32) for x in _data(3))
  present = jnp.array([True, False, True, True, True])
  agg, w = jax.jit(kd_aggregate.fedet)(local, g_other, present)
  agg2, w2 = jax.jit(kd_aggregate.fedgems)(local, g_same, g_other, present)
  for a in (agg, w, agg2, w2):
    assert a.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(a)))


PRESENCE = [[1, 1, 1, 1, 1], [1, 1, 0, 1, 0], [0, 0, 0, 1, 0], [0, 0, 0, 0, 0]]


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("present", PRESENCE)
def test_chunked_fedet_matches_the_loop(x64, chunk, present):
  """Every chunk size gives the loop's consensus and diversity ensemble, absent clients at 0."""
  local, _, g_other = _data(4)
  present = np.asarray(present, bool)
  got = kd_aggregate.fedet_with_diversity(
    local, g_other, present, temperature=TAU, chunk_size=chunk
  )
  for a, b in zip(got, _fedet_loop(local, g_other, present), strict=True):
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-9, atol=1e-12)
  agg, w = kd_aggregate.fedet(local, g_other, present, temperature=TAU, chunk_size=chunk)
  np.testing.assert_array_equal(np.asarray(agg), np.asarray(got[0]))
  np.testing.assert_array_equal(np.asarray(w), np.asarray(got[1]))
  for weights in (got[1], got[3]):
    assert np.all(np.asarray(weights)[~present] == 0)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("present", PRESENCE)
def test_chunked_fedgems_matches_the_loop(x64, chunk, present):
  local, g_same, g_other = _data(5)
  present = np.asarray(present, bool)
  agg, w = kd_aggregate.fedgems(local, g_same, g_other, present, temperature=TAU, chunk_size=chunk)
  want_agg, want_w = _fedgems_loop(local, g_same, g_other, present)
  np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-9, atol=1e-12)
  np.testing.assert_allclose(np.asarray(agg), want_agg, rtol=1e-9, atol=1e-12)
  assert np.all(np.asarray(w)[~present] == 0)


def test_automatic_chunks_bound_the_probabilities_in_memory():
  """chunk_size=None keeps C x chunk x P probabilities within DEFAULT_CHUNK_ELEMENTS."""
  for clients, public in ((9, 1200), (10, 50_000), (3, 10)):
    chunk = kd_aggregate.default_chunk_size(clients, public)
    assert 1 <= chunk <= public
    assert clients * chunk * public <= max(kd_aggregate.DEFAULT_CHUNK_ELEMENTS, clients * public)
  assert kd_aggregate.default_chunk_size(10, 50_000) < 50_000  # the paper's P is chunked
  # The automatic choice gives the same values as one chunk (here it is one chunk).
  local, g_same, g_other = (jnp.asarray(x, jnp.float32) for x in _data(6))
  present = jnp.array([True, True, False, True, True])
  auto = kd_aggregate.fedgems(local, g_same, g_other, present)
  whole = kd_aggregate.fedgems(local, g_same, g_other, present, chunk_size=12)
  for a, b in zip(auto, whole, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_chunked_rules_jit_with_a_static_chunk():
  local, g_same, g_other = (jnp.asarray(x, jnp.float32) for x in _data(7))
  present = jnp.array([True, False, True, True, True])
  fedet = jax.jit(lambda *a: kd_aggregate.fedet_with_diversity(*a, chunk_size=5))
  fedgems = jax.jit(lambda *a: kd_aggregate.fedgems(*a, chunk_size=5))
  for got, want in (
    (fedet(local, g_other, present), kd_aggregate.fedet_with_diversity(local, g_other, present)),
    (
      fedgems(local, g_same, g_other, present),
      kd_aggregate.fedgems(local, g_same, g_other, present),
    ),
  ):
    for a, b in zip(got, want, strict=True):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="chunk_size"):
    kd_aggregate.fedet(local, g_other, present, chunk_size=0)


def _diversity_loop(server, local, beta, g_other):
  """KL(softmax of the beta-weighted mean of the non-majority clients' LOGITS || server's)."""
  kl = np.zeros(server.shape[0])
  for k in range(server.shape[0]):
    if beta[:, k].sum() == 0:
      continue  # no client outside the majority: no diversity to keep
    teacher_logits = sum(beta[c, k] * (local[c, k] @ g_other.T / TAU) for c in range(len(beta)))
    t = np.exp(teacher_logits - teacher_logits.max())
    t /= t.sum()
    s = np.exp(server[k] @ g_other.T / TAU - (server[k] @ g_other.T / TAU).max())
    s /= s.sum()
    kl[k] = np.sum(t * np.log(t / s))
  return kl


@pytest.mark.parametrize("present", [[1, 1, 1, 1, 1], [1, 1, 0, 1, 1]])
def test_diversity_term_matches_a_loop(x64, present):
  """The regulariser on the ensemble representation == the loop over averaged client logits."""
  local, g_same, g_other = _data(8)
  present = np.asarray(present, bool)
  _, _, ensemble, beta = kd_aggregate.fedet_with_diversity(
    local, g_other, present, temperature=TAU, chunk_size=5
  )
  beta = np.asarray(beta)
  has = beta.sum(0) > 0
  assert 0 < has.sum() < len(has)  # both kinds of samples occur
  got = losses.fedet_diversity(g_same, ensemble, g_other, temperature=TAU, where=has)
  want = _diversity_loop(g_same, local, beta, g_other)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-9, atol=1e-12)
  assert np.all(np.asarray(got)[~has] == 0) and np.all(want[has] > 0)


def test_diversity_is_empty_under_unanimity_and_for_one_client():
  g = jnp.eye(4)
  unanimous = jnp.stack([g, 0.9 * g + 0.01, g])  # every client votes for each sample's pair
  for present in ([True, True, True], [False, True, False]):
    _, w, ensemble, beta = kd_aggregate.fedet_with_diversity(unanimous, g, jnp.array(present))
    assert np.all(np.asarray(beta) == 0) and np.all(np.asarray(ensemble) == 0)
    np.testing.assert_allclose(np.asarray(w).sum(0), 1.0, rtol=1e-6)
  # A dissenting client is the whole diversity ensemble of its samples.
  dissent = jnp.stack([g, 0.9 * g + 0.01, jnp.roll(g, 1, axis=0)])
  _, w, ensemble, beta = kd_aggregate.fedet_with_diversity(
    dissent, g, jnp.array([True, True, True]), temperature=0.1
  )
  np.testing.assert_allclose(np.asarray(beta), [[0] * 4, [0] * 4, [1] * 4])
  np.testing.assert_allclose(np.asarray(ensemble), np.asarray(dissent[2]), rtol=1e-6)
  # The server that already matches the ensemble has nothing to learn from it.
  zero = losses.fedet_diversity(ensemble, ensemble, g)
  np.testing.assert_allclose(np.asarray(zero), 0.0, atol=1e-6)
