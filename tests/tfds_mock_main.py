"""``python -m tests.tfds_mock_main FLAGS``: ``experiments.main`` with TFDS answered by mock data.

For the end-to-end tests of runs that read TFDS (nothing is downloaded or prepared):
every builder's splits come from :func:`tfds.testing.mock_data` (random examples
from each feature spec, ``$MOCK_TFDS_EXAMPLES`` per split, default 24), except
``coco_captions``, whose builder imports TensorFlow, so mock_data cannot make it:
its splits are :func:`coco_captions` examples, made here. The flags are
``experiments.main``'s, unchanged.
"""

import os
import runpy

import numpy as np


def coco_captions(num: int, seed: int = 0) -> list[dict]:
  """``num`` coco_captions/2014 examples as ``data_source`` decodes them (what the reader reads).

  Each has a random image, one to three object classes and two captions, the first
  naming the example (so tests can tell examples apart by their captions).
  """
  rng = np.random.default_rng(seed)
  return [
    {
      "image": rng.integers(0, 256, (24, 20, 3), dtype=np.uint8),
      "objects": {"label": rng.integers(0, 80, rng.integers(1, 4))},
      "captions": {
        "text": np.array([f"a red circle number {i}".encode(), b"a blue square"], object)
      },
    }
    for i in range(num)
  ]


def main() -> None:
  import tensorflow_datasets as tfds

  from fedjax_mm.data import tfds as tfds_data

  num = int(os.environ.get("MOCK_TFDS_EXAMPLES", "24"))
  coco = coco_captions(num)
  real = tfds_data.data_source

  def data_source(name, **kwargs):
    return coco if name == "coco_captions" else real(name, **kwargs)

  tfds_data.data_source = data_source
  with tfds.testing.mock_data(num_examples=num, policy=tfds.testing.MockPolicy.USE_CODE):
    runpy.run_module("experiments.main", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
  main()
