"""The per-user model: encoder + projector (the representation model) + task head.

FedMuscle (and CreamFL, FedSCMR) split user n's model into a representation
model ``w^n`` and a task head::

    pooled, spatial = encoder(x)          pooled [b, h], spatial [b, H', W', c] or [b, L, h]
    p  = projector(pooled)                [b, d]      (d = rep_dim, 256 in the paper)
    z  = p / max(||p||, eps)              [b, d]      what crosses the wire
    y  = head(p)          classification  [b, C]      logits
    y  = head(spatial)    segmentation    [b, H, W, C]

:meth:`UserModel.forward` returns ``(z, y)`` from one encoder pass, which is
what a local step that mixes a task loss and a contrastive loss needs.

The three attribute names ``encoder``, ``projector`` and ``head`` are part of
the contract: the engine selects parameters by path with
:data:`representation_filter` (encoder + projector, for contrastive epochs)
and :data:`head_filter`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["UserModel", "head_filter", "l2_normalize", "representation_filter"]

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


class UserModel(nnx.Module):
  """Encoder + projector + head for one user.

  Args:
    encoder: image or text encoder returning ``(pooled [b, h], spatial)``; must
      expose ``features`` (= h).
    projector: dense ``h -> d``.
    head: a module from :mod:`fedjax_mm.models.heads` (``reads`` says whether
      it consumes the projector output or the spatial map).
    modality: ``"image"`` or ``"text"``.
  """

  def __init__(
    self, encoder: nnx.Module, projector: nnx.Module, head: nnx.Module, *, modality: str
  ):
    if modality not in ("image", "text"):
      raise ValueError(f"modality must be 'image' or 'text', got {modality!r}.")
    if head.reads == "spatial" and modality != "image":
      raise ValueError("a segmentation head needs an image encoder.")
    self.encoder = encoder
    self.projector = projector
    self.head = head
    self.modality = modality

  @property
  def rep_dim(self) -> int:
    return self.projector.out_features

  def _head(self, p: jax.Array | None, spatial: jax.Array, x: jax.Array) -> jax.Array:
    if self.head.reads == "spatial":
      return self.head(spatial, out_size=x.shape[1:3])
    return self.head(p)

  def represent(self, x: jax.Array) -> jax.Array:
    """L2-normalised representations ``z [b, d]`` of inputs ``x``."""
    pooled, _ = self.encoder(x)
    return l2_normalize(self.projector(pooled))

  def __call__(self, x: jax.Array) -> jax.Array:
    """Task outputs: logits ``[b, C]`` or per-pixel logits ``[b, H, W, C]``."""
    pooled, spatial = self.encoder(x)
    p = None if self.head.reads == "spatial" else self.projector(pooled)
    return self._head(p, spatial, x)

  def forward(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(z, outputs)`` = (:meth:`represent`, :meth:`__call__`) with one encoder pass."""
    pooled, spatial = self.encoder(x)
    p = self.projector(pooled)
    return l2_normalize(p), self._head(p, spatial, x)
