"""Semantic-segmentation metrics: the pixel confusion matrix, mean IoU and binary Dice.

mIoU is a dataset-level metric: the counts are accumulated over every valid
pixel of the whole evaluation set before any ratio is taken (Pascal VOC
protocol), so it is not a mean of per-image IoUs. To evaluate a set too large
for one call, sum :func:`confusion_matrix` over batches and finish with
:func:`mean_iou_from_confusion_matrix`; the result equals one call of
:func:`mean_iou` on the whole set.

Only ``jax`` is imported; everything is safe under ``jit`` and ``vmap`` (a
padded client set carries a boolean ``where`` mask over its samples).

Binary Dice (:func:`dice`) is dataset-level in the same way: one ratio of the
foreground counts summed over every valid pixel of the set.

References:
  - FedMuscle paper, Section 6 ("Performance Metrics"): mIoU for the semantic
    segmentation task.
  - FedRGB paper, Sec. 5 / App. C.2: the Dice score of RSNA segmentation.
  - [Everingham et al., 2010] The Pascal Visual Object Classes (VOC) Challenge.
    IJCV 88(2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _pixel_mask(where: Array | None, labels: Array) -> Array:
  """A ``where`` over the leading axes of ``labels`` broadcast to its shape."""
  if where is None:
    return jnp.ones(labels.shape, dtype=bool)
  where = jnp.asarray(where).astype(bool)
  if where.shape != labels.shape[: where.ndim]:
    raise ValueError(f"where {where.shape} must match the leading axes of labels {labels.shape}.")
  where = where.reshape(where.shape + (1,) * (labels.ndim - where.ndim))
  return jnp.broadcast_to(where, labels.shape)


def _to_predictions(predictions: Array, labels: Array) -> Array:
  """Integer predictions; scores with one extra trailing axis are arg-maxed."""
  predictions = jnp.asarray(predictions)
  if predictions.ndim == labels.ndim + 1 and predictions.shape[:-1] == labels.shape:
    return jnp.argmax(predictions, axis=-1)
  if predictions.shape == labels.shape:
    return predictions.astype(jnp.int32)
  raise ValueError(
    f"predictions {predictions.shape} must have the shape of labels {labels.shape},"
    " or that shape plus a trailing class axis of scores."
  )


def confusion_matrix(
  predictions: Array,
  labels: Array,
  *,
  num_classes: int,
  where: Array | None = None,
  ignore_index: int | None = None,
) -> Array:
  r"""Confusion matrix of per-pixel (or per-example) class predictions.

  ``cm[t, p]`` counts the valid entries with true class ``t`` predicted as
  class ``p`` (rows are true classes, as in ``sklearn.metrics.confusion_matrix``
  with ``labels=range(num_classes)``). An entry is counted only if

  * its sample is valid (``where``),
  * ``labels != ignore_index`` (when given), and
  * both label and prediction lie in ``[0, num_classes)``; in particular the
    Pascal VOC "void" label 255 is never counted even without
    ``ignore_index``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import metrics
    >>> labels = jnp.array([[0, 0, 1, 255]])
    >>> predictions = jnp.array([[0, 1, 1, 0]])
    >>> metrics.confusion_matrix(predictions, labels, num_classes=2)
    Array([[1, 1],
           [0, 1]], dtype=int32)

  Args:
    predictions: ``[n, H, W]`` integer predicted classes, or ``[n, H, W, C]``
      scores (logits or probabilities) that are arg-maxed over the last axis.
      Any shape ``S`` (resp. ``S + [C]``) matching ``labels`` works.
    labels: ``[n, H, W]`` integer true classes.
    num_classes: keyword-only number of classes ``C`` (static).
    where: optional boolean mask over the leading axes of ``labels``: ``[n]``
      marks valid samples (padding is False); ``[n, H, W]`` marks valid pixels.
    ignore_index: optional label value whose entries are not counted.

  Returns:
    ``[C, C]`` int32 counts (exact up to ``2**31 - 1`` entries).
  """
  labels = jnp.asarray(labels)
  predictions = _to_predictions(predictions, labels)
  labels = labels.astype(jnp.int32)
  valid = _pixel_mask(where, labels)
  valid &= (labels >= 0) & (labels < num_classes)
  valid &= (predictions >= 0) & (predictions < num_classes)
  if ignore_index is not None:
    valid &= labels != ignore_index
  # A scatter-add over C * C bins keeps memory O(pixels), unlike one-hot
  # products which would be O(pixels * C).
  index = jnp.where(valid, labels * num_classes + predictions, 0)
  counts = jnp.zeros(num_classes * num_classes, jnp.int32)
  counts = counts.at[index.ravel()].add(valid.ravel().astype(jnp.int32))
  return counts.reshape(num_classes, num_classes)


def mean_iou_from_confusion_matrix(cm: Array) -> Array:
  r"""Mean IoU over the classes present in a confusion matrix.

  Per class ``c``, with ``TP = cm[c, c]``, ``FP = sum_t cm[t, c] - TP`` and
  ``FN = sum_p cm[c, p] - TP``,

  .. math::
    \mathrm{IoU}_c = \frac{\mathrm{TP}_c}{\mathrm{TP}_c + \mathrm{FP}_c + \mathrm{FN}_c},
    \qquad
    \mathrm{mIoU} = \frac{1}{|P|} \sum_{c \in P} \mathrm{IoU}_c,

  where ``P`` is the set of classes whose union ``TP + FP + FN`` is positive
  (a class neither present nor predicted is left out, not scored 0 or 1).
  With ``P`` empty the mIoU is ``0``.

  Args:
    cm: ``[C, C]`` confusion matrix (rows true, columns predicted), e.g. a sum
      of :func:`confusion_matrix` over batches.

  Returns:
    Scalar float in ``[0, 1]`` (reports multiply by 100).
  """
  cm = jnp.asarray(cm)
  dtype = jnp.result_type(float)
  tp = jnp.diagonal(cm).astype(dtype)
  union = (jnp.sum(cm, axis=0) + jnp.sum(cm, axis=1)).astype(dtype) - tp
  present = union > 0
  iou = tp / jnp.where(present, union, 1)
  count = jnp.sum(present)
  return jnp.where(count > 0, jnp.sum(jnp.where(present, iou, 0)) / jnp.maximum(count, 1), 0)


def mean_iou(
  predictions: Array,
  labels: Array,
  *,
  num_classes: int,
  where: Array | None = None,
  ignore_index: int | None = None,
) -> Array:
  r"""Dataset-level mean intersection-over-union (mIoU).

  :func:`confusion_matrix` accumulated over every valid pixel of the set, then
  :func:`mean_iou_from_confusion_matrix`: per-class
  ``IoU_c = TP_c / (TP_c + FP_c + FN_c)``, averaged over the classes with a
  positive union. This equals ``sklearn.metrics.jaccard_score(y_true, y_pred,
  average="macro", labels=<classes with a positive union>)`` on the flattened
  valid pixels.

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import metrics
    >>> labels = jnp.array([[0, 0, 1, 1]])
    >>> predictions = jnp.array([[0, 1, 1, 1]])
    >>> miou = metrics.mean_iou(predictions, labels, num_classes=3)  # class 2 absent
    >>> print(f"{miou:.4f}")  # (1/2 + 2/3) / 2
    0.5833

  Args:
    predictions: ``[n, H, W]`` integer predicted classes, or ``[n, H, W, C]``
      scores that are arg-maxed over the last axis.
    labels: ``[n, H, W]`` integer true classes; entries outside
      ``[0, num_classes)`` (e.g. 255) are not counted.
    num_classes: keyword-only number of classes ``C`` (static).
    where: optional ``[n]`` boolean mask of valid samples (padding is False),
      or an ``[n, H, W]`` pixel mask.
    ignore_index: optional label value whose pixels are not counted.

  Returns:
    Scalar float in ``[0, 1]`` (reports multiply by 100).
  """
  cm = confusion_matrix(
    predictions, labels, num_classes=num_classes, where=where, ignore_index=ignore_index
  )
  return mean_iou_from_confusion_matrix(cm)


def dice(predictions: Array, labels: Array, *, where: Array | None = None) -> Array:
  r"""Dataset-level binary Dice score of foreground masks.

  .. math:: \mathrm{Dice} = \frac{2\,|P \cap G|}{|P| + |G|}

  with ``P`` the predicted and ``G`` the true foreground pixels, counted over every
  valid pixel of the whole set (not a mean of per-image scores, so images without
  foreground count through their false positives). This equals
  ``sklearn.metrics.f1_score(y_true, y_pred)`` on the flattened valid pixels; an empty
  ``P`` and ``G`` give 1 (nothing to find, nothing predicted), as the all-background
  limit of the ratio with equal smoothing.

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import metrics
    >>> labels = jnp.array([[0, 1, 1, 0]])
    >>> predictions = jnp.array([[1, 1, 0, 0]])
    >>> print(f"{metrics.dice(predictions, labels):.4f}")  # 2 * 1 / (2 + 2)
    0.5000

  Args:
    predictions: ``[n, H, W]`` booleans or ``{0, 1}`` predicted foreground.
    labels: ``[n, H, W]`` booleans or ``{0, 1}`` true foreground.
    where: optional ``[n]`` boolean mask of valid samples, or an ``[n, H, W]`` pixel mask.

  Returns:
    Scalar float in ``[0, 1]``.
  """
  predictions, labels = jnp.asarray(predictions), jnp.asarray(labels)
  if predictions.shape != labels.shape:
    raise ValueError(f"predictions {predictions.shape} and labels {labels.shape} must match.")
  valid = _pixel_mask(where, labels)
  p = (predictions != 0) & valid
  g = (labels != 0) & valid
  both = jnp.sum(p & g, dtype=jnp.float32)
  total = jnp.sum(p, dtype=jnp.float32) + jnp.sum(g, dtype=jnp.float32)
  return jnp.where(total > 0, 2.0 * both / jnp.maximum(total, 1.0), 1.0)
