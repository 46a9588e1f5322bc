"""FedMuscle's Table 1 baselines: FedDF, FedHeNN, FedRCL, SimCLR and Curriculum Labeling.

(SAGE and CoFED: tests/test_fedmuscle_ssl.py; all of them run a round here.)

Losses and the cross-group average against numpy written from the papers'
formulas; FedDF never mixes tasks; FedRCL reads no public data; every method
runs a round of the ``:smoke`` config side by side.
"""

import math

import fedmuscle_toys
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import fedmuscle as fedmuscle_config
from fedjax_mm import core, losses, server
from fedjax_mm.algorithms import fedhenn, fedrcl
from fedjax_mm.algorithms.fedmuscle import public_batches
from fedjax_mm.core import ledger
from fedjax_mm.runner import fedmuscle as runner
from fedjax_mm.runner import fedmuscle_report, loop
from fedjax_mm.runner.errors import ConfigError
from fedjax_mm.runner.report import flatten

# ---------------------------------------------------------------- losses vs numpy


def _np_log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _np_sigmoid(x):
  return 1 / (1 + np.exp(-x))


@pytest.mark.parametrize("kind", ["classification", "multilabel", "segmentation"])
def test_ensemble_distillation_is_the_kl_of_the_averaged_logits(kind):
  rng = np.random.default_rng(0)
  shape = (3, 2, 2, 4) if kind == "segmentation" else (3, 4)
  student = rng.normal(size=shape)
  teachers = rng.normal(size=(2,) + shape)  # two users of the same task
  ensemble = teachers.mean(0)  # FedDF averages logits, then the softmax
  t = 2.0
  if kind == "multilabel":
    p, q = _np_sigmoid(ensemble / t), _np_sigmoid(student / t)
    want = (p * np.log(p / q) + (1 - p) * np.log((1 - p) / (1 - q))).mean(-1)
  else:
    lp, lq = _np_log_softmax(ensemble / t), _np_log_softmax(student / t)
    want = (np.exp(lp) * (lp - lq)).sum(-1).reshape(3, -1).mean(-1)
  got = losses.ensemble_distillation(
    jnp.asarray(student, jnp.float32),
    jnp.asarray(ensemble, jnp.float32),
    kind=kind,
    temperature=t,
  )
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  same = losses.ensemble_distillation(jnp.asarray(student), jnp.asarray(student), kind=kind)
  np.testing.assert_allclose(same, 0.0, atol=1e-6)


def test_cka_matches_the_hsic_formula():
  rng = np.random.default_rng(1)
  z1, z2 = rng.normal(size=(6, 3)), rng.normal(size=(6, 5))  # different widths, same samples
  n = 6
  h = np.eye(n) - np.ones((n, n)) / n
  hsic = lambda k, l: np.trace(k @ h @ l @ h) / (n - 1) ** 2
  k, l = z1 @ z1.T, z2 @ z2.T
  want = hsic(k, l) / math.sqrt(hsic(k, k) * hsic(l, l))
  got = losses.cka(losses.linear_kernel(jnp.asarray(z1)), losses.linear_kernel(jnp.asarray(z2)))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_allclose(losses.cka_distance(jnp.asarray(z1), jnp.asarray(3 * k)), 0, atol=1e-6)


def test_cka_refuses_what_is_not_two_kernels_of_one_shape():
  z = jnp.ones((6, 3))
  for k, l in ((z, z), (jnp.eye(6), jnp.eye(4)), (jnp.eye(6), z)):
    with pytest.raises(ValueError, match=r"cka takes two \[n, n\] kernels on the same n samples"):
      losses.cka(k, l)
  with pytest.raises(ValueError, match="pass linear_kernel"):
    losses.cka_distance(z, jnp.eye(5))


def _np_rcl(z, labels, tau, lam, beta, where):
  """FedRCL's terms, anchor by anchor, pair by pair (see losses/fedrcl.py)."""
  s = z @ z.T
  out = np.zeros(len(z))
  for i in np.flatnonzero(where):
    others = [j for j in np.flatnonzero(where) if j != i]
    pos = [j for j in others if labels[i] == labels[j]]
    neg = [j for j in others if labels[i] != labels[j]]
    scl = 0.0
    for p in pos:
      num = np.exp(s[i, p] / tau)
      scl += -np.log(num / (num + sum(np.exp(s[i, n] / tau) for n in neg)))
    scl = scl / len(pos) if pos else 0.0
    close = [j for j in pos if s[i, j] > lam]
    div = 0.0
    if close:
      own = np.exp(s[i, i] / tau)
      div = -np.log(own / (own + sum(np.exp(s[i, j] / tau) for j in close)))
    out[i] = scl + beta * div
  return out


def test_relaxed_contrastive_loss_matches_numpy():
  rng = np.random.default_rng(2)
  z = rng.normal(size=(7, 4))
  z[1] = z[0] + 0.05 * rng.normal(size=4)  # a same-class pair above the threshold
  z /= np.linalg.norm(z, axis=1, keepdims=True)
  labels = np.array([0, 0, 1, 0, 1, 2, 1])
  where = np.array([1, 1, 1, 1, 1, 1, 0], bool)  # the last sample is padding
  tau, lam, beta = 0.5, 0.7, 0.8
  want = _np_rcl(z, labels, tau, lam, beta, where)
  assert want[0] > 0 and want[5] == 0  # the pair is penalised; a lone class has no term
  got = losses.relaxed_contrastive_loss(
    jnp.asarray(z, jnp.float32),
    losses.label_positives(jnp.asarray(labels)),
    tau=tau,
    threshold=lam,
    beta=beta,
    where=jnp.asarray(where),
  )
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_set_positives_is_a_jaccard_threshold():
  sets = np.array([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]])
  inter = sets @ sets.T
  union = sets.sum(1)[:, None] + sets.sum(1)[None] - inter
  jac = np.where(union > 0, inter / np.maximum(union, 1), 1.0)
  np.testing.assert_array_equal(losses.set_positives(jnp.asarray(sets)), jac >= 0.5)


def test_fedrcl_mask_positives_leave_out_only_a_real_background():
  # Three masks over classes {0, 1, 2} plus void (255): their label sets with class 0
  # are {0, 1}, {0, 2}, {0}; without it {1}, {2}, {}.
  masks = np.zeros((3, 2, 2), np.int32)
  masks[0, 0, 0], masks[1, 0, 0], masks[2, 1, 1] = 1, 2, 255
  sets = np.array([[1, 1, 0], [1, 0, 1], [1, 0, 0]])

  def jaccard_pairs(sets):
    inter = sets @ sets.T
    union = sets.sum(1)[:, None] + sets.sum(1)[None] - inter
    return np.where(union > 0, inter / np.maximum(union, 1), 1.0) >= 0.5

  world = core.Task("segmentation", "image", "mask", 3, background=0)
  coco = core.Task("segmentation", "image", "mask", 3)  # 0 is an object (person)
  got_world = fedrcl.positives(world, jnp.asarray(masks))
  got_coco = fedrcl.positives(coco, jnp.asarray(masks))
  np.testing.assert_array_equal(got_world, jaccard_pairs(sets[:, 1:]))
  np.testing.assert_array_equal(got_coco, jaccard_pairs(sets))
  assert got_coco[0, 2] and not got_world[0, 2]  # {0, 1} vs {0}: 1/2 with person, 0 without
  # The runner gives the world's masks a background and COCO panoptic's none.
  config = fedmuscle_config.get_config("smoke")
  ss = runner.User(0, "cnn_s", "ss")
  assert runner._task(ss, config).background == 0
  config.data.source, config.data.tasks.ss = "tfds", "coco_panoptic"
  assert runner._task(ss, config).background is None
  with pytest.raises(ValueError, match="background"):
    core.Task("classification", "image", "label10", 10, background=0)


def test_average_within_classes_matches_numpy():
  rng = np.random.default_rng(3)
  xs = [rng.normal(size=(k, 3)) for k in (2, 1, 1, 1)]
  ws = [np.array([1.0, 3.0]), np.array([2.0]), np.array([4.0]), np.array([0.0])]
  classes = (0, 1, 0, 2)
  got = server.average_within_classes(
    [{"w": jnp.asarray(x)} for x in xs], [jnp.asarray(w) for w in ws], classes
  )
  mean0 = (xs[0] * ws[0][:, None]).sum(0) + xs[2][0] * 4.0
  mean0 /= 8.0
  np.testing.assert_allclose(got[0]["w"], np.stack([mean0, mean0]), rtol=1e-6)
  np.testing.assert_allclose(got[2]["w"], mean0[None], rtol=1e-6)
  np.testing.assert_allclose(got[1]["w"], xs[1], rtol=1e-6)  # alone: its own model
  np.testing.assert_allclose(got[3]["w"], xs[3], rtol=1e-6)  # weight 0: kept


def test_average_within_classes_receive_and_select():
  rng = np.random.default_rng(4)
  trees = [
    {"body": jnp.asarray(rng.normal(size=(k, 3))), "head": jnp.asarray(rng.normal(size=(k, 2)))}
    for k in (2, 2)
  ]
  ws = [jnp.asarray([1.0, 2.0]), jnp.asarray([3.0, 0.0])]
  receive = [jnp.asarray([True, False]), jnp.asarray([False, True])]
  got = server.average_within_classes(
    trees, ws, ("a", "a"), receive=receive, select=lambda path: "head" in str(path[0])
  )
  w = np.array([1.0, 2.0, 3.0, 0.0])
  joined = np.concatenate([np.asarray(t["head"]) for t in trees])
  mean = (joined * w[:, None]).sum(0) / w.sum()  # a non-receiving client's weight still counts
  for g, t in enumerate(trees):
    np.testing.assert_array_equal(got[g]["body"], t["body"])  # not selected: kept exactly
    for k in range(2):
      want = mean if receive[g][k] else np.asarray(t["head"][k])
      np.testing.assert_allclose(got[g]["head"][k], want, rtol=1e-6)
  # A class of one client is returned exactly, not recomputed as x * w / w.
  alone = {"w": jnp.asarray(rng.normal(size=(1, 5)), jnp.float32)}
  (out,) = server.average_within_classes([alone], [jnp.asarray([0.3])], (0,))
  np.testing.assert_array_equal(out["w"], alone["w"])


# ---------------------------------------------------------------- algorithms

ALL = fedmuscle_toys.ALL
_build = fedmuscle_toys.build
_algorithm = fedmuscle_toys.algorithm
_leaves = fedmuscle_toys.leaves
_assert_same = fedmuscle_toys.assert_same
_changed = fedmuscle_toys.changed
_shifted = fedmuscle_toys.shifted


def _round(name, public=None, *, states=None):
  """Every user's parameters after one round of a method, and its stats."""
  new, stats = fedmuscle_toys.one_round(name, public, states=states)
  return [g.params for g in new.groups], stats


def test_feddf_averages_and_distils_within_a_task_only():
  states = _build()[3]
  params, stats = _round("feddf")
  local, _ = _round("local")
  _assert_same(params[3], params[4])  # same task and architecture: one prototype
  for g in (0, 2):  # no partner: local training, bit for bit
    _assert_same(params[g], local[g])
  assert _changed(params[1], local[1])  # IC10 vit_t: distilled toward its task's ensemble
  loss = np.asarray(stats["distill_loss"])
  assert np.all(loss[[1, 3, 4]] > 0) and np.all(loss[[0, 2]] == 0)
  # Another model for the MLC user changes nothing for the IC10 users, and vice versa.
  moved, _ = _round("feddf", states=_shifted(states, 0))
  for g in (1, 3, 4):
    _assert_same(moved[g], params[g])
  moved, _ = _round("feddf", states=_shifted(states, 1))
  for g in (0, 2):
    _assert_same(moved[g], params[g])


def test_fedrcl_reads_no_public_data_and_averages_within_a_class():
  public = _build()[6]
  params, _ = _round("fedrcl")
  _assert_same(
    _round("fedrcl", jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), public))[0], params
  )
  _assert_same(params[3], params[4])
  local, _ = _round("local")
  assert all(_changed(params[g], local[g]) for g in range(5))  # the contrastive term acts


def test_fedhenn_distances_are_cka_to_the_mean_kernel():
  config, _, groups, states, _, _, public, _ = _build()
  params, stats = _round("fedhenn")
  assert np.all(np.isfinite(np.concatenate([x.ravel() for x in _leaves(params)])))
  # The alignment set: the first batch of the round's public order (FedMuscle's first
  # CL batch when rad_size = B).
  size = config.baselines.fedhenn.rad_size
  round_key = jax.random.fold_in(jax.random.key(7), 0)
  batches, _ = public_batches(jax.random.fold_in(round_key, 0), public, size)
  rad = jax.tree.map(lambda x: x[0], batches)
  represent = lambda states: [  # one compile for every user (op by op is slower)
    fedhenn.representations(g, s.params, s.shared, g.task.inputs(rad))[0]
    for g, s in zip(groups, states, strict=True)
  ]
  z = [np.asarray(x) for x in jax.jit(represent)(states)]
  h = np.eye(size) - np.ones((size, size)) / size
  hsic = lambda k, l: np.trace(k @ h @ l @ h)
  mean = sum(x @ x.T for x in z) / len(z)  # K_bar: every user's kernel, uniformly
  want = [1 - hsic(x @ x.T, mean) / np.sqrt(hsic(x @ x.T, x @ x.T) * hsic(mean, mean)) for x in z]
  np.testing.assert_allclose(stats["cka_distance"], want, rtol=1e-4, atol=1e-5)


def test_every_method_runs_a_round_from_the_same_start():
  config, users, groups, states, _, test, _, _ = _build()
  algs = runner.algorithms(config, users, groups)
  assert tuple(algs) == runner.METHODS
  starts = {m: alg.init(states, jax.random.key(7)) for m, alg in algs.items()}
  for m in runner.METHODS[1:]:
    _assert_same(
      [g.params for g in starts[m].groups], [g.params for g in starts["fedmuscle"].groups]
    )
  for m in runner.METHODS:
    params, _ = _round(m)
    assert np.all(np.isfinite(np.concatenate([x.ravel() for x in _leaves(params)]))), m


# ---------------------------------------------------------------- the experiment


def test_methods_config():
  config = fedmuscle_config.get_config("smoke")
  assert runner.methods_of(config) == ("fedmuscle", "local")  # the default: today's run
  config.methods = "local, fedrcl,feddf"
  assert runner.methods_of(config) == ("feddf", "fedrcl", "local")  # report order
  config.methods = "('fedhenn', 'local')"  # a tuple typed on the command line
  assert runner.methods_of(config) == ("fedhenn", "local")
  assert runner.methods_of({"methods": ("local", "fedhenn")}) == ("fedhenn", "local")
  for bad, message in [
    ("feddf", "must include local"),
    ("fedmatch,local", r"unknown \['fedmatch'\]"),
  ]:
    config.methods = bad
    with pytest.raises(ConfigError, match=message):
      runner.validate(config)


def test_report_has_a_column_and_a_delta_per_method():
  config, users, groups, *_, trivial = _build()
  # Each method's evaluation: its users' metrics (runner.fedmuscle.experiment's evaluate).
  final = {m: {"users": [0.5 + 0.1 * i, 0.2, 0.3, 0.4, 0.5]} for i, m in enumerate(runner.METHODS)}
  final["local"] = {"users": [0.5, 0.2, 0.0, 0.4, 0.5]}
  history = [{"run": m, "round": 1, "delta": 0.0} for m in runner.METHODS[:-1]]
  outcome = loop.Outcome(final, history, {"fedmuscle": ledger.Ledger.zeros(len(users))}, 1.0, 0)
  traffic = runner._bytes_per_round(config, 2)
  costs = {
    m: runner.cost_lib.MethodCost((1e9, 2e9, 0.0, 0.0, 0.5e9), 3e9 * (m == "feddf"))
    for m in runner.METHODS
  }
  report = fedmuscle_report.report(
    config, runner.METHODS, users, groups, traffic, trivial, outcome, costs=costs
  )
  assert report.results["flops_per_round"]["feddf"] == {
    "users": [1e9, 2e9, 0.0, 0.0, 0.5e9],
    "users_total": 3.5e9,
    "server": 3e9,
  }
  rows = [[c.strip() for c in line.split("|")[1:-1]] for line in report.text.splitlines()]
  flops_row = [r for r in rows if r and r[0] == "FedDF" and len(r) == 5][0]
  assert flops_row[1:4] == ["3.5", "1 / 2 / 0 / 0 / 0.5", "3"]
  deltas = report.results["deltas"]
  assert list(deltas) == list(runner.METHODS[:-1])
  for i, m in enumerate(deltas):  # user 1 gains 0.1 i / 0.5; user 3 (local 0) is left out
    assert deltas[m] == pytest.approx(0.1 * i / 0.5 / 4)
    assert report.results[m] == final[m]["users"]  # results.json keeps the per-user list
  assert report.results["delta"] == deltas["fedmuscle"]
  assert report.results["delta_excluded_users"] == ["user 3"]
  # The result table (fedmuscle_report.tables, rendered by the loop): a row per method.
  names = ("FedMuscle (muscle)", "SAGE", "CoFED", "FedDF", "FedHeNN", "FedRCL", "local")
  assert all(name in report.final for name in names)
  table = fedmuscle_report.tables(config)[0].render(
    {m: flatten(f) for m, f in report.final.items()},
    {"trivial": flatten(report.baselines["trivial"])},
  )
  assert "\n| FedMuscle (muscle) " in table and "\n| trivial " in table
  assert f"{100 * deltas['feddf']:+.1f} |" in table.split("| FedDF ")[1].split("\n")[0]


def test_baseline_bytes_count_only_users_with_a_partner():
  config, users, _, states, *_ = _build()
  sent = runner._baseline_bytes(config, runner.METHODS, users, states)
  params = [sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(s.params)) for s in states]
  up, down = sent["feddf"]  # IC10 users 2, 4 and 5 distil together
  np.testing.assert_array_equal(up, [0, params[1], 0, params[3], params[4]])
  np.testing.assert_array_equal(down, up)
  np.testing.assert_array_equal(sent["fedrcl"][0], [0, 0, 0, params[3], params[4]])
  np.testing.assert_array_equal(sent["fedhenn"][0], [4 * 8 * 8] * 5)  # an 8 x 8 float32 kernel
  for alone in ("simclr", "pseudo_label"):  # each user alone: a ledger of zeros
    np.testing.assert_array_equal(np.stack(sent[alone]), np.zeros((2, 5)))
