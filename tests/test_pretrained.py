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
from fedjax_mm.algorithms import clip
from fedjax_mm.models import pretrained
from fedjax_mm.runner import rcsr as rcsr_runner
from fedjax_mm.runner import writers
from fedjax_mm.zoo import pretrain

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
  weights = folder / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[:100])  # A copy cut short.
  for read in (pretrained.read_tensors, pretrained.read_feature_stats):
    with pytest.raises(
      pretrained.PretrainedError, match=r"model\.safetensors cannot be read as safetensors"
    ):
      read(folder)
  (folder / "config.json").write_bytes(b"\xff\xfe")
  with pytest.raises(pretrained.PretrainedError, match=r"config\.json is not valid JSON \('utf-8'"):
    pretrained.read_config(folder)
  weights.unlink()
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


def test_feature_stats_are_stored_and_standardize_the_pooled_features(tmp_path):
  x = _inputs("cnn_s")
  source = models.build_encoder("cnn_s", rngs=nnx.Rngs(0), **IMAGE)
  inputs = np.random.default_rng(1).random((10, 32, 32, 3), np.float32)
  mean, std = pretrained.feature_stats(source, inputs, batch_size=3)  # batches 3+3+3+1
  pooled = np.asarray(source(jnp.asarray(inputs))[0], np.float64)
  np.testing.assert_allclose(mean, pooled.mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(std, pooled.std(0), rtol=1e-5, atol=1e-6)
  cfg = {"encoder": "cnn_s", "modality": "image", **IMAGE}
  folder = pretrained.save(tmp_path / "with", source, cfg, feature_stats=(mean, std))
  bare = pretrained.save(tmp_path / "bare", source, cfg)
  got = pretrained.read_feature_stats(folder)
  np.testing.assert_array_equal(got[0], mean)
  np.testing.assert_array_equal(got[1], std)

  config = {"encoder": "cnn_s", "head": "mlp", "num_outputs": 10, "rep_dim": 16}
  plain = models.build(config | {"pretrained": str(folder)}, rngs=nnx.Rngs(5))
  model = models.build(config | {"pretrained": str(folder), "standardize": True}, rngs=nnx.Rngs(5))
  assert plain.standardize is None
  # The same encoder, projector and head; the projector reads (pooled - mean) / std.
  raw = np.asarray(model.encoder(x)[0])
  p = model.projector(jnp.asarray((raw - mean) / np.maximum(std, 1e-6)))  # dead units: std 0
  z, y = model.forward(x)
  np.testing.assert_allclose(z, models.l2_normalize(p), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(y, model.head(p), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(model(x), y, rtol=1e-6)
  np.testing.assert_allclose(model.represent(x), z, rtol=1e-6)
  assert not np.allclose(plain.forward(x)[0], z, atol=1e-3)
  # The statistics are no parameter: nothing trains or averages them.
  stats = nnx.state(model, models.FeatureStat)
  assert {".".join(map(str, k)) for k, _ in nnx.to_flat_state(stats)} == {
    "standardize.mean",
    "standardize.std",
  }
  for wrt in (nnx.Param, models.trainable_filter(lora=True), models.representation_filter):
    paths = {".".join(map(str, k)) for k, _ in nnx.to_flat_state(nnx.state(model, wrt))}
    assert not any(k.startswith("standardize") for k in paths)

  with pytest.raises(pretrained.PretrainedError, match="carries no feature statistics"):
    models.build(config | {"pretrained": str(bare), "standardize": True}, rngs=nnx.Rngs(5))
  with pytest.raises(ValueError, match="needs a `pretrained` checkpoint"):
    models.build(config | {"standardize": True}, rngs=nnx.Rngs(5))
  with pytest.raises(ValueError, match="standardize must be a bool"):
    models.build(config | {"pretrained": str(folder), "standardize": 1}, rngs=nnx.Rngs(5))
  with pytest.raises(ValueError, match=r"two \[64\] arrays, got \(3,\)"):
    pretrained.save(tmp_path / "x", source, cfg, feature_stats=(mean[:3], std))
  # Added later to a folder without them, every other tensor kept.
  pretrained.add_feature_stats(bare, source, (mean, std))
  np.testing.assert_array_equal(pretrained.read_feature_stats(bare)[1], std)
  before, after = pretrained.read_tensors(folder), pretrained.read_tensors(bare)
  assert before.keys() == after.keys()
  for k in before:
    np.testing.assert_array_equal(before[k], after[k], err_msg=k)


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
  # The model card's training curve: each epoch's loss and probes, as metrics.jsonl has them.
  lines = [r for r in writers.read_metrics(tmp_path / "run") if r["run"] == "vit_t+transformer_t"]
  curve = recorded["pretraining"]["curve"]
  assert [c["epoch"] for c in curve] == list(range(1, config.default_epochs + 1))
  for c, line in zip(curve, lines, strict=True):
    assert set(c) == {"epoch", *pretrain.CURVE_KEYS}
    for key in pretrain.CURVE_KEYS:
      assert c[key] == pytest.approx(line[key], abs=1e-4), key
  # FedMuscle's precondition, measured on the folders and printed.
  shared = results["precondition"]["vit_t/cnn_s"]
  assert 0 <= shared["min"] == min(shared["x"], shared["y"]) <= 100
  assert len(shared["correlations"]) == config.precondition.k
  assert "shape in the shared directions" in (tmp_path / "run" / "report.md").read_text()
  # Reload the owner pair from its folders and measure again.
  model = pretrain.load_pair(config, folder, "vit_t", "transformer_t")
  splits = _eval_splits(config)
  again = pretrain.evaluate(model, *splits)
  for key, value in recorded["quality"].items():
    assert again[key] == pytest.approx(value, abs=1e-3), key
  # Each folder holds its encoder's feature statistics over the first stats_size web inputs.
  web = data.generate(pretrain.WEB_SEED + config.seed, config.web.size, shift=config.web.shift)
  for name, encoder in (("vit_t", model.image_encoder), ("transformer_t", model.text_encoder)):
    modality = models.ENCODERS[name][0]
    want = pretrained.feature_stats(encoder, pretrain.stats_inputs(config, web, modality))
    got = pretrained.read_feature_stats(folder / name)
    for g, w in zip(got, want, strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=name)
  # A rerun resumes: nothing is retrained, the same figures come back, and folders
  # written before the statistics existed get them.
  from safetensors.numpy import save_file

  old = {k: v for k, v in pretrained.read_tensors(folder / "cnn_s").items() if "pooled" not in k}
  save_file(old, str(folder / "cnn_s" / pretrained.WEIGHTS_FILE))
  with pytest.raises(pretrained.PretrainedError):
    pretrained.read_feature_stats(folder / "cnn_s")
  assert pretrain.run(config, tmp_path / "run", progress=False)["pairs"] == results["pairs"]
  cnn = pretrain.load_pair(config, folder, "cnn_s", "transformer_t").image_encoder
  want = pretrained.feature_stats(cnn, pretrain.stats_inputs(config, web, "image"))
  for g, w in zip(pretrained.read_feature_stats(folder / "cnn_s"), want, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def _folders_and_lines(workdir):
  """Every tensor of every folder the run wrote, and its metric lines."""
  folder = workdir / "world-clip"
  tensors = {p.name: pretrained.read_tensors(p) for p in sorted(folder.iterdir())}
  return tensors, (workdir / "metrics.jsonl").read_text()


def test_pretraining_resumes_from_the_last_epoch_bit_for_bit(tmp_path, monkeypatch):
  """A stop inside a pair keeps its epochs: a preemption after an epoch, then Ctrl-C inside
  the next; the run resumed twice writes what the uninterrupted run writes. The job's
  agreement on a notice (processes.preempted) is asked once per epoch of the run, in
  order, finished pairs' epochs included."""
  config = _tiny_config()
  config.default_epochs = 2  # Two pairs of 2 epochs: steps 1, 2 (vit_t), 3, 4 (cnn_s).
  pretrain.run(config, tmp_path / "one", progress=False)
  reference = _folders_and_lines(tmp_path / "one")
  workdir = tmp_path / "run"
  asked = []

  def preempted(step):
    asked.append(step)
    return step == 3  # A notice during cnn_s's first epoch.

  monkeypatch.setattr(pretrain.processes, "preempted", preempted)
  with pytest.raises(pretrain.Preempted) as info:
    pretrain.run(config, workdir, progress=False)
  assert info.value.where == "epoch 1 of cnn_s+transformer_t" and asked == [1, 2, 3]
  assert sorted(p.name for p in (workdir / "world-clip").iterdir()) == ["transformer_t", "vit_t"]
  pair = workdir / "checkpoints" / "cnn_s+transformer_t"
  assert sorted(p.name for p in pair.iterdir()) == ["1"]
  assert not (workdir / "checkpoints" / "vit_t+transformer_t").exists()

  # Ctrl-C inside cnn_s's second epoch (while it is evaluated): epoch 1 is what is kept.
  asked.clear()
  monkeypatch.setattr(pretrain.processes, "preempted", lambda step: asked.append(step) or False)
  evaluate = pretrain.evaluate

  def interrupted(model, *splits):
    if model.image_encoder.__class__.__name__.lower().startswith("cnn"):
      raise KeyboardInterrupt
    return evaluate(model, *splits)

  monkeypatch.setattr(pretrain, "evaluate", interrupted)
  with pytest.raises(KeyboardInterrupt):
    pretrain.run(config, workdir, progress=False)
  assert asked == [1, 2, 3] and sorted(p.name for p in pair.iterdir()) == ["1"]

  asked.clear()
  cnn_evaluations = []

  def counted(model, *splits):
    cnn_evaluations.append(model.image_encoder.__class__.__name__)
    return evaluate(model, *splits)

  monkeypatch.setattr(pretrain, "evaluate", counted)
  pretrain.run(config, workdir, progress=False)
  assert asked == [1, 2, 3, 4]
  # Only cnn_s's second epoch was trained: its curve point and the final measure.
  assert len(cnn_evaluations) == 2, cnn_evaluations
  assert list((workdir / "checkpoints").iterdir()) == []
  tensors, lines = _folders_and_lines(workdir)
  assert lines == reference[1]
  assert tensors.keys() == reference[0].keys()
  for name, got in tensors.items():
    assert got.keys() == reference[0][name].keys(), name
    for key, value in got.items():
      np.testing.assert_array_equal(value, reference[0][name][key], err_msg=f"{name} {key}")


def test_distillation_acts_trains_the_teacher_first_and_resumes_bit_for_bit(tmp_path, monkeypatch):
  """With distill.teacher = cnn_s (listed second), cnn_s trains first by CLIP alone and
  vit_t is distilled from it: vit_t's weights differ from a run without distillation,
  cnn_s's do not; its folder records the teacher. A stop right after the teacher's pair
  resumes with the teacher read back from its folder and writes the same tensors."""
  plain = _tiny_config()
  plain.default_epochs = 2  # steps 1, 2: the teacher (cnn_s); 3, 4: vit_t
  pretrain.run(plain, tmp_path / "plain", progress=False)
  config = _tiny_config()
  config.default_epochs = 2
  config.distill.teacher = "cnn_s"
  assert pretrain.training_order(config, [tuple(p) for p in config.pairs]) == [1, 0]
  pretrain.run(config, tmp_path / "one", progress=False)
  a, b = _folders_and_lines(tmp_path / "plain")[0], _folders_and_lines(tmp_path / "one")[0]
  for key, value in a["cnn_s"].items():
    np.testing.assert_array_equal(value, b["cnn_s"][key], err_msg=key)
  changed = [k for k, v in a["vit_t"].items() if not np.array_equal(v, b["vit_t"][k])]
  assert len(changed) == len(a["vit_t"]), "distillation left some vit_t tensors unchanged"
  recorded = pretrained.read_config(tmp_path / "one" / "world-clip" / "vit_t")["pretraining"]
  assert recorded["distilled_from"] == "cnn_s" and recorded["distill_weight"] == 1.0
  assert (
    "distilled_from" not in pretrained.read_config(tmp_path / "one/world-clip/cnn_s")["pretraining"]
  )

  # Preempted after vit_t's first epoch (step 3): the rerun reads the teacher back from
  # its folder and distils it into vit_t's second epoch.
  monkeypatch.setattr(pretrain.processes, "preempted", lambda step: step == 3)
  with pytest.raises(pretrain.Preempted):
    pretrain.run(config, tmp_path / "run", progress=False)
  assert sorted(p.name for p in (tmp_path / "run" / "world-clip").iterdir()) == ["cnn_s"]
  monkeypatch.setattr(pretrain.processes, "preempted", lambda step: False)
  pretrain.run(config, tmp_path / "run", progress=False)
  tensors, lines = _folders_and_lines(tmp_path / "run")
  reference = _folders_and_lines(tmp_path / "one")
  assert lines == reference[1]
  for name, got in tensors.items():
    for key, value in got.items():
      np.testing.assert_array_equal(value, reference[0][name][key], err_msg=f"{name} {key}")


def test_distill_loss_is_the_cosine_distance():
  x = jnp.array([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]])
  y = jnp.array([[2.0, 0.0], [0.0, -1.0], [4.0, -3.0]])
  np.testing.assert_allclose(clip.distill_loss(x, y), [0.0, 2.0, 1.0], atol=1e-6)


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
  mean, std = pretrained.read_feature_stats(name)
  assert mean.shape == std.shape == (config["features"],) and (std > 0).all()


def test_shipped_feature_stats_are_the_pretraining_datas():
  # cnn_m, the encoder every default FedMuscle IC user has: its stored statistics are
  # what pretrain.feature_stats gives over the first stats_size web images (float16).
  if "world-clip/cnn_m" not in pretrained.available():
    pytest.skip("no shipped weights")
  config = pretrain_config.get_config()
  web = data.generate(pretrain.WEB_SEED + config.seed, config.web.size, shift=config.web.shift)
  encoder = models.build_encoder("cnn_m", rngs=nnx.Rngs(0), **IMAGE)
  pretrained.load_into(encoder, "world-clip/cnn_m")
  want = pretrained.feature_stats(encoder, pretrain.stats_inputs(config, web, "image"))
  for got, w in zip(pretrained.read_feature_stats("world-clip/cnn_m"), want, strict=True):
    np.testing.assert_allclose(got, w, rtol=2e-3, atol=1e-4)


def test_shipped_pair_reproduces_its_recorded_quality():
  # vitc_t and the shipped transformer_t were trained together (FedRGB's, RCSR's and
  # CreamFL's multimodal clients' pair); the folders give back the figures they record.
  if "world-clip/vitc_t" not in pretrained.available():
    pytest.skip("no shipped weights")
  config = pretrain_config.get_config()
  recorded = pretrained.read_config("world-clip/vitc_t")
  assert recorded["pretraining"]["partner"] == "transformer_t"
  assert pretrained.read_config("world-clip/transformer_t")["pretraining"]["partner"] == "vitc_t"
  model = pretrain.load_pair(
    config, pretrained.WEIGHTS_DIR / "world-clip", "vitc_t", "transformer_t"
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
    (lambda c: c.epochs.update({"vit_t": 0}), r"^epochs\.vit_t must be >= 1, got 0\.$"),
    (lambda c: setattr(c, "seed", -1), r"^seed must be >= 0, got -1\.$"),
    # Found before hours of training, not at the first save.
    (lambda c: setattr(c, "dtype", "int8"), r"dtype must be one of \['float16', 'float32'\]"),
    (lambda c: setattr(c, "warmup_fraction", 1.0), r"warmup_fraction must be in \[0, 1\)"),
    (lambda c: setattr(c, "eval_pairs", 5), r"^eval_pairs must be >= 10, got 5\.$"),
    (lambda c: setattr(c, "stats_size", 10**6), r"stats_size must be in \[2, web\.size\]"),
    (lambda c: setattr(c.precondition, "encoders", ("gru",)), "precondition.encoders names 'gru'"),
    (lambda c: setattr(c.distill, "teacher", "cnn_m"), "distill.teacher 'cnn_m' is not an image"),
    (lambda c: setattr(c.distill, "weight", -1.0), r"^distill\.weight must be >= 0, got -1\.0\.$"),
    (lambda c: setattr(c.distill, "students", ("vit_t",)), "students is set but distill.teacher"),
    (
      lambda c: c.distill.update({"teacher": "cnn_s", "students": ("cnn_s",)}),
      "distill.students names 'cnn_s', which is no image encoder other than the teacher",
    ),
    (
      lambda c: c.distill.update({"teacher": "cnn_s", "students": ("gru",)}),
      "distill.students names 'gru'",
    ),
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
  config.pairs = (("vitc_b", "transformer_t"),)  # no epochs of its own, no student
  assert pretrain.validate(config) == [("vitc_b", "transformer_t")]
  assert pretrain.epochs_for(config, "vitc_b") == config.default_epochs
  config.pairs = (("vitc_t", "transformer_t"),)  # a student whose teacher is not here
  with pytest.raises(pretrain.ConfigError, match="distill.teacher 'cnn_m'"):
    pretrain.validate(config)


def test_distill_students_default_to_every_other_image_encoder():
  config = pretrain_config.get_config()
  pairs = [("a", "t"), ("b", "t"), ("c", "t")]
  config.distill.teacher = ""
  assert pretrain.distill_students(config, pairs) == ()
  config.distill.teacher = "b"
  config.distill.students = ()
  assert pretrain.distill_students(config, pairs) == ("a", "c")
  config.distill.students = ("c", "z")  # z: not in this run's pairs
  assert pretrain.distill_students(config, pairs) == ("c",)


def test_fedmuscle_default_lineup_meets_its_precondition():
  """Every two distinct encoders of FedMuscle's default users share shape (issue 65).

  The top k CCA directions of their shipped encoders' pooled features, fitted on a
  public set of the pretraining report's size and shift, decode the primary shape at
  >= 40% from either side (chance 10%): what FedMuscle's alignment can pass on. The
  previous zoo (vit_s, resnet_t after 3 epochs, cnn_m) decoded 12-21% at the same k.
  """
  from experiments import fedmuscle as fedmuscle_config

  lineup = tuple(dict.fromkeys(u["encoder"] for u in fedmuscle_config.get_config().users))
  config = pretrain_config.get_config()
  assert tuple(config.precondition.encoders) == lineup  # The report measures this lineup.
  folder = pretrained.WEIGHTS_DIR / "world-clip"
  missing = [n for n in lineup if not (folder / n).is_dir()]
  assert not missing, f"no shipped weights for {missing}"
  probe_train, probe_test, _ = _eval_splits(config)
  found = pretrain.precondition(config, folder, probe_train, probe_test)
  assert len(found) == len(lineup) * (len(lineup) - 1) // 2
  shape = {pair: round(r["min"], 1) for pair, r in found.items()}
  assert min(shape.values()) >= 40.0, shape


def _default_encoders() -> dict[str, set[str]]:
  """System -> the World-CLIP encoders its default config starts from."""
  from experiments import creamfl, fedmuscle, fedrgb, fedscmr, rcsr

  c = creamfl.get_config()
  f = fedscmr.get_config().features
  return {
    "fedmuscle": {u["encoder"] for u in fedmuscle.get_config().users},
    "creamfl": {
      c.clients.image.encoder,
      c.clients.text.encoder,
      c.clients.multimodal.image_encoder,
      c.clients.multimodal.text_encoder,
      c.server.image_encoder,
      c.server.text_encoder,
    },
    "fedrgb": {fedrgb.get_config().image_encoder, fedrgb.get_config().text_encoder},
    "rcsr": {rcsr.get_config().image_encoder, rcsr_runner.TEXT_ENCODER},
    "fedscmr": {
      f.image_encoder.removeprefix("world-clip/"),
      f.text_encoder.removeprefix("world-clip/"),
    },
  }


@pytest.mark.parametrize("system", ["fedmuscle", "creamfl", "fedrgb", "rcsr", "fedscmr"])
def test_default_image_encoders_meet_the_zoo_targets(system):
  # Issue 65's bar for every image encoder a default config uses, from the quality its
  # folder records (test_shipped_pair_reproduces_its_recorded_quality re-measures one):
  # a shape probe >= 65%, multi-label F1 >= 60 and zero-shot R@10 >= 70% both ways.
  images = [n for n in sorted(_default_encoders()[system]) if models.encoder_modality(n) == "image"]
  assert images, system
  for name in images:
    q = pretrained.read_config(f"world-clip/{name}")["quality"]
    got = {k: round(q[k], 1) for k in ("probe_shape", "probe_multilabel", "i2t_R@10", "t2i_R@10")}
    assert got["probe_shape"] >= 65 and got["probe_multilabel"] >= 60, (name, got)
    assert got["i2t_R@10"] >= 70 and got["t2i_R@10"] >= 70, (name, got)


#: Text towers of default configs below issue 65's retrieval bar, still to rebuild:
#: gru (cnn_s's partner, 5 epochs: R@10 65.3 / 51.3; CreamFL's text clients) and
#: transformer_s (vit_s's partner: 53.2 / 36.0; CreamFL's server, beside vitc_s).
KNOWN_TEXT_GAPS = frozenset({"gru", "transformer_s"})


@pytest.mark.parametrize("system", ["creamfl", "fedrgb", "rcsr", "fedscmr"])  # FedMuscle: images
def test_default_text_towers_meet_the_zoo_retrieval_target(system):
  # A text tower's folder records its pair's zero-shot retrieval; the bar is R@10 >= 70
  # both ways.
  texts = [
    n
    for n in sorted(_default_encoders()[system] - KNOWN_TEXT_GAPS)
    if models.encoder_modality(n) == "text"
  ]
  assert texts, system
  for name in texts:
    q = pretrained.read_config(f"world-clip/{name}")["quality"]
    got = (round(q["i2t_R@10"], 1), round(q["t2i_R@10"], 1))
    assert min(got) >= 70, (name, got)


def test_the_known_text_gaps_are_still_gaps():
  # Rebuilding one of them removes it from KNOWN_TEXT_GAPS (this fails until then).
  for name in KNOWN_TEXT_GAPS:
    q = pretrained.read_config(f"world-clip/{name}")["quality"]
    assert min(q["i2t_R@10"], q["t2i_R@10"]) < 70, name
