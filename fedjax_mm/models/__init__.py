"""Flax NNX models: encoders, heads, LoRA adapters and the per-user model.

Every model is a pure function of its ``nnx.Param``/``nnx.LoRAParam``
variables (no BatchNorm in training form, no dropout, no other state; an
``hf:`` SegFormer's decode head reads its BatchNorm's running statistics from
frozen ``nnx.BatchStat`` variables, which ``nnx.split(model, trainable, ...)``
keeps with the frozen rest), so the engine can
``nnx.split`` it once, stack many clients' states along a leading axis and run
them all with ``jax.vmap(lambda s, x: nnx.merge(graphdef, s)(x))``.

Models are built by name from a small config::

  model = models.build(
    {"encoder": "vit_s", "head": "mlp", "num_outputs": 100, "lora_rank": 16},
    rngs=nnx.Rngs(0),
  )
  z, logits = model.forward(images)        # z: [b, 256] unit-norm, logits: [b, 100]

Config keys (``DEFAULTS`` gives the defaults; unknown keys are an error):

* ``encoder``: a name in :data:`ENCODERS`, or ``"hf:<folder>"`` for a Hugging
  Face checkpoint (BERT family, ViT, a CLIP tower, SegFormer; :mod:`fedjax_mm.models.hf`),
  wrapped in :class:`~fedjax_mm.models.hf.ZooEncoder` (required).
* ``head``: ``"linear"`` | ``"mlp"`` | ``"segmentation"`` (default ``"linear"``).
* ``num_outputs``: classes / labels / segmentation classes (required).
* ``rep_dim``: representation dimension d (default 256).
* ``lora_rank``: LoRA rank on the encoder's dense layers, 0 = none (default 0).
* ``head_hidden``: hidden width of the ``mlp`` / ``segmentation`` head
  (default: d for ``mlp``, 64 for ``segmentation``).
* ``modality``: optional; inferred from the encoder, checked if given (a full
  CLIP checkpoint needs it: it picks the tower).
* ``pretrained``: optional checkpoint for the encoder, a shipped name
  (``"world-clip/vit_s"``) or a folder (:mod:`fedjax_mm.models.pretrained`);
  its ``encoder`` and size keys must match. The projector and head stay
  freshly initialised; with ``lora_rank > 0`` the adapters too (``B = 0``, so
  the loaded encoder's output is unchanged until they train).
* ``standardize``: standardise the encoder's pooled features with the
  ``pretrained`` checkpoint's statistics of its pretraining data before the
  projector (:class:`~fedjax_mm.models.user_model.Standardize`; default False).
  Needs a ``pretrained`` checkpoint that carries them.
* text: ``vocab_size`` (1000), ``max_len`` (32); image: ``image_size`` (32),
  ``channels`` (3). Keys of the other modality are ignored, and so are these
  for ``hf:`` encoders, whose sizes are the checkpoint's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx

from fedjax_mm.models import heads, hf, image, lora, pretrained, text
from fedjax_mm.models.heads import LinearHead, MlpHead, SegmentationHead
from fedjax_mm.models.lora import adapter_filter, dense, frozen_filter, trainable_filter
from fedjax_mm.models.user_model import (
  FeatureStat,
  Standardize,
  UserModel,
  head_filter,
  l2_normalize,
  representation_filter,
)

__all__ = [
  "DEFAULTS",
  "ENCODERS",
  "HEADS",
  "FeatureStat",
  "LORA_ENCODERS",
  "LinearHead",
  "MlpHead",
  "SegmentationHead",
  "Standardize",
  "UserModel",
  "adapter_filter",
  "build",
  "build_encoder",
  "dense",
  "encoder_modality",
  "frozen_filter",
  "head_filter",
  "heads",
  "hf",
  "image",
  "l2_normalize",
  "lora",
  "param_count",
  "pretrained",
  "representation_filter",
  "text",
  "trainable_filter",
]

#: Encoder name -> (modality, constructor). Image constructors take
#: ``(*, image_size, channels, lora_rank, rngs)``; text constructors take
#: ``(*, vocab_size, max_len, lora_rank, rngs)``. Both return a module mapping
#: inputs to ``(pooled [b, h], spatial)`` with attribute ``features = h``.
ENCODERS: dict[str, tuple[str, Callable[..., nnx.Module]]] = {
  "cnn_s": ("image", image.cnn_s),
  "cnn_m": ("image", image.cnn_m),
  "resnet_t": ("image", image.resnet_t),
  "vit_t": ("image", image.vit_t),
  "vit_s": ("image", image.vit_s),
  "vit_b": ("image", image.vit_b),
  "vitc_t": ("image", image.vitc_t),
  "vitc_s": ("image", image.vitc_s),
  "vitc_b": ("image", image.vitc_b),
  "transformer_t": ("text", text.transformer_t),
  "transformer_s": ("text", text.transformer_s),
  "gru": ("text", text.gru),
}

#: Encoders with dense layers that take LoRA adapters (the CNNs have none).
LORA_ENCODERS = frozenset(
  {"vit_t", "vit_s", "vit_b", "vitc_t", "vitc_s", "vitc_b", "transformer_t", "transformer_s", "gru"}
)

#: Head name -> head class.
HEADS: dict[str, type[nnx.Module]] = {
  "linear": LinearHead,
  "mlp": MlpHead,
  "segmentation": SegmentationHead,
}

DEFAULTS: dict[str, Any] = {
  "encoder": None,
  "head": "linear",
  "num_outputs": None,
  "rep_dim": 256,
  "lora_rank": 0,
  "head_hidden": None,
  "modality": None,
  "pretrained": None,
  "standardize": False,
  "vocab_size": 1000,
  "max_len": 32,
  "image_size": 32,
  "channels": 3,
}

_MODALITY_KEYS = {"image": ("image_size", "channels"), "text": ("vocab_size", "max_len")}


def _choose(kind: str, name: Any, table: Mapping[str, Any]) -> Any:
  if name not in table:
    raise ValueError(f"unknown {kind} {name!r}; valid names: {', '.join(sorted(table))}.")
  return table[name]


def encoder_modality(name: str, modality: str | None = None) -> str:
  """``"image"`` or ``"text"``: what encoder ``name`` (registry or ``hf:``) reads.

  ``modality``, if given, is checked (and picks the tower of a CLIP checkpoint).
  """
  if hf.is_hf(name):
    return hf.modality(name, modality)
  found, _ = _choose("encoder", name, ENCODERS)
  if modality is not None and modality != found:
    raise ValueError(f"encoder {name!r} is a {found} encoder, not {modality!r}.")
  return found


def build_encoder(
  name: str, *, rngs: nnx.Rngs, lora_rank: int = 0, modality: str | None = None, **kwargs
) -> nnx.Module:
  """Builds the encoder ``name`` of :data:`ENCODERS`, or an ``"hf:<folder>"`` checkpoint.

  ``kwargs`` may hold the size keys of either modality (``image_size``,
  ``channels``, ``vocab_size``, ``max_len``); those of the other modality are
  ignored, so one call site can build any encoder. An ``hf:`` encoder is
  loaded from its folder (sizes from its ``config.json``; the size keys are
  ignored) with LoRA adapters when ``lora_rank > 0``; ``modality`` picks a
  CLIP checkpoint's tower.
  """
  if not hf.is_hf(name):
    modality = encoder_modality(name, modality)
  unknown = sorted(set(kwargs) - {k for keys in _MODALITY_KEYS.values() for k in keys})
  if unknown:
    raise ValueError(f"unknown encoder arguments {unknown}.")
  if hf.is_hf(name):
    return hf.zoo_encoder(name, modality=modality, lora_rank=lora_rank, rngs=rngs)
  _, constructor = ENCODERS[name]
  kwargs = {k: v for k, v in kwargs.items() if k in _MODALITY_KEYS[modality]}
  return constructor(lora_rank=lora_rank, rngs=rngs, **kwargs)


def build(name_or_config: str | Mapping[str, Any], *, rngs: nnx.Rngs, **overrides) -> UserModel:
  """Builds a :class:`UserModel` from an encoder name or a config mapping.

  Args:
    name_or_config: an encoder name (other keys then come from ``overrides``)
      or a mapping (``dict``, ``ml_collections.ConfigDict``) of the keys in
      :data:`DEFAULTS`.
    rngs: random streams for initialisation (``params``).
    **overrides: config keys that take precedence over ``name_or_config``.

  Returns:
    The initialised model.

  Raises:
    ValueError: unknown encoder/head/key, missing ``num_outputs``, a modality
      that contradicts the encoder, a segmentation head on a text encoder,
      ``lora_rank > 0`` on a convolutional encoder, or a ``pretrained``
      checkpoint that is missing or does not fit
      (:class:`~fedjax_mm.models.pretrained.PretrainedError`).
  """
  if isinstance(name_or_config, str):
    config = {"encoder": name_or_config}
  elif hasattr(name_or_config, "to_dict"):
    config = dict(name_or_config.to_dict())
  elif isinstance(name_or_config, Mapping):
    config = dict(name_or_config)
  else:
    raise ValueError(f"expected an encoder name or a config mapping, got {name_or_config!r}.")
  config.update(overrides)
  unknown = sorted(set(config) - set(DEFAULTS))
  if unknown:
    raise ValueError(f"unknown model config keys {unknown}; valid keys: {', '.join(DEFAULTS)}.")
  c = {**DEFAULTS, **config}

  modality = encoder_modality(c["encoder"], c["modality"])
  head_cls = _choose("head", c["head"], HEADS)
  if hf.is_hf(c["encoder"]) and c["pretrained"]:
    raise ValueError(
      f"encoder {c['encoder']!r} is a checkpoint already; `pretrained` must be unset, "
      f"got {c['pretrained']!r}."
    )
  for key in ("num_outputs", "rep_dim"):
    if isinstance(c[key], bool) or not isinstance(c[key], int) or c[key] < 1:
      raise ValueError(f"{key} must be a positive int, got {c[key]!r}.")
  if head_cls.reads == "spatial" and modality != "image":
    raise ValueError(f"head {c['head']!r} needs an image encoder, got {c['encoder']!r}.")
  if not isinstance(c["standardize"], bool):
    raise ValueError(f"standardize must be a bool, got {c['standardize']!r}.")
  if c["standardize"] and not c["pretrained"]:
    raise ValueError(
      "standardize=True needs a `pretrained` checkpoint: the statistics are its pretraining data's."
    )

  encoder = build_encoder(
    c["encoder"],
    rngs=rngs,
    lora_rank=c["lora_rank"],
    modality=modality,
    **{k: c[k] for k in _MODALITY_KEYS[modality]},
  )
  if c["pretrained"]:
    expect = {"encoder": c["encoder"], **{k: c[k] for k in _MODALITY_KEYS[modality]}}
    pretrained.load_into(encoder, c["pretrained"], expect=expect)
  standardize = (
    Standardize(*pretrained.read_feature_stats(c["pretrained"])) if c["standardize"] else None
  )
  projector = nnx.Linear(encoder.features, c["rep_dim"], rngs=rngs)
  head_kwargs = (
    {} if c["head_hidden"] is None or c["head"] == "linear" else {"hidden": c["head_hidden"]}
  )
  if head_cls.reads == "spatial":
    head = head_cls(encoder.spatial_features, c["num_outputs"], rngs=rngs, **head_kwargs)
  else:
    head = head_cls(c["rep_dim"], c["num_outputs"], rngs=rngs, **head_kwargs)
  return UserModel(encoder, projector, head, modality=modality, standardize=standardize)


def param_count(model: nnx.Module, wrt: nnx.filterlib.Filter = nnx.Param) -> int:
  """Number of scalar parameters of ``model`` selected by ``wrt`` (default: all)."""
  state = nnx.state(model, wrt)
  return sum(x.size for x in jax.tree.leaves(state))
