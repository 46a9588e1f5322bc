"""A frozen encoder's features computed once per set (fedjax_mm.core.features).

The cached groups must compute what the raw groups compute: the same model outputs,
and for every FedMuscle method one round from the same states gives the same states
and statistics, up to float32 rounding (the encoder sees batches of another size).
"""

import fedmuscle_toys as toys
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import rounding
from flax import nnx

from fedjax_mm import core, models
from fedjax_mm.core import features
from fedjax_mm.runner import fedmuscle as runner

TASK = core.Task("classification", "image", "label10", 10)


def _group(encoder, *, lora_rank=0, head="linear", lora=True, task=TASK):
  config = {"encoder": encoder, "head": head, "num_outputs": 10, "rep_dim": 16}
  config["lora_rank"] = lora_rank
  return core.init_group(
    lambda rngs: models.build(config, rngs=rngs),
    name=encoder,
    tx=optax.adam(1e-3),
    task=task,
    key=jax.random.key(0),
    num_clients=2,
    trainable=models.trainable_filter(lora=lora),
  )


def test_which_groups_have_a_frozen_encoder():
  assert features.frozen_encoder(*_group("cnn_s"))  # a CNN under adapters: head + projector
  assert not features.frozen_encoder(*_group("vit_t", lora_rank=4))  # its adapters train
  assert not features.frozen_encoder(*_group("cnn_s", lora=False))  # full fine-tuning
  seg = core.Task("segmentation", "image", "mask", 10)
  assert not features.frozen_encoder(*_group("cnn_s", head="segmentation", task=seg))
  text = core.Task("classification", "caption", "caption_label", 10)
  assert not features.frozen_encoder(*_group("gru", task=text))


def test_the_pooled_model_reads_features_and_computes_the_same_outputs():
  group, state = _group("cnn_s")
  pooled = features.pooled_group(group, state, "pooled:0")
  x = jax.random.uniform(jax.random.key(1), (2, 5, 32, 32, 3))
  f = features.pooled_features(group, state, x, batch_size=3)  # [K, n, h], padded batches
  assert f.shape == (2, 5, group.merge(*_one(state)).encoder.features)
  for k in range(2):
    params = jax.tree.map(lambda p, k=k: p[k], state.params)
    raw, cached = group.merge(params, state.shared), pooled.merge(params, state.shared)
    rounding.assert_close(cached(f[k]), raw(x[k]))
    rounding.assert_close(cached.represent(f[k]), raw.represent(x[k]))
    rounding.assert_close(cached.forward(f[k]), raw.forward(x[k]))
  assert pooled.task.input_key == "pooled:0" and group.task.input_key == "image"
  # The parameters are the raw group's: the same tree, so states and checkpoints carry over.
  assert jax.tree.structure(nnx.split(pooled.merge(*_one(state)))[1]) == jax.tree.structure(
    nnx.split(group.merge(*_one(state)))[1]
  )


def _one(state):
  return jax.tree.map(lambda p: p[0], state.params), state.shared


def test_a_pooled_model_refuses_raw_inputs_and_a_segmentation_head():
  group, state = _group("cnn_s")
  model = features.pooled_group(group, state, "pooled:0").merge(*_one(state))
  with pytest.raises(ValueError, match="reads pooled features"):
    model(jnp.zeros((2, 32, 32, 3)))
  seg = core.Task("segmentation", "image", "mask", 10)
  group, state = _group("cnn_s", head="segmentation", task=seg)
  with pytest.raises(ValueError, match="segmentation head"):
    features.pooled_group(group, state, "pooled:0")


def _cached_toys():
  config, users, groups, states, train, test, public, _ = toys.build()
  cached, (train_c, test_c), public_c = features.cache_frozen_encoders(
    groups, states, (train, test), public
  )
  return config, users, groups, states, cached, train_c, test_c, public_c


def test_the_toys_frozen_cnns_are_cached_and_the_vit_is_not():
  _, users, groups, _, cached, train_c, _, public_c = _cached_toys()
  flags = features.cached(cached)
  assert flags == tuple(u.encoder == "cnn_s" for u in users)  # vit_t trains LoRA adapters
  for i, flag in enumerate(flags):
    key = features.POOLED_KEY.format(i)
    assert (key in train_c[i].arrays) == flag and (key in public_c) == flag
  assert features.cached(groups) == (False,) * len(groups)


@pytest.mark.parametrize("name", runner.METHODS)
def test_a_round_on_cached_features_is_the_raw_round(name):
  config, users, groups, states, cached, train_c, _, public_c = _cached_toys()
  raw_alg = runner.algorithms(config, users, groups)[name]
  alg = runner.algorithms(config, users, cached, groups)[name]
  key = jax.random.key(7)
  args = (train_c,) if name == "local" else (train_c, public_c)
  raw_state, raw_stats = jax.jit(raw_alg.round)(raw_alg.init(states, key), *args)
  state, stats = jax.jit(alg.round)(alg.init(states, key), *args)
  rounding.assert_close(state, raw_state)
  rounding.assert_close(stats, raw_stats)
  # Not vacuous: the round trained the cached users' heads.
  for i, flag in enumerate(features.cached(cached)):
    if flag:
      assert not rounding.close(state.groups[i].params, states[i].params), (name, i)


def test_evaluation_on_cached_features_is_the_raw_evaluation():
  _, _, groups, states, cached, _, test_c, _ = _cached_toys()
  for g, c, s, d in zip(groups, cached, states, test_c, strict=True):
    raw = jax.jit(lambda s, d, g=g: core.evaluate_group(g, s, d))(s, d)
    out = jax.jit(lambda s, d, c=c: core.evaluate_group(c, s, d))(s, d)
    rounding.assert_close(out, raw)
    assert np.all(np.isfinite(jax.tree.leaves(out)[0]))
