"""scikit-learn's 8x8 handwritten digits, in the world's dict interface.

The 1,797 digit images ship inside scikit-learn (UCI ML hand-written digits,
no download), which makes them the one *real* image dataset every machine with
the test extra has. They feed the same partitioners and trainers as
`fedjax_mm.data.world` (keys ``image`` and ``label10``).

Requires scikit-learn (the ``test`` extra); it is imported only when
`load_digits` is called, so importing ``fedjax_mm.data`` does not need it.
"""

from __future__ import annotations

import numpy as np

NUM_DIGIT_CLASSES = 10
_MAX_PIXEL = 16.0  # the raw pixels are integers in [0, 16]


def load_digits(*, seed: int = 0) -> dict[str, np.ndarray]:
  """Loads the digits, shuffled deterministically by ``seed``.

  Args:
    seed: integer seed of the permutation of the samples.

  Returns:
    ``{"image": float32 [1797, 8, 8, 1] in [0, 1], "label10": int32 [1797]}``.
  """
  from sklearn import datasets  # noqa: PLC0415 (imported here: a second to import)

  raw = datasets.load_digits()
  images = (raw.images / _MAX_PIXEL).astype(np.float32)[..., None]
  labels = raw.target.astype(np.int32)
  perm = np.random.default_rng(seed).permutation(labels.shape[0])
  return {"image": images[perm], "label10": labels[perm]}
