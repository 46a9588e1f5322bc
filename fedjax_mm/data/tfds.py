"""The papers' real datasets through TFDS, in the world's dict-of-arrays interface.

FedMuscle, CreamFL and FedSCMR train on CIFAR-10/100, PASCAL VOC, MS-COCO
(captions, panoptic segmentation) and AG News, among others. TensorFlow Datasets prepares them once (``tfds build``, on a machine
with TensorFlow and a network) as ArrayRecord files; this module reads them with
``tfds.data_source`` (random access, decoded to numpy, no TensorFlow at run time)
and returns the same dict of numpy arrays as :func:`fedjax_mm.data.world.generate`,
so the partitioners (:func:`~fedjax_mm.data.partition.dirichlet_partition`,
:func:`~fedjax_mm.data.cross_modal.class_subset_split`,
:func:`~fedjax_mm.data.partition.drop_modality`) apply unchanged::

  from fedjax_mm.data import tfds as tfds_data
  train = tfds_data.load("cifar100", split="train", limit=5000, image_size=32)
  parts = data.dirichlet_partition(train["label100"], 8, alpha=0.1, seed=0)

What each reader returns (``S = image_size``; every image is resized to ``S x S``
bilinearly and scaled to ``float32`` in ``[0, 1]``, the world's layout):

* ``cifar10``: ``image [n, S, S, 3]``, ``label10 int32 [n]``.
* ``cifar100``: ``image``, ``label100 int32 [n]`` (the fine label),
  ``label20 int32 [n]`` (the coarse superclass).
* ``voc`` (TFDS ``voc/2012``): ``image``, ``multilabel float32 [n, 20]`` (the
  object classes present). TFDS's VOC is the *detection* set: it has boxes, no
  segmentation masks, so it cannot feed a segmentation task (FedMuscle's ``ss``:
  ``coco_panoptic`` does).
* ``coco_captions`` (TFDS ``coco_captions/2014``: the Karpathy splits ``train``,
  ``restval``, ``val``, ``test``): ``image``, ``caption int32 [n, C, L]`` (the
  first ``C`` captions, cycled when an image has fewer, through ``tokenizer``),
  ``multilabel float32 [n, 80]`` (the object classes present). Without a
  ``tokenizer`` the captions are left out.
* ``coco_panoptic`` (TFDS ``coco/2017_panoptic``: ``train``, 118,287 images, and
  ``validation``, 5,000; COCO's test masks are not public): ``image`` and ``mask
  int32 [n, S, S]``, each pixel's semantic class in ``[0, 133)`` (TFDS's
  ``panoptic_objects/label``, the order of COCO's panoptic category list: the 80
  thing classes ``0..79``, then the 53 stuff classes ``80..132``), or :data:`VOID` (255)
  where no segment lies (segment id 0). Crowd segments keep their class (a crowd
  is one region of a thing class; semantic masks need no instances). Void is
  ignored by the segmentation task's loss and mIoU (:class:`fedjax_mm.core.Task`);
  the mask is resized with nearest neighbour (:func:`resize_mask`), so it holds
  only labels present before. :func:`panoptic_to_semantic` converts; FedMuscle's
  Setup2 SS users (semantic segmentation on COCO) read it.

* ``ag_news_subset`` (AG News, CreamFL's text clients): ``caption int32 [n, 1, L]``
  (title and description, through ``tokenizer``, which it requires) and
  ``caption_label int32 [n]`` (4 topics): the world's text-classification keys.

Not in TFDS (4.9.10): Flickr30K, Yahoo! Answers, NUS-WIDE and the cross-modal
Wikipedia set (TFDS's ``wikipedia`` is the text dump). FedSCMR reads Wikipedia as
precomputed features from an ``.npz`` (``experiments/fedscmr.py:paper``).

``limit`` keeps the first ``n`` examples and ``indices`` picks some of those
(:func:`num_examples` says how many there are): the arrays are decoded into
memory (COCO's 113k training images at ``S = 224`` would be 68 GB of float32).
Each reader names the labelled splits a runner trains and tests on
(:attr:`Reader.splits`: ``validation`` is VOC's and COCO panoptic's test set) and
its classes per label key (:attr:`Reader.classes`). FedMuscle's runner reads its users' sets and
public set this way when ``config.data.source = "tfds"``
(:func:`fedjax_mm.runner.fedmuscle_data._tfds_sets`), CreamFL's its clients' pools, public
set and test set (:func:`fedjax_mm.runner.creamfl_data._tfds_sets`), both through
:func:`read_disjoint`.

Where the data must be
----------------------
``data_dir`` (default: ``$TFDS_DATA_DIR``, else ``~/tensorflow_datasets``, as
TFDS) holds ``<name>[/<config>]/<version>/`` with ``dataset_info.json`` and the
``*.array_record-*`` shards, made by e.g.::

  tfds build cifar100 --data_dir=DIR --file_format=array_record

A prepared folder is opened with ``tfds.builder_from_directory``, which reads its
metadata and does not run the builder's code, so ``coco_captions`` and
``coco_panoptic`` (whose builders import TensorFlow in tensorflow-datasets 4.9.10)
need no TensorFlow to be read.
That path is not exercised by the tests: writing a folder with images needs
TensorFlow, which the project does not install.

Only when no folder is found is the registered builder asked
(``tfds.data_source(..., download=False)``; :func:`tfds.testing.mock_data`
answers there in the tests); when that fails too, :func:`load` raises
:class:`DatasetError` in one line naming the ``tfds build`` command and the
folder it looked in (:func:`fedjax_mm.runner.validation.check_data` turns it into
a ``ConfigError``, which ``experiments/main.py`` prints with exit status 2). Nothing
is ever downloaded. A folder prepared as TFRecord (TFDS's default) has no random
access: rebuild it with ``--file_format=array_record``.

Requires ``tensorflow-datasets`` and ``array-record`` (``pip install
'fedjax_mm[tfds]'``), imported only when :func:`load` is called.

Disjoint, seeded slices (:func:`read_disjoint`). A runner with ``config.data.source =
"tfds"`` asks each ``(dataset, split)`` for some sets (a user's training set, a client group's pool, the public
set, a test set), each of some size. :func:`read_disjoint` reads each split once
and gives every set its own examples:

* the pool is the split's first ``data.limit`` examples (0: all of them), so a
  small ``limit`` makes a run small;
* the pool is permuted by a key of the run's seed, the dataset and the split
  (``crc32("<dataset>/<split>")``), and the sets take consecutive slices of that
  order, in the order they were asked: no example is in two sets;
* a pool smaller than the sum asked is shared in proportion (:func:`shares`:
  ``floor(asked * pool / sum)`` each, every set at least one example, else
  :class:`DatasetError`).

Each set's indices are sorted before reading (a set is unordered and the files
are read in order), and :func:`fedjax_mm.data.tfds.load` returns them in the
world's dict-of-arrays interface. FedMuscle's and CreamFL's runners read their data through it.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import zlib
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from fedjax_mm.data.partition import take


class DatasetError(ValueError):
  """A dataset that cannot be read here: one line saying what to run or where to put it."""


#: ``tokenizer(texts) -> int [len(texts), L]``: captions to token ids, PAD = 0.
Tokenizer = Callable[[Sequence[str]], np.ndarray]

NUM_AG_NEWS_CLASSES = 4
NUM_CIFAR100_CLASSES = 100
NUM_CIFAR100_SUPERCLASSES = 20
NUM_VOC_CLASSES = 20
NUM_COCO_CLASSES = 80
#: COCO panoptic's classes: 80 things then 53 stuff (TFDS ``panoptic_objects/label``).
NUM_COCO_PANOPTIC_CLASSES = 133
#: A mask's value where no class lies (COCO panoptic's unlabelled pixels): outside every
#: task's ``[0, num_outputs)``, so the loss and mIoU skip it (255 as VOC's boundary label).
VOID = 255


@dataclasses.dataclass(frozen=True)
class Reader:
  """How one dataset is found and mapped into the world's interface.

  Attributes:
    builder: the TFDS name, with its config (``voc/2012``).
    convert: ``(example, image_size, tokenizer, captions_per_image) -> {key: array}``
      for one example as ``tfds.data_source`` decodes it (numpy, nested dicts).
    keys: the keys :func:`load` returns (with a tokenizer, for captions).
    classes: label key -> its number of classes (a task's outputs).
    splits: ``(train, test)``: the labelled splits a runner trains and tests on.
    background: a mask's class for "no object", None where every class is one
      (COCO panoptic: 0 is person; its unlabelled pixels are :data:`VOID`).
  """

  builder: str
  convert: Callable[..., dict[str, np.ndarray]]
  keys: tuple[str, ...]
  classes: dict[str, int]
  splits: tuple[str, str] = ("train", "test")
  background: int | None = None


def resize_image(image: np.ndarray, size: int) -> np.ndarray:
  """``uint8 [H, W, C]`` (C = 1 or 3) -> ``float32 [size, size, 3]`` in ``[0, 1]``, bilinear."""
  from PIL import Image  # matplotlib's dependency; imported where images are decoded

  image = np.asarray(image)
  if image.ndim == 2:
    image = image[..., None]
  if image.shape[-1] == 1:
    image = np.repeat(image, 3, axis=-1)
  if image.shape[:2] != (size, size):
    image = np.asarray(Image.fromarray(image).resize((size, size), Image.Resampling.BILINEAR))
  return image.astype(np.float32) / 255.0


def resize_mask(mask: np.ndarray, size: int) -> np.ndarray:
  """``int [H, W]`` class ids -> ``int32 [size, size]``, nearest neighbour.

  Output pixel ``(i, j)`` takes the source pixel under its centre, row
  ``floor((i + 1/2) H / size)`` (PIL's ``NEAREST``), so no value is invented: a
  mask keeps only its own labels (and :data:`VOID`), which interpolation would mix.
  """
  mask = np.asarray(mask)
  if mask.ndim != 2:
    raise ValueError(f"a mask is [H, W], got shape {mask.shape}.")
  h, w = mask.shape
  rows = np.minimum(((np.arange(size) + 0.5) * h / size).astype(np.int64), h - 1)
  cols = np.minimum(((np.arange(size) + 0.5) * w / size).astype(np.int64), w - 1)
  return mask[rows[:, None], cols[None, :]].astype(np.int32)


def panoptic_ids(png: np.ndarray) -> np.ndarray:
  """A COCO panoptic PNG ``uint8 [H, W, 3]`` -> segment ids ``int64 [H, W]``: ``R + 256 G + 256^2 B``."""
  rgb = np.asarray(png).astype(np.int64)
  if rgb.ndim != 3 or rgb.shape[-1] != 3:
    raise ValueError(f"a panoptic PNG is [H, W, 3], got shape {rgb.shape}.")
  return rgb[..., 0] + 256 * rgb[..., 1] + 256 * 256 * rgb[..., 2]


def panoptic_to_semantic(
  png: np.ndarray,
  segment_ids: Sequence[int] | np.ndarray,
  labels: Sequence[int] | np.ndarray,
  *,
  void: int = VOID,
) -> np.ndarray:
  """A panoptic annotation -> its semantic mask: each pixel's segment's class.

  Args:
    png: ``uint8 [H, W, 3]``, the panoptic PNG (:func:`panoptic_ids` decodes it).
    segment_ids: ``int [K]``, the segments' ids (``panoptic_objects/id``).
    labels: ``int [K]``, their classes (``panoptic_objects/label``), aligned.
    void: the value of pixels in no listed segment, id 0 (unlabelled) included.

  Returns:
    ``int32 [H, W]``. A repeated id (never in COCO) takes its first listed class.
  """
  ids = panoptic_ids(png)
  segment_ids = np.asarray(segment_ids, np.int64).reshape(-1)
  labels = np.asarray(labels, np.int64).reshape(-1)
  if segment_ids.shape != labels.shape:
    raise ValueError(f"{segment_ids.size} segment ids but {labels.size} labels.")
  if segment_ids.size == 0:
    return np.full(ids.shape, void, np.int32)
  # A sorted lookup: O(pixels log K), not one pass over the image per segment.
  order = np.argsort(segment_ids, kind="stable")
  known = segment_ids[order]
  at = np.minimum(np.searchsorted(known, ids), known.size - 1)
  hit = (known[at] == ids) & (ids != 0)
  return np.where(hit, labels[order][at], void).astype(np.int32)


def multi_hot(labels: Sequence[int] | np.ndarray, num_classes: int) -> np.ndarray:
  """Class ids (repeats allowed) -> ``float32 [num_classes]`` with 1 where present."""
  out = np.zeros(num_classes, np.float32)
  out[np.asarray(labels, dtype=np.int64)] = 1.0
  return out


def _text(value: Any) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _cifar10(example, image_size, tokenizer, captions_per_image):
  del tokenizer, captions_per_image
  return {
    "image": resize_image(example["image"], image_size),
    "label10": np.int32(example["label"]),
  }


def _cifar100(example, image_size, tokenizer, captions_per_image):
  del tokenizer, captions_per_image
  return {
    "image": resize_image(example["image"], image_size),
    "label100": np.int32(example["label"]),
    "label20": np.int32(example["coarse_label"]),
  }


def _voc(example, image_size, tokenizer, captions_per_image):
  del tokenizer, captions_per_image
  return {
    "image": resize_image(example["image"], image_size),
    "multilabel": multi_hot(example["labels"], NUM_VOC_CLASSES),
  }


def _coco_captions(example, image_size, tokenizer, captions_per_image):
  out = {
    "image": resize_image(example["image"], image_size),
    "multilabel": multi_hot(example["objects"]["label"], NUM_COCO_CLASSES),
  }
  if tokenizer is not None:
    texts = [_text(t) for t in np.atleast_1d(example["captions"]["text"])]
    if not texts:
      raise ValueError("a coco_captions example has no caption.")
    # COCO has 5 to 7 captions per image: keep C, cycling when fewer.
    texts = [texts[i % len(texts)] for i in range(captions_per_image)]
    out["caption"] = np.asarray(tokenizer(texts), dtype=np.int32)
  return out


def _coco_panoptic(example, image_size, tokenizer, captions_per_image):
  del tokenizer, captions_per_image
  objects = example["panoptic_objects"]
  ids = np.asarray(objects["id"]).reshape(-1)
  labels = np.asarray(objects["label"]).reshape(-1)
  # One entry per segment in a prepared folder; TFDS's random mock examples draw each
  # field's length on its own, so pair the first ones.
  num = min(ids.size, labels.size)
  semantic = panoptic_to_semantic(example["panoptic_image"], ids[:num], labels[:num])
  return {
    "image": resize_image(example["image"], image_size),
    "mask": resize_mask(semantic, image_size),
  }


def _ag_news(example, image_size, tokenizer, captions_per_image):
  del image_size, captions_per_image
  text = f"{_text(example['title'])}. {_text(example['description'])}"
  return {
    "caption": np.asarray(tokenizer([text]), dtype=np.int32),
    "caption_label": np.int32(example["label"]),
  }


#: Dataset name -> :class:`Reader`.
READERS: dict[str, Reader] = {
  "cifar10": Reader("cifar10", _cifar10, ("image", "label10"), {"label10": 10}),
  "cifar100": Reader(
    "cifar100",
    _cifar100,
    ("image", "label100", "label20"),
    {"label100": NUM_CIFAR100_CLASSES, "label20": NUM_CIFAR100_SUPERCLASSES},
  ),
  # VOC 2012's test labels are not public: its validation split is the test set.
  "voc": Reader(
    "voc/2012",
    _voc,
    ("image", "multilabel"),
    {"multilabel": NUM_VOC_CLASSES},
    ("train", "validation"),
  ),
  # Karpathy's splits: train (82,783 images), restval, val and test (5,000 each).
  "coco_captions": Reader(
    "coco_captions/2014",
    _coco_captions,
    ("image", "multilabel", "caption"),
    {"multilabel": NUM_COCO_CLASSES},
  ),
  # COCO 2017 panoptic: train (118,287 images) and validation (5,000; the test masks
  # are not public).
  "coco_panoptic": Reader(
    "coco/2017_panoptic",
    _coco_panoptic,
    ("image", "mask"),
    {"mask": NUM_COCO_PANOPTIC_CLASSES},
    ("train", "validation"),
  ),
  "ag_news_subset": Reader(
    "ag_news_subset",
    _ag_news,
    ("caption", "caption_label"),
    {"caption_label": NUM_AG_NEWS_CLASSES},
  ),
}

#: Readers that cannot run without a ``tokenizer``.
NEEDS_TOKENIZER = frozenset({"ag_news_subset"})


def default_data_dir() -> pathlib.Path:
  """TFDS's default: ``$TFDS_DATA_DIR``, else ``~/tensorflow_datasets``."""
  return pathlib.Path(os.environ.get("TFDS_DATA_DIR", "~/tensorflow_datasets")).expanduser()


def build_command(name: str, data_dir: str | os.PathLike | None = None) -> str:
  """The command that prepares ``name`` where :func:`load` looks for it."""
  root = pathlib.Path(data_dir).expanduser() if data_dir else default_data_dir()
  builder = READERS[name].builder if name in READERS else name
  return f"tfds build {builder} --data_dir={root} --file_format=array_record"


def _version_key(path: pathlib.Path) -> tuple[int, ...]:
  try:
    return tuple(int(p) for p in path.name.split("."))
  except ValueError:
    return (-1,)


def prepared_folder(builder: str, data_dir: str | os.PathLike | None = None) -> pathlib.Path | None:
  """``<data_dir>/<builder>/<newest version>`` holding ``dataset_info.json``, or None."""
  root = pathlib.Path(data_dir).expanduser() if data_dir else default_data_dir()
  parent = root / builder
  if not parent.is_dir():
    return None
  versions = [p for p in parent.iterdir() if (p / "dataset_info.json").is_file()]
  return max(versions, key=_version_key) if versions else None


def _import_tfds():
  try:
    import tensorflow_datasets as tfds  # optional dependency, imported lazily
  except ImportError:
    raise DatasetError(
      "reading TFDS datasets needs tensorflow-datasets and array-record: "
      "pip install 'fedjax_mm[tfds]'."
    ) from None
  return tfds


def data_source(name: str, *, split: str = "train", data_dir: str | os.PathLike | None = None):
  """The random-access source (``len``, ``[i]`` -> decoded numpy example) of ``name``'s split.

  Raises:
    DatasetError: an unknown name, a dataset not prepared in ``data_dir`` (the
      message names the ``tfds build`` command), or prepared without random access.
  """
  if name not in READERS:
    raise DatasetError(f"unknown TFDS dataset {name!r}; known: {', '.join(READERS)}.")
  tfds = _import_tfds()
  builder = READERS[name].builder
  root = pathlib.Path(data_dir).expanduser() if data_dir else default_data_dir()
  folder = prepared_folder(builder, root)
  try:
    if folder is not None:
      return tfds.builder_from_directory(str(folder)).as_data_source(split=split)
    return tfds.data_source(builder, split=split, data_dir=str(root), download=False)
  except Exception as e:  # TFDS raises many kinds: report what to do in one line
    if folder is not None:
      reason = " ".join(str(e).split())[:200]
      raise DatasetError(
        f"{name}: cannot read split {split!r} of {folder} ({type(e).__name__}: {reason}); "
        f"if it was prepared as TFRecord (no random access), rebuild it: {build_command(name, root)}."
      ) from None
    raise DatasetError(
      f"{name}: no prepared {builder} under {root}; prepare it once on a machine with "
      f"TensorFlow and network: {build_command(name, root)} (or set data.data_dir / "
      "$TFDS_DATA_DIR to the folder that holds it)."
    ) from None


def load(
  name: str,
  *,
  split: str = "train",
  data_dir: str | os.PathLike | None = None,
  limit: int | None = None,
  image_size: int = 32,
  tokenizer: Tokenizer | None = None,
  captions_per_image: int = 5,
  indices: Sequence[int] | np.ndarray | None = None,
) -> dict[str, np.ndarray]:
  """The first ``limit`` examples of ``name``'s ``split`` (or those ``indices`` pick) as arrays.

  Args:
    name: a key of :data:`READERS` (``cifar10``, ``cifar100``, ``voc``, ``coco_captions``,
      ``coco_panoptic``, ``ag_news_subset``).
    split: a TFDS split string (``"train"``, ``"validation"``, ``"train[:10%]"``).
    data_dir: the TFDS data folder (default :func:`default_data_dir`).
    limit: keep the first ``limit`` examples (None: all of them).
    image_size: ``S``, the side every image is resized to.
    tokenizer: captions to ids ``int [n, L]`` (e.g. a Hugging Face tokenizer with
      ``padding="max_length"``); without it no ``caption`` key is returned.
    captions_per_image: ``C``, the captions kept per image.
    indices: read only these examples, in this order, each below the split's size
      capped by ``limit`` (:func:`num_examples`); None: all of the first ``limit``.

  Returns:
    ``{key: array [n, ...]}`` with the keys the module docstring lists (``n =
    len(indices)`` when given).

  Raises:
    DatasetError: see :func:`data_source`; a ``limit`` or ``image_size`` < 1, no
      index or one out of range.
  """
  for key, value in (("limit", limit), ("image_size", image_size)):
    if value is not None and (not isinstance(value, int) or value < 1):
      raise DatasetError(f"{key} must be an int >= 1, got {value!r}.")
  if not isinstance(captions_per_image, int) or captions_per_image < 1:
    raise DatasetError(f"captions_per_image must be an int >= 1, got {captions_per_image!r}.")
  if name in NEEDS_TOKENIZER and tokenizer is None:
    raise DatasetError(f"{name} is text only: load it with a tokenizer.")
  source = data_source(name, split=split, data_dir=data_dir)
  num = len(source) if limit is None else min(limit, len(source))
  if num == 0:
    raise DatasetError(f"{name}: split {split!r} is empty.")
  order = np.arange(num) if indices is None else np.asarray(indices, dtype=np.int64).reshape(-1)
  if order.size == 0:
    raise DatasetError(f"{name}: no example to read (indices is empty).")
  if order.min() < 0 or order.max() >= num:
    raise DatasetError(
      f"{name}: indices must lie in [0, {num}) (split {split!r}, limit {limit}), "
      f"got {order.min()}..{order.max()}."
    )
  convert = READERS[name].convert
  rows = [convert(source[int(i)], image_size, tokenizer, captions_per_image) for i in order]
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def num_examples(
  name: str,
  *,
  split: str = "train",
  data_dir: str | os.PathLike | None = None,
  limit: int | None = None,
) -> int:
  """How many examples :func:`load` can read of ``name``'s ``split``: its size, capped by ``limit``.

  Opens the split (its metadata; nothing is decoded). Raises :class:`DatasetError`
  as :func:`data_source`.
  """
  size = len(data_source(name, split=split, data_dir=data_dir))
  return size if limit is None else min(limit, size)


def hf_tokenizer(checkpoint: str, max_len: int = 32) -> Tokenizer:
  """The tokenizer of an ``hf:`` checkpoint as a :data:`Tokenizer` (``[CLS] ... [SEP]``, PAD 0).

  The same call as :func:`fedjax_mm.core.text.retokenize` makes for the world's captions.
  """
  from fedjax_mm.models import hf  # jax and transformers, only when captions are tokenised

  tok = hf.tokenizer(checkpoint)

  def tokenize(texts: Sequence[str]) -> np.ndarray:
    out = tok(
      list(texts), padding="max_length", truncation=True, max_length=max_len, return_tensors="np"
    )
    return out["input_ids"].astype(np.int32)

  return tokenize


def shares(asked: Sequence[int], pool: int, where: str, limit: int | None) -> list[int]:
  """How many examples each of the sets cut from one pool gets: what it asked, or a share.

  When the pool is smaller than the sum asked, each set gets ``floor(asked * pool /
  sum)``; a set left with none raises :class:`DatasetError`.
  """
  total = sum(asked)
  if total <= pool:
    return list(asked)
  sizes = [n * pool // total for n in asked]
  if min(sizes) < 1:
    raise DatasetError(
      f"data: {where} has {pool} examples (data.limit={limit or 0}) for {len(asked)} sets "
      f"asking {total}: too few to give each one."
    )
  return sizes


def read_disjoint(
  wants: Mapping[tuple[str, str], Sequence[tuple[Hashable, int]]],
  *,
  seed: int,
  data_dir: str | None,
  limit: int | None,
  image_size: int,
  tokenizer: Callable[[str, str], Tokenizer | None] = lambda name, split: None,
) -> dict[Hashable, dict[str, np.ndarray]]:
  """Reads every ``(dataset, split)`` once and cuts it in disjoint, seeded slices.

  Args:
    wants: ``(dataset, split) -> [(who, size), ...]``: the sets each split gives,
      in the order they take their slices; ``who`` names a set (unique overall).
    seed: the run's seed (with the dataset and split, the permutation's key).
    data_dir: the TFDS data folder (None: TFDS's default).
    limit: read at most the first ``limit`` examples of each split (None: all).
    image_size: the side every image is resized to.
    tokenizer: ``(dataset, split) -> Tokenizer | None``, the tokenizer a read's
      captions go through (None: the read keeps no captions).

  Returns:
    ``{who: {key: array [n_who, ...]}}``; ``n_who`` is the size asked, or a share
    of a pool smaller than the sum asked (:func:`shares`).

  Raises:
    DatasetError: a pool too small to give every set an example, or a split that cannot be
      read (:func:`load`).
  """
  sets = {}
  for (name, split), asked in wants.items():
    pool = num_examples(name, split=split, data_dir=data_dir, limit=limit)
    sizes = shares([n for _, n in asked], pool, f"{name} {split!r}", limit)
    key = zlib.crc32(f"{name}/{split}".encode())
    order = np.random.default_rng([seed, key]).permutation(pool)
    bounds = np.cumsum([0, *sizes])
    # Each set's indices sorted: a set is unordered, and the files are read in order.
    indices = np.concatenate(
      [np.sort(order[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    )
    arrays = load(
      name,
      split=split,
      data_dir=data_dir,
      limit=limit,
      image_size=image_size,
      tokenizer=tokenizer(name, split),
      indices=indices,
    )
    for (who, _), a, b in zip(asked, bounds[:-1], bounds[1:], strict=True):
      sets[who] = take(arrays, np.arange(a, b))
  return sets


__all__ = [
  "DatasetError",
  "NUM_AG_NEWS_CLASSES",
  "NUM_CIFAR100_CLASSES",
  "NUM_CIFAR100_SUPERCLASSES",
  "NUM_COCO_CLASSES",
  "NUM_COCO_PANOPTIC_CLASSES",
  "NEEDS_TOKENIZER",
  "NUM_VOC_CLASSES",
  "READERS",
  "Reader",
  "Tokenizer",
  "VOID",
  "build_command",
  "data_source",
  "default_data_dir",
  "hf_tokenizer",
  "load",
  "multi_hot",
  "num_examples",
  "panoptic_ids",
  "panoptic_to_semantic",
  "prepared_folder",
  "read_disjoint",
  "resize_image",
  "resize_mask",
  "shares",
]
