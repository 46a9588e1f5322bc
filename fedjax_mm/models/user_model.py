"""The per-user model: encoder + projector (the representation model) + task head.

FedMuscle (and CreamFL, FedSCMR) split user n's model into a representation
model ``w^n`` and a task head::

    pooled, spatial = encoder(x)          pooled [b, h], spatial [b, H', W', c] or [b, L, h]
    pooled = (pooled - mu) / sigma        optional: a pretrained encoder's feature statistics
    p  = projector(pooled)                [b, d]      (d = rep_dim, 256 in the paper)
    z  = p / max(||p||, eps)              [b, d]      what crosses the wire
    y  = head(p)          classification  [b, C]      logits
    y  = head(spatial)    segmentation    [b, H, W, C]

:meth:`UserModel.forward` returns ``(z, y)`` from one encoder pass, which is
what a local step that mixes a task loss and a contrastive loss needs.

A model whose encoder is frozen (a CNN fine-tuned with "adapters", which has
no dense layers for LoRA) computes the same pooled features of a sample at
every step. After :meth:`UserModel.read_pooled` it reads those features ``[b, h]``
in place of the raw input and skips the encoder
(:mod:`fedjax_mm.core.features` computes them once per set); its parameters
are the same, only the graph's static flag differs.

The three attribute names ``encoder``, ``projector`` and ``head`` are part of
the contract: the engine selects parameters by path with
:data:`representation_filter` (encoder + projector, for contrastive epochs)
and :data:`head_filter`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = [
  "FeatureStat",
  "Standardize",
  "UserModel",
  "head_filter",
  "l2_normalize",
  "representation_filter",
]

#: Parameters of the representation model ``w^n`` (encoder + projector).
representation_filter = nnx.All(
  nnx.Param, nnx.Any(nnx.PathContains("encoder"), nnx.PathContains("projector"))
)
#: Parameters of the task head.
head_filter = nnx.All(nnx.Param, nnx.PathContains("head"))


def l2_normalize(x: jax.Array, axis: int = -1, eps: float = 1e-6) -> jax.Array:
  """``x / max(||x||, eps)`` along ``axis``; 0 (with a zero gradient) for ``x = 0``.

  ``jnp.linalg.norm`` has a NaN gradient at 0; clamping the squared norm first
  keeps both the value and the gradient finite.
  """
  sq = jnp.sum(x * x, axis=axis, keepdims=True)
  return x * jax.lax.rsqrt(jnp.maximum(sq, eps * eps))


class FeatureStat(nnx.Variable):
  """A fixed statistic of a pretrained encoder's features: not an ``nnx.Param``, never trained."""


class Standardize(nnx.Module):
  """``(x - mean) / max(std, eps)`` per feature, with fixed statistics.

  The pooled features of a pretrained encoder over its pretraining data
  (:func:`fedjax_mm.models.pretrained.feature_stats`), as the frozen BatchNorm
  statistics of a pretrained ResNet or the final LayerNorm of a ViT put the
  papers' encoders' features on one scale. Raw World-CLIP CNN features are
  averages of ReLU maps whose dimensions differ in scale by up to 7x (cnn_m),
  and a head trained on them under Adam with 50-200 samples learns less
  (docs/guides/pretrained.md). ``mean`` and ``std`` are :class:`FeatureStat` variables, so
  ``nnx.Param`` filters (what an optimiser trains, what FedAvg averages) skip them.
  """

  def __init__(self, mean, std, *, eps: float = 1e-6):
    mean, std = jnp.asarray(mean, jnp.float32), jnp.asarray(std, jnp.float32)
    if mean.ndim != 1 or mean.shape != std.shape:
      raise ValueError(f"mean and std must be equal [h] vectors, got {mean.shape}, {std.shape}.")
    self.mean = FeatureStat(mean)
    self.std = FeatureStat(std)
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    return (x - self.mean[...]) / jnp.maximum(self.std[...], self.eps)


class UserModel(nnx.Module):
  """Encoder + projector + head for one user.

  Args:
    encoder: image or text encoder returning ``(pooled [b, h], spatial)``; must
      expose ``features`` (= h).
    projector: dense ``h -> d``.
    head: a module from :mod:`fedjax_mm.models.heads` (``reads`` says whether
      it consumes the projector output or the spatial map).
    modality: ``"image"`` or ``"text"``.
    standardize: optional :class:`Standardize` applied to the pooled features
      before the projector (the segmentation head's feature map is left as is).

  ``pooled_input`` (False until :meth:`read_pooled`): the model reads the
  encoder's pooled features ``[b, h]`` (computed beforehand by :meth:`pooled`)
  instead of raw inputs, and never runs its encoder.
  """

  def __init__(
    self,
    encoder: nnx.Module,
    projector: nnx.Module,
    head: nnx.Module,
    *,
    modality: str,
    standardize: Standardize | None = None,
  ):
    if modality not in ("image", "text"):
      raise ValueError(f"modality must be 'image' or 'text', got {modality!r}.")
    if head.reads == "spatial" and modality != "image":
      raise ValueError("a segmentation head needs an image encoder.")
    if standardize is not None and standardize.mean.shape != (encoder.features,):
      raise ValueError(
        f"standardize has {standardize.mean.shape[0]} features, the encoder {encoder.features}."
      )
    self.encoder = encoder
    self.standardize = standardize
    self.projector = projector
    self.head = head
    self.modality = modality
    self.pooled_input = False

  def read_pooled(self) -> None:
    """From now on the model reads pooled encoder features, not raw inputs (see the class)."""
    if self.head.reads == "spatial":
      raise ValueError("a segmentation head reads the encoder's feature map: it needs raw inputs.")
    self.pooled_input = True

  def pooled(self, x: jax.Array) -> jax.Array:
    """The encoder's pooled features ``[b, h]`` of raw inputs (before ``standardize``)."""
    return self.encoder(x)[0]

  def _encode(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    if self.pooled_input:
      if x.shape[-1:] != (self.encoder.features,) or x.ndim != 2:
        raise ValueError(
          f"this model reads pooled features [b, {self.encoder.features}], got {x.shape}."
        )
      return x, None
    return self.encoder(x)

  @property
  def rep_dim(self) -> int:
    return self.projector.out_features

  def _pooled(self, pooled: jax.Array) -> jax.Array:
    return pooled if self.standardize is None else self.standardize(pooled)

  def _head(self, p: jax.Array | None, spatial: jax.Array, x: jax.Array) -> jax.Array:
    if self.head.reads == "spatial":
      return self.head(spatial, out_size=x.shape[1:3])
    return self.head(p)

  def represent(self, x: jax.Array) -> jax.Array:
    """L2-normalised representations ``z [b, d]`` of inputs ``x``."""
    pooled, _ = self._encode(x)
    return l2_normalize(self.projector(self._pooled(pooled)))

  def __call__(self, x: jax.Array) -> jax.Array:
    """Task outputs: logits ``[b, C]`` or per-pixel logits ``[b, H, W, C]``."""
    pooled, spatial = self._encode(x)
    p = None if self.head.reads == "spatial" else self.projector(self._pooled(pooled))
    return self._head(p, spatial, x)

  def forward(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(z, outputs)`` = (:meth:`represent`, :meth:`__call__`) with one encoder pass."""
    pooled, spatial = self._encode(x)
    p = self.projector(self._pooled(pooled))
    return l2_normalize(p), self._head(p, spatial, x)
