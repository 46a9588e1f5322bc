"""CreamFL's client step: the intra-modal negative is the start-of-round model; objectives."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import rounding
from flax import nnx

from fedjax_mm import core, data, losses, models
from fedjax_mm.algorithms import creamfl, creamfl_baselines
from fedjax_mm.server import kd_aggregate

D = 8
NUM_PUBLIC = 4
# Public samples per local step: ceil(P / S) with S = 1 private step (4 samples, batches of 4).
B_PUBLIC = 4


@pytest.fixture(scope="module")
def setup():
  """Two text clients (transformer_t, caption colour), a tiny public set and global reps."""
  world = data.WorldConfig(image_size=16)
  config = {
    "encoder": "transformer_t",
    "num_outputs": data.NUM_COLORS,
    "rep_dim": D,
    "vocab_size": data.VOCAB_SIZE,
    "max_len": world.max_caption_len,
  }
  group, state = core.init_group(
    lambda rngs: models.build(config, rngs=rngs),
    name="text",
    tx=optax.sgd(0.5),
    task=core.Task("classification", "caption", "caption_label", data.NUM_COLORS),
    key=jax.random.key(0),
    num_clients=2,
    batch_size=4,
  )
  client = creamfl.ClientGroup(group, ("text",))
  private = data.generate(3, 8, config=world)
  clients = [{k: private[k][i::2] for k in ("caption", "caption_label")} for i in range(2)]
  stacked, mask = data.stack_clients(clients)
  client_data = core.make_client_data(stacked, mask, user_ids=np.arange(2))
  public = data.generate(4, NUM_PUBLIC, config=world, shift=1.0)
  public = {"image": jnp.asarray(public["image"]), "caption": jnp.asarray(public["caption"])}
  keys = jax.random.split(jax.random.key(1), 2)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  global_reps = {
    m: unit(jax.random.normal(k, (NUM_PUBLIC, D)))
    for m, k in zip(("image", "text"), keys, strict=True)
  }
  return client, state, client_data, public, global_reps


def _config():
  return creamfl.CreamConfig(batch_size=2, lcr_weight=1.0, num_selected=2)


def _assert_trees(assert_fn, a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert_fn(np.asarray(x), np.asarray(y))


def _update(client, state, client_data, active, public, global_reps, var, config):
  return jax.jit(creamfl.client_update, static_argnums=(0, 7))(
    client, state, client_data, active, public, global_reps, var, config
  )


def test_intra_modal_negative_is_the_start_of_round_model(setup):
  client, state, client_data, public, global_reps = setup
  config = _config()
  var = creamfl.variant("gca", "lcr", inter=False)  # intra only: the negative matters
  active = jnp.array([True, True])
  new, _ = _update(client, state, client_data, active, public, global_reps, var, config)

  # The same steps by hand: E epochs of eq. (3) with a chosen negative.
  private, _ = core.train_group(client.group, state, client_data, active=active)
  moved = max(
    float(np.max(np.abs(a - b)))
    for a, b in zip(jax.tree.leaves(private.params), jax.tree.leaves(state.params), strict=True)
  )
  assert moved > 1e-3  # Local training moves the model: the two candidate negatives differ.

  def one(params, opt, rng, arrays, sample_mask, neg):
    objective = creamfl.local_objective(
      client, state.shared, neg, public, global_reps, config, var, B_PUBLIC
    )
    return core.local_update(
      objective,
      client.group.tx,
      params,
      opt,
      rng,
      arrays,
      sample_mask,
      num_epochs=client.group.local_epochs,
      batch_size=client.group.batch_size,
    )[0]

  # One jitted program for both negatives (an argument): jitting it anew per negative
  # traced and compiled the same program twice.
  steps = jax.jit(jax.vmap(one))

  def by_hand(negative_params):
    return steps(
      state.params,
      state.opt_state,
      state.rng,
      client_data.arrays,
      client_data.sample_mask,
      negative_params,
    )

  start_of_round = by_hand(state.params)
  after_private = by_hand(private.params)
  # Two compiled programs of the same arithmetic: equal at float32 rounding (rounding.py;
  # at rtol 1e-6 / atol 1e-7 one weight in 2,048 once differed by 1.2e-7 under load in CI).
  rounding.assert_close(new.params, start_of_round)
  assert not rounding.close(new.params, after_private)


def test_inactive_clients_take_no_step(setup):
  client, state, client_data, public, global_reps = setup
  # Client 1 is not selected: it keeps its parameters exactly.
  new, _ = _update(
    client,
    state,
    client_data,
    jnp.array([True, False]),
    public,
    global_reps,
    creamfl.variant("gca", "lcr"),
    _config(),
  )
  moved = []
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params), strict=True):
    np.testing.assert_array_equal(a[1], b[1])
    moved.append(not np.array_equal(a[0], b[0]))
  assert any(moved)  # ... while the selected client 0 trained.


def test_gamma_zero_is_training_without_the_regulariser(setup):
  """gamma = 0 (CreamFL's row), no regulariser (reamFL rows) and the private task alone agree."""
  client, state, client_data, public, global_reps = setup
  active = jnp.array([True, True])
  zero = dataclasses.replace(_config(), lcr_weight=0.0)
  cream, _ = _update(
    client, state, client_data, active, public, global_reps, creamfl.variant("gca", "lcr"), zero
  )
  ream, _ = _update(
    client,
    state,
    client_data,
    active,
    public,
    global_reps,
    creamfl.variant("gca", "none"),
    _config(),
  )
  private, _ = jax.jit(core.train_group, static_argnums=0)(
    client.group, state, client_data, active=active
  )
  rounding.assert_close(cream.params, ream.params)  # two programs: rounding.py
  rounding.assert_close(cream.params, private.params)
  rounding.assert_close(cream.opt_state, private.opt_state)
  # ... while gamma > 0 trains something else.
  regularised, _ = _update(
    client,
    state,
    client_data,
    active,
    public,
    global_reps,
    creamfl.variant("gca", "lcr"),
    _config(),
  )
  assert not rounding.close(regularised.params, private.params)


@pytest.mark.parametrize("regulariser", ["lcr", "muscle", "kd"])
def test_doubling_gamma_doubles_the_regularisers_gradient(setup, regulariser):
  """grad eq.(3)(gamma) - grad eq.(3)(0) = gamma * grad regulariser, on the step's public batch."""
  client, state, client_data, public, global_reps = setup
  var = creamfl.variant("gca", regulariser, server="distill")
  params = jax.tree.map(lambda x: x[0], state.params)
  start = jax.tree.map(lambda x: x[1], state.params)
  batch = {k: v[0, :4] for k, v in client_data.arrays.items()}
  mask = client_data.sample_mask[0, :4]
  key = jax.random.key(7)

  def grad(gamma):
    config = dataclasses.replace(_config(), lcr_weight=gamma)
    objective = creamfl.local_objective(
      client, state.shared, start, public, global_reps, config, var, B_PUBLIC
    )
    return jax.jit(jax.grad(lambda p: objective(p, batch, mask, key)[0]))(params)

  g0, g1, g2 = grad(0.0), grad(0.3), grad(0.6)
  part1 = jax.tree.map(lambda a, b: a - b, g1, g0)
  part2 = jax.tree.map(lambda a, b: a - b, g2, g0)
  _assert_trees(
    lambda a, b: np.testing.assert_allclose(a, 2 * b, rtol=1e-4, atol=1e-7), part2, part1
  )
  # The regulariser's own gradient on the step's public minibatch, computed apart.
  index = creamfl.public_batch(key, NUM_PUBLIC, B_PUBLIC)
  regulariser = creamfl.regulariser_objective(
    client, state.shared, start, public, global_reps, _config(), var
  )
  reg_grad = jax.grad(
    lambda p: regulariser(p, {"index": index}, jnp.ones(index.shape, bool), key)[0]
  )(params)
  _assert_trees(
    lambda a, b: np.testing.assert_allclose(a, 0.3 * b, rtol=1e-4, atol=1e-6), part1, reg_grad
  )
  assert max(float(np.max(np.abs(x))) for x in jax.tree.leaves(part1)) > 1e-4


def test_public_batch_size_draws_about_the_public_set_per_epoch():
  auto = creamfl.CreamConfig()
  assert creamfl.public_batch_size(auto, 384, 4) == 96  # 4 steps x 96 = P
  assert creamfl.public_batch_size(auto, 384, 5) == 77  # ceil(384 / 5)
  assert creamfl.public_batch_size(auto, 384, 1000) == 1
  assert creamfl.public_batch_size(auto, 4, 1) == 4
  fixed = creamfl.CreamConfig(public_batch_size=16)
  assert creamfl.public_batch_size(fixed, 384, 4) == 16
  assert creamfl.public_batch_size(fixed, 8, 4) == 8


def test_public_batch_is_distinct_in_range_and_keyed():
  a = np.asarray(creamfl.public_batch(jax.random.key(0), 10, 6))
  assert a.dtype == np.int32 and len(set(a.tolist())) == 6 and a.min() >= 0 and a.max() < 10
  b = np.asarray(creamfl.public_batch(jax.random.key(1), 10, 6))
  assert not np.array_equal(a, b)
  full = np.sort(np.asarray(creamfl.public_batch(jax.random.key(2), 8, 8)))
  np.testing.assert_array_equal(full, np.arange(8))


def test_regulariser_objective_terms(setup):
  client, state, _, public, global_reps = setup
  config = _config()
  params = jax.tree.map(lambda x: x[0], state.params)
  start = jax.tree.map(lambda x: x[1], state.params)
  batch = {"index": jnp.array([2, 0])}
  mask = jnp.array([True, True])
  model = client.group.merge(params, state.shared)
  x = public["caption"][batch["index"], 0]
  z = model.represent(x)
  previous = client.group.merge(start, state.shared).represent(x)

  def value(var):
    objective = creamfl.regulariser_objective(
      client, state.shared, start, public, global_reps, config, var
    )
    return float(objective(params, batch, mask, jax.random.key(0))[0])

  inter = losses.inter_modal_contrast(z, global_reps["image"], batch["index"], temperature=0.5)
  intra = losses.intra_modal_contrast(
    z, global_reps["text"][batch["index"]], previous, temperature=0.5
  )
  others = jnp.stack([global_reps[m][batch["index"]] for m in ("image", "text")])
  muscle = losses.muscle_loss(z, others, tau=0.2, gamma=1 / 0.15 - 1 / 0.2)
  np.testing.assert_allclose(
    value(creamfl.variant("gca", "lcr")), inter.mean() + intra.mean(), rtol=1e-5
  )
  np.testing.assert_allclose(
    value(creamfl.variant("gca", "lcr", intra=False)), inter.mean(), rtol=1e-5
  )
  np.testing.assert_allclose(
    value(creamfl.variant("mean", "muscle", server="muscle")), muscle.mean(), rtol=1e-5
  )
  # FedMD / FedET / FedGEMS: the l2 distance to the server's representation, same modality.
  kd = np.linalg.norm(np.asarray(z) - np.asarray(global_reps["text"][batch["index"]]), axis=-1)
  np.testing.assert_allclose(value(creamfl.variant("fedet", "kd")), kd.mean(), rtol=1e-5)


def test_variants_table_and_validation():
  v = creamfl.variant(**creamfl.VARIANTS["CreamFL"])
  assert int(v.aggregation) == creamfl.AGGREGATIONS.index("gca")
  assert float(v.inter) == float(v.intra) == float(v.distill) == 1.0
  assert float(v.client_muscle) == float(v.server_muscle) == 0.0
  m = creamfl.variant(**creamfl.VARIANTS["CreamFL+Muscle"])
  assert float(m.client_muscle) == float(m.server_muscle) == 1.0 and float(m.distill) == 0.0
  assert float(m.inter) == float(m.intra) == 0.0
  for name in ("reamFL+Mean", "reamFL+Avg", "reamFL+IoT", "reamFL+GCA"):
    assert not bool(creamfl.variant(**creamfl.VARIANTS[name]).regularised)
  with pytest.raises(ValueError, match="aggregation"):
    creamfl.variant("median")
  # Table 1's distillation baselines: local distillation only, each its own aggregation.
  for name, rule in (("FedMD", "mean"), ("FedET", "fedet"), ("FedGEMS", "fedgems")):
    b = creamfl.variant(**creamfl_baselines.BASELINES[name])
    assert int(b.aggregation) == creamfl.AGGREGATIONS.index(rule) and bool(b.regularised)
    assert float(b.local_kd) == float(b.distill) == 1.0
    assert float(b.inter) == float(b.intra) == float(b.client_muscle) == 0.0
  assert float(creamfl.variant(**creamfl.VARIANTS["CreamFL"]).local_kd) == 0.0
  # FedET's diversity regulariser: the FedET row only, and only with FedET's majority vote.
  rows = {**creamfl.VARIANTS, **creamfl_baselines.BASELINES}
  for name, row in rows.items():
    assert float(creamfl.variant(**row).diversity) == float(name == "FedET"), name
  with pytest.raises(ValueError, match="diversity"):
    creamfl.variant("gca", "kd", diversity=True)


def test_partners_are_distinct_and_present():
  present = jnp.array([True, False, True, True, False, True])
  for seed in range(20):
    p = np.asarray(creamfl.draw_local_partners(jax.random.key(seed), present, 3))
    assert len(set(p.tolist())) == 3 and np.all(np.asarray(present)[p])


@pytest.fixture(scope="module")
def server_setup(setup):
  """A tiny server (cnn_s + transformer_t) under Adam, and FedET's targets of 3 clients."""
  *_, public, global_reps = setup
  world = data.WorldConfig(image_size=16)
  model = creamfl.DualEncoder(
    "cnn_s",
    "transformer_t",
    rep_dim=D,
    image_size=16,
    vocab_size=data.VOCAB_SIZE,
    max_len=world.max_caption_len,
    rngs=nnx.Rngs(3),
  )
  graphdef, params = nnx.split(model)
  server = creamfl.ServerDef(graphdef, optax.adam(1e-2))
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  present = jnp.ones((3,), bool)
  local, targets, diversity = {}, {}, {}
  for i, m in enumerate(creamfl.MODALITIES):
    local[m] = unit(jax.random.normal(jax.random.key(10 + i), (3, NUM_PUBLIC, D)))
    agg, _, ensemble, beta = kd_aggregate.fedet_with_diversity(
      local[m], global_reps[creamfl._other(m)], present, chunk_size=3
    )
    targets[m], diversity[m] = agg, (ensemble, jnp.sum(beta, axis=0) > 0)
  assert all(bool(jnp.any(d[1])) for d in diversity.values())  # some samples have dissent
  return server, params, public, global_reps, local, targets, diversity, present


def _server_objective(server_setup, weight, var, with_diversity=True, distill_weight=1.0):
  server, _, public, global_reps, local, targets, diversity, present = server_setup
  config = dataclasses.replace(
    _config(), fedet_diversity_weight=weight, muscle_partners=2, distill_weight=distill_weight
  )
  has = {m: jnp.float32(1.0) for m in creamfl.MODALITIES}
  return creamfl.server_kd_objective(
    server,
    public,
    targets,
    has,
    jnp.concatenate([local[m] for m in creamfl.MODALITIES]),
    jnp.concatenate([present, present]),
    config,
    var,
    diversity=diversity if with_diversity else None,
    global_reps=global_reps if with_diversity else None,
  )


def test_fedet_diversity_term_in_the_servers_distillation(setup, server_setup):
  """FedET's objective = eq. (7) + lambda sum_m mean KL; inactive in the other rows."""
  server, params, public, global_reps, _, _, diversity, _ = server_setup
  batch, mask, key = {"index": jnp.array([3, 0, 1])}, jnp.ones((3,), bool), jax.random.key(0)
  fedet = creamfl.variant(**creamfl_baselines.BASELINES["FedET"])

  @functools.partial(jax.jit, static_argnums=2)
  def value(weight, var, with_diversity=True):
    objective = _server_objective(server_setup, weight, var, with_diversity)
    return objective(params, batch, mask, key)[0]

  model = server.merge(params)
  kl = 0.0
  for m in creamfl.MODALITIES:
    z = creamfl.represent(model, m, creamfl._public_inputs(public, m, batch["index"]))
    ensemble, has = diversity[m]
    kl += float(
      losses.fedet_diversity(
        z, ensemble[batch["index"]], global_reps[creamfl._other(m)], where=has[batch["index"]]
      ).mean()
    )
  assert kl > 0
  base = float(value(0.0, fedet))
  np.testing.assert_allclose(float(value(0.3, fedet)) - base, 0.3 * kl, rtol=1e-4)
  # Without the switch (the other rows) the term is off whatever lambda is, and equals the
  # program that never had it.
  no_switch = creamfl.variant("fedet", "kd")
  off = float(value(0.3, no_switch))
  np.testing.assert_allclose(off, base, rtol=1e-6)
  np.testing.assert_allclose(off, float(value(0.0, no_switch, False)), rtol=1e-6)


def test_fedet_diversity_weight_moves_the_adam_server_update(server_setup):
  """grad is linear in lambda, and under Adam the pass's update moves with it."""
  server, params, *_ = server_setup
  fedet = creamfl.variant(**creamfl_baselines.BASELINES["FedET"])
  batch, mask, key = {"index": jnp.array([3, 0])}, jnp.ones((2,), bool), jax.random.key(1)

  @jax.jit
  def grad(weight):
    objective = _server_objective(server_setup, weight, fedet)
    return jax.grad(lambda p: objective(p, batch, mask, key)[0])(params)

  g0, g1, g2 = grad(0.0), grad(1.0), grad(2.0)
  part1 = jax.tree.map(lambda a, b: a - b, g1, g0)
  part2 = jax.tree.map(lambda a, b: a - b, g2, g0)
  scale = max(float(np.max(np.abs(x))) for x in jax.tree.leaves(part1))
  assert scale > 1e-5
  _assert_trees(
    lambda a, b: np.testing.assert_allclose(a, 2 * b, rtol=1e-3, atol=1e-3 * scale), part2, part1
  )

  @jax.jit
  def update(weight):
    objective = _server_objective(server_setup, weight, fedet)
    opt = server.tx.init(params)
    new, *_ = creamfl._public_pass(objective, server.tx, params, opt, key, NUM_PUBLIC, 2, True)
    return jnp.concatenate(
      [jnp.ravel(a - b) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params), strict=True)]
    )

  u0, u_small, u1 = (np.asarray(update(w)) for w in (0.0, 0.05, 1.0))
  cosine = lambda a, b: float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
  # Adam normalises each coordinate's step, so lambda is checked on the update (two steps
  # over the public set), not on the loss: its values move, and its direction.
  assert np.max(np.abs(u_small - u0)) > 1e-4
  assert cosine(u1, u0) < cosine(u_small, u0) < 1.0


def test_distill_weight_acts_through_the_adam_state_the_retrieval_epoch_shares(server_setup):
  """distill_weight scales the whole distillation objective. Adam's step does not depend on
  a loss's scale, so from a fresh optimiser state a 10x weight changes the distillation
  epoch only through Adam's epsilon (on coordinates whose gradients are that small); after
  the server's retrieval epoch (step 1, the same state) it sets the distillation gradients
  against the retrieval ones in the moments, and acts."""
  server, params, public, *_ = server_setup
  fedet = creamfl.variant(**creamfl_baselines.BASELINES["FedET"])
  key = jax.random.key(2)

  def kd_update(weight, after_retrieval):
    objective = _server_objective(server_setup, 0.05, fedet, distill_weight=weight)
    start, opt = params, server.tx.init(params)
    if after_retrieval:
      retrieval = creamfl.server_retrieval_objective(server, public, _config().server_temperature)
      start, opt, *_ = creamfl._public_pass(
        retrieval, server.tx, start, opt, key, NUM_PUBLIC, 2, True
      )
    new, *_ = creamfl._public_pass(objective, server.tx, start, opt, key, NUM_PUBLIC, 2, True)
    return jnp.concatenate(
      [jnp.ravel(a - b) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(start), strict=True)]
    )

  step = jax.jit(kd_update, static_argnums=1)
  fresh = [np.asarray(step(w, False)) for w in (1.0, 10.0)]
  shared = [np.asarray(step(w, True)) for w in (1.0, 10.0)]
  rel = lambda u: float(np.linalg.norm(u[1] - u[0]) / np.linalg.norm(u[0]))
  # Measured: 1.3% from a fresh state (coordinates whose gradients are near epsilon),
  # 52% after the retrieval epoch.
  assert rel(fresh) < 0.05
  assert rel(shared) > 0.25


def test_the_servers_rate_factor_is_read_at_the_states_round(server_setup):
  """ServerDef.lr_factor scales round r's server updates by lr_factor(r) (the cosine
  schedule of CreamFL's ``:paper`` server): factor 1 is the constant-rate round, factor 0
  leaves the model where it is, 0.5 is the optimiser at half the rate. Under SGD, whose
  step is linear in the gradient; that AdamW's and AdamP's rates scale so too is
  test_optim's."""
  server, params, public, *_ = server_setup
  config = _config()

  def two_rounds(tx, lr_factor=None):
    s = creamfl.ServerDef(server.graphdef, tx, lr_factor=lr_factor)
    algorithm = creamfl.server_only(s, config)
    state = algorithm.init(params, (), jax.random.key(5))
    round_fn = jax.jit(algorithm.round)
    first, _ = round_fn(state, public)
    second, _ = round_fn(first, public)
    return first.server_params, second.server_params

  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # noqa: E731
  constant = two_rounds(optax.sgd(0.1))
  # 1 in round 0, 0 in round 1.
  stepped = two_rounds(optax.sgd(0.1), lambda r: jnp.where(r == 0, 1.0, 0.0))
  _assert_trees(close, stepped[0], constant[0])
  _assert_trees(np.testing.assert_array_equal, stepped[1], stepped[0])
  moved = lambda a, b: max(
    float(np.max(np.abs(x - y)))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )  # noqa: E731
  assert moved(constant[1], constant[0]) > 1e-3
  halved = two_rounds(optax.sgd(0.1), lambda r: 0.5)
  reference = two_rounds(optax.sgd(0.05))
  for h, r in zip(halved, reference, strict=True):
    _assert_trees(close, h, r)
  assert moved(halved[1], constant[1]) > 1e-3
