"""Supervised tasks: what a client's inputs, targets, loss and metric are.

A :class:`Task` is a small static description (hashable, so it can be closed
over by jitted functions) that turns a batch of a client's local data (a dict of
arrays, see :mod:`fedjax_mm.data`) into model inputs, and model outputs into a
loss and the task's metric as the papers report it:

==================  =====================  ===========================  ===========
kind                outputs                loss                         metric
==================  =====================  ===========================  ===========
``classification``  logits ``[b, C]``      softmax cross-entropy        accuracy
``multilabel``      logits ``[b, C]``      sigmoid binary CE (mean/C)   micro-F1
``segmentation``    logits ``[b,H,W,C]``   per-pixel softmax CE         mIoU
==================  =====================  ===========================  ===========

Text tasks are classification tasks whose input is a caption key: the data holds
several captions per sample ``[n, C, L]``; training picks one at random per
sample and step, evaluation uses the first. ``caption`` holds them as the world's
token ids; ``caption:<space>`` holds the same captions in another token space (an
``hf:`` checkpoint's ids, :mod:`fedjax_mm.core.text`), so users of different
tokenizers read one data dict (the public set) each through its own key.

Segmentation masks may hold pixels of no class (COCO panoptic's unlabelled
pixels, :data:`fedjax_mm.data.tfds.VOID` = 255): a pixel whose label lies outside
``[0, num_outputs)`` is ignored by the loss (each example's mean runs over its
labelled pixels), by mIoU (:func:`fedjax_mm.metrics.confusion_matrix`) and by the
trivial baseline's class counts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedjax_mm import metrics

Array = jax.Array

KINDS = ("classification", "multilabel", "segmentation")
METRIC_NAMES = {"classification": "accuracy", "multilabel": "micro_f1", "segmentation": "mIoU"}


#: The data key of captions as the world's token ids.
CAPTION_KEY = "caption"
#: An optional data key: per-example loss weights (``[n]``; multi-label ``[n, C]``), read
#: by :func:`fedjax_mm.core.client.supervised_objective` (CoFED's class-balanced loss).
SAMPLE_WEIGHT_KEY = "sample_weight"


def is_caption_key(key: str) -> bool:
  """Whether a data key holds captions: ``caption`` or ``caption:<token space>``."""
  return key == CAPTION_KEY or key.startswith(CAPTION_KEY + ":")


def masked_mean(values: Array, mask: Array) -> Array:
  """Mean of ``values [b]`` over ``mask [b]``; 0 when nothing is valid."""
  mask = mask.astype(values.dtype)
  return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


@dataclasses.dataclass(frozen=True)
class Task:
  """A supervised task on one client's data.

  Attributes:
    kind: one of :data:`KINDS`.
    input_key: data key of the model input, ``"image"`` or a caption key
      (``"caption"``, ``"caption:<token space>"``: :func:`is_caption_key`).
    target_key: data key of the target, e.g. ``"label10"``, ``"multilabel"``,
      ``"mask"``, ``"caption_label"``.
    num_outputs: number of classes (labels for multi-label).
    background: segmentation only: the class that marks the absence of an object
      (the world's ``0``), or None where every class is an object (COCO panoptic,
      whose ``0`` is person). Label-set methods (FedRCL's positives) leave it out.
  """

  kind: str
  input_key: str
  target_key: str
  num_outputs: int
  background: int | None = None

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"unknown task kind {self.kind!r}; expected one of {KINDS}.")
    if self.num_outputs < 1:
      raise ValueError(f"num_outputs must be positive, got {self.num_outputs}.")
    if self.background is not None and (
      self.kind != "segmentation" or not 0 <= self.background < self.num_outputs
    ):
      raise ValueError(
        f"background {self.background} needs a segmentation task with it among its "
        f"{self.num_outputs} classes (task kind {self.kind!r})."
      )

  @property
  def modality(self) -> str:
    return "text" if is_caption_key(self.input_key) else "image"

  @property
  def metric_name(self) -> str:
    return METRIC_NAMES[self.kind]

  def inputs(self, batch: dict[str, Array], key: Array | None = None) -> Array:
    """Model inputs of a batch; one random caption per sample when ``key``."""
    x = batch[self.input_key]
    if is_caption_key(self.input_key) and x.ndim == 3:  # [b, C, L]: several captions.
      if key is None:
        return x[:, 0]
      choice = jax.random.randint(key, (x.shape[0],), 0, x.shape[1])
      return jnp.take_along_axis(x, choice[:, None, None], axis=1)[:, 0]
    return x

  def per_example_loss(self, outputs: Array, targets: Array, weights: Array | None = None) -> Array:
    """Loss of each example ``[b]``; segmentation: the mean over its labelled pixels (0 if none).

    ``weights`` (optional) scales each example's loss (``[b]``), or for multi-label
    each label's term before the mean over labels (``[b, C]``); none for segmentation.
    """
    if weights is not None and self.kind == "segmentation":
      raise ValueError("sample weights are not defined for segmentation.")
    if self.kind == "classification":
      loss = optax.softmax_cross_entropy_with_integer_labels(outputs, targets)
      return loss if weights is None else loss * weights
    if self.kind == "multilabel":
      terms = optax.sigmoid_binary_cross_entropy(outputs, targets.astype(outputs.dtype))
      return (terms if weights is None else terms * weights).mean(-1)
    # Pixels labelled outside [0, C) (void) are ignored: optax would give NaN there.
    labelled = (targets >= 0) & (targets < self.num_outputs)
    safe = jnp.where(labelled, targets, 0)
    per_pixel = optax.softmax_cross_entropy_with_integer_labels(outputs, safe)
    per_pixel = jnp.where(labelled, per_pixel, 0).reshape(per_pixel.shape[0], -1)
    count = labelled.reshape(labelled.shape[0], -1).sum(-1)
    return per_pixel.sum(-1) / jnp.maximum(count, 1).astype(per_pixel.dtype)

  def loss(
    self, outputs: Array, targets: Array, mask: Array, weights: Array | None = None
  ) -> Array:
    """Mean loss over the valid examples of a batch (``mask [b]``); ``weights`` as
    :meth:`per_example_loss` (the mean still divides by the number of examples)."""
    return masked_mean(self.per_example_loss(outputs, targets, weights), mask)

  def metric(self, outputs: Array, targets: Array, mask: Array) -> Array:
    """The task's reported metric over the valid examples (a fraction)."""
    if self.kind == "classification":
      return metrics.accuracy(outputs, targets, where=mask)
    if self.kind == "multilabel":
      return metrics.micro_f1(outputs, targets, where=mask)
    return metrics.mean_iou(outputs, targets, num_classes=self.num_outputs, where=mask)

  def trivial_metric(self, train_targets: Array, test_targets: Array) -> Array:
    """The metric of a predictor that never looks at the input (a fraction).

    The floor a reader needs beside every score, to tell learning from chance:

    * ``classification``: the training set's majority class, always;
    * ``multilabel``: every label present, always (a model that predicts no
      label scores micro-F1 = 0, below this);
    * ``segmentation``: the training set's most frequent pixel class everywhere
      (void pixels, outside ``[0, num_outputs)``, neither counted nor scored).

    Args:
      train_targets: targets of the training set (labels ``[n]``, multi-hot
        ``[n, C]`` or masks ``[n, H, W]``).
      test_targets: targets of the set scored.
    """
    train_targets, test_targets = jnp.asarray(train_targets), jnp.asarray(test_targets)
    mask = jnp.ones(test_targets.shape[0], bool)
    if self.kind == "multilabel":
      return self.metric(jnp.ones(test_targets.shape, jnp.float32), test_targets, mask)
    flat = train_targets.reshape(-1)
    labelled = (flat >= 0) & (flat < self.num_outputs)  # void pixels are no class
    counts = jnp.bincount(
      jnp.where(labelled, flat, 0), labelled.astype(jnp.int32), length=self.num_outputs
    )
    outputs = jax.nn.one_hot(jnp.full(test_targets.shape, jnp.argmax(counts)), self.num_outputs)
    return self.metric(outputs, test_targets, mask)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)
