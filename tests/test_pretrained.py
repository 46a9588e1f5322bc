"""Pretrained checkpoints: safetensors folders, loading by name, LoRA on a loaded encoder,
the pretraining run's determinism and the shipped World-CLIP weights."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from experiments import pretrain as pretrain_config
from fedjax_mm import core, data, models
from fedjax_mm.models import pretrained
from fedjax_mm.runner import pretrain

IMAGE = {"image_size": 32, "channels": 3}
TEXT = {"vocab_size": data.VOCAB_SIZE, "max_len": 16}


def _inputs(name):
  if models.ENCODERS[name][0] == "image":
    return jnp.asarray(np.random.default_rng(0).random((3, 32, 32, 3), np.float32))
  return jnp.asarray(data.generate(0, 3)["caption"][:, 0])


def _save(tmp_path, name, seed=0, **kwargs):
  modality = models.ENCODERS[name][0]
  sizes = IMAGE if modality == "image" else TEXT
  encoder = models.build_encoder(name, rngs=nnx.Rngs(seed), **sizes)
  folder = pretrained.save(
    tmp_path / name, encoder, {"encoder": name, "modality": modality, **sizes}, **kwargs
  )
  return encoder, folder


@pytest.mark.parametrize("name", ["vit_t", "cnn_s", "resnet_t", "gru", "transformer_t"])
def test_safetensors_round_trip_is_exact(tmp_path, name):
  encoder, folder = _save(tmp_path, name)
  assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
  sizes = IMAGE if models.ENCODERS[name][0] == "image" else TEXT
  fresh = models.build_encoder(name, rngs=nnx.Rngs(1), **sizes)
  x = _inputs(name)
  assert not np.allclose(fresh(x)[0], encoder(x)[0])
  config = pretrained.load_into(fresh, folder, expect={"encoder": name})
  assert config["encoder"] == name and config["model_type"] == "world-clip"
  np.testing.assert_array_equal(fresh(x)[0], encoder(x)[0])
  # The stored names are the module paths, as PyTorch state dicts name parameters.
  from safetensors.numpy import load_file

  names = set(load_file(folder / "model.safetensors"))
  flat = nnx.to_flat_state(nnx.state(encoder, nnx.Param))
  assert names == {".".join(map(str, path)) for path, _ in flat}


def test_float16_storage_loads_as_float32_within_half_precision(tmp_path):
  encoder, folder = _save(tmp_path, "vit_t", dtype="float16")
  tensors = pretrained.read_tensors(folder)
  assert all(t.dtype == np.float32 for t in tensors.values())
  fresh = models.build_encoder("vit_t", rngs=nnx.Rngs(1), **IMAGE)
  pretrained.load_into(fresh, folder)
  for (path, a), (_, b) in zip(
    nnx.to_flat_state(nnx.state(encoder, nnx.Param)),
    nnx.to_flat_state(nnx.state(fresh, nnx.Param)),
    strict=True,
  ):
    np.testing.assert_allclose(b[...], a[...], rtol=1e-3, atol=1e-4, err_msg=str(path))


def test_mismatches_are_named(tmp_path):
  _, folder = _save(tmp_path, "vit_t", projection=np.zeros((64, 8)))
  with pytest.raises(pretrained.PretrainedError, match="encoder: wanted 'vit_s'"):
    pretrained.load_into(
      models.build_encoder("vit_s", rngs=nnx.Rngs(0)), folder, expect={"encoder": "vit_s"}
    )
  with pytest.raises(pretrained.PretrainedError, match="missing .*unexpected"):
    pretrained.load_into(models.build_encoder("vit_s", rngs=nnx.Rngs(0)), folder)
  with pytest.raises(
    pretrained.PretrainedError, match="no pretrained checkpoint 'world-clip/nope'"
  ):
    pretrained.resolve("world-clip/nope")
  (folder / "model.safetensors").unlink()
  with pytest.raises(pretrained.PretrainedError, match="has no model.safetensors"):
    pretrained.resolve(folder)


def test_build_loads_the_encoder_and_lora_trains_only_adapters(tmp_path):
  source, folder = _save(tmp_path, "vit_t")
  config = {"encoder": "vit_t", "head": "mlp", "num_outputs": 10, "rep_dim": 16, "lora_rank": 4}
  model = models.build(config | {"pretrained": str(folder)}, rngs=nnx.Rngs(5))
  x = _inputs("vit_t")
  np.testing.assert_array_equal(model.encoder(x)[0], source(x)[0])  # B = 0: unchanged.
  with pytest.raises(ValueError, match="does not fit: image_size"):
    models.build(config | {"pretrained": str(folder), "image_size": 16}, rngs=nnx.Rngs(5))

  # One local epoch through the engine: the base weights are shared (untrained) and
  # stay equal to the checkpoint; adapters, projector and head move.
  group, state = core.init_group(
    lambda rngs: models.build(config | {"pretrained": str(folder)}, rngs=rngs),
    name="g",
    tx=optax.adamw(1e-2),
    task=core.Task("classification", "image", "label10", 10),
    key=jax.random.key(0),
    num_clients=1,
    trainable=models.trainable_filter(lora=True),
    batch_size=8,
  )
  world = data.generate(3, 16)
  stacked, mask = data.stack_clients([world])
  client_data = core.make_client_data(stacked, mask, user_ids=np.array([0]))
  new_state, _ = core.train_group(group, state, client_data)
  trained = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(state.params)}
  assert all("lora" in p or p.startswith(("projector", "head")) for p in trained), trained
  assert any("lora_b" in p for p in trained)
  for (path, before), (_, after) in zip(
    nnx.to_flat_state(state.params), nnx.to_flat_state(new_state.params), strict=True
  ):
    assert not np.array_equal(before[...], after[...]), path
  merged = group.merge(jax.tree.map(lambda v: v[0], new_state.params), new_state.shared)
  loaded = dict(nnx.to_flat_state(nnx.state(merged.encoder, nnx.Not(nnx.LoRAParam))))
  src = dict(nnx.to_flat_state(nnx.state(source, nnx.Param)))
  assert loaded.keys() == src.keys()
  for path, var in src.items():
    np.testing.assert_array_equal(loaded[path][...], var[...], err_msg=str(path))


def _tiny_config():
  config = pretrain_config.get_config("smoke")
  config.web.size = 128
  return config


def test_pretraining_is_deterministic():
  config = _tiny_config()
  web = data.generate(pretrain.WEB_SEED, config.web.size, shift=config.web.shift)

  def params(seed):
    model = pretrain.train_pair(
      config, "vit_t", "transformer_t", web, jax.random.key(seed), progress=False
    )
    return nnx.state(model, nnx.Param)

  a, b, c = params(0), params(0), params(1)
  jax.tree.map(np.testing.assert_array_equal, a, b)
  assert not np.array_equal(a["logit_scale"][...], c["logit_scale"][...]) or not np.array_equal(
    a["image_projection"]["kernel"][...], c["image_projection"]["kernel"][...]
  )


def test_pretrain_smoke_run_writes_folders_that_reproduce_their_quality(tmp_path):
  config = pretrain_config.get_config("smoke")
  results = pretrain.run(config, tmp_path / "run", progress=False)
  folder = tmp_path / "run" / "world-clip"
  assert sorted(p.name for p in folder.iterdir()) == ["cnn_s", "transformer_t", "vit_t"]
  recorded = json.loads((folder / "vit_t" / "config.json").read_text())
  assert recorded["pretraining"]["partner"] == "transformer_t"
  assert recorded["quality"] == results["pairs"]["vit_t+transformer_t"]
  # Reload the owner pair from its folders and measure again.
  model = pretrain.load_pair(config, folder, "vit_t", "transformer_t")
  splits = _eval_splits(config)
  again = pretrain.evaluate(model, *splits)
  for key, value in recorded["quality"].items():
    assert again[key] == pytest.approx(value, abs=1e-3), key
  # A rerun resumes: nothing is retrained, the same figures come back.
  assert pretrain.run(config, tmp_path / "run", progress=False)["pairs"] == results["pairs"]


def _eval_splits(config):
  seed = pretrain.WEB_SEED + config.seed
  held_out = data.generate(seed + 1, config.eval_pairs, shift=config.web.shift)
  pool = data.generate(seed + 2, config.probe.train + config.probe.test)
  n = config.probe.train
  return (
    data.take(pool, np.arange(n)),
    data.take(pool, np.arange(n, n + config.probe.test)),
    held_out,
  )


@pytest.mark.parametrize("name", pretrained.available())
def test_shipped_weights_load_and_match_their_config(name):
  config = pretrained.read_config(name)
  assert name == f"world-clip/{config['encoder']}"
  modality = config["modality"]
  sizes = {k: config[k] for k in pretrained.size_keys(modality)}
  model = models.build(
    {"encoder": config["encoder"], "num_outputs": 2, "pretrained": name, **sizes},
    rngs=nnx.Rngs(0),
  )
  assert model.encoder.features == config["features"]
  assert np.isfinite(np.asarray(model.encoder(_inputs(config["encoder"]))[0])).all()


def test_shipped_pair_reproduces_its_recorded_quality():
  if "world-clip/vit_t" not in pretrained.available():
    pytest.skip("no shipped weights")
  config = pretrain_config.get_config()
  recorded = pretrained.read_config("world-clip/vit_t")
  assert recorded["pretraining"]["partner"] == "transformer_t"
  model = pretrain.load_pair(
    config, pretrained.WEIGHTS_DIR / "world-clip", "vit_t", "transformer_t"
  )
  again = pretrain.evaluate(model, *_eval_splits(config))
  for key, value in recorded["quality"].items():
    assert again[key] == pytest.approx(value, abs=0.5), key


@pytest.mark.parametrize(
  "change,message",
  [
    (lambda c: setattr(c, "pairs", [("gru", "transformer_t")]), "'gru' is not an image encoder"),
    (lambda c: setattr(c, "pairs", [("vit_t", "gru"), ("vit_t", "transformer_t")]), "two pairs"),
    (lambda c: setattr(c, "learning_rate", float("nan")), "learning_rate"),
    (lambda c: setattr(c.web, "size", 10), "smaller than one batch"),
    (lambda c: c.epochs.update({"vit_x": 1}), "'vit_x', which is no image encoder"),
    (lambda c: c.epochs.update({"gru": 1}), "'gru', which is no image encoder"),
  ],
)
def test_bad_pretraining_configs_are_refused_in_one_line(change, message):
  config = pretrain_config.get_config("smoke")
  change(config)
  with pytest.raises(pretrain.ConfigError, match=message):
    pretrain.validate(config)


def test_one_pair_of_the_default_config_can_be_pretrained_alone():
  # The default's per-encoder epochs name pairs outside the run; that is allowed.
  config = pretrain_config.get_config()
  config.pairs = (("cnn_m", "transformer_t"),)
  assert pretrain.validate(config) == [("cnn_m", "transformer_t")]
  assert pretrain.epochs_for(config, "cnn_m") == config.epochs.cnn_m == 12
  config.pairs = (("resnet_t", "transformer_t"),)  # no epochs of its own
  assert pretrain.validate(config) == [("resnet_t", "transformer_t")]
  assert pretrain.epochs_for(config, "resnet_t") == config.default_epochs
