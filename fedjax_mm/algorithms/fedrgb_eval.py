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

**Downstream segmentation** (Sec. 5 / App. C.2, RSNA after MGCA, Wang et al. 2022):
"we construct a U-Net framework using a decoder and our pre-trained image encoder ...
we freeze the encoder and fine-tune the decoder using 1%, 10% of the training data ...
and then use the Dice score". :func:`segmentation_dice` freezes the whole pretrained
image tower (encoder and image align module, the tower's last stage) and trains
:class:`SegDecoder` on its per-position output (:meth:`FedRGB.image_map`, at 1/4 of
the image's resolution). The decoder is U-Net's expanding path: a 3 x 3 convolution,
then per factor of 2 a nearest-neighbour upsampling and two 3 x 3 convolutions halving
the width, and a 1 x 1 convolution to one foreground logit per pixel. The zoo's towers
expose one resolution, so there are no skip connections across scales; a skip from the
raw pixels is left out on purpose, since it would let the decoder segment the world's
flat-coloured objects without the pretrained features it is meant to test. Loss: the
mixed loss of the public MGCA-line segmentation code (sigmoid focal loss, alpha 0.25,
gamma 2, plus ``-log`` of the soft Dice with smoothing 1), AdamW with the round's weight
decay, batches drawn with replacement from the labelled subset. Score: dataset-level
Dice (:func:`fedjax_mm.metrics.dice`) of ``logit > 0`` over the test set's pixels. The
tower is frozen, so its features are computed once and every subset's decoder trains
on them in one vmapped program.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fedjax_mm import metrics
from fedjax_mm.algorithms.fedrgb import FedRGB
from fedjax_mm.core import processes
from fedjax_mm.core.client import apply_in_batches, map_clients
from fedjax_mm.core.sharding import replicate, traced_in
from fedjax_mm.models.conv import Conv

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


class SegDecoder(nnx.Module):
  """U-Net's expanding path: ``[b, h, w, c]`` -> foreground logits ``[b, h 2^u, w 2^u]``."""

  def __init__(self, in_features: int, width: int, upsamplings: int, *, rngs: nnx.Rngs):
    if width % 2**upsamplings:
      raise ValueError(f"width {width} must be divisible by 2^{upsamplings}.")
    self.stem = Conv(in_features, width, (3, 3), rngs=rngs)
    convs = []
    for i in range(upsamplings):
      c_in, c_out = width // 2**i, width // 2 ** (i + 1)
      convs.append(
        nnx.List([Conv(c_in, c_out, (3, 3), rngs=rngs), Conv(c_out, c_out, (3, 3), rngs=rngs)])
      )
    self.up = nnx.List(convs)
    self.head = Conv(width // 2**upsamplings, 1, (1, 1), rngs=rngs)

  def __call__(self, x: Array) -> Array:
    x = jax.nn.relu(self.stem(x))
    for first, second in self.up:
      x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)  # nearest neighbour, x2
      x = jax.nn.relu(second(jax.nn.relu(first(x))))
    return self.head(x)[..., 0]


def segmentation_loss(logits: Array, targets: Array) -> Array:
  """Sigmoid focal loss (alpha 0.25, gamma 2, mean) ``- log`` soft Dice (smoothing 1)."""
  targets = targets.astype(logits.dtype)
  focal = optax.sigmoid_focal_loss(logits, targets, alpha=0.25, gamma=2.0).mean()
  p = jax.nn.sigmoid(logits)
  soft = (2.0 * jnp.sum(p * targets) + 1.0) / (jnp.sum(p) + jnp.sum(targets) + 1.0)
  return focal - jnp.log(soft)


def segmentation_dice(
  alg: FedRGB,
  encoder,
  aligner,
  key: Array,
  images: Array,
  targets: Array,
  masks: Array,
  test_images: Array,
  test_targets: Array,
  *,
  steps: int,
  batch_size: int,
  learning_rate: float,
  width: int = 32,
) -> Array:
  """Dice ``[F]`` of :class:`SegDecoder` trained on the frozen tower, one per labelled subset.

  Args:
    alg: supplies the model definitions and AdamW's weight decay.
    encoder, aligner: the pretrained (final global) model, frozen.
    key: the decoder's initialisation (shared by the subsets) and the batch draws.
    images: ``[n, S, S, 3]`` labelled training images, ``targets`` ``bool [n, S, S]``.
    masks: ``bool [F, n]``, the labelled subsets (:func:`subset_masks`).
    test_images: ``[m, S, S, 3]``, ``test_targets`` ``bool [m, S, S]``.
    steps, batch_size, learning_rate: the decoder's AdamW steps.
    width: the decoder's first width (halved at every upsampling).
  """
  features = alg.image_map(encoder, aligner, images)
  test_features = alg.image_map(encoder, aligner, test_images)
  factor = images.shape[1] // features.shape[1]
  upsamplings = factor.bit_length() - 1
  if 2**upsamplings != factor or features.shape[1] * factor != images.shape[1]:
    raise ValueError(
      f"the image ({images.shape[1]}) must be a power-of-2 multiple of the tower's map "
      f"({features.shape[1]})."
    )
  k_init, k_train = jax.random.split(key)
  decoder = SegDecoder(features.shape[-1], width, upsamplings, rngs=nnx.Rngs(k_init))
  graph, params = nnx.split(decoder, nnx.Param)
  apply = lambda p, x: nnx.merge(graph, p)(x)
  cfg = dataclasses.replace(alg.config, batch_size=batch_size, learning_rate=learning_rate)
  tuner = dataclasses.replace(alg, config=cfg)

  def loss_fn(p, batch):
    return segmentation_loss(apply(p, batch["features"]), batch["targets"])

  def one(mask):
    data = {"features": features, "targets": targets}
    trained, _ = tuner._train(loss_fn, params, k_train, data, mask.astype(jnp.float32), steps)
    return metrics.dice(apply(trained, test_features) > 0, test_targets)

  return jax.vmap(one)(masks)


def all_positive_dice(test_targets: np.ndarray) -> float:
  """Dice of predicting every pixel foreground, ``2p / (1 + p)``: the trivial score."""
  p = float(np.mean(np.asarray(test_targets) != 0))
  return 2.0 * p / (1.0 + p)


def majority_accuracy(test_labels: np.ndarray) -> float:
  """Accuracy (%) of always predicting the test set's most frequent class (the trivial score)."""
  counts = np.bincount(np.asarray(test_labels))
  return float(100.0 * counts.max() / counts.sum())


def retrieval(z_i: Array, z_t: Array, gallery: int, ks=(1, 5)) -> dict[str, Array]:
  """R@K of pairs ``(z_i[j], z_t[j])`` in percent: both directions, and t2i per gallery batch."""
  n = z_i.shape[0]
  ids = jnp.arange(n)
  out = metrics.image_text_recall(z_i, z_t, ids, ks=ks)
  used = n // gallery * gallery
  batched = metrics.image_text_recall(z_i[:used], z_t[:used], ids[:used], ks=ks, folds=n // gallery)
  return out | {f"gallery_t2i_R@{k}": batched[f"t2i_R@{k}"] for k in ks}


def evaluate(embedder, local, encoder, aligner, test, ood, *, gallery, batch_size=256, ks=(1, 5)):
  """FedRGB's retrieval metrics (:func:`retrieval`) of every client's held-out pairs and of the
  out-of-distribution pairs ``ood``.

  ``local`` (static under ``jit``): ``encoder`` / ``aligner`` hold every client's own model,
  stacked (Local), each scored on its own pairs and the OOD metrics averaged over them; else
  one global model scores all. Pairs are embedded ``batch_size`` at a time
  (:func:`fedjax_mm.core.client.apply_in_batches`). Returns ``(own [K] per metric, ood)``.
  """

  def score(enc, al, b):
    embed = lambda x: embedder.embed(enc, al, x["images"], x["captions"])  # noqa: E731
    return retrieval(*apply_in_batches(embed, b, batch_size), gallery, ks)

  axes = 0 if local else None
  own = jax.vmap(score, in_axes=(axes, axes, 0))(encoder, aligner, test)
  if local:  # every client's model on the shared OOD pairs, averaged
    # One client at a time: vmapped, each block of similarities (chunk x OOD pairs) was
    # formed for all K clients at once, K times the memory.
    shifted = jax.lax.map(lambda m: score(*m, ood), (encoder, aligner))
    shifted = jax.tree.map(jnp.mean, shifted)
  else:
    shifted = score(encoder, aligner, ood)
  return own, shifted


class FinalEvaluation:
  """The evaluations of a final global model, each compiled once for every method.

  The distortion matrix (Tables 6 / 11: :func:`distortion_matrix` per retraining, its
  clients mapped over ``mesh`` as in a round), downstream fine-tuning (both of ``tasks`` and
  every fraction in one program: the tasks' labels stacked, a task's missing classes masked
  out of its logits; :func:`finetune_accuracy`) and segmentation (:func:`segmentation_dice`).
  Every method gets the same keys, from ``seed`` (+19 the distortion's client draws, +17
  the fine-tuning's, +29 the decoder's start), hence the same draws.

  Args:
    embedder: the FedRGB model (:meth:`~fedjax_mm.algorithms.fedrgb.FedRGB.embed`).
    mesh: the job's mesh (:func:`fedjax_mm.core.job_mesh`); with more than one device the
      scenes are replicated over it, as the run's data are.
    data: the run's ``{"train", "mask", "test"}`` client data, placed.
    scenes: the labelled downstream scenes: ``images``, ``masks`` (``[fractions, n]``),
      ``test_images``, ``seg_targets``, ``seg_test_targets``, and ``labels`` /
      ``test_labels`` (``{task: [n]}``).
    tasks: ``{task: (num_classes, ...)}``, in order.
    seed: the run's seed.
    distortion_steps, fractions: the retraining's steps; the labelled fractions.
    downstream: ``steps``, ``batch_size``, ``learning_rate``, ``train_encoder`` of the
      fine-tuning; segmentation: ``steps``, ``batch_size``, ``learning_rate``, ``width``.
    name_fraction: a fraction's key in the results (``0.01 -> "1%"``).
  """

  def __init__(
    self,
    embedder,
    mesh,
    data,
    scenes,
    tasks,
    *,
    seed,
    distortion_steps,
    fractions,
    downstream,
    segmentation,
    name_fraction,
  ):
    self.data, self.fractions, self.name_fraction = data, list(fractions), name_fraction
    self.tasks = list(tasks)
    dist_key = jax.random.key(seed + 19)  # the same client draws for every method

    @functools.partial(jax.jit, static_argnums=0)
    @functools.partial(traced_in, mesh)  # the clients' retraining: map_clients, as in a round
    def distortion_jit(a, encoder, aligner, teacher, decoder, train, mask, test):
      return distortion_matrix(
        a,
        encoder,
        aligner,
        teacher,
        dist_key,
        train,
        mask,
        test,
        steps=distortion_steps,
        decoder=decoder,
      )

    down_key = jax.random.key(seed + 17)
    num_classes = max(c for c, _ in tasks.values())
    valid = jnp.asarray([np.arange(num_classes) < tasks[t][0] for t in self.tasks])
    stacked = lambda labels: jnp.asarray(np.stack([labels[t] for t in self.tasks]))  # noqa: E731
    # The labelled scenes, passed to the jitted evaluations as arguments (like the rounds' data).
    names = ("images", "masks", "test_images", "seg_targets", "seg_test_targets")
    placed = {k: scenes[k] for k in names}
    placed |= {"labels": stacked(scenes["labels"]), "test_labels": stacked(scenes["test_labels"])}
    self.scenes = replicate(placed, mesh) if mesh.size > 1 else placed

    @jax.jit
    def finetune_jit(encoder, aligner, d):
      def one(y, y_test, classes):
        return finetune_accuracy(
          embedder,
          encoder,
          aligner,
          down_key,
          d["images"],
          y,
          d["masks"],
          d["test_images"],
          y_test,
          num_classes=num_classes,
          steps=int(downstream["steps"]),
          batch_size=int(downstream["batch_size"]),
          learning_rate=float(downstream["learning_rate"]),
          train_encoder=downstream["train_encoder"],
          classes=classes,
        )

      return jax.vmap(one)(d["labels"], d["test_labels"], valid)

    seg_key = jax.random.key(seed + 29)  # the same decoder start and draws for every row

    @jax.jit
    def segment_jit(encoder, aligner, d):
      return segmentation_dice(
        embedder,
        encoder,
        aligner,
        seg_key,
        d["images"],
        d["seg_targets"],
        d["masks"],
        d["test_images"],
        d["seg_test_targets"],
        steps=int(segmentation["steps"]),
        batch_size=int(segmentation["batch_size"]),
        learning_rate=float(segmentation["learning_rate"]),
        width=int(segmentation["width"]),
      )

    self._distortion, self._finetune, self._segment = distortion_jit, finetune_jit, segment_jit

  def distortion(self, algorithm: FedRGB, s, retrains) -> dict[str, Any]:
    """Per retraining (:data:`RETRAIN`): the matrix, its summary, the paired and unpaired
    cosines before retraining. A retraining that is the same algorithm as an earlier one
    (FedAvg's own update is ``L_task``) is not rerun."""
    out, seen = {}, {}
    for retrain in retrains:
      a = retrainer(algorithm, retrain)
      if a in seen:
        out[retrain] = out[seen[a]]
        continue
      seen[a] = retrain
      d = {
        n: np.asarray(v, np.float64)
        for n, v in processes.gather(
          self._distortion(
            a,
            s.encoder,
            s.aligner,
            s.teacher,
            s.decoder,
            *(self.data[k] for k in ("train", "mask", "test")),
          )
        ).items()
      }
      out[retrain] = {
        "matrix": d["matrix"].tolist(),
        "summary": summarize_distortion(d["matrix"]),
        "paired_cosine": float(d["before"].mean()),
        "unpaired_cosine": float(d["unpaired"].mean()),
      }
    return out

  def downstream(self, encoder, aligner) -> dict[str, dict[str, float]]:
    """``{task: {fraction: accuracy}}`` of the image tower + a linear layer fine-tuned."""
    acc = np.asarray(processes.gather(self._finetune(encoder, aligner, self.scenes)))
    return {
      t: {self.name_fraction(f): float(v) for f, v in zip(self.fractions, acc[i], strict=True)}
      for i, t in enumerate(self.tasks)
    }

  def segmentation(self, encoder, aligner) -> dict[str, float]:
    """``{fraction: Dice in %}`` of a decoder trained on the frozen image tower."""
    dice = np.asarray(processes.gather(self._segment(encoder, aligner, self.scenes)))
    return {
      self.name_fraction(f): 100.0 * float(v) for f, v in zip(self.fractions, dice, strict=True)
    }


__all__ = [
  "RETRAIN",
  "FinalEvaluation",
  "SegDecoder",
  "all_positive_dice",
  "distortion_matrix",
  "evaluate",
  "finetune_accuracy",
  "majority_accuracy",
  "paired_cosine",
  "retrieval",
  "retrainer",
  "segmentation_dice",
  "segmentation_loss",
  "subset_masks",
  "summarize_distortion",
  "unpaired_cosine",
]
