"""VQA on a frozen server: CreamFL's Table 2 protocol, as a fusion head on its features.

CreamFL (Yu et al., "Multimodal Federated Learning via Contrastive
Representation Ensemble", ICLR 2023) evaluates the server model on two tasks:
image-text retrieval (Table 1) and visual question answering (Table 2,
"VQA evaluation", one accuracy per method; VQA v2 of Goyal et al. 2017,
"accuracy over the 3,000 most frequent answers", App. A.2). The paper says no
more about the VQA model. The VQA code of the authors' public repository
(FLAIR-THU/CreamFL, ``src/networks/fusion_model.py``: ``VQAFusionModel``;
``src/algorithms/vqa_trainer.py``) puts a fusion head on the server model's
``d``-dimensional image and question embeddings: each through a linear layer,
multiplied elementwise, then Tanh + linear layers to logits over the answer
categories (the top answers plus "unknown"), trained with cross-entropy while
the server is frozen (it is unfrozen after ``vqa_full_training_epoch``
epochs); accuracy is the share of questions whose top answer equals the
annotators' most common answer.

This module is the cheap, standard version of that head (a tanh on each
branch before the product keeps it bounded; a ReLU layer after it). With ``i`` the
frozen server's image feature and ``t`` its text tower's feature of the
question's argument phrase (:mod:`fedjax_mm.data.vqa`), both standardised with
the training set's mean and standard deviation, and ``k`` the question type::

  v      = tanh(W_v i + b_v)                      [hidden]
  q      = tanh(W_q t + E[k] + b_q)               [hidden]   (E: a learnt type embedding)
  logits = W_2 relu(W_1 (v * q) + b_1) + b_2      [A]        (A = 38 answers)

trained by Adam on softmax cross-entropy, ``steps`` minibatches of
``batch_size`` questions drawn uniformly (with replacement) from the training
pairs; the server never changes. Two baselines stand beside it so that a
reader can tell learning from priors:

* **blind** (question only): the same head, trained the same way from the same
  initialisation, with its image branch ``v`` held at 1 so that the product
  passes ``q`` through and the image is never read — what the question's type
  and argument alone give;
* **majority**: each type's most frequent training answer (no features at all).

What differs from the paper's protocol: the images are the embedded world's
scenes and the questions six templates (:mod:`fedjax_mm.data.vqa`) rather than
VQA v2's; every answer is in a closed 38-word vocabulary (no "unknown" class),
and accuracy is exact match against the one true answer (VQA v2's official
metric, ``min(#annotators agreeing / 3, 1)``, has no meaning with one
noise-free answer); the question's interrogative reaches the head as a type
embedding, because the world's vocabulary has no question words; the server
stays frozen throughout (no fine-tuning phase). The features are the server's
L2-normalised ``d``-dimensional representations, the embeddings the authors'
head reads (``features="pooled"`` in the runner takes the encoders' pooled
outputs instead).

Everything here is pure and deterministic given the key, and un-jitted but for
:func:`server_accuracy`, which jits it at the top with the feature extraction (the
runner's :func:`fedjax_mm.runner.creamfl_data.vqa_accuracy` calls it); :func:`evaluate`
fits the head and the blind head together (``vmap`` over the image switch ``sees_image``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from fedjax_mm import metrics
from fedjax_mm.core.client import apply_in_batches
from fedjax_mm.data import vqa as vqa_data

Array = jax.Array


__all__ = [
  "QASet",
  "VqaData",
  "accuracy_by_type",
  "evaluate",
  "fit_head",
  "head_logits",
  "init_head",
  "majority_logits",
  "predict",
  "server_accuracy",
  "server_features",
]


class QASet(NamedTuple):
  """Question-answer pairs as features, one row per question.

  Attributes:
    image: ``float [Q, h_v]`` the server's feature of the question's image.
    text: ``float [Q, h_t]`` the server's text feature of the question's argument.
    qtype: ``int [Q]`` question type in ``[0, num_types)``.
    answer: ``int [Q]`` answer id in ``[0, num_answers)``.
  """

  image: Array
  text: Array
  qtype: Array
  answer: Array


def init_head(
  key: Array, image_dim: int, text_dim: int, *, num_types: int, num_answers: int, hidden: int
) -> dict[str, Array]:
  """Fresh head parameters (LeCun-normal weights, zero biases)."""
  init = jax.nn.initializers.lecun_normal()
  kv, kq, ke, k1, k2 = jax.random.split(key, 5)
  return {
    "w_v": init(kv, (image_dim, hidden)),
    "b_v": jnp.zeros((hidden,)),
    "w_q": init(kq, (text_dim, hidden)),
    "type_embedding": init(ke, (num_types, hidden)),
    "b_q": jnp.zeros((hidden,)),
    "w_1": init(k1, (hidden, hidden)),
    "b_1": jnp.zeros((hidden,)),
    "w_2": init(k2, (hidden, num_answers)),
    "b_2": jnp.zeros((num_answers,)),
  }


def head_logits(
  params: dict[str, Array],
  image: Array,
  text: Array,
  qtype: Array,
  sees_image: Array | float = 1.0,
) -> Array:
  """``[A]`` answer logits of one question: image feature ``[h_v]``, text ``[h_t]``, type ``[]``.

  The features are the standardised ones (:func:`fit_head` standardises);
  ``sees_image`` is 1 for the head, 0 for the blind (question-only) head.
  """
  # sees_image = 0 (the blind head): v = 1, the product passes q unchanged and the image
  # is never read. (Zeroing the image instead leaves v * q = 0 at initialisation, and the
  # ReLU's zero gradient there would freeze the head on the answer prior.)
  v = sees_image * jnp.tanh(image @ params["w_v"] + params["b_v"]) + (1.0 - sees_image)
  q = jnp.tanh(text @ params["w_q"] + params["type_embedding"][qtype] + params["b_q"])
  hidden = jax.nn.relu((v * q) @ params["w_1"] + params["b_1"])
  return hidden @ params["w_2"] + params["b_2"]


def _standardise(x: Array, stats: tuple[Array, Array]) -> Array:
  mean, std = stats
  return (x - mean) / std


def _stats(x: Array) -> tuple[Array, Array]:
  return x.mean(0), x.std(0) + 1e-6


def fit_head(
  key: Array,
  train: QASet,
  *,
  num_types: int,
  num_answers: int,
  hidden: int,
  steps: int,
  batch_size: int,
  learning_rate: float,
  sees_image: Array | float = 1.0,
) -> dict[str, Array]:
  """Trains a head on ``train`` (un-jitted, like everything here).

  Args:
    key: initialises the head (split off first) and draws the minibatches.
    train: the training pairs.
    num_types, num_answers, hidden: the head's sizes.
    steps: Adam steps; each on ``batch_size`` pairs drawn uniformly with replacement.
    learning_rate: Adam's step size.
    sees_image: 1 for the head, 0 for the blind (question-only) head
      (:func:`head_logits`).

  Returns:
    The head's parameters, with the standardisation statistics under
    ``"image_stats"`` / ``"text_stats"`` and ``sees_image``, as :func:`predict` reads them.
  """
  init_key, data_key = jax.random.split(key)
  image_stats, text_stats = _stats(train.image), _stats(train.text)
  image = _standardise(train.image, image_stats)
  text = _standardise(train.text, text_stats)
  params = init_head(
    init_key,
    image.shape[1],
    text.shape[1],
    num_types=num_types,
    num_answers=num_answers,
    hidden=hidden,
  )
  batched = jax.vmap(head_logits, in_axes=(None, 0, 0, 0, None))
  tx = optax.adam(learning_rate)

  def loss_fn(p, idx):
    logits = batched(p, image[idx], text[idx], train.qtype[idx], sees_image)
    return optax.softmax_cross_entropy_with_integer_labels(logits, train.answer[idx]).mean()

  def step(carry, i):
    p, s = carry
    idx = jax.random.randint(jax.random.fold_in(data_key, i), (batch_size,), 0, image.shape[0])
    grads = jax.grad(loss_fn)(p, idx)
    updates, s = tx.update(grads, s, p)
    return (optax.apply_updates(p, updates), s), None

  (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), jnp.arange(steps))
  return params | {
    "image_stats": image_stats,
    "text_stats": text_stats,
    "sees_image": jnp.asarray(sees_image, jnp.float32),
  }


def predict(params: dict[str, Array], qa: QASet) -> Array:
  """``[Q, A]`` logits of a fitted head (:func:`fit_head`) on ``qa``."""
  image = _standardise(qa.image, params["image_stats"])
  text = _standardise(qa.text, params["text_stats"])
  batched = jax.vmap(head_logits, in_axes=(None, 0, 0, 0, None))
  return batched(params, image, text, qa.qtype, params["sees_image"])


def accuracy_by_type(
  logits: Array, answer: Array, qtype: Array, *, num_types: int
) -> tuple[Array, Array]:
  """Top-1 accuracy overall and per question type.

  Args:
    logits: ``[Q, A]`` answer scores.
    answer: ``int [Q]`` true answers.
    qtype: ``int [Q]`` question types.
    num_types: ``T``.

  Returns:
    ``(overall [], per_type [T])`` in ``[0, 1]``
    (:func:`fedjax_mm.metrics.accuracy`; a type with no question scores 0).
  """
  overall = metrics.accuracy(logits, answer)
  per_type = jax.vmap(lambda t: metrics.accuracy(logits, answer, where=qtype == t))(
    jnp.arange(num_types)
  )
  return overall, per_type


def majority_logits(
  train_type: Array, train_answer: Array, qtype: Array, *, num_types: int, num_answers: int
) -> Array:
  """``[Q, A]`` one-hot logits of each type's most frequent training answer (ties: lowest id)."""
  counts = jnp.zeros((num_types, num_answers)).at[train_type, train_answer].add(1.0)
  return jax.nn.one_hot(jnp.argmax(counts, axis=1)[qtype], num_answers)


def evaluate(
  key: Array,
  train: QASet,
  test: QASet,
  *,
  num_types: int,
  num_answers: int,
  hidden: int = 256,
  steps: int = 1000,
  batch_size: int = 128,
  learning_rate: float = 1e-3,
) -> dict[str, Array]:
  """Fits the head and the blind head on ``train``; accuracies on ``test``, with the majority's.

  Both heads start from the same parameters and see the same minibatches
  (one ``key``); they differ only in ``sees_image`` (:func:`head_logits`).

  Returns:
    Fractions in ``[0, 1]``, a dict of ``accuracy``, ``blind_accuracy`` and
    ``majority_accuracy`` (scalars) and of ``per_type``, ``blind_per_type`` and
    ``majority_per_type`` (``[num_types]`` each).
  """
  sizes = {"num_types": num_types, "num_answers": num_answers, "hidden": hidden}

  def fit_and_score(sees):
    params = fit_head(
      key,
      train,
      **sizes,
      steps=steps,
      batch_size=batch_size,
      learning_rate=learning_rate,
      sees_image=sees,
    )
    return accuracy_by_type(predict(params, test), test.answer, test.qtype, num_types=num_types)

  (overall, per_type) = jax.vmap(fit_and_score)(jnp.array([1.0, 0.0]))
  majority = majority_logits(
    train.qtype, train.answer, test.qtype, num_types=num_types, num_answers=num_answers
  )
  majority_overall, majority_per_type = accuracy_by_type(
    majority, test.answer, test.qtype, num_types=num_types
  )
  return {
    "accuracy": overall[0],
    "per_type": per_type[0],
    "blind_accuracy": overall[1],
    "blind_per_type": per_type[1],
    "majority_accuracy": majority_overall,
    "majority_per_type": majority_per_type,
  }


def server_features(model, images: Array, arguments: Array, features: str) -> tuple[Array, Array]:
  """The frozen server's ``(image [N, h_v], argument [U, h_t])`` features for the head.

  ``model`` is a :class:`fedjax_mm.algorithms.creamfl.DualEncoder`; ``features``
  ``"representation"`` reads its L2-normalised representations (the authors'
  head), ``"pooled"`` its encoders' pooled outputs. 256 rows at a time.
  """
  if features == "representation":
    image = lambda x: model.represent(x, "image")
    text = lambda x: model.represent(x, "text")
  else:
    image = lambda x: model.image_encoder(x)[0]
    text = lambda x: model.text_encoder(x)[0]
  return apply_in_batches(image, images, 256), apply_in_batches(text, arguments, 256)


class VqaData(NamedTuple):
  """The VQA analogue's scenes and questions, as the server reads them.

  Attributes:
    images: ``float32 [N_train + N_test, S, S, 3]`` the training scenes, then the test scenes.
    arguments: ``int32 [U, L]`` every distinct argument phrase (:mod:`fedjax_mm.data.vqa`),
      as the server's text tower reads captions (world ids padded to ``L``, or the
      ``hf:`` checkpoint's tokens).
    train, test: ``{"image": [Q] row of images, "argument": [Q] row of arguments,
      "type": [Q], "answer": [Q]}``, int32 each.
  """

  images: Array
  arguments: Array
  train: dict[str, Array]
  test: dict[str, Array]


@functools.partial(jax.jit, static_argnames=("graphdef", "features", "head"))
def server_accuracy(graphdef, params, qa: VqaData, key, *, features: str, head: tuple):
  """Features of the frozen server (``graphdef`` + ``params``), then :func:`evaluate`.

  One program (module level, the graph and ``head``'s hyperparameters static): every
  server, and a second run in the same process, reuse it.
  """
  image, text = server_features(nnx.merge(graphdef, params), qa.images, qa.arguments, features)

  def qa_set(split):
    return QASet(image[split["image"]], text[split["argument"]], split["type"], split["answer"])

  return evaluate(
    key,
    qa_set(qa.train),
    qa_set(qa.test),
    num_types=vqa_data.NUM_TYPES,
    num_answers=vqa_data.NUM_ANSWERS,
    **dict(head),
  )
