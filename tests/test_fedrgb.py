"""FedRGB's losses and DRO weights against direct numpy."""

import dataclasses

import fedrgb_toys
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mm import core, losses, server


def _unit(rng, *shape):
  x = rng.normal(size=shape)
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _np_ce(s):
  """Per-row cross-entropy with the diagonal as target."""
  out = []
  for i in range(s.shape[0]):
    out.append(-(s[i, i] - np.log(np.sum(np.exp(s[i])))))
  return np.array(out)


def _np_task(a, b, tau):
  s = a @ b.T / tau
  return _np_ce(s) + _np_ce(s.T)


def test_task_loss_matches_numpy():
  rng = np.random.default_rng(0)
  a, b = _unit(rng, 6, 5), _unit(rng, 6, 5)
  got = losses.task_loss(jnp.asarray(a), jnp.asarray(b))
  np.testing.assert_allclose(got, _np_task(a, b, 0.07), rtol=1e-4, atol=1e-4)


def test_guide_and_local_loss_match_numpy():
  rng = np.random.default_rng(1)
  zi, zt, ti, tt = (_unit(rng, 4, 3) for _ in range(4))
  guide = np.sum((ti - zi) ** 2, -1) + np.sum((tt - zt) ** 2, -1)
  np.testing.assert_allclose(losses.guide_loss(zi, zt, ti, tt), guide, rtol=1e-5, atol=1e-6)
  local = losses.local_loss(zi, zt, ti, tt, alpha=3.0)
  np.testing.assert_allclose(local, guide + 3.0 * _np_task(zi, zt, 0.07), rtol=1e-4, atol=1e-4)


def test_dro_loss_every_form_matches_numpy():
  rng = np.random.default_rng(2)
  ti, tt, ai, at, li, lt = (_unit(rng, 5, 4) for _ in range(6))
  reg = np.sum((ai - ti) ** 2, -1) + np.sum((at - tt) ** 2, -1)
  eq6 = 2.0 * reg + _np_task(ti, ai, 0.07) + _np_task(li, lt, 0.07)
  got6 = losses.dro_loss(ti, tt, ai, at, li, lt, beta=2.0)
  np.testing.assert_allclose(got6, eq6, rtol=1e-4, atol=1e-4)
  eq12 = 2.0 * reg + _np_task(ai, at, 0.07)
  got12 = losses.dro_loss(ti, tt, ai, at, beta=2.0, form="eq12")
  np.testing.assert_allclose(got12, eq12, rtol=1e-4, atol=1e-4)
  appb = eq12 + _np_task(li, lt, 0.07)  # App. B: eq. (12) + L_task on the distorted features
  gotb = losses.dro_loss(ti, tt, ai, at, li, lt, beta=2.0, form="appb")
  np.testing.assert_allclose(gotb, appb, rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match="form"):
    losses.dro_loss(ti, tt, ai, at, form="eq7")
  with pytest.raises(ValueError, match="local_img"):
    losses.dro_loss(ti, tt, ai, at, form="appb")


_project = jax.jit(server.project_chi2_ball)  # rho traced: one compile per shape


def _np_divergence(w):
  n = len(w)
  return np.sum((n * w - 1.0) ** 2) / (2 * n)


@pytest.mark.parametrize("rho", [1e-4, 0.01, 0.3, 5.0])
def test_projection_on_simplex_is_shrink_towards_uniform(rho):
  rng = np.random.default_rng(3)
  for _ in range(5):
    w = rng.dirichlet(np.ones(6) * 0.5)
    u = np.full(6, 1 / 6)
    want = u + min(1.0, np.sqrt(rho / _np_divergence(w))) * (w - u)
    got = _project(jnp.asarray(w), rho)
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_projection_rho_zero_uniform_and_inactive_identity():
  w = jnp.asarray([0.7, 0.2, 0.1, 0.0])
  np.testing.assert_allclose(server.project_chi2_ball(w, 0.0), np.full(4, 0.25), atol=1e-7)
  d = float(server.chi2_divergence(w))
  np.testing.assert_allclose(server.project_chi2_ball(w, d * 1.01), w, atol=1e-6)
  with pytest.raises(ValueError, match="rho"):
    server.project_chi2_ball(w, -0.1)


def _np_dykstra(w, rho, iters=3000):
  """Independent reference: Dykstra's alternating projections (simplex, ball)."""
  n = len(w)
  u = np.full(n, 1 / n)
  r = np.sqrt(2 * rho / n)

  def simplex(v):
    s = np.sort(v)[::-1]
    css = np.cumsum(s) - 1
    k = np.nonzero(s - css / np.arange(1, n + 1) > 0)[0][-1]
    return np.maximum(v - css[k] / (k + 1), 0)

  def ball(v):
    d = np.linalg.norm(v - u)
    return v if d <= r else u + r / d * (v - u)

  x, p, q = w.copy(), np.zeros(n), np.zeros(n)
  for _ in range(iters):
    y = simplex(x + p)
    p = x + p - y
    x = ball(y + q)
    q = y + q - x
  return x


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_projection_of_any_point_is_optimal(seed, x64):
  rng = np.random.default_rng(seed)
  n = 5
  w = rng.normal(size=n) * 0.6 + 0.1
  for rho in (0.02, 0.4, 3.0):
    got = np.asarray(_project(jnp.asarray(w), rho))
    assert abs(got.sum() - 1) < 1e-9 and got.min() >= -1e-12
    assert _np_divergence(got) <= rho * (1 + 1e-9) + 1e-12
    np.testing.assert_allclose(got, _np_dykstra(w, rho), atol=1e-6)
    # Variational inequality: (w - x) . (y - x) <= 0 for every feasible y.
    ys = rng.dirichlet(np.ones(n), size=2000)
    u = np.full(n, 1 / n)
    dist = np.sqrt([_np_divergence(y) for y in ys])
    ys = u + np.minimum(1, np.sqrt(rho) / dist)[:, None] * (ys - u)
    assert np.max((ys - got) @ (w - got)) <= 1e-9
    assert np.min(np.linalg.norm(ys - w, axis=1)) >= np.linalg.norm(got - w) - 1e-9


def test_dro_update_upweights_high_loss_and_stays_feasible():
  w = jnp.full(4, 0.25)
  v = jnp.asarray([0.1, 0.2, 2.0, 0.3])
  new = server.dro_update(w, v, gamma=1.0, rho=1.0)
  assert int(jnp.argmax(new)) == 2
  assert float(server.chi2_divergence(new)) <= 1.0 + 1e-5
  np.testing.assert_allclose(float(new.sum()), 1.0, atol=1e-6)
  unconstrained = jax.nn.softmax(jnp.log(w) + v)
  np.testing.assert_allclose(
    server.dro_update(w, v, gamma=1.0, rho=100.0), unconstrained, atol=1e-6
  )
  np.testing.assert_allclose(server.dro_update(w, v, gamma=0.0, rho=1.0), w, atol=1e-6)


# -- the algorithm -------------------------------------------------------------

from fedjax_mm.algorithms import fedrgb as rgb  # noqa: E402


def _tiny(method="fedrgb", client_map="vmap", **kw):
  return fedrgb_toys.tiny(method, client_map, **kw)[:4]


def _client(tree, c):
  return jax.tree.map(lambda x: x[c], tree)


@pytest.fixture(scope="module")
def stage1():
  """A tiny model, its data, and stage 1 of every client run vmapped."""
  alg, state, arrays, mask = _tiny()
  keys = jax.random.split(jax.random.key(1), 3)
  one = lambda k, a, m: alg.stage1_client(state.encoder, state.aligner, state.teacher, k, a, m)
  mapped = jax.jit(lambda: rgb.map_clients(one, (keys, arrays, mask), "vmap"))()
  return alg, state, arrays, mask, keys, one, mapped


def test_round_runs_and_updates_weights(stage1):
  alg, state, arrays, mask, *_ = stage1
  new, metrics = jax.jit(alg.round)(state, arrays, mask)
  assert int(new.round) == 1
  assert all(np.isfinite(np.asarray(v)).all() for v in metrics.values())
  np.testing.assert_allclose(float(np.sum(metrics["weights"])), 1.0, atol=1e-5)
  assert float(server.chi2_divergence(metrics["weights"])) <= alg.config.rho + 1e-5


def test_vmapped_equals_looped_client_update(stage1):
  """Same losses and same embeddings (parameters to which the output is blind, e.g.

  attention key biases, get zero gradients that Adam turns into noise-sized
  steps of either sign, so the embeddings are compared, not every leaf)."""
  alg, state, arrays, mask, keys, one, mapped = stage1
  single_fn = jax.jit(one)
  embed = jax.jit(alg.embed)
  images, captions = arrays["images"][0], arrays["captions"][0]
  for c in range(3):
    enc, al, loss = single_fn(keys[c], _client(arrays, c), mask[c])
    np.testing.assert_allclose(loss, mapped[2][c], rtol=1e-4)
    got = embed(*_client((mapped[0], mapped[1]), c), images, captions)
    want = embed(enc, al, images, captions)
    for a, b in zip(got, want, strict=True):
      np.testing.assert_allclose(a, b, atol=1e-4)


def test_raising_a_clients_weight_moves_the_global_model_towards_it(stage1):
  aligns = stage1[-1][1]
  client0 = jax.tree.map(lambda x: x[0], aligns)

  def dist(tree):
    pairs = zip(jax.tree.leaves(tree), jax.tree.leaves(client0), strict=True)
    return sum(float(jnp.sum((a - b) ** 2)) for a, b in pairs)

  uniform = dist(server.weighted_mean(aligns, jnp.asarray([1 / 3, 1 / 3, 1 / 3])))
  raised = dist(server.weighted_mean(aligns, jnp.asarray([0.6, 0.2, 0.2])))
  assert raised < uniform


def test_fedavg_weights_and_traffic(stage1):
  alg, state, _, mask, *_ = stage1
  np.testing.assert_allclose(rgb.data_size_weights(mask), np.array([8, 6, 5]) / 19, rtol=1e-6)
  traffic = rgb.stage_traffic(alg, state)
  assert 0 < traffic["stage2"] == traffic["stage1"] < traffic["full_model"]
  fedavg = rgb.FedRGB(
    dataclasses.replace(alg.config, method="fedavg"), alg.encoder_def, alg.aligner_def
  )
  assert rgb.stage_traffic(fedavg, state)["stage2"] == 0
  with pytest.raises(ValueError, match="rho"):
    rgb.RgbConfig(rho=-1.0)
  with pytest.raises(ValueError, match="method"):
    rgb.RgbConfig(method="fedprox")


def test_contrastive_guidance_matches_numpy():
  """The "->CL" ablation: task_loss between local and teacher outputs, per modality."""
  rng = np.random.default_rng(5)
  zi, zt, ti, tt = (_unit(rng, 5, 3) for _ in range(4))
  want = _np_task(zi, ti, 0.07) + _np_task(zt, tt, 0.07)
  got = losses.guide_contrastive_loss(zi, zt, ti, tt)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  local = losses.local_loss(zi, zt, ti, tt, alpha=2.0, guide="cl")
  np.testing.assert_allclose(local, want + 2.0 * _np_task(zi, zt, 0.07), rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match="guide"):
    losses.local_loss(zi, zt, ti, tt, guide="l1")


def test_ablations_average_teacher_and_uniform_weights():
  """ "->avg.alig." skips stage 2 and the teacher is the aggregate; rho = 0 is uniform w."""
  alg, state, arrays, mask = _tiny(teacher="average", guide="cl", rho=0.0)
  new, metrics = jax.jit(alg.round)(state, arrays, mask)
  assert "stage2_loss" not in metrics and np.isfinite(float(metrics["stage1_loss"].mean()))
  np.testing.assert_allclose(metrics["weights"], np.full(3, 1 / 3), atol=1e-6)
  for a, b in zip(jax.tree.leaves(new.teacher), jax.tree.leaves(new.aligner), strict=True):
    np.testing.assert_array_equal(a, b)
  assert rgb.stage_traffic(alg, new)["stage2"] == 0
  with pytest.raises(ValueError, match="teacher"):
    rgb.RgbConfig(teacher="ema")


@pytest.mark.parametrize("form", ["appb", "eq12"])
def test_stage_one_reaches_the_round_through_app_b_task_loss_only(form):
  """Algorithm 1 line 27 makes the teacher the next aligners, so with frozen encoders (the
  authors' code) stage 1 reaches the next round only through stage 2. App. B's ``L_task``
  (the default) reads the client's stage-1 aligner on the distorted features: the "->CL"
  guidance changes the round's state. Eq. (12) alone does not read the local aligners:
  "->CL" gives bit for bit the state eq. (1)'s gives. (With ``train_encoders=True``, the
  paper's "whole model jointly optimized", stage 1 also reaches the next round through the
  aggregated encoders.)"""
  outs = []
  for guide in ("l2", "cl"):
    alg, state, arrays, mask = _tiny(guide=guide, dro_form=form)
    new, metrics = jax.jit(alg.round)(state, arrays, mask)
    outs.append((jax.tree.leaves((new.encoder, new.aligner)), metrics["stage1_loss"]))
  (l2, l2_loss), (cl, cl_loss) = outs
  assert not np.allclose(l2_loss, cl_loss)  # stage 1 did run on different losses
  same = all(np.array_equal(a, b) for a, b in zip(l2, cl, strict=True))
  assert same == (form == "eq12")


def test_app_b_task_loss_distorts_the_encoder_copy_and_beta_acts():
  """Stage 2's distortion. The encoder copy starts equal to ``f*``: there eq. (12)'s gradient
  for it is exactly zero (the regulariser at its minimum, ``L_CL`` reading ``f*``), App. B's
  ``L_task`` (the frozen local aligner on the copy's features) gives it one. Without the
  regulariser (beta = 0), App. B's stage distorts the copy (the teacher's outputs on its
  features move away from those on ``f*``'s), eq. (12)'s leaves it where AdamW's weight
  decay puts it; and beta changes the teacher App. B's stage trains."""
  alg, state, arrays, mask = _tiny()
  assert alg.config.dro_form == "appb"  # the default
  local = jax.tree.map(lambda x: x + 0.05, state.aligner)  # a client's own aligner
  client = _client(arrays, 0)
  batch = jax.tree.map(lambda x: x[:4], client)

  def fedrgb(form, beta=2.0):
    cfg = dataclasses.replace(alg.config, dro_form=form, beta=beta)
    return rgb.FedRGB(cfg, alg.encoder_def, alg.aligner_def)

  def copy_grad(form):
    fn = lambda c: fedrgb(form).dro_objective(c, state.teacher, state.encoder, local, batch)
    return jax.grad(fn)(state.encoder)

  assert all(not np.any(g) for g in jax.tree.leaves(copy_grad("eq12")))
  assert any(np.any(g) for g in jax.tree.leaves(copy_grad("appb")))

  def stage2(form, beta):
    """Stage 2 of client 0 as ``stage2_client`` runs it, the encoder copy kept:
    ``(teacher's z_I on f*'s features, mean squared drift of its outputs on the copy's)``."""
    a = fedrgb(form, beta)
    loss_fn = lambda p, b: a.dro_objective(p["copy"], p["teacher"], state.encoder, local, b)
    params = {"copy": state.encoder, "teacher": state.teacher}
    train = jax.jit(lambda k: a._train(loss_fn, params, k, client, mask[0], 2)[0])
    p = train(jax.random.key(3))
    clean = a.embed(state.encoder, p["teacher"], client["images"], client["captions"])
    moved = a.embed(p["copy"], p["teacher"], client["images"], client["captions"])
    drift = sum(jnp.sum((x - y) ** 2, -1) for x, y in zip(clean, moved, strict=True))
    return clean[0], float(jnp.mean(drift))

  assert stage2("appb", 0.0)[1] > 0.1  # measured 1.0
  assert stage2("eq12", 0.0)[1] < 1e-6  # measured 1.2e-8: weight decay alone
  z0, z2 = stage2("appb", 0.0)[0], stage2("appb", 2.0)[0]
  assert float(jnp.max(jnp.abs(z0 - z2))) > 1e-2  # measured 0.12


def test_dro_source_code_uses_last_rounds_losses_on_a_fixed_tenth():
  """The authors' code's variant: round 1's weights stay uniform (no losses yet); round 2's
  are eq. (5) of round 1's weights and the losses round 1 stored, which are L_dro of the
  averaged model on the first 10% of each client's split. The paper's variant differs.
  Eq. (12), which reads no local aligner, lets the check below recompute the losses from
  the state alone (App. B's form reads each client's stage-1 aligner, which it does not
  keep)."""
  alg, state, arrays, mask = _tiny(dro_source="code", dro_form="eq12")
  round_fn = jax.jit(alg.round)
  s1, m1 = round_fn(state, arrays, mask)
  np.testing.assert_allclose(m1["weights"], np.full(3, 1 / 3), atol=1e-6)
  assert "dro_loss_start" not in m1
  np.testing.assert_array_equal(s1.dro_losses, m1["dro_loss_next"])
  subset = np.asarray(rgb.dro_subset(mask[0]))
  np.testing.assert_array_equal(subset, [0, 1])  # max(2, round(0.1 * 8)) = 2 pairs
  np.testing.assert_array_equal(rgb.dro_subset(jnp.arange(400) % 2 == 1)[:3], [1, 3, 5])
  assert rgb.dro_subset(jnp.ones(400, bool)).shape == (40,)
  # Direct: client c's L_dro of the new global model on its fixed subset. Round 1's local
  # aligners are only read by eq. (6); with eq. (12) any aligner gives the same loss.
  direct = jax.jit(alg.dro_objective)
  for c in range(3):
    batch = jax.tree.map(lambda x, c=c: x[c][subset], arrays)
    want = direct(s1.encoder, s1.teacher, s1.encoder, s1.aligner, batch)
    np.testing.assert_allclose(s1.dro_losses[c], want, rtol=1e-5, atol=1e-6)
  s2, m2 = round_fn(s1, arrays, mask)
  want = server.dro_update(s1.weights, s1.dro_losses, gamma=alg.config.gamma, rho=alg.config.rho)
  np.testing.assert_allclose(m2["weights"], want, atol=1e-6)
  assert not np.allclose(m2["weights"], 1 / 3)
  paper, p_state, *_ = _tiny(dro_form="eq12")
  _, p1 = jax.jit(paper.round)(p_state, arrays, mask)
  assert not np.allclose(p1["weights"], m1["weights"])  # the paper's: this round's losses
  with pytest.raises(ValueError, match="dro_source"):
    rgb.RgbConfig(dro_source="authors")


def test_centralised_trains_one_model_on_the_union():
  """The "Centralized" row: one model (no client axis) trained for K * stage1_steps steps on
  the pooled pairs, stage1_client on the union; changing any one client's data changes the
  result (it sees every client's pairs). Compared by embeddings, as vmapped == looped:
  parameters the output is blind to take noise-sized Adam steps of either sign."""
  alg, state, arrays, mask = _tiny("centralised")
  round_fn = jax.jit(alg.round)
  new, metrics = round_fn(state, arrays, mask)
  for a, b in zip(jax.tree.leaves(new.aligner), jax.tree.leaves(state.aligner), strict=True):
    assert a.shape == b.shape  # one model, not K
  np.testing.assert_allclose(metrics["weights"], np.array([8, 6, 5]) / 19, rtol=1e-6)
  assert rgb.stage_traffic(alg, state)["stage1"] == 0
  # Directly: stage 1 (L_task) on the flattened union with K * stage1_steps steps.
  k1 = jax.random.split(jax.random.fold_in(state.rng, 0), 3)[1]
  union = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), arrays)
  want_enc, want, _ = jax.jit(alg.stage1_client, static_argnums=6)(
    state.encoder, state.aligner, state.teacher, k1, union, mask.reshape(-1), 3 * 2
  )
  embed = jax.jit(alg.embed)
  images, captions = union["images"], union["captions"]
  base = embed(new.encoder, new.aligner, images, captions)
  for a, b in zip(base, embed(want_enc, want, images, captions), strict=True):
    np.testing.assert_allclose(a, b, atol=1e-4)
  for c in range(3):
    changed, _ = round_fn(state, arrays | {"images": arrays["images"].at[c].multiply(-1.0)}, mask)
    moved = embed(changed.encoder, changed.aligner, images, captions)
    diff = max(np.abs(a - b).max() for a, b in zip(moved, base, strict=True))
    print(f"client {c} negated: embeddings move by {diff:.2e}")
    assert diff > 1e-2, c


# -- FedEMA's divergence-aware EMA (server.fedema) --------------------------------

from fedjax_mm.server import fedema  # noqa: E402


def _toy_trees(seed):
  rng = np.random.default_rng(seed)
  f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
  tree = lambda: {"a": f32(3, 2), "b": {"c": f32(4)}}
  return tree(), tree()


def test_fedema_start_matches_numpy():
  """mu = min(lambda ||W_g - W_k||, 1) with lambda = tau / ||W_g - W_k|| the first time,
  then kept; W_k <- mu W_k + (1 - mu) W_g, against a hand computation."""
  g, w = _toy_trees(0)
  flat = lambda t: np.concatenate([t["a"].ravel(), t["b"]["c"]])
  d = np.linalg.norm(flat(g) - flat(w))
  start, mu, lam, div = fedema.fedema_start(g, w, jnp.float32(0.0), tau=0.8)
  np.testing.assert_allclose(div, d, rtol=1e-6)
  np.testing.assert_allclose(lam, 0.8 / d, rtol=1e-6)
  np.testing.assert_allclose(mu, 0.8, rtol=1e-6)  # the first mu is the target
  np.testing.assert_allclose(flat(start), 0.8 * flat(w) + 0.2 * flat(g), rtol=1e-6)
  # A set scaler is kept: mu = lambda d.
  start, mu, lam, _ = fedema.fedema_start(g, w, jnp.float32(0.3 / d), tau=0.8)
  np.testing.assert_allclose([mu, lam], [0.3, 0.3 / d], rtol=1e-5)
  np.testing.assert_allclose(flat(start), 0.3 * flat(w) + 0.7 * flat(g), rtol=1e-5)
  # Clipped at 1: a client that drifted far keeps its own model.
  start, mu, lam, _ = fedema.fedema_start(g, w, jnp.float32(5.0 / d), tau=0.8)
  assert float(mu) == 1.0 and float(lam) == pytest.approx(5.0 / d, rel=1e-6)
  np.testing.assert_allclose(flat(start), flat(w), rtol=1e-6)


def test_fedema_client_equal_to_global_is_unchanged():
  g, _ = _toy_trees(1)
  for lam in (0.0, 2.0):  # unset (stays unset: no divergence to scale by) and set
    start, mu, new_lam, div = fedema.fedema_start(g, g, jnp.float32(lam))
    assert float(div) == 0.0 and float(mu) == 0.0 and float(new_lam) == lam
    for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(g), strict=True):
      np.testing.assert_array_equal(a, b)


def test_fedema_rounds_keep_client_models_and_set_the_scaler():
  """Round 1: every client starts from the global model (mu 0, scaler unset); round 2:
  the scalers are set so that mu = ema_tau, and client k starts from the EMA of its
  round-1 model and the round-1 global model."""
  alg, state, arrays, mask = _tiny("fedema")
  round_fn = jax.jit(alg.round)
  s1, m1 = round_fn(state, arrays, mask)
  np.testing.assert_array_equal(m1["ema_mu"], np.zeros(3))
  np.testing.assert_array_equal(s1.scaler, np.zeros(3))
  np.testing.assert_allclose(m1["weights"], np.array([8, 6, 5]) / 19, rtol=1e-6)
  # The global model is the data-size-weighted mean of the stored client models.
  mean = server.weighted_mean(s1.clients["aligner"], m1["weights"])
  for a, b in zip(jax.tree.leaves(s1.aligner), jax.tree.leaves(mean), strict=True):
    np.testing.assert_allclose(a, b, atol=1e-6)
  s2, m2 = round_fn(s1, arrays, mask)
  np.testing.assert_allclose(m2["ema_mu"], np.full(3, alg.config.ema_tau), rtol=1e-5)
  np.testing.assert_allclose(s2.scaler, alg.config.ema_tau / m2["divergence"], rtol=1e-5)
  assert np.all(np.asarray(m2["divergence"]) > 0)
  assert rgb.stage_traffic(alg, state) == rgb.stage_traffic(
    rgb.FedRGB(dataclasses.replace(alg.config, method="fedavg"), alg.encoder_def, alg.aligner_def),
    state,
  )
  with pytest.raises(ValueError, match="ema_tau"):
    rgb.RgbConfig(method="fedema", ema_tau=0.0)


def test_fedema_code_divergence_is_the_last_trainings_drift():
  """ema_divergence="code": mu from the mean per-matrix L2 drift of the client's last
  training (rank >= 2 leaves), lambda set from the first: round 3's mu = tau d_2 / d_1."""
  g, w = _toy_trees(2)
  want = np.linalg.norm(g["a"] - w["a"])  # the only rank-2 leaf
  np.testing.assert_allclose(fedema.layer_divergence(g, w), want, rtol=1e-6)
  alg, state, arrays, mask = _tiny("fedema", ema_divergence="code")
  round_fn = jax.jit(alg.round)
  s1, m1 = round_fn(state, arrays, mask)
  s2, m2 = round_fn(s1, arrays, mask)
  s3, m3 = round_fn(s2, arrays, mask)
  np.testing.assert_array_equal(m1["ema_mu"], np.zeros(3))
  np.testing.assert_allclose(m2["divergence"], s1.drift, rtol=1e-6)
  np.testing.assert_allclose(m2["ema_mu"], np.full(3, alg.config.ema_tau), rtol=1e-5)
  want_mu = np.minimum(alg.config.ema_tau * np.asarray(s2.drift) / np.asarray(s1.drift), 1)
  np.testing.assert_allclose(m3["ema_mu"], want_mu, rtol=1e-5)
  with pytest.raises(ValueError, match="ema_divergence"):
    rgb.RgbConfig(method="fedema", ema_divergence="layer")


def test_embedding_in_minibatches_equals_the_whole_set():
  """The runner scores test and OOD sets ``EVAL_BATCH`` pairs at a time: the towers treat
  pairs independently (no batch statistics), so minibatches change no embedding."""
  alg, state, arrays, _ = _tiny()
  pairs = {"images": arrays["images"][0], "captions": arrays["captions"][0]}  # 8 pairs

  def embed(b):
    return alg.embed(state.encoder, state.aligner, b["images"], b["captions"])

  want = jax.jit(embed)(pairs)
  got = jax.jit(lambda p: core.client.apply_in_batches(embed, p, 3))(pairs)  # 3 + 3 + 2 (padded)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
