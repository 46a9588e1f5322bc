"""Frozen encoders' features: a user's computed once per set, FedSCMR's pairs of the world.

A user whose encoder trains nothing (a pretrained CNN fine-tuned with
"adapters": a CNN has no dense layers for LoRA, so only its projector and head
train) computes the same pooled features of a sample in every local step, every
contrastive batch and every evaluation. :func:`cache_frozen_encoders` computes
them once for each of the group's sets and the public set, stores them under a
key of their own, and gives the group a model that reads them
(:meth:`fedjax_mm.models.UserModel.read_pooled`) and a task whose ``input_key``
names them. Parameters, optimiser states and random draws are untouched, so a
round of the cached groups computes what the raw groups compute, up to float32
rounding (the encoder now sees batches of another size); checkpoints are
interchangeable. Only a method that transforms its raw inputs (an augmentation)
needs the raw groups.

A group qualifies (:func:`frozen_encoder`) when its model is a
:class:`~fedjax_mm.models.UserModel` whose head reads the pooled features, whose
task reads images, and none of whose trained parameters sits in its encoder.

FedSCMR's features of the embedded world (:func:`pretrained_features`,
:func:`world_features`). The paper feeds 4096-d VGG-19 fc7 image
features and 1024-d sentence-BERT text features, from networks pretrained
elsewhere. By default (``features.image_encoder="world-clip/cnn_m"``), both come
from frozen World-CLIP encoders pretrained on the world's web split
(:func:`pretrained_features`): cnn_m, the shipped encoder that knows the primary
object's shape (this benchmark's label), and transformer_t. The earlier
stand-in remains (``features.image_encoder="" features.text_encoder=transformer_t``,
:func:`world_features`):
the text side is a frozen, randomly initialised text encoder of
:mod:`fedjax_mm.models` (``features.text_encoder``) applied to one caption
per image (chosen at random, seeded), mean-pooled. The image side cannot be a
randomly initialised image encoder: with the world's random textures, colours,
sizes and positions, pooled features of a frozen random ``cnn_s`` / ``cnn_m`` /
``resnet_t`` (or a random projection of the pixels) let a logistic regression
find the primary shape no better than chance (11-15% for 10 classes, measured
on 1,000 / 500 pairs), where VGG features of real photos are strongly
informative. The image features therefore simulate a pretrained extractor: a
fixed seeded random projection of the image's per-shape pixel areas (read from
its segmentation mask, so several objects mix, the largest dominating) plus
Gaussian noise; the same logistic regression reaches about 86% on them, the
text features about 82%.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from fedjax_mm import data, models
from fedjax_mm.core.client import ClientData, ClientState, GroupDef, apply_in_batches, init_jitted
from fedjax_mm.core.tasks import Task
from fedjax_mm.data.cross_modal import PairedFeatures
from fedjax_mm.models.user_model import UserModel

Array = jax.Array

#: The data key under which group ``i``'s pooled features are stored.
POOLED_KEY = "pooled:{}"


def _model(group: GroupDef, state: ClientState) -> nnx.Module:
  """Client 0's model, outside any trace (its static graph is what matters here)."""
  return group.merge(jax.tree.map(lambda x: x[0], state.params), state.shared)


def _trains_encoder(state: ClientState) -> bool:
  paths = jax.tree_util.tree_flatten_with_path(state.params)[0]
  return any(
    getattr(entry, "key", getattr(entry, "name", None)) == "encoder"
    for path, _ in paths
    for entry in path
  )


def frozen_encoder(group: GroupDef, state: ClientState) -> bool:
  """Whether the group's encoder is a fixed function its features can be cached for."""
  if group.task.input_key != "image" or _trains_encoder(state):
    return False
  model = _model(group, state)
  return isinstance(model, UserModel) and model.head.reads != "spatial" and not model.pooled_input


def pooled_group(group: GroupDef, state: ClientState, key: str) -> GroupDef:
  """The group reading pooled features under data key ``key`` (same parameters)."""
  model = _model(group, state)
  model.read_pooled()
  graphdef = nnx.split(model)[0]
  return dataclasses.replace(
    group, graphdef=graphdef, task=dataclasses.replace(group.task, input_key=key)
  )


def pooled_features(
  group: GroupDef, state: ClientState, images: Array, *, batch_size: int = 256
) -> Array:
  """The group's frozen pooled features of ``images [..., H, W, C]`` -> ``[..., h]``.

  Leading axes (clients, samples) are flattened into one batch axis and restored.
  """
  lead = images.shape[:-3]
  flat = images.reshape((-1,) + images.shape[-3:])

  @jax.jit
  def run(shared, params, x):
    model = group.merge(jax.tree.map(lambda p: p[0], params), shared)
    return apply_in_batches(model.pooled, x, batch_size)

  out = run(state.shared, state.params, flat)
  return out.reshape(lead + out.shape[-1:])


def cache_frozen_encoders(
  groups: Sequence[GroupDef],
  states: Sequence[ClientState],
  sets: Sequence[Sequence[ClientData]],
  public: dict[str, Array] | None = None,
) -> tuple[tuple[GroupDef, ...], tuple[tuple[ClientData, ...], ...], dict[str, Array] | None]:
  """Every frozen-encoder group reading its features, computed once per set.

  Args:
    groups: the groups.
    states: their initial states (only the frozen ``shared`` weights are read).
    sets: each a per-group tuple of :class:`ClientData` (train, test, ...).
    public: optional public set (dict of ``[P, ...]`` arrays).

  Returns:
    ``(groups, sets, public)``: a frozen-encoder group ``i`` replaced by
    :func:`pooled_group` reading :data:`POOLED_KEY` ``.format(i)``, which its
    sets and the public set gain; every other group, array and key unchanged.
  """
  groups, public = list(groups), None if public is None else dict(public)
  sets = [list(s) for s in sets]
  for i, (group, state) in enumerate(zip(tuple(groups), states, strict=True)):
    if not frozen_encoder(group, state):
      continue
    key = POOLED_KEY.format(i)
    for s in sets:
      arrays = dict(s[i].arrays)
      arrays[key] = pooled_features(group, state, arrays["image"])
      s[i] = s[i].replace(arrays=arrays)
    if public is not None and "image" in public:
      public[key] = pooled_features(group, state, public["image"])
    groups[i] = pooled_group(group, state, key)
  return tuple(groups), tuple(tuple(s) for s in sets), public


def _reads_pooled(task: Task) -> bool:
  return task.input_key.startswith(POOLED_KEY.format(""))


def source_task(task: Task) -> Task:
  """The task as its raw group states it: a pooled group reads its images' features.

  Two groups solve one task when their kind, targets and raw inputs agree; which array
  holds a group's inputs (the images or their cached features) does not change the task.
  """
  return dataclasses.replace(task, input_key="image") if _reads_pooled(task) else task


def cached(groups: Sequence[GroupDef]) -> tuple[bool, ...]:
  """Which groups read pooled features (``input_key`` :data:`POOLED_KEY`)."""
  return tuple(_reads_pooled(g.task) for g in groups)


# ---------------------------------------------------------------------------
# Labelled image-text pairs of the world as fixed features (FedSCMR's input)

#: Text feature extractors: ``"bow"`` (numpy, a fixed random projection of word counts) or a
#: frozen, randomly initialised text encoder of :mod:`fedjax_mm.models`.
TEXT_FEATURES = ("bow",) + tuple(
  name for name, (modality, _) in models.ENCODERS.items() if modality == "text"
)


def world_features(
  seed: int, num: int, *, image_dim: int = 64, image_noise: float = 0.5, text_encoder: str
) -> PairedFeatures:
  """``num`` labelled pairs of the embedded world as fixed feature vectors.

  The image features simulate a pretrained extractor (see the module docstring).
  Deterministic in ``seed``; labels are the world's ``retrieval_label`` (the primary
  object's shape, 10 classes).

  Args:
    seed: integer seed of the world, the projection, the noise, the caption
      choice and the text encoder's initialisation.
    num: number of pairs.
    image_dim: dimension of the image features.
    image_noise: standard deviation of the noise on the image features, whose
      noise-free norm is about 1.
    text_encoder: ``"bow"`` or the name of a text encoder in
      :data:`fedjax_mm.models.ENCODERS` (see :data:`TEXT_FEATURES`).

  Returns:
    :class:`~fedjax_mm.data.cross_modal.PairedFeatures`.
  """
  world = data.generate(seed, num)
  rng = np.random.default_rng([seed, 7])
  masks = world["mask"].reshape(num, -1)
  areas = np.stack([(masks == 1 + s).mean(1) for s in range(data.NUM_SHAPES)], axis=1)
  areas /= np.maximum(areas.sum(1, keepdims=True), 1e-12)
  projection = rng.normal(size=(data.NUM_SHAPES, image_dim)) / math.sqrt(image_dim)
  image = areas @ projection + image_noise * rng.normal(size=(num, image_dim)) / math.sqrt(
    image_dim
  )
  choice = rng.integers(0, world["caption"].shape[1], size=num)
  captions = world["caption"][np.arange(num), choice]
  if text_encoder == "bow":
    return PairedFeatures(
      image=image, text=_bag_of_words(rng, captions), labels=world["retrieval_label"]
    )
  graphdef, params = init_jitted(
    lambda rngs: models.build_encoder(
      text_encoder, rngs=rngs, vocab_size=data.VOCAB_SIZE, max_len=captions.shape[1]
    ),
    jax.random.key(seed),
  )
  encode = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)[0])
  text = np.asarray(apply_in_batches(lambda x: encode(params, x), captions, 512))
  return PairedFeatures(image=image, text=text, labels=world["retrieval_label"])


def pretrained_features(
  seed: int, num: int, *, image_encoder: str, text_encoder: str
) -> PairedFeatures:
  """``num`` labelled pairs of the world through frozen pretrained encoders.

  The paper's setting: VGG-19 fc7 image features and sentence-BERT text
  features, both from networks pretrained elsewhere. Here both come from the
  World-CLIP checkpoints (:mod:`fedjax_mm.zoo.pretrain`), pretrained on the
  web split, which shares no seed with this pool: the pooled output of the
  frozen image encoder on each image, and of the frozen text encoder on one
  caption per image (chosen at random, seeded).

  Args:
    seed: integer seed of the world and of the caption choice.
    num: number of pairs.
    image_encoder: a checkpoint name or folder (``"world-clip/vit_s"``).
    text_encoder: a checkpoint name or folder (``"world-clip/transformer_s"``).
  """
  world = data.generate(seed, num)
  rng = np.random.default_rng([seed, 7])
  choice = rng.integers(0, world["caption"].shape[1], size=num)
  captions = world["caption"][np.arange(num), choice]
  return PairedFeatures(
    image=checkpoint_features(image_encoder, world["image"]),
    text=checkpoint_features(text_encoder, captions),
    labels=world["retrieval_label"],
  )


def checkpoint_features(checkpoint: str, x: np.ndarray) -> np.ndarray:
  """Pooled outputs ``[n, h]`` of the checkpoint's encoder on ``x``, in batches of 512."""
  cfg = models.pretrained.read_config(checkpoint)
  sizes = {k: cfg[k] for k in models.pretrained.size_keys(cfg["modality"])}
  encoder = models.build_encoder(cfg["encoder"], rngs=nnx.Rngs(0), **sizes)
  models.pretrained.load_into(encoder, checkpoint)
  graphdef, params = nnx.split(encoder)
  encode = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)[0])
  return np.asarray(apply_in_batches(lambda x: encode(params, x), x, 512))


def _bag_of_words(rng: np.random.Generator, captions: np.ndarray, dim: int = 64) -> np.ndarray:
  """``[n, dim]`` text features: ReLU of a fixed random projection of word counts (no PAD)."""
  counts = np.zeros((captions.shape[0], data.VOCAB_SIZE), np.float32)
  np.add.at(counts, (np.arange(captions.shape[0])[:, None], captions), 1.0)
  counts[:, data.PAD_ID] = 0
  projection = rng.normal(size=(data.VOCAB_SIZE, dim)) / math.sqrt(dim)
  return np.maximum(counts @ projection, 0)


__all__ = [
  "POOLED_KEY",
  "TEXT_FEATURES",
  "cache_frozen_encoders",
  "cached",
  "checkpoint_features",
  "frozen_encoder",
  "pooled_features",
  "pooled_group",
  "pretrained_features",
  "source_task",
  "world_features",
]
