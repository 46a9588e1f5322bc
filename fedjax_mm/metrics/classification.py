"""Classification metrics: accuracy (single-label) and micro-F1 (multi-label).

Each function reduces one client's evaluation set to a scalar. The set may be
padded to a fixed size: a boolean ``where`` mask marks the valid rows, and
padded rows never change the result, so the engine evaluates ``K`` clients at
once with ``jax.vmap`` over a leading client axis. Only ``jax`` is imported;
everything is safe under ``jit`` and ``vmap``.

References:
  - FedMuscle paper, Section 6 ("Performance Metrics"): accuracy for the image
    and text classification tasks, micro-F1 for multi-label classification.
  - [Wu & Zhou, 2017] A Unified View of Multi-Label Performance Measures (ICML).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _row_mask(where: Array | None, shape: tuple[int, ...]) -> Array:
  """``where`` as a boolean array of ``shape`` (all True when None)."""
  if where is None:
    return jnp.ones(shape, dtype=bool)
  where = jnp.asarray(where)
  if where.shape != shape:
    raise ValueError(f"where must have shape {shape}, got {where.shape}.")
  return where.astype(bool)


def _safe_ratio(numerator: Array, denominator: Array) -> Array:
  """``numerator / denominator`` as a float, and 0 where the denominator is 0."""
  numerator = jnp.asarray(numerator, dtype=jnp.result_type(float))
  denominator = jnp.asarray(denominator, dtype=numerator.dtype)
  positive = denominator > 0
  return jnp.where(positive, numerator / jnp.where(positive, denominator, 1), 0)


def accuracy(logits: Array, labels: Array, *, where: Array | None = None) -> Array:
  r"""Fraction of valid examples whose arg-max class equals the label.

  .. math::
    \mathrm{acc} = \frac{\sum_i w_i \, [\arg\max_c z_{ic} = y_i]}{\sum_i w_i}

  with ``w_i = where[i]``. Ties in the logits go to the lowest class index
  (``jnp.argmax``). With no valid example (``sum(where) == 0``, e.g. a padding
  client) the accuracy is defined as ``0``, never NaN.

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import metrics
    >>> logits = jnp.array([[2.0, 1.0], [0.0, 3.0], [1.0, 0.0]])
    >>> print(f"{metrics.accuracy(logits, jnp.array([0, 0, 0])):.4f}")
    0.6667
    >>> print(metrics.accuracy(logits, jnp.array([0, 0, 0]), where=jnp.array([1, 0, 1]) > 0))
    1.0

  Args:
    logits: ``[n, C]`` scores (logits, log-probabilities or probabilities; only
      the arg-max is used).
    labels: ``[n]`` integer class labels in ``[0, C)``.
    where: optional ``[n]`` boolean mask of valid examples (padding is False).

  Returns:
    Scalar float in ``[0, 1]`` (reports multiply by 100).
  """
  logits = jnp.asarray(logits)
  labels = jnp.asarray(labels)
  if logits.shape[:-1] != labels.shape:
    raise ValueError(f"logits {logits.shape} must be labels {labels.shape} plus a class axis.")
  valid = _row_mask(where, labels.shape)
  correct = (jnp.argmax(logits, axis=-1) == labels) & valid
  return _safe_ratio(jnp.sum(correct), jnp.sum(valid))


def micro_f1(
  logits: Array,
  targets: Array,
  *,
  threshold: float | Array = 0.0,
  where: Array | None = None,
) -> Array:
  r"""Micro-averaged F1 of multi-label predictions over all (row, label) entries.

  Entry ``(i, l)`` is predicted positive when ``logits[i, l] > threshold``; the
  default threshold ``0`` on logits is ``sigmoid(logits) > 0.5``. Counting over
  every label of every valid row,

  .. math::
    \mathrm{TP} = \sum_{i,l} w_i \hat y_{il} y_{il}, \quad
    \mathrm{FP} = \sum_{i,l} w_i \hat y_{il} (1 - y_{il}), \quad
    \mathrm{FN} = \sum_{i,l} w_i (1 - \hat y_{il}) y_{il},

  .. math::
    F_1^{\mathrm{micro}} = \frac{2\,\mathrm{TP}}{2\,\mathrm{TP} + \mathrm{FP} + \mathrm{FN}},

  which equals ``sklearn.metrics.f1_score(targets, predictions,
  average="micro")`` on the valid rows. When the denominator is 0 (no positive
  target and no positive prediction, or no valid row) the score is ``0``, as
  with scikit-learn's ``zero_division=0``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import metrics
    >>> logits = jnp.array([[3.0, -1.0, 2.0], [-2.0, 1.0, -1.0]])
    >>> targets = jnp.array([[1, 0, 0], [0, 1, 1]])
    >>> print(f"{metrics.micro_f1(logits, targets):.4f}")  # TP=2, FP=1, FN=1
    0.6667

  Args:
    logits: ``[n, L]`` per-label scores (logits for the default threshold).
    targets: ``[n, L]`` binary targets in ``{0, 1}`` (any nonzero is positive).
    threshold: keyword-only decision threshold on ``logits`` (strict ``>``);
      pass e.g. ``0.5`` when ``logits`` holds probabilities.
    where: optional ``[n]`` boolean mask of valid rows (padding is False).

  Returns:
    Scalar float in ``[0, 1]`` (reports multiply by 100).
  """
  logits = jnp.asarray(logits)
  targets = jnp.asarray(targets)
  if logits.shape != targets.shape or logits.ndim < 1:
    raise ValueError(f"logits {logits.shape} and targets {targets.shape} must match.")
  valid = _row_mask(where, logits.shape[:-1])[..., None]
  predicted = logits > threshold
  positive = targets.astype(bool)
  tp = jnp.sum(predicted & positive & valid)
  fp = jnp.sum(predicted & ~positive & valid)
  fn = jnp.sum(~predicted & positive & valid)
  return _safe_ratio(2 * tp, 2 * tp + fp + fn)
