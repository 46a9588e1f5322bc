"""Task heads: what turns a representation into task outputs.

Each head declares which encoder output it reads, through the static class
attribute ``reads``:

* ``"representation"``: the projector output ``[b, d]`` before L2
  normalisation, so the head sits on top of the representation model
  (FedMuscle's ``w^n``). :class:`LinearHead`, :class:`MlpHead`.
* ``"spatial"``: the encoder's feature map ``[b, H', W', c]``.
  :class:`SegmentationHead`.

Single-label and multi-label classification use the same heads; they output
logits and the loss applies softmax or sigmoid.
"""

from __future__ import annotations

import jax
from flax import nnx

from fedjax_mm.models.conv import Conv
from fedjax_mm.models.norm import GroupNorm

__all__ = ["LinearHead", "MlpHead", "SegmentationHead"]


class LinearHead(nnx.Module):
  """``[b, d] -> [b, num_outputs]`` logits by one dense layer."""

  reads = "representation"

  def __init__(self, in_features: int, num_outputs: int, *, rngs: nnx.Rngs):
    self.dense = nnx.Linear(in_features, num_outputs, rngs=rngs)

  def __call__(self, z: jax.Array) -> jax.Array:
    return self.dense(z)


class MlpHead(nnx.Module):
  """Two-layer MLP with ReLU, as FedMuscle's task heads: ``d -> hidden -> num_outputs``."""

  reads = "representation"

  def __init__(
    self,
    in_features: int,
    num_outputs: int,
    *,
    hidden: int | None = None,
    rngs: nnx.Rngs,
  ):
    hidden = hidden or in_features
    self.fc1 = nnx.Linear(in_features, hidden, rngs=rngs)
    self.fc2 = nnx.Linear(hidden, num_outputs, rngs=rngs)

  def __call__(self, z: jax.Array) -> jax.Array:
    return self.fc2(jax.nn.relu(self.fc1(z)))


class SegmentationHead(nnx.Module):
  """A light decoder: conv3x3 + GroupNorm + ReLU, 1x1 to classes, bilinear upsample.

  ``[b, H', W', c] -> [b, H, W, num_classes]`` per-pixel logits, where
  ``(H, W)`` is given at call time (the input image size).
  """

  reads = "spatial"

  def __init__(
    self,
    in_features: int,
    num_outputs: int,
    *,
    hidden: int = 64,
    rngs: nnx.Rngs,
  ):
    self.conv = Conv(in_features, hidden, (3, 3), use_bias=False, rngs=rngs)
    self.norm = GroupNorm(hidden, num_groups=8 if hidden % 8 == 0 else 1, rngs=rngs)
    self.classify = Conv(hidden, num_outputs, (1, 1), rngs=rngs)

  def __call__(self, feature_map: jax.Array, out_size: tuple[int, int]) -> jax.Array:
    """Per-pixel logits.

    Args:
      feature_map: ``[b, H', W', c]``.
      out_size: ``(H, W)`` of the output (the input image).

    Returns:
      ``[b, H, W, num_outputs]``.
    """
    y = self.classify(jax.nn.relu(self.norm(self.conv(feature_map))))
    b, _, _, k = y.shape
    return jax.image.resize(y, (b, *out_size, k), method="bilinear")
