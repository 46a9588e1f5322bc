"""Table 1's federated semi-supervised baselines: SAGE and CoFED.

SAGE's pseudo-label rule and loss against a numpy port of the authors' code,
CoFED's vote against a port of theirs (``fedLabelling``, ``removeOverlap``) and
by hand through the world's class hierarchy; SAGE never mixes tasks; a CoFED
user with no pseudo-label trains as local training does; padding clients keep
their state; the ledgers.
"""

import math

import fedmuscle_toys
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rounding

from fedjax_mm import core, losses
from fedjax_mm.algorithms import cofed
from fedjax_mm.core import ledger
from fedjax_mm.runner import fedmuscle as runner
from fedjax_mm.server import cofed as vote

# ---------------------------------------------------------------- SAGE's rule vs numpy


def _np_softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


KAPPA = math.log(2) / 0.05  # SAGE.py: lambda = 1/2 at a confidence gap of 0.05


def _np_sage(local, glob, strong, tau=0.95, kappa=KAPPA, t=1.0):
  """SAGE.py's ``fixmatch_train`` on ``[n, C]`` logits, line by line (numpy for torch)."""
  c = local.shape[-1]
  p_g = _np_softmax(glob / t)
  max_g, y_g = p_g.max(-1), p_g.argmax(-1)
  p_l = _np_softmax(local / t)
  max_l, y_l = p_l.max(-1), p_l.argmax(-1)
  one_l, one_g = np.eye(c)[y_l], np.eye(c)[y_g]
  mask_l, mask_g = (max_l >= tau).astype(float), (max_g >= tau).astype(float)
  delta = np.clip(np.abs(max_l - max_g) + 1e-6, 1e-6, 1.0)
  lam = np.clip(np.exp(-kappa * delta), 1e-6, 1.0)
  final = np.where(mask_l[:, None] > 0, lam[:, None] * one_l + (1 - lam[:, None]) * one_g, one_g)
  valid = np.maximum(mask_l, mask_g)
  q, target = _np_softmax(strong) + 1e-10, final + 1e-10
  kl = (target * (np.log(target) - np.log(q))).sum(-1)  # F.kl_div(q.log(), target)
  return final, valid, kl * valid


def _logits(seed, shape):
  """Logits spread enough that some predictions pass 0.95 and some do not."""
  return np.random.default_rng(seed).normal(scale=4.0, size=shape).astype(np.float32)


def test_sage_rule_and_loss_match_the_authors_code():
  local, glob, strong = _logits(0, (64, 5)), _logits(1, (64, 5)), _logits(2, (64, 5))
  glob[:8] = local[:8] + 0.05  # near-agreement: lambda close to 1
  want_t, want_m, want_l = _np_sage(local, glob, strong)
  assert 0 < want_m.mean() < 1  # both branches: counted and not
  lam_used = (want_t.max(-1) < 1) & (want_t.max(-1) > 0)
  assert lam_used.any()  # some blended (soft) targets
  targets, mask = losses.sage_targets(jnp.asarray(local), jnp.asarray(glob))
  np.testing.assert_allclose(targets, want_t, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(mask, want_m)
  loss = losses.sage_unlabeled_loss(jnp.asarray(strong), targets, mask)
  np.testing.assert_allclose(loss, want_l, rtol=1e-4, atol=1e-6)


def test_sage_multilabel_is_the_rule_per_label_and_segmentation_per_pixel():
  # Multi-label: each label the two-class problem of logits (0, f); loss: mean over labels.
  local, glob, strong = _logits(3, (16, 6)), _logits(4, (16, 6)), _logits(5, (16, 6))
  two = lambda f: np.stack([np.zeros_like(f), f], -1).reshape(-1, 2)
  want_t, want_m, want_l = _np_sage(two(local), two(glob), two(strong))
  targets, mask = losses.sage_targets(jnp.asarray(local), jnp.asarray(glob), kind="multilabel")
  np.testing.assert_allclose(targets, want_t[:, 1].reshape(16, 6), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(mask, want_m.reshape(16, 6))
  loss = losses.sage_unlabeled_loss(jnp.asarray(strong), targets, mask, kind="multilabel")
  np.testing.assert_allclose(loss, want_l.reshape(16, 6).mean(-1), rtol=1e-4, atol=1e-6)
  # Segmentation: every pixel a sample of the classification rule; loss: mean over pixels.
  shape = (3, 4, 4, 5)
  local, glob, strong = _logits(6, shape), _logits(7, shape), _logits(8, shape)
  flat = lambda x: x.reshape(-1, 5)
  want_t, want_m, want_l = _np_sage(flat(local), flat(glob), flat(strong))
  targets, mask = losses.sage_targets(jnp.asarray(local), jnp.asarray(glob), kind="segmentation")
  np.testing.assert_allclose(targets, want_t.reshape(shape), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(mask, want_m.reshape(shape[:-1]))
  loss = losses.sage_unlabeled_loss(jnp.asarray(strong), targets, mask, kind="segmentation")
  np.testing.assert_allclose(loss, want_l.reshape(3, -1).mean(-1), rtol=1e-4, atol=1e-6)


def test_sage_gradient_flows_only_through_the_strong_view():
  local, glob, strong = (jnp.asarray(_logits(s, (8, 4))) for s in (9, 10, 11))

  def total(local, glob, strong):
    t, m = losses.sage_targets(local, glob, threshold=0.5)
    return losses.sage_unlabeled_loss(strong, t, m).sum()

  g_local, g_glob, g_strong = jax.grad(total, argnums=(0, 1, 2))(local, glob, strong)
  assert not np.any(g_local) and not np.any(g_glob) and np.any(g_strong)


# ---------------------------------------------------------------- CoFED's vote vs numpy


def _np_fed_labelling(probs, class_list, weights, margin, threshold):
  """``fedLabelling`` + ``removeOverlap`` (fed_cifar100_cifar10_pub_noiid.m), in numpy.

  Returns, per participant, ``{sample: local class index}`` of its pseudo-labels.
  """
  votes = {}  # global class -> {sample: summed weight}
  for p, classes, w in zip(probs, class_list, weights, strict=True):
    top = -np.sort(-p, axis=1)[:, :2]
    best = p.argmax(1)
    for s in np.flatnonzero(top[:, 1] - top[:, 0] < -margin):  # diff(y, 1, 2) < -margin
      c = classes[best[s]]
      votes.setdefault(c, {})
      votes[c][s] = votes[c].get(s, 0.0) + w
  total = {}
  for classes, w in zip(class_list, weights, strict=True):
    for c in classes:
      total[c] = total.get(c, 0.0) + w
  kept = {c: {s for s, v in by.items() if v / total[c] > threshold} for c, by in votes.items()}
  out = []
  for classes in class_list:
    found = {}
    for k, c in enumerate(classes):
      for s in kept.get(c, ()):
        found.setdefault(s, []).append(k)
    out.append({s: ks[0] for s, ks in found.items() if len(ks) == 1})  # removeOverlap
  return out


def test_cofed_vote_matches_the_authors_code():
  rng = np.random.default_rng(0)
  # Four participants over 8 global classes, overlapping class lists (CIFAR-100 subsets).
  class_list = [np.array([0, 1, 2, 3]), np.array([2, 3, 4]), np.array([0, 4, 5, 6, 7]), [1, 2]]
  truth = rng.integers(0, 8, size=200)
  probs = []
  for classes in class_list:
    logits = rng.normal(size=(200, len(classes)))
    hit = np.isin(truth, classes)  # samples of a class it has: mostly right
    logits[hit, np.searchsorted(classes, truth[hit])] += 3.0
    probs.append(_np_softmax(logits))
  weights = np.full(4, 0.25)
  want = _np_fed_labelling(probs, class_list, weights, 0.3, 0.3)
  assert all(len(w) > 10 for w in want)

  implies = jnp.eye(8, dtype=bool)  # classes identified by id alone: the paper's rule
  statements = [jnp.asarray(np.asarray(c, np.int32)[None]) for c in class_list]
  votes = [vote.confident_votes(jnp.asarray(p)[:, None, :], margin=0.3) for p in probs]
  asserts = jnp.stack(
    [vote.asserted(v, s, implies) for v, s in zip(votes, statements, strict=True)]
  )
  can = jnp.stack([vote.expressible(s, implies) for s in statements])
  kept, _ = vote.consensus(asserts, can, jnp.asarray(weights), threshold=0.3)
  for s, w in zip(statements, want, strict=True):
    labels = np.asarray(vote.assign(kept, s))[:, 0]
    assert {i: int(labels[i]) for i in np.flatnonzero(labels >= 0)} == w


def test_cofed_votes_through_the_world_hierarchy():
  implies = jnp.asarray(cofed.world_implications())
  tasks = {
    "ic100": runner._task(runner.User(0, "cnn_s", "ic100")),
    "ic10": runner._task(runner.User(0, "cnn_s", "ic10")),
    "mlc": runner._task(runner.User(0, "cnn_s", "mlc")),
  }
  st = {k: jnp.asarray(cofed.world_statements(t)) for k, t in tasks.items()}
  assert st["ic100"].shape == (1, 100) and st["ic10"].shape == (1, 10)
  assert st["mlc"].shape == (10, 2)
  assert cofed.world_statements(runner._task(runner.User(0, "cnn_s", "ss"))) is None
  # Two public samples. Sample 0: all agree on a colour-3 shape 2, alone. Sample 1: IC100
  # says a colour-0 shape 5, IC10 says shape 7; MLC is unsure of label 5 and denies 7.
  absent = [0] * 10
  v = {
    "ic100": jnp.asarray([[23], [50]]),
    "ic10": jnp.asarray([[2], [7]]),
    "mlc": jnp.asarray([absent[:2] + [1] + absent[3:], absent[:5] + [-1] + absent[6:]]),
  }
  asserts = jnp.stack([vote.asserted(v[k], st[k], implies) for k in st])
  can = jnp.stack([vote.expressible(st[k], implies) for k in st])
  kept, share = vote.consensus(asserts, can, jnp.ones(3) / 3, threshold=0.3)
  labels = {k: np.asarray(vote.assign(kept, st[k])) for k in st}
  assert labels["ic100"][:, 0].tolist() == [23, 50]  # only IC100 votes on its fine classes
  # IC10's shape 5 (implied by IC100's 50) and shape 7 both reach 1/2: dropped as ambiguous.
  assert labels["ic10"][:, 0].tolist() == [2, -1]
  np.testing.assert_allclose(share[1, cofed.SHAPE + 5], 0.5)
  assert labels["mlc"][0].tolist() == [0, 0, 1] + [0] * 7
  # Label 5: IC100's implied "present" (1 of 3 able to say it) beats no denial; label 7:
  # present (IC10) and absent (MLC) both kept, so the sample is undecided for MLC.
  np.testing.assert_allclose(share[1, cofed.PRESENT + 5], 1 / 3, rtol=1e-6)
  assert labels["mlc"][1, 5] == 1 and labels["mlc"][1, 7] == -1


# ---------------------------------------------------------------- the algorithms

ALL = fedmuscle_toys.ALL
_build = fedmuscle_toys.build
_algorithm = fedmuscle_toys.algorithm
_leaves = fedmuscle_toys.leaves
_assert_same = fedmuscle_toys.assert_same


def _round(name, *, states=None, **overrides):
  return fedmuscle_toys.one_round(name, states=states, **overrides)


def _head(params):
  return params["head"]


_shifted = fedmuscle_toys.shifted


def test_sage_averages_within_a_task_only():
  # Threshold 0: every public sample's pseudo-label counts, so the pseudo-labels act too.
  states = _build()[3]
  new, stats = _round("sage", threshold=0.0)
  params = [g.params for g in new.groups]
  _assert_same(params[3], params[4])  # same task and architecture: one model
  _assert_same(_head(params[1]), _head(params[3]))  # same task: one head
  assert not np.array_equal(  # ... but user 2 keeps its own projector
    np.asarray(params[1]["projector"]["kernel"][...]),
    np.asarray(params[3]["projector"]["kernel"][...]),
  )
  # Another model for the MLC user changes nothing for the IC10 users, and vice versa;
  # the IC100 user, alone in its task, is untouched by both.
  moved = [g.params for g in _round("sage", states=_shifted(states, 0), threshold=0.0)[0].groups]
  for g in (1, 2, 3, 4):
    _assert_same(moved[g], params[g])
  moved = [g.params for g in _round("sage", states=_shifted(states, 1), threshold=0.0)[0].groups]
  for g in (0, 2):
    _assert_same(moved[g], params[g])
  assert not rounding.close(_head(moved[3]), _head(params[3]))


def test_sage_without_counted_pseudo_labels_is_local_training_for_a_user_alone():
  # Threshold 1: no pseudo-label ever counts, so no public step is taken. The users alone
  # in their tasks (MLC, IC100) then train exactly as local training does; the IC10 users
  # still average their heads (and users 4 and 5 everything).
  local = [g.params for g in _round("local")[0].groups]
  new, stats = _round("sage", threshold=1.0)
  np.testing.assert_array_equal(stats["kept"], 0.0)
  params = [g.params for g in new.groups]
  for g in (0, 2):
    _assert_same(params[g], local[g])
  assert not rounding.close(_head(params[3]), _head(local[3]))
  # Threshold 0: every public sample counts and the unlabelled term moves every user.
  new, stats = _round("sage", threshold=0.0)
  np.testing.assert_allclose(stats["kept"], 1.0)
  assert np.all(np.asarray(stats["pseudo_loss"]) > 0)
  for g in (0, 2):
    assert not rounding.close(new.groups[g].params, local[g])


def test_cofed_without_pseudo_labels_is_local_training_and_with_them_is_not():
  # Unweighted (class_balanced off): the class weights alone would already move a user
  # whose own labels are imbalanced (test_cofed_class_balanced_loss_...).
  local, _ = _round("local")
  # The initial heads are near-uniform: no prediction clears the margin, nothing is kept.
  new, stats = _round("cofed", class_balanced=False)
  np.testing.assert_array_equal(stats["kept"], 0.0)
  for a, b in zip(new.groups, local.groups, strict=True):
    _assert_same(a.params, b.params)
  # With no margin and no threshold every user votes and every voted statement is kept:
  # the IC100 user, alone on its fine classes, gets a label for every sample; the others'
  # votes conflict (IC10 users disagree, IC users' "present" meets MLC's "absent") and
  # their samples are dropped (removeOverlap), so they train as local training does.
  new, stats = _round("cofed", margin=0.0, threshold=0.0, class_balanced=False)
  kept = np.asarray(stats["kept"])
  np.testing.assert_array_equal(kept, [0, 0, 1, 0, 0])
  for g, (a, b) in enumerate(zip(new.groups, local.groups, strict=True)):
    assert (not rounding.close(a.params, b.params)) == (kept[g] > 0), g


def test_cofed_class_weights_are_the_authors_inverse_counts():
  # classWeights = 1 ./ countcats(yTrain), divided by their maximum: min_c n_c / n_y over
  # the client's combined set; masked samples count nowhere and weigh 0.
  labels = np.array([0, 0, 0, 2, 2, 5, 0, 5])
  mask = np.array([1, 1, 1, 1, 1, 1, 0, 0], bool)
  counts = np.bincount(labels[mask], minlength=7).astype(float)
  inverse = np.where(counts > 0, 1 / np.maximum(counts, 1), 0.0)
  want = (inverse / inverse.max())[labels] * mask
  task = core.Task("classification", "image", "label10", 7)
  got = cofed.class_weights(task, jnp.asarray(labels), jnp.asarray(mask))
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_allclose(got[:6], [1 / 3, 1 / 3, 1 / 3, 0.5, 0.5, 1.0], rtol=1e-6)
  # Multi-label: each label a two-class head (absent, present), balanced on its own.
  multi = np.array([[1, 0, 1], [1, 0, 0], [0, 0, 1], [1, 1, 1]], np.float32)
  mask = np.array([1, 1, 1, 0], bool)
  task = core.Task("multilabel", "image", "multilabel", 3)
  got = np.asarray(cofed.class_weights(task, jnp.asarray(multi), jnp.asarray(mask)))
  for c in range(3):
    t = multi[mask, c]
    n = np.array([np.sum(t == 0), np.sum(t == 1)], float)
    inv = np.where(n > 0, 1 / np.maximum(n, 1), 0.0)
    np.testing.assert_allclose(got[mask, c], (inv / inv.max())[t.astype(int)], rtol=1e-6)
  np.testing.assert_array_equal(got[~mask], 0.0)
  # The weighted loss is the mean over the batch of each example's weighted loss.
  logits = jax.random.normal(jax.random.key(0), (8, 7))
  task = core.Task("classification", "image", "label10", 7)
  w = cofed.class_weights(task, jnp.asarray(labels), jnp.ones(8, bool))
  per = -jax.nn.log_softmax(logits)[np.arange(8), labels]
  np.testing.assert_allclose(
    task.loss(logits, jnp.asarray(labels), jnp.ones(8, bool), w), np.mean(per * w), rtol=1e-6
  )


def test_cofed_class_balanced_loss_acts():
  """The class weights change what a user trains: on the IC100 user, which keeps every
  public sample with no margin and no threshold (its pseudo-labels are imbalanced)."""
  off, stats = _round("cofed", margin=0.0, threshold=0.0, class_balanced=False)
  on, stats_on = _round("cofed", margin=0.0, threshold=0.0)
  np.testing.assert_array_equal(stats["kept"], stats_on["kept"])  # the same votes
  assert not rounding.close(on.groups[2].params, off.groups[2].params)


def _padded(state, data):
  """A group's state and data with one padding client appended (zeros, no samples)."""
  state = state.replace(
    params=jax.tree.map(lambda x: jnp.concatenate([x, x + 1.0]), state.params),
    opt_state=jax.tree.map(lambda x: jnp.concatenate([x, x]), state.opt_state),
    rng=jnp.concatenate([state.rng, jax.random.split(jax.random.key(3), 1)]),
  )
  zeros = lambda x: jnp.concatenate([x, jnp.zeros_like(x)])
  data = data.replace(
    arrays={k: zeros(v) for k, v in data.arrays.items()},
    sample_mask=zeros(data.sample_mask),
    user_ids=jnp.concatenate([data.user_ids, jnp.asarray([-1], data.user_ids.dtype)]),
    client_mask=zeros(data.client_mask),
  )
  return state, data


@pytest.mark.parametrize(
  "name,g",
  [
    ("sage", 3),  # beside user 4, averaged with user 5: a weighed padding would move the mean
    ("cofed", 2),  # beside the IC100 user: a voting padding would break its unanimous labels
  ],
)
def test_padding_clients_keep_their_state_and_change_nothing(name, g):
  config, users, groups, states, train, _, public, _ = _build()
  overrides = {"threshold": 0.0} if name == "sage" else {"margin": 0.0, "threshold": 0.0}
  reference, _ = _round(name, **overrides)
  padded_state, padded_data = _padded(states[g], train[g])  # its parameters moved by 1
  states = states[:g] + (padded_state,) + states[g + 1 :]
  train = train[:g] + (padded_data,) + train[g + 1 :]
  alg, _ = _algorithm(name, **overrides)
  new, stats = jax.jit(alg.round)(alg.init(states, jax.random.key(7)), train, public)
  for field in ("params", "opt_state"):
    pad = jax.tree.map(lambda x: x[1:], getattr(new.groups[g], field))
    _assert_same(pad, jax.tree.map(lambda x: x[1:], getattr(padded_state, field)))
  if name == "sage":  # the public phase's own optimizer state too
    start = alg.init(states, jax.random.key(7)).cl_opt_state[g]
    _assert_same(*(jax.tree.map(lambda x: x[1:], o) for o in (new.cl_opt_state[g], start)))
  assert float(stats["kept"][g + 1]) == 0.0  # the padding client's slot in the user axis
  for h, (a, b) in enumerate(zip(new.groups, reference.groups, strict=True)):
    if h == g:
      a = a.replace(params=jax.tree.map(lambda x: x[:1], a.params))
    for x, y in zip(_leaves(a.params), _leaves(b.params), strict=True):
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_ledgers_of_sage_and_cofed():
  config, users, _, states, *_ = _build()
  sent = runner._baseline_bytes(config, runner.METHODS, users, states)
  tree = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t))
  up, down = sent["sage"]
  params = [tree(s.params) for s in states]
  head = tree(_head(states[1].params))
  # MLC and IC100 users are alone in their tasks; user 2 shares its head with users 4 and 5,
  # who share everything.
  np.testing.assert_array_equal(up, [0, head, 0, params[3], params[4]])
  np.testing.assert_array_equal(down, up)
  p = config.public.size
  up, down = sent["cofed"]  # int32 votes up, int32 pseudo-labels down: 10 heads for MLC
  np.testing.assert_array_equal(up, [4 * p * 10, 4 * p, 4 * p, 4 * p, 4 * p])
  np.testing.assert_array_equal(down, up)
  assert ledger.tree_bytes(cofed.messages(None, p)) == 0
