r"""FedRGB's evaluations beyond retrieval: the distortion matrix and downstream fine-tuning.

**Distortion** (FedRGB paper, App. D, Tables 6 and 11; Sec. 5.2 Fig. 5): "we retrain
the model on each local dataset with the same backbone methods and setting and
conduct the study on the change of similarity between embeddings of paired image and
text. We show the performance gap between the server and local retrained models."
Rows are "Retrain on C_i", columns "Test on C_j", and every entry is positive in the
paper (a decrease), so

.. math::
  D_{ij} = \overline{\cos}_j(f, g) - \overline{\cos}_j(f_i, g_i),

the mean over client ``j``'s held-out pairs of ``cos(z_I, z_T)`` of the final global
model ``(f, g)``, minus the same for the model retrained on client ``i``'s training
split from it (:func:`distortion_matrix`; positive = the retraining lowered the
paired similarity). "The same backbone methods and setting" is read as each method's
own client update (:meth:`FedRGB.stage1_client`: ``L_task`` for FedAvg, the guided
``L_local`` of eq. (2) with the final teacher for FedRGB, FedX's terms against the final
model, FedMAE's with its final decoder), run for ``steps`` steps
with the round's optimiser and batch size (``retrain="own"``); ``retrain="task"``
retrains every method on ``L_task`` alone, a control (ours) telling the guidance
apart from the global model it starts from. The paper does not give the number of
retraining steps (its Fig. 5 retrains for 500); the runner's is
``config.distortion.steps``. The paper's summary is the mean of each column ("Avg");
the runner also reports the mean off-diagonal entry (retrained on one client, tested
on another). Chance level: retraining nothing gives 0 (tested).

**Downstream classification by fine-tuning** (Sec. 5 / App. C.2, RSNA and COVIDx):
"we fine-tune our pre-trained model with an additional linear layer on 1%, 10% of
the training dataset ... and evaluate the classification accuracy".
:func:`finetune_accuracy` puts a linear layer (zero-initialised) on the image
tower's unit-length ``z_I`` (:meth:`FedRGB.embed_images`) and trains the image
aligner and the layer (the encoder too with ``train_encoder``) with the round's
AdamW on softmax cross-entropy, batches drawn with replacement from the labelled
subset; all subsets are one vmapped program (:func:`subset_masks`: the first
``max(1, round(f n))`` of a shuffled training set, so the 1% subset is inside the
10% one).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_mm.algorithms.fedrgb import FedRGB
from fedjax_mm.core.client import map_clients

Array = jax.Array

#: Which client update retrains the global model in the distortion study.
RETRAIN = ("own", "task")


def paired_cosine(alg: FedRGB, encoder, aligner, pairs: dict[str, Array]) -> Array:
  """``cos(z_I[j], z_T[j])`` ``[n]`` of the pairs ``images [n, S, S, 3]``, ``captions [n, L]``."""
  z_i, z_t = alg.embed(encoder, aligner, pairs["images"], pairs["captions"])
  return jnp.sum(z_i * z_t, -1)  # both unit length


def unpaired_cosine(alg: FedRGB, encoder, aligner, pairs: dict[str, Array]) -> Array:
  """Mean ``cos(z_I[j], z_T[l])`` over ``j != l``: the level of a model that pairs nothing."""
  z_i, z_t = alg.embed(encoder, aligner, pairs["images"], pairs["captions"])
  s = z_i @ z_t.T
  n = s.shape[0]
  return (jnp.sum(s) - jnp.trace(s)) / (n * (n - 1))


def retrainer(alg: FedRGB, retrain: str) -> FedRGB:
  """The algorithm whose client update retrains: the method's own, or ``L_task`` alone."""
  if retrain not in RETRAIN:
    raise ValueError(f"retrain must be one of {RETRAIN}, got {retrain!r}.")
  if retrain == "task" and alg.config.method in ("fedrgb", "fedx", "fedmae"):
    return dataclasses.replace(alg, config=dataclasses.replace(alg.config, method="fedavg"))
  return alg


def distortion_matrix(
  alg: FedRGB,
  encoder,
  aligner,
  teacher,
  key: Array,
  train: dict[str, Array],
  mask: Array,
  test: dict[str, Array],
  *,
  steps: int,
  decoder=None,
) -> dict[str, Array]:
  """Tables 6 / 11: the drop in mean paired cosine after retraining on each client.

  Args:
    alg: the algorithm whose ``stage1_client`` retrains (see :func:`retrainer`).
    encoder, aligner, teacher: the final global model (the teacher guides FedRGB).
    key: the retraining's randomness (client ``i`` gets ``split(key, K)[i]``).
    train: each client's training pairs ``[K, n, ...]``; ``mask`` ``bool [K, n]``.
    test: each client's held-out pairs ``[K, m, ...]``.
    steps: client update steps from the global model (0: no retraining).
    decoder: FedMAE's global decoder, which its own client update trains alongside.

  Returns:
    ``matrix`` ``[K, K]`` (row ``i`` retrained on client ``i``, column ``j`` tested on
    client ``j``: before minus after), ``before`` ``[K]`` (the global model's mean
    paired cosine per test client) and ``unpaired`` ``[K]`` (its mean unpaired cosine).
  """
  k = mask.shape[0]
  per_test = lambda enc, al: jax.vmap(lambda t: paired_cosine(alg, enc, al, t).mean())(test)
  before = per_test(encoder, aligner)

  def after(kk, a, m):
    enc, al, _ = alg.stage1_client(
      encoder, aligner, teacher, kk, a, m, steps=steps, decoder=decoder
    )
    return per_test(enc, al)

  retrained = map_clients(after, (jax.random.split(key, k), train, mask), alg.config.client_map)
  unpaired = jax.vmap(lambda t: unpaired_cosine(alg, encoder, aligner, t))(test)
  return {"matrix": before[None, :] - retrained, "before": before, "unpaired": unpaired}


def summarize_distortion(matrix: np.ndarray) -> dict[str, float]:
  """``off_diagonal`` (mean over ``i != j``), ``diagonal``, ``all`` (mean of the paper's Avg row)."""
  m = np.asarray(matrix, np.float64)
  off = ~np.eye(m.shape[0], dtype=bool)
  return {
    "off_diagonal": float(m[off].mean()),
    "diagonal": float(np.diag(m).mean()),
    "all": float(m.mean()),
  }


def subset_masks(n: int, fractions) -> np.ndarray:
  """``bool [F, n]``: the first ``max(1, round(f n))`` samples for each fraction ``f``."""
  sizes = [max(1, int(round(f * n))) for f in fractions]
  return np.arange(n)[None, :] < np.asarray(sizes)[:, None]


def finetune_accuracy(
  alg: FedRGB,
  encoder,
  aligner,
  key: Array,
  images: Array,
  labels: Array,
  masks: Array,
  test_images: Array,
  test_labels: Array,
  *,
  num_classes: int,
  steps: int,
  batch_size: int,
  learning_rate: float,
  train_encoder: bool = False,
  classes: Array | None = None,
) -> Array:
  """Accuracy (%) ``[F]`` of the image tower + a linear layer fine-tuned on each subset.

  Args:
    alg: supplies the model definitions and AdamW's weight decay.
    encoder, aligner: the pretrained (final global) model.
    key: batch draws, shared by the subsets.
    images: ``[n, S, S, 3]`` labelled training images, ``labels`` ``int [n]``.
    masks: ``bool [F, n]``, the labelled subsets (:func:`subset_masks`).
    test_images: ``[m, S, S, 3]``, ``test_labels`` ``int [m]``.
    num_classes: the linear layer's outputs.
    steps, batch_size, learning_rate: the fine-tuning's AdamW steps.
    train_encoder: also fine-tune the image encoder (default: frozen, as in the
      pretraining's stage 1).
    classes: ``bool [num_classes]``, the classes the task has (default all); the
      others get a logit of ``-1e9``, so tasks with fewer classes run in one vmapped
      program with the rest.
  """
  cfg = dataclasses.replace(alg.config, batch_size=batch_size, learning_rate=learning_rate)
  tuner = dataclasses.replace(alg, config=cfg)
  dim = jax.eval_shape(lambda: alg.embed_images(encoder, aligner, test_images[:1])).shape[-1]
  head = {"w": jnp.zeros((dim, num_classes)), "b": jnp.zeros((num_classes,))}

  def logits(params, x):
    enc = params["encoder"] if train_encoder else jax.lax.stop_gradient(encoder)
    z = alg.embed_images(enc, params["aligner"], x)
    out = z @ params["head"]["w"] + params["head"]["b"]
    return out if classes is None else jnp.where(classes, out, -1e9)

  def loss_fn(params, batch):
    out = logits(params, batch["images"])
    return optax.softmax_cross_entropy_with_integer_labels(out, batch["labels"]).mean()

  def one(mask):
    params = {"encoder": encoder if train_encoder else {}, "aligner": aligner, "head": head}
    data = {"images": images, "labels": labels}
    params, _ = tuner._train(loss_fn, params, key, data, mask.astype(jnp.float32), steps)
    pred = jnp.argmax(logits(params, test_images), -1)
    return 100.0 * jnp.mean(pred == test_labels)

  return jax.vmap(one)(masks)


def majority_accuracy(test_labels: np.ndarray) -> float:
  """Accuracy (%) of always predicting the test set's most frequent class (the trivial score)."""
  counts = np.bincount(np.asarray(test_labels))
  return float(100.0 * counts.max() / counts.sum())


__all__ = [
  "RETRAIN",
  "distortion_matrix",
  "finetune_accuracy",
  "majority_accuracy",
  "paired_cosine",
  "retrainer",
  "subset_masks",
  "summarize_distortion",
  "unpaired_cosine",
]
