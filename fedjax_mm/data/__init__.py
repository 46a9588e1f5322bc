"""Data: the procedurally generated multimodal world, digits, client splits.

Every dataset is a dict of numpy arrays sharing a leading sample axis::

  from fedjax_mm import data
  private = data.generate(seed=0, num=2000)
  public = data.generate(seed=1, num=500, shift=data.PUBLIC_SHIFT)
  parts = data.dirichlet_partition(private["label10"], 8, alpha=0.1, seed=0,
                                   samples_per_client=100)
  clients = data.split_clients(private, parts)
  clients[0] = data.drop_modality(clients[0], "text")  # an image-only client
  stacked, mask = data.stack_clients(clients)           # [K, n_max, ...]

See `fedjax_mm.data.world` for the world and the exact label definitions,
`fedjax_mm.data.vqa` for question-answer pairs about its scenes
(``data.vqa.questions(scene, seed)``), and
`fedjax_mm.data.tfds` (imported on its own: it needs tensorflow-datasets) for the
papers' datasets (CIFAR-100, VOC, COCO captions) in the same interface.
"""

from fedjax_mm.data import vqa
from fedjax_mm.data.digits import load_digits
from fedjax_mm.data.partition import (
  IMAGE_KEYS,
  TEXT_KEYS,
  dirichlet_partition,
  drop_modality,
  iid_partition,
  modalities,
  pad_clients,
  split_clients,
  stack_clients,
  take,
)
from fedjax_mm.data.world import (
  CLS_ID,
  COLOR_NAMES,
  NUM_COLORS,
  NUM_SEG_CLASSES,
  NUM_SHAPES,
  NUM_SIZES,
  PAD_ID,
  PUBLIC_SHIFT,
  REGION_NAMES,
  SHAPE_NAMES,
  SIZE_NAMES,
  TEXTURE_NAMES,
  VOCAB,
  VOCAB_SIZE,
  WORD_TO_ID,
  WorldConfig,
  decode,
  encode,
  generate,
  rasterize,
  word_to_id,
)

__all__ = [
  "CLS_ID",
  "COLOR_NAMES",
  "IMAGE_KEYS",
  "NUM_COLORS",
  "NUM_SEG_CLASSES",
  "NUM_SHAPES",
  "NUM_SIZES",
  "PAD_ID",
  "PUBLIC_SHIFT",
  "REGION_NAMES",
  "SHAPE_NAMES",
  "SIZE_NAMES",
  "TEXTURE_NAMES",
  "TEXT_KEYS",
  "VOCAB",
  "VOCAB_SIZE",
  "WORD_TO_ID",
  "WorldConfig",
  "decode",
  "dirichlet_partition",
  "drop_modality",
  "encode",
  "generate",
  "iid_partition",
  "load_digits",
  "modalities",
  "pad_clients",
  "rasterize",
  "split_clients",
  "stack_clients",
  "take",
  "vqa",
  "word_to_id",
]
