"""FedMuscle: protocols agree, heads stay put in CL epochs, one forward pass, one trace."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_mm import core, data, losses, models
from fedjax_mm.algorithms import fedmuscle

ENCODERS = ("cnn_s", "vit_t", "transformer_t")
TASKS = (
  core.Task("multilabel", "image", "multilabel", 10),
  core.Task("classification", "image", "label10", 10),
  core.Task("classification", "caption", "caption_label", 10),
)


@functools.cache
def _setup(num_users=3, local_epochs=1, tx_name="adamw"):
  world = data.generate(0, 12 * num_users)
  public = data.generate(1, 8, shift=data.PUBLIC_SHIFT)
  public = {"image": public["image"], "caption": public["caption"]}
  groups, states, datas = [], [], []
  for n in range(num_users):
    task = TASKS[n]
    config = {"encoder": ENCODERS[n], "head": "mlp", "num_outputs": task.num_outputs, "rep_dim": 16}
    config |= {"vocab_size": data.VOCAB_SIZE, "max_len": 16} if task.modality == "text" else {}
    tx = optax.adamw(1e-3) if tx_name == "adamw" else optax.sgd(0.1)
    group, state = core.init_group(
      lambda rngs, config=config: models.build(config, rngs=rngs),
      name=f"user{n}",
      tx=tx,
      task=task,
      key=jax.random.fold_in(jax.random.key(0), n),
      num_clients=1,
      local_epochs=local_epochs,
      batch_size=4,
    )
    local = data.take(world, np.arange(12 * n, 12 * n + 12))
    stacked, mask = data.stack_clients([local])
    groups.append(group)
    states.append(state)
    datas.append(core.make_client_data(stacked, mask, user_ids=np.array([n])))
  return tuple(groups), tuple(states), tuple(datas), jax.tree.map(jnp.asarray, public)


def _run(config, num_users=3, local_epochs=1, tx_name="adamw", rounds=1):
  groups, states, datas, public = _setup(num_users, local_epochs, tx_name)
  alg = fedmuscle.fedmuscle(groups, config)
  state = alg.init(states, jax.random.key(3))
  round_fn = jax.jit(alg.round)
  for _ in range(rounds):
    state, stats = round_fn(state, datas, public)
  return groups, states, state, stats


def test_factored_and_paper_downlink_train_identical_models():
  # SGD: Adam would turn float32 rounding differences of near-zero gradients
  # into full-size steps, hiding the equality of the two protocols.
  config = fedmuscle.MuscleConfig(num_partners=2, batch_size=4)
  _, _, factored, stats = _run(config, tx_name="sgd")
  _, _, paper, _ = _run(
    fedmuscle.MuscleConfig(num_partners=2, batch_size=4, downlink="paper"), tx_name="sgd"
  )
  assert np.isfinite(np.asarray(stats["cl_loss"])).all()
  chex.assert_trees_all_close(
    [g.params for g in factored.groups], [g.params for g in paper.groups], rtol=2e-4, atol=2e-5
  )


def test_cl_epochs_update_the_representation_model_only():
  config = fedmuscle.MuscleConfig(num_partners=2, batch_size=4)
  _, initial, state, _ = _run(config, local_epochs=0)
  for before, after in zip(initial, state.groups, strict=True):
    heads_equal = jax.tree.map(
      lambda a, b: bool(jnp.array_equal(a, b)), before.params["head"], after.params["head"]
    )
    assert all(jax.tree.leaves(heads_equal))
    moved = jax.tree.map(
      lambda a, b: float(jnp.abs(a - b).max()), before.params["encoder"], after.params["encoder"]
    )
    assert max(jax.tree.leaves(moved)) > 0


def test_cl_update_equals_the_gradient_of_the_loss_two_users():
  # With N = 2 and M = 1 the partner is fixed; one public batch, no local epochs,
  # plain SGD: the update must be -lr * d/dw InfoNCE(w; stop_grad(partner)).
  config = fedmuscle.MuscleConfig(num_partners=1, batch_size=8)
  groups, initial, state, _ = _run(config, num_users=2, local_epochs=0, tx_name="sgd")
  _, _, _, public = _setup(2, 0, "sgd")

  def rep(g, params):
    return (
      groups[g]
      .merge(jax.tree.map(lambda x: x[0], params), initial[g].shared)
      .represent(groups[g].task.inputs(public))
    )

  z = [rep(g, initial[g].params) for g in range(2)]
  for g in range(2):
    other = jax.lax.stop_gradient(z[1 - g])
    loss = lambda p, g=g, other=other: losses.muscle_loss(
      rep(g, p), other[None], tau=0.2, gamma=config.gamma
    ).mean()
    grads = jax.grad(loss)(initial[g].params)
    expected = jax.tree.map(
      lambda p, d: p - 0.1 * d, initial[g].params["encoder"], grads["encoder"]
    )
    chex.assert_trees_all_close(state.groups[g].params["encoder"], expected, rtol=1e-4, atol=1e-6)


def test_each_encoder_runs_once_per_batch_and_the_round_traces_once():
  groups, states, datas, public = _setup()
  calls = []

  def counting(group, params, shared, inputs):
    calls.append(group.name)
    return group.merge(params, shared).represent(inputs)

  config = fedmuscle.MuscleConfig(num_partners=2, batch_size=4)
  alg = fedmuscle.fedmuscle(groups, config, represent_fns=[counting] * len(groups))
  round_fn = jax.jit(chex.assert_max_traces(alg.round, n=1))
  state = alg.init(states, jax.random.key(0))
  for _ in range(2):
    state, _ = round_fn(state, datas, public)
  assert sorted(calls) == sorted(g.name for g in groups)  # one trace of one forward per group


def test_partners_are_distinct_other_present_users():
  present = jnp.array([True, True, False, True, True, True])
  for seed in range(20):
    partners = np.asarray(fedmuscle.draw_partners(jax.random.key(seed), present, 3))
    for n in np.flatnonzero(present):
      assert len(set(partners[n])) == 3 and n not in partners[n] and present[partners[n]].all()
  counts = np.zeros(6)
  for seed in range(400):
    counts += np.bincount(
      np.asarray(fedmuscle.draw_partners(jax.random.key(seed), present, 3))[0], minlength=6
    )
  np.testing.assert_allclose(counts[[1, 3, 4, 5]], 400 * 3 / 4, rtol=0.12)
  assert counts[0] == counts[2] == 0


@pytest.mark.parametrize(
  "kwargs,message",
  [
    (dict(num_partners=4), "num_partners"),
    (dict(batch_size=1), "at least 2"),
    (dict(tau_reduced=0.3), "gamma > 0"),
    (dict(loss="cosine"), "muscle.loss"),
    (dict(downlink="both"), "muscle.downlink"),
  ],
)
def test_config_validation(kwargs, message):
  with pytest.raises(ValueError, match=message):
    fedmuscle.MuscleConfig(**kwargs).validate(num_users=4)


@pytest.mark.parametrize("loss", ["muscle", "pairwise", "gramian"])
def test_user_gradients_equal_direct_computation(loss):
  rng = np.random.default_rng(0)
  z = rng.normal(size=(5, 4, 6)).astype(np.float32)
  z = jnp.asarray(z / np.linalg.norm(z, axis=-1, keepdims=True))
  partners = fedmuscle.draw_partners(jax.random.key(0), jnp.ones(5, bool), 2)
  config = fedmuscle.MuscleConfig(num_partners=2, batch_size=4, loss=loss)
  value, grad = jax.jit(fedmuscle.user_gradients, static_argnums=0)(config, z, partners)
  direct = {
    "muscle": lambda a, o: losses.muscle_loss(a, o, tau=0.2, gamma=config.gamma),
    "pairwise": lambda a, o: losses.pairwise_info_nce(a, o, tau=0.2),
    "gramian": lambda a, o: losses.gramian_loss(a, o, tau=0.2),
  }[loss]
  for n in range(5):
    others = z[np.asarray(partners[n])]
    expected_value, expected_grad = jax.value_and_grad(
      lambda a, others=others: direct(a, others).mean()
    )(z[n])
    np.testing.assert_allclose(value[n], expected_value, rtol=1e-5)
    np.testing.assert_allclose(grad[n], expected_grad, rtol=1e-4, atol=1e-6)


def test_downlink_shapes():
  dim = 16
  factored = fedmuscle.downlink_shapes(fedmuscle.MuscleConfig(num_partners=3, batch_size=32), dim)
  paper = fedmuscle.downlink_shapes(
    fedmuscle.MuscleConfig(num_partners=3, batch_size=32, downlink="paper"), dim
  )
  assert factored.scaled_others.shape == (3, 32, dim) and factored.pair_logits.shape == (3, 32, 32)
  assert paper[0].shape == (32**3, dim) and paper[1].shape == (32**3,)
