"""Tests of the contrastive losses against literal implementations of the paper."""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from fedjax_mm import losses
from fedjax_mm.losses import gramian, muscle


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _random_problem(seed, num_others, batch, dim=5):
  rng = np.random.default_rng(seed)
  anchor = _unit(rng.normal(size=(batch, dim)))
  others = _unit(rng.normal(size=(num_others, batch, dim)))
  tau = rng.uniform(0.1, 0.5, size=num_others)
  gamma = rng.uniform(0.2, 3.0, size=(num_others, num_others))
  gamma = (gamma + gamma.T) / 2
  return anchor, others, tau, gamma


def _literal_muscle(anchor, others, tau, gamma):
  """Eq. (3) as written: a Python loop over every tuple j in [B]^M."""
  num_others, batch, _ = others.shape
  losses_ = []
  for i in range(batch):

    def logit(j, i=i):
      value = sum(anchor[i] @ others[m, j[m]] / tau[m] for m in range(num_others))
      # log alpha_j = -1/2 sum over ordered pairs m != m' of gamma z^m . z^m'.
      for m in range(num_others):
        for mp in range(num_others):
          if m != mp:
            value -= 0.5 * gamma[m, mp] * others[m, j[m]] @ others[mp, j[mp]]
      return value

    all_logits = [logit(j) for j in itertools.product(range(batch), repeat=num_others)]
    top = max(all_logits)
    denominator = top + np.log(sum(np.exp(v - top) for v in all_logits))
    losses_.append(denominator - logit((i,) * num_others))
  return np.array(losses_)


def _literal_info_nce(anchor, positive, temperature):
  out = []
  for i in range(anchor.shape[0]):
    logits = np.array([anchor[i] @ positive[j] / temperature for j in range(positive.shape[0])])
    out.append(-logits[i] + np.log(np.exp(logits).sum()))
  return np.array(out)


@pytest.mark.usefixtures("x64")
class TestMuscle:
  @pytest.mark.parametrize("method", muscle.METHODS)
  @pytest.mark.parametrize("num_others,batch", [(1, 5), (2, 4), (3, 4), (4, 3)])
  def test_equals_literal_loop_over_tuples(self, num_others, batch, method):
    anchor, others, tau, gamma = _random_problem(num_others, num_others, batch)
    expected = _literal_muscle(anchor, others, tau, gamma)
    got = losses.muscle_loss(
      jnp.asarray(anchor), jnp.asarray(others), tau=tau, gamma=gamma, method=method
    )
    np.testing.assert_allclose(got, expected, rtol=1e-10)

  @pytest.mark.parametrize("num_others,batch", [(1, 5), (2, 4), (3, 5), (4, 3)])
  def test_contraction_equals_log_domain_with_gradients_and_chunks(self, num_others, batch):
    anchor, others, tau, gamma = _random_problem(30 + num_others, num_others, batch)

    def total(a, o, method, chunk):
      per_anchor = losses.muscle_loss(a, o, tau=tau, gamma=gamma, method=method, chunk_size=chunk)
      return (per_anchor * jnp.arange(1, batch + 1)).sum()  # distinct weight per anchor

    grad = jax.jit(jax.value_and_grad(total, argnums=(0, 1)), static_argnums=(2, 3))
    reference = grad(anchor, others, "logsumexp", None)
    for chunk in (None, 1, 2, batch - 1):
      chex.assert_trees_all_close(
        grad(anchor, others, "contract", chunk), reference, rtol=1e-10, atol=1e-12
      )

  @pytest.mark.parametrize("num_others,batch", [(1, 5), (2, 4), (3, 4), (4, 3)])
  def test_protocols_and_chunks_agree(self, num_others, batch):
    anchor, others, tau, gamma = _random_problem(10 + num_others, num_others, batch)
    reference = losses.muscle_loss(anchor, others, tau=tau, gamma=gamma)
    targets = losses.muscle_server_targets(others, tau=tau, gamma=gamma)
    np.testing.assert_allclose(losses.muscle_client_loss(anchor, targets), reference, rtol=1e-12)
    s, log_alpha = losses.muscle_paper_targets(others, tau=tau, gamma=gamma)
    assert s.shape == (batch**num_others, anchor.shape[1])
    assert log_alpha.shape == (batch**num_others,)
    paper = losses.muscle_loss_from_paper_targets(anchor, s, log_alpha)
    np.testing.assert_allclose(paper, reference, rtol=1e-12)
    for chunk in range(1, batch + 2):
      chunked = losses.muscle_loss(anchor, others, tau=tau, gamma=gamma, chunk_size=chunk)
      np.testing.assert_allclose(chunked, reference, rtol=1e-12)

  @pytest.mark.parametrize("kernel_max_others", [0, 4])
  @pytest.mark.parametrize("num_others,batch", [(1, 5), (2, 4), (3, 4), (4, 3)])
  def test_both_contraction_orders_equal_the_literal_loop(
    self, num_others, batch, kernel_max_others, monkeypatch
  ):
    # The kernel tensor (M <= KERNEL_MAX_OTHERS) and the greedy einsum, each at every M.
    monkeypatch.setattr(muscle, "KERNEL_MAX_OTHERS", kernel_max_others)
    anchor, others, tau, gamma = _random_problem(50 + num_others, num_others, batch)
    expected = _literal_muscle(anchor, others, tau, gamma)

    def total(a, o, chunk):
      per_anchor = losses.muscle_loss(
        a, o, tau=tau, gamma=gamma, method="contract", chunk_size=chunk
      )
      return (per_anchor * jnp.arange(1, batch + 1)).sum(), per_anchor

    for chunk in (None, 2):
      (_, got), grads = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(
        anchor, others, chunk
      )
      np.testing.assert_allclose(got, expected, rtol=1e-10)
      monkeypatch.setattr(muscle, "KERNEL_MAX_OTHERS", 4 - kernel_max_others)  # the other order
      reference, _ = jax.grad(total, argnums=(0, 1), has_aux=True)(anchor, others, chunk)
      chex.assert_trees_all_close(grads, reference, rtol=1e-10, atol=1e-12)
      monkeypatch.setattr(muscle, "KERNEL_MAX_OTHERS", kernel_max_others)

  def test_chunked_gradients_agree(self):
    anchor, others, tau, gamma = _random_problem(3, 3, 5)

    def total(a, o, chunk):
      return losses.muscle_loss(a, o, tau=tau, gamma=gamma, chunk_size=chunk).sum()

    grad = jax.jit(jax.grad(total, argnums=(0, 1)), static_argnums=2)
    full = grad(anchor, others, None)
    for chunk in (1, 2, 4):
      chunked = grad(anchor, others, chunk)
      chex.assert_trees_all_close(chunked, full, rtol=1e-10)

  def test_one_other_model_is_info_nce(self):
    anchor, others, tau, _ = _random_problem(4, 1, 6)
    got = losses.muscle_loss(anchor, others, tau=tau[0], gamma=2.0)
    expected = losses.info_nce(anchor, others[0], temperature=tau[0])
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    np.testing.assert_allclose(expected, _literal_info_nce(anchor, others[0], tau[0]), rtol=1e-12)

  def test_zero_gamma_is_pairwise(self):
    anchor, others, tau, _ = _random_problem(5, 3, 5)
    got = losses.muscle_loss(anchor, others, tau=tau, gamma=0.0)
    expected = losses.pairwise_info_nce(anchor, others, tau=tau)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    literal = sum(_literal_info_nce(anchor, others[m], tau[m]) for m in range(3))
    np.testing.assert_allclose(expected, literal, rtol=1e-12)

  def test_gamma_changes_the_loss(self):
    # Guards the tests above against a gamma that is silently ignored.
    anchor, others, tau, gamma = _random_problem(6, 3, 4)
    with_gamma = losses.muscle_loss(anchor, others, tau=tau, gamma=gamma)
    without = losses.muscle_loss(anchor, others, tau=tau, gamma=0.0)
    assert np.abs(with_gamma - without).max() > 1e-3

  def test_gamma_diagonal_is_ignored_and_scalar_broadcasts(self):
    anchor, others, tau, _ = _random_problem(7, 3, 4)
    gamma = np.full((3, 3), 1.5)
    np.fill_diagonal(gamma, 100.0)
    np.testing.assert_allclose(
      losses.muscle_loss(anchor, others, tau=tau, gamma=gamma),
      losses.muscle_loss(anchor, others, tau=tau, gamma=1.5),
      rtol=1e-12,
    )

  def test_gradients(self):
    anchor, others, tau, gamma = _random_problem(8, 2, 3, dim=3)
    f = jax.jit(lambda a, o: losses.muscle_loss(a, o, tau=tau, gamma=gamma, chunk_size=2))
    check_grads(f, (anchor, others), order=2, modes=["rev"])
    targets = losses.muscle_server_targets(others, tau=tau, gamma=gamma)
    check_grads(
      lambda a: losses.muscle_client_loss(a, targets), (anchor,), order=1, modes=["fwd", "rev"]
    )

  def test_vmap_over_users(self):
    rng = np.random.default_rng(9)
    anchors = _unit(rng.normal(size=(5, 4, 6)))
    others = _unit(rng.normal(size=(5, 3, 4, 6)))
    batched = jax.vmap(lambda a, o: losses.muscle_loss(a, o, tau=0.2, gamma=1.5))(anchors, others)
    looped = np.stack(
      [losses.muscle_loss(a, o, tau=0.2, gamma=1.5) for a, o in zip(anchors, others, strict=True)]
    )
    np.testing.assert_allclose(batched, looped, rtol=1e-12)

  def test_server_targets_are_what_the_paper_sends(self):
    _, others, tau, gamma = _random_problem(11, 3, 4)
    targets = losses.muscle_server_targets(others, tau=tau, gamma=gamma)
    np.testing.assert_allclose(targets.scaled_others, others / tau[:, None, None], rtol=1e-12)
    for p, (m, mp) in enumerate(itertools.combinations(range(3), 2)):
      np.testing.assert_allclose(
        targets.pair_logits[p], -gamma[m, mp] * others[m] @ others[mp].T, rtol=1e-12
      )
    s, log_alpha = losses.muscle_paper_targets(others, tau=tau, gamma=gamma)
    for flat, j in enumerate(itertools.product(range(4), repeat=3)):
      np.testing.assert_allclose(
        s[flat], sum(others[m, j[m]] / tau[m] for m in range(3)), rtol=1e-12
      )
      expected = -sum(
        gamma[m, mp] * others[m, j[m]] @ others[mp, j[mp]]
        for m, mp in itertools.combinations(range(3), 2)
      )
      np.testing.assert_allclose(log_alpha[flat], expected, rtol=1e-10, atol=1e-12)


def test_muscle_gamma():
  np.testing.assert_allclose(losses.muscle_gamma(0.2, 0.15), 1 / 0.15 - 1 / 0.2, rtol=1e-6)
  tau_full, tau_reduced = np.full((3, 3), 0.3), np.full((3, 3), 0.1)
  np.testing.assert_allclose(
    losses.muscle_gamma(tau_full, tau_reduced), np.full((3, 3), 10 - 10 / 3), rtol=1e-6
  )


def test_muscle_logit_range():
  gamma = losses.muscle_gamma(0.2, 0.15)  # 10/3
  # M = 3: three anchor factors of range 2 / 0.2 and three pairs of range 2 * 10/3.
  assert losses.muscle_logit_range(0.2, gamma, 3) == pytest.approx(40.0, rel=1e-6)
  tau = np.array([0.1, 0.2, 0.5])
  pairs = np.array([[0.0, 1.0, 2.0], [1.0, 0.0, -3.0], [2.0, -3.0, 0.0]])
  expected = 2 * (10 + 5 + 2) + 2 * (1 + 2 + 3)
  assert losses.muscle_logit_range(tau, pairs, 3) == pytest.approx(expected)
  seen = []
  jax.jit(lambda t: seen.append(losses.muscle_logit_range(t, 1.0, 3)) or t)(0.2)
  assert seen == [None]  # traced: unknown, so "auto" keeps the log domain


@pytest.mark.parametrize(
  "method,logit_range,dtype,expected",
  [
    ("auto", 40.0, jnp.float32, True),
    ("auto", 84.0, jnp.float32, True),
    ("auto", 90.0, jnp.float32, False),  # e^-90 is below float32's normal range
    ("auto", 600.0, jnp.float64, True),
    ("auto", 40.0, jnp.float16, False),
    ("auto", 40.0, jnp.bfloat16, False),
    ("auto", None, jnp.float32, False),
    ("contract", None, jnp.float16, True),
    ("logsumexp", 1.0, jnp.float32, False),
  ],
)
def test_muscle_method_choice(method, logit_range, dtype, expected):
  assert muscle._use_contraction(method, logit_range, dtype) is expected


def test_muscle_auto_falls_back_where_the_contraction_underflows():
  # Anchor e1; each partner holds e1 and -e1. Every anchor factor peaks at the
  # e1 sample, the pair factor at opposite samples, so the largest exp-domain
  # term is e^{-min(2 gamma, 2 / tau)} = e^{-120}: zero in float32.
  e1, e2 = np.eye(2, dtype=np.float32)
  anchor = np.stack([e1, e2])
  others = np.stack([np.stack([e1, -e1])] * 2)
  tau, gamma = 1 / 60, 60.0
  assert losses.muscle_logit_range(tau, gamma, 2) > muscle.CONTRACT_MAX_RANGE["float32"]
  forced = losses.muscle_loss(anchor, others, tau=tau, gamma=gamma, method="contract")
  assert not np.isfinite(np.asarray(forced)[0])  # the failure "auto" must avoid
  auto = losses.muscle_loss(anchor, others, tau=tau, gamma=gamma)
  expected = _literal_muscle(
    anchor.astype(np.float64), others.astype(np.float64), [tau] * 2, np.full((2, 2), gamma)
  )
  np.testing.assert_allclose(auto, expected, rtol=1e-5)


def test_muscle_method_rejects_unknown():
  with pytest.raises(ValueError, match="method must be one of"):
    ones = np.ones((1, 2, 3), np.float32)
    losses.muscle_loss(ones[0], ones, tau=0.2, gamma=1.0, method="fast")


def test_muscle_compiles_once_per_shape():
  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(a, o):
    return jax.value_and_grad(lambda a: losses.muscle_loss(a, o, tau=0.2, gamma=1.0).mean())(a)

  rng = np.random.default_rng(0)
  for _ in range(3):
    step(
      jnp.asarray(_unit(rng.normal(size=(4, 8))), jnp.float32),
      jnp.asarray(_unit(rng.normal(size=(3, 4, 8))), jnp.float32),
    )


@pytest.mark.parametrize(
  "kwargs,message",
  [
    (dict(others=np.ones((0, 4, 3))), "at least one other"),
    (dict(others=np.ones((2, 1, 3)), anchor=np.ones((1, 3))), "at least 2"),
    (dict(tau=np.ones(3)), "tau must be"),
    (dict(gamma=np.ones((3, 3))), "gamma must be"),
    (
      dict(anchor=np.ones((3, 3))),
      r"must share B and d, got anchor \(3, 3\) and others \(2, 4, 3\)",
    ),
    (dict(anchor=np.ones((4, 5))), r"must share B and d, got anchor \(4, 5\)"),
    (dict(others=np.ones((2, 4, 5))), r"got anchor \(4, 3\) and others \(2, 4, 5\)"),
    (dict(anchor=np.ones(3)), r"must share B and d, got anchor \(3,\)"),
    (dict(anchor=np.ones((4, 3), int)), "anchor must be floating-point"),
    (dict(others=np.ones((2, 4, 3), int)), "others must be floating-point"),
    (dict(others=[np.ones((4, 3)), np.ones((3, 3))]), r"got shapes \[\(4, 3\), \(3, 3\)\]"),
    (dict(others=[]), "at least one other"),
    (dict(tau=0.0), "tau must be positive, got 0.0"),
    (dict(tau=np.array([0.2, -0.1])), "tau must be positive"),
  ],
)
def test_muscle_bad_input(kwargs, message):
  args = dict(anchor=np.ones((4, 3)), others=np.ones((2, 4, 3)), tau=0.2, gamma=1.0) | kwargs
  float_ = lambda v: np.asarray(v, np.float32) if v.dtype.kind == "f" else v
  args = {k: float_(v) if isinstance(v, np.ndarray) else v for k, v in args.items()}
  with pytest.raises(ValueError, match=message):
    losses.muscle_loss(args.pop("anchor"), args.pop("others"), **args)


def test_muscle_client_loss_names_the_targets_shape():
  targets = losses.muscle_server_targets(jnp.ones((2, 4, 3)), tau=0.2, gamma=1.0)
  with pytest.raises(ValueError, match=r"anchor must be \[B=4, d=3\], got shape \(4, 5\)"):
    losses.muscle_client_loss(jnp.ones((4, 5)), targets)


def test_muscle_takes_the_others_as_a_sequence_of_matrices():
  """What each partner sends is one [B, d] matrix: a list of them is the stacked loss."""
  anchor, others, _, _ = (np.asarray(x, np.float32) for x in _random_problem(40, 3, 5))
  stacked = losses.muscle_loss(anchor, others, tau=0.2, gamma=1.0)
  np.testing.assert_array_equal(
    losses.muscle_loss(anchor, list(others), tau=0.2, gamma=1.0), stacked
  )
  np.testing.assert_array_equal(
    jax.jit(lambda a, o: losses.muscle_loss(a, o, tau=0.2, gamma=1.0))(anchor, tuple(others)),
    stacked,
  )
  np.testing.assert_array_equal(
    losses.pairwise_info_nce(anchor, list(others), tau=0.2),
    losses.pairwise_info_nce(anchor, others, tau=0.2),
  )


def test_a_traced_temperature_is_not_checked_but_still_used():
  """A learnt temperature is a tracer under jit: no check can read it, and the loss uses it."""
  anchor, others, _, _ = (np.asarray(x, np.float32) for x in _random_problem(41, 2, 5))
  traced = jax.jit(lambda t: losses.muscle_loss(anchor, others, tau=t, gamma=1.0))(0.3)
  np.testing.assert_allclose(
    traced, losses.muscle_loss(anchor, others, tau=0.3, gamma=1.0), rtol=1e-6
  )


@pytest.mark.parametrize(
  "positive,temperature,message",
  [
    (np.ones((3, 2)), 0.5, r"shapes \(4, 2\) and \(3, 2\)"),
    (np.ones((4, 3)), 0.5, r"shapes \(4, 2\) and \(4, 3\)"),
    (np.ones((4, 2)), 0.0, "temperature must be positive"),
    (np.ones((4, 2)), -1.0, "temperature must be positive"),
    (np.ones((4, 2), int), 0.5, "positive must be floating-point"),
  ],
)
def test_info_nce_bad_input(positive, temperature, message):
  with pytest.raises(ValueError, match=message):
    losses.info_nce(np.ones((4, 2), np.float32), positive, temperature=temperature)


@pytest.mark.usefixtures("x64")
class TestInfoNCE:
  def test_literal(self):
    anchor, others, _, _ = _random_problem(20, 1, 6)
    np.testing.assert_allclose(
      losses.info_nce(anchor, others[0], temperature=0.3),
      _literal_info_nce(anchor, others[0], 0.3),
      rtol=1e-12,
    )

  def test_where_equals_dropping_the_rows(self):
    anchor, others, _, _ = _random_problem(21, 1, 7)
    where = np.array([1, 1, 0, 1, 0, 1, 1], bool)
    masked = losses.info_nce(anchor, others[0], temperature=0.3, where=where)
    dropped = losses.info_nce(anchor[where], others[0][where], temperature=0.3)
    np.testing.assert_allclose(masked[where], dropped, rtol=1e-12)
    np.testing.assert_array_equal(masked[~where], 0.0)

  def test_symmetric(self):
    a, b, _, _ = _random_problem(22, 1, 6)
    b = b[0]
    got = losses.symmetric_info_nce(a, b, temperature=0.25, weight=0.7)
    expected = 0.7 * _literal_info_nce(a, b, 0.25) + 0.3 * _literal_info_nce(b, a, 0.25)
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def _literal_gramian(anchor, others, tau):
  num_others, batch, _ = others.shape
  out = []
  for i in range(batch):
    logits = []
    for j in range(batch):
      vectors = np.stack([anchor[i]] + [others[m, j] for m in range(num_others)])
      logits.append(-np.sqrt(max(np.linalg.det(vectors @ vectors.T), 0.0)) / tau)
    logits = np.array(logits)
    out.append(np.log(np.exp(logits).sum()) - logits[i])
  return np.array(out)


@pytest.mark.usefixtures("x64")
class TestGramian:
  @pytest.mark.parametrize("num_others", [1, 2, 3])
  def test_against_direct_determinant(self, num_others):
    anchor, others, _, _ = _random_problem(30 + num_others, num_others, 5, dim=6)
    got = losses.gramian_loss(anchor, others, tau=0.2)
    np.testing.assert_allclose(got, _literal_gramian(anchor, others, 0.2), rtol=1e-9)

  def test_one_other_model_is_not_info_nce(self):
    # Appendix J: with two models the Gramian loss is not InfoNCE. Its logit is
    # -|sin(angle)|/tau, blind to the sign of the similarity: flipping the
    # positive to its antipode leaves the loss unchanged, unlike InfoNCE.
    anchor, others, _, _ = _random_problem(40, 1, 6)
    g = losses.gramian_loss(anchor, others, tau=0.2)
    assert np.abs(g - losses.info_nce(anchor, others[0], temperature=0.2)).max() > 1e-2
    np.testing.assert_allclose(losses.gramian_loss(anchor, -others, tau=0.2), g, rtol=1e-10)
    similarity = anchor @ others[0].T
    logits = -np.sqrt(1 - similarity**2) / 0.2
    np.testing.assert_allclose(g, np.log(np.exp(logits).sum(-1)) - np.diag(logits), rtol=1e-8)

  def test_gradients(self):
    anchor, others, _, _ = _random_problem(41, 2, 4, dim=6)
    check_grads(
      lambda a, o: gramian.gramian_loss(a, o, tau=0.3), (anchor, others), order=1, modes=["rev"]
    )

  def test_degenerate_volume_has_finite_gradient(self):
    anchor, others, _, _ = _random_problem(42, 1, 3)
    grad = jax.grad(lambda a: losses.gramian_loss(a, jnp.asarray(anchor)[None], tau=0.2).sum())(
      jnp.asarray(anchor)
    )
    assert np.isfinite(grad).all()


def test_pairwise_info_nce_checks_its_temperatures_before_the_vmap_hides_them():
  anchor, others, _, _ = (np.asarray(x, np.float32) for x in _random_problem(42, 2, 4))
  with pytest.raises(ValueError, match=r"tau must be positive, got \[0.2, 0.0\]"):
    losses.pairwise_info_nce(anchor, others, tau=[0.2, 0.0])
