"""Linear probes on frozen features: how much a pretrained encoder already knows.

The standard test of a representation (CLIP, SimCLR): freeze the encoder,
extract features, and fit a linear classifier on a small labelled set. Here
the classifier is multinomial logistic regression (single-label) or one
logistic regression per label (multi-label), fitted full-batch with Adam on
standardised features, with an L2 penalty ``l2 * ||W||^2 / 2``. Standardising
uses the training set's mean and standard deviation only.

Both fits are deterministic (zero initialisation, full batch) and jittable.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_mm import data, metrics

__all__ = [
  "WORLD_PROBES",
  "fit_linear_probe",
  "linear_probe_logits",
  "linear_probe_score",
  "probe_scores",
  "trivial_scores",
]

#: What a representation of the world's scenes is probed for: name -> (the scenes' key, the
#: number of classes or labels, multi-label). Shape is the primary object's (10), colour
#: its colour (10), multilabel the set of shapes present (micro-F1).
WORLD_PROBES = {
  "shape": ("label10", data.NUM_SHAPES, False),
  "colour": ("caption_label", data.NUM_COLORS, False),
  "multilabel": ("multilabel", data.NUM_SHAPES, True),
}


@functools.partial(jax.jit, static_argnames=("num_outputs", "multilabel", "steps"))
def fit_linear_probe(
  features: jax.Array,
  targets: jax.Array,
  *,
  num_outputs: int,
  multilabel: bool = False,
  steps: int = 500,
  learning_rate: float = 0.05,
  l2: float = 1e-3,
):
  """Fits a linear classifier on ``features [n, h]``.

  Args:
    features: ``[n, h]`` frozen features.
    targets: ``int [n]`` labels, or ``float [n, C]`` multi-hot when ``multilabel``.
    num_outputs: number of classes / labels ``C``.
    multilabel: sigmoid cross-entropy per label instead of softmax.
    steps: full-batch Adam steps.
    learning_rate: Adam's step size.
    l2: weight of ``||W||^2 / 2`` (the bias is not penalised).

  Returns:
    ``(mean [h], std [h], W [h, C], b [C])``; predict with
    :func:`linear_probe_logits`.
  """
  mean = features.mean(0)
  std = features.std(0) + 1e-6
  x = (features - mean) / std
  params = (jnp.zeros((x.shape[1], num_outputs)), jnp.zeros((num_outputs,)))

  def loss_fn(p):
    logits = x @ p[0] + p[1]
    if multilabel:
      data = optax.sigmoid_binary_cross_entropy(logits, targets).sum(-1)
    else:
      data = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return data.mean() + 0.5 * l2 * jnp.sum(p[0] ** 2)

  tx = optax.adam(learning_rate)

  def step(carry, _):
    p, s = carry
    grads = jax.grad(loss_fn)(p)
    updates, s = tx.update(grads, s, p)
    return (optax.apply_updates(p, updates), s), None

  (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), None, length=steps)
  return mean, std, params[0], params[1]


def linear_probe_logits(probe, features: jax.Array) -> jax.Array:
  """``[n, C]`` logits of a fitted probe on ``features [n, h]``."""
  mean, std, w, b = probe
  return ((features - mean) / std) @ w + b


def linear_probe_score(
  train_features: jax.Array,
  train_targets: jax.Array,
  test_features: jax.Array,
  test_targets: jax.Array,
  *,
  num_outputs: int,
  multilabel: bool = False,
  **fit_kwargs,
) -> float:
  """Fits on the training features; returns test accuracy (or micro-F1, multi-label)."""
  probe = fit_linear_probe(
    train_features, train_targets, num_outputs=num_outputs, multilabel=multilabel, **fit_kwargs
  )
  logits = linear_probe_logits(probe, test_features)
  if multilabel:
    return float(metrics.micro_f1(logits, test_targets))
  return float(metrics.accuracy(logits, test_targets))


def probe_scores(train_features, test_features, train_set, test_set, names) -> dict[str, float]:
  """Test accuracy (micro-F1 for a multi-label target) in % of a linear probe per target.

  Args:
    train_features, test_features: ``[n, h]`` features of the two sets' scenes.
    train_set, test_set: the scenes (:func:`fedjax_mm.data.generate`), holding the targets.
    names: targets of :data:`WORLD_PROBES` to probe.
  """
  out = {}
  for name in names:
    key, outputs, multilabel = WORLD_PROBES[name]
    out[name] = 100 * linear_probe_score(
      train_features,
      jnp.asarray(train_set[key]),
      test_features,
      jnp.asarray(test_set[key]),
      num_outputs=outputs,
      multilabel=multilabel,
    )
  return out


def trivial_scores(train_set, test_set, names) -> dict[str, float]:
  """What each probe of :func:`probe_scores` scores without looking at the scene (in %):
  the training set's majority class, or every label present (multi-label)."""
  out = {}
  for name in names:
    key, outputs, multilabel = WORLD_PROBES[name]
    y_test = jnp.asarray(test_set[key])
    if multilabel:
      out[name] = 100 * float(metrics.micro_f1(jnp.ones_like(y_test), y_test))
    else:
      majority = int(np.bincount(train_set[key], minlength=outputs).argmax())
      out[name] = 100 * float(jnp.mean(y_test == majority))
  return out
