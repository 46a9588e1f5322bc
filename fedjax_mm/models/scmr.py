"""The local cross-modal retrieval model of DSCMR / FedSCMR (Flax NNX).

FedSCMR (Li, Li and Shao, 2024), Section 4.1 and Figure 1, on DSCMR's network
(Zhen et al., 2019). Inputs are fixed feature vectors of an image-text pair
(``v [d_img]``, ``t [d_txt]``); the model is a pure function of its
``nnx.Param`` variables (no batch statistics, no dropout), so a client group is
``nnx.split`` once and stacked ``[K, ...]`` by the engine.

::

  v ──image BaseNet: relu(Linear d_img→h)──┐
                                           ├─► common: Linear h→d ─► S  ─► classifier: Linear d→c ─► p
  t ──text  BaseNet: relu(Linear d_txt→h)──┘                         │
                                          S_V ─► image EnhanceNet (d→d→d, ReLU) ─► S'_V
                                          S_T ─► text  EnhanceNet (d→d→d, ReLU) ─► S'_T

* ``image_base`` / ``text_base``: modality-specific hidden layers.
* ``common``: ONE linear layer shared by both modalities that maps them into
  the common subspace ``S`` (DSCMR's ``linearLayer``). This is the
  "common-subspace linear layer" the server aggregates (FedSCMR eq. 9,
  FedCMR): :data:`COMMON` names it for the path-selected aggregation.
* ``classifier``: the linear label classifier on ``S``, shared by both
  modalities (DSCMR's ``linearLayer2``), whose raw outputs enter ``L_imd``.
* ``image_enhance`` / ``text_enhance``: the EnhanceNets ``S -> S'``.

Retrieval compares ``S`` features by cosine similarity (:meth:`ScmrModel.embed`).
"""

from __future__ import annotations

import jax
from flax import nnx

__all__ = ["COMMON", "EnhanceNet", "ScmrModel"]

#: Name of the common-subspace layer, the only part of the model that is federated.
COMMON = "common"


class EnhanceNet(nnx.Module):
  """``S -> S'``: two dense layers with a ReLU between, ``d -> d -> d``."""

  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(dim, dim, rngs=rngs)
    self.fc2 = nnx.Linear(dim, dim, rngs=rngs)

  def __call__(self, s: jax.Array) -> jax.Array:
    return self.fc2(jax.nn.relu(self.fc1(s)))


class ScmrModel(nnx.Module):
  """Image and text BaseNets into ``S``, a label classifier, EnhanceNets into ``S'``.

  Args:
    image_dim: ``d_img`` of the image features.
    text_dim: ``d_txt`` of the text features.
    num_classes: ``c``.
    hidden: width ``h`` of the modality-specific BaseNet layers.
    dim: ``d``, the dimension of ``S`` and ``S'``.
    rngs: random streams.
  """

  def __init__(
    self,
    image_dim: int,
    text_dim: int,
    num_classes: int,
    *,
    hidden: int = 256,
    dim: int = 64,
    rngs: nnx.Rngs,
  ):
    self.image_base = nnx.Linear(image_dim, hidden, rngs=rngs)
    self.text_base = nnx.Linear(text_dim, hidden, rngs=rngs)
    self.common = nnx.Linear(hidden, dim, rngs=rngs)
    self.classifier = nnx.Linear(dim, num_classes, rngs=rngs)
    self.image_enhance = EnhanceNet(dim, rngs=rngs)
    self.text_enhance = EnhanceNet(dim, rngs=rngs)

  def embed(self, image: jax.Array, text: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``([b, d_img], [b, d_txt]) -> (S_V [b, d], S_T [b, d])``; either may have its own ``b``."""
    return (
      self.common(jax.nn.relu(self.image_base(image))),
      self.common(jax.nn.relu(self.text_base(text))),
    )

  def __call__(self, image: jax.Array, text: jax.Array) -> dict[str, jax.Array]:
    """Every output the losses read, for a batch of ``b`` pairs.

    Returns:
      ``s_img, s_txt`` ``[b, d]`` (``S``), ``e_img, e_txt`` ``[b, d]`` (``S'``),
      ``p_img, p_txt`` ``[b, c]`` (label predictions from ``S``).
    """
    s_img, s_txt = self.embed(image, text)
    return {
      "s_img": s_img,
      "s_txt": s_txt,
      "e_img": self.image_enhance(s_img),
      "e_txt": self.text_enhance(s_txt),
      "p_img": self.classifier(s_img),
      "p_txt": self.classifier(s_txt),
    }
