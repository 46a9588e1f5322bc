"""Image encoders: small CNNs, a tiny ResNet and a ViT family, sized for CPUs.

Every encoder maps a batch of images ``x: float32 [b, H, W, C]`` in ``[0, 1]``
to a pair::

    pooled   [b, features]                     global feature (mean over space)
    spatial  [b, H', W', spatial_features]     feature map for dense heads

with ``H' = H / 4`` for every encoder here (two stride-2 stages for the CNNs and
the conv-stem ViTs, patch size 4 for the patch ViTs), so a segmentation head can
read ``spatial`` whichever encoder a user picked.

The encoders are pure functions of their parameters: normalisation is
GroupNorm (CNNs) or LayerNorm (ViTs), never BatchNorm, and nothing is random at
call time, so a stacked pytree of many clients' states runs under ``jax.vmap``.

+--------------+--------------------------------------+----------+
| name         | kind                                 | features |
+==============+======================================+==========+
| ``cnn_s``    | 3 conv3x3 (32-64-64), GN, ReLU       | 64       |
+--------------+--------------------------------------+----------+
| ``cnn_m``    | 5 conv3x3 (32-64-64-128-128)         | 128      |
+--------------+--------------------------------------+----------+
| ``resnet_t`` | s2 stem + 3 basic blocks (32-64-128) | 128      |
+--------------+--------------------------------------+----------+
| ``vit_t``    | patch 4, width 64, depth 2, 2 heads  | 64       |
+--------------+--------------------------------------+----------+
| ``vit_s``    | patch 4, width 96, depth 4, 3 heads  | 96       |
+--------------+--------------------------------------+----------+
| ``vit_b``    | patch 4, width 128, depth 6, 4 heads | 128      |
+--------------+--------------------------------------+----------+
| ``vitc_t``   | ``vit_t`` with a conv stem           | 64       |
+--------------+--------------------------------------+----------+
| ``vitc_s``   | ``vit_s`` with a conv stem           | 96       |
+--------------+--------------------------------------+----------+
| ``vitc_b``   | ``vit_b`` with a conv stem           | 128      |
+--------------+--------------------------------------+----------+

(ViT MLPs have hidden width 2 x width.) The conv stem (Xiao et al., 2021, "Early
convolutions help transformers see better") replaces the patch embedding by three
3x3 convolutions (32 s1, 64 s2, width s2; GroupNorm + GELU after the first two):
the same 8x8 token grid, the same blocks. On the embedded world, whose shapes span
two or three 4x4 patches, a patch-4 ViT barely learns shape even when trained on it
directly; a conv stem learns it several times faster (the zoo's model cards).

Only the ViTs accept LoRA adapters (on attention and MLP dense layers); the
convolutional encoders reject ``lora_rank > 0`` with a ``ValueError`` rather
than silently freezing the whole encoder.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import nnx

from fedjax_mm.models.conv import Conv
from fedjax_mm.models.layers import TransformerBlock
from fedjax_mm.models.norm import GroupNorm

__all__ = [
  "Cnn",
  "ResNet",
  "Vit",
  "cnn_m",
  "cnn_s",
  "resnet_t",
  "vit_b",
  "vit_s",
  "vit_t",
  "vitc_b",
  "vitc_s",
  "vitc_t",
]

_GROUPS = 8  # GroupNorm groups; every width below is a multiple of 8.


def _no_lora(name: str, lora_rank: int) -> None:
  if lora_rank:
    raise ValueError(
      f"encoder {name!r} is convolutional and has no dense layers to adapt; "
      f"use lora_rank=0 (got {lora_rank}) or a ViT encoder."
    )


def _check_image(x: jax.Array, channels: int) -> None:
  if x.ndim != 4 or x.shape[-1] != channels:
    raise ValueError(f"expected images [b, H, W, {channels}], got shape {x.shape}.")


class ConvNormAct(nnx.Module):
  """conv3x3 (optionally stride 2) -> GroupNorm -> optional ReLU."""

  def __init__(self, cin: int, cout: int, *, stride: int = 1, act: bool = True, rngs: nnx.Rngs):
    self.conv = Conv(cin, cout, (3, 3), strides=stride, use_bias=False, rngs=rngs)
    self.norm = GroupNorm(cout, num_groups=_GROUPS, rngs=rngs)
    self.act = act

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.norm(self.conv(x))
    return jax.nn.relu(x) if self.act else x


class Cnn(nnx.Module):
  """A plain stack of ``ConvNormAct`` layers; mean-pooled output.

  Args:
    widths_strides: ``(width, stride)`` per layer.
    channels: input channels C.
    rngs: random streams.
  """

  def __init__(
    self, widths_strides: Sequence[tuple[int, int]], *, channels: int = 3, rngs: nnx.Rngs
  ):
    layers, cin = [], channels
    for width, stride in widths_strides:
      layers.append(ConvNormAct(cin, width, stride=stride, rngs=rngs))
      cin = width
    self.layers = nnx.List(layers)
    self.channels = channels
    self.features = cin
    self.spatial_features = cin

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[b, H, W, C] -> ([b, features], [b, H/4, W/4, features])``."""
    _check_image(x, self.channels)
    for layer in self.layers:
      x = layer(x)
    return x.mean(axis=(1, 2)), x


class BasicBlock(nnx.Module):
  """ResNet basic block with GroupNorm; 1x1 projection shortcut on shape change."""

  def __init__(self, cin: int, cout: int, *, stride: int, rngs: nnx.Rngs):
    self.conv1 = ConvNormAct(cin, cout, stride=stride, rngs=rngs)
    self.conv2 = ConvNormAct(cout, cout, act=False, rngs=rngs)
    if stride != 1 or cin != cout:
      self.shortcut = nnx.Sequential(
        Conv(cin, cout, (1, 1), strides=stride, use_bias=False, rngs=rngs),
        GroupNorm(cout, num_groups=_GROUPS, rngs=rngs),
      )
    else:
      self.shortcut = None

  def __call__(self, x: jax.Array) -> jax.Array:
    skip = x if self.shortcut is None else self.shortcut(x)
    return jax.nn.relu(self.conv2(self.conv1(x)) + skip)


class ResNet(nnx.Module):
  """A ResNet-style encoder: a stride-2 conv stem, then one basic block per stage."""

  def __init__(
    self,
    stem: int,
    stages: Sequence[tuple[int, int]],
    *,
    channels: int = 3,
    rngs: nnx.Rngs,
  ):
    self.stem = ConvNormAct(channels, stem, stride=2, rngs=rngs)
    blocks, cin = [], stem
    for width, stride in stages:
      blocks.append(BasicBlock(cin, width, stride=stride, rngs=rngs))
      cin = width
    self.blocks = nnx.List(blocks)
    self.channels = channels
    self.features = cin
    self.spatial_features = cin

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[b, H, W, C] -> ([b, features], [b, H/4, W/4, features])``."""
    _check_image(x, self.channels)
    x = self.stem(x)
    for block in self.blocks:
      x = block(x)
    return x.mean(axis=(1, 2)), x


class ConvStem(nnx.Module):
  """``[b, S, S, C] -> [b, S/4, S/4, width]``: conv3x3 32 (s1), 64 (s2), width (s2)."""

  def __init__(self, channels: int, width: int, *, rngs: nnx.Rngs):
    self.convs = nnx.List(
      [
        Conv(channels, 32, (3, 3), strides=1, use_bias=False, rngs=rngs),
        Conv(32, 64, (3, 3), strides=2, use_bias=False, rngs=rngs),
        Conv(64, width, (3, 3), strides=2, rngs=rngs),
      ]
    )
    self.norms = nnx.List(
      [GroupNorm(32, num_groups=_GROUPS, rngs=rngs), GroupNorm(64, num_groups=_GROUPS, rngs=rngs)]
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    for conv, norm in zip(self.convs[:2], self.norms, strict=True):
      x = jax.nn.gelu(norm(conv(x)))
    return self.convs[2](x)


class Vit(nnx.Module):
  """Vision Transformer (Dosovitskiy et al., 2021) without a class token.

  Non-overlapping ``patch x patch`` patches are flattened and embedded by a
  dense layer, a learned positional embedding is added, pre-LN blocks follow,
  and a final LayerNorm. The pooled feature is the mean of the patch tokens;
  the spatial map is the tokens on the ``image_size / patch`` grid.

  Args:
    width: token width (= ``features``).
    depth: number of blocks.
    num_heads: attention heads.
    patch: patch size; must divide ``image_size``.
    stem: ``"patch"`` (a dense layer on flattened patches) or ``"conv"``
      (:class:`ConvStem`, which needs ``patch == 4``).
    image_size: input height = width.
    channels: input channels.
    mlp_ratio: MLP hidden width / width (2 rather than the usual 4 keeps
      ``vit_b`` cheap on CPUs).
    lora_rank: LoRA rank for attention and MLP dense layers (0 = none).
    rngs: random streams.
  """

  def __init__(
    self,
    *,
    width: int,
    depth: int,
    num_heads: int,
    patch: int = 4,
    stem: str = "patch",
    image_size: int = 32,
    channels: int = 3,
    mlp_ratio: int = 2,
    lora_rank: int = 0,
    rngs: nnx.Rngs,
  ):
    if stem not in ("patch", "conv"):
      raise ValueError(f"stem must be 'patch' or 'conv', got {stem!r}.")
    if stem == "conv" and patch != 4:
      raise ValueError(f"the conv stem downsamples by 4; got patch {patch}.")
    if image_size % patch:
      raise ValueError(f"image_size {image_size} is not divisible by the patch size {patch}.")
    self.patch = patch
    self.image_size = image_size
    self.channels = channels
    self.grid = image_size // patch
    self.features = width
    self.spatial_features = width
    self.stem = stem
    if stem == "conv":
      self.embed = ConvStem(channels, width, rngs=rngs)
    else:
      self.embed = nnx.Linear(patch * patch * channels, width, rngs=rngs)
    self.pos = nnx.Param(
      nnx.initializers.normal(0.02)(rngs.params(), (self.grid * self.grid, width))
    )
    self.blocks = nnx.List(
      [
        TransformerBlock(width, num_heads, mlp_ratio=mlp_ratio, lora_rank=lora_rank, rngs=rngs)
        for _ in range(depth)
      ]
    )
    self.norm = nnx.LayerNorm(width, rngs=rngs)

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[b, S, S, C] -> ([b, width], [b, S/patch, S/patch, width])``."""
    _check_image(x, self.channels)
    tokens = self.embed_tokens(x)
    for block in self.blocks:
      tokens = block(tokens)
    tokens = self.norm(tokens)
    g = self.grid
    return tokens.mean(axis=1), tokens.reshape(x.shape[0], g, g, -1)

  def embed_tokens(self, x: jax.Array) -> jax.Array:
    """``[b, S, S, C] -> [b, (S/patch)^2, width]``: the stem's tokens plus positions.

    What the blocks read; a model that runs the blocks itself (RCSR's adapters after
    each block) starts here, so it follows either stem.
    """
    b, h, w, c = x.shape
    if (h, w) != (self.image_size, self.image_size):
      raise ValueError(f"Vit built for {self.image_size}x{self.image_size} images, got {h}x{w}.")
    g, p = self.grid, self.patch
    if self.stem == "conv":
      tokens = self.embed(x).reshape(b, g * g, -1)
    else:
      patches = x.reshape(b, g, p, g, p, c).transpose(0, 1, 3, 2, 4, 5)
      tokens = self.embed(patches.reshape(b, g * g, p * p * c))
    return tokens + self.pos[...]


# --- Named constructors (the registry's entries) -------------------------------
# Each takes (*, image_size, channels, lora_rank, rngs) so the registry can call
# them uniformly.


def cnn_s(*, image_size: int = 32, channels: int = 3, lora_rank: int = 0, rngs: nnx.Rngs) -> Cnn:
  """3-layer CNN, widths 32-64-64, features 64."""
  del image_size  # fully convolutional
  _no_lora("cnn_s", lora_rank)
  return Cnn([(32, 1), (64, 2), (64, 2)], channels=channels, rngs=rngs)


def cnn_m(*, image_size: int = 32, channels: int = 3, lora_rank: int = 0, rngs: nnx.Rngs) -> Cnn:
  """5-layer CNN, widths 32-64-64-128-128, features 128."""
  del image_size
  _no_lora("cnn_m", lora_rank)
  return Cnn([(32, 1), (64, 2), (64, 1), (128, 2), (128, 1)], channels=channels, rngs=rngs)


def resnet_t(
  *, image_size: int = 32, channels: int = 3, lora_rank: int = 0, rngs: nnx.Rngs
) -> ResNet:
  """Tiny ResNet: stem 32 (s2), basic blocks 32 (s1), 64 (s2), 128 (s1); features 128."""
  del image_size
  _no_lora("resnet_t", lora_rank)
  return ResNet(32, [(32, 1), (64, 2), (128, 1)], channels=channels, rngs=rngs)


def vit_t(*, image_size: int = 32, channels: int = 3, lora_rank: int = 0, rngs: nnx.Rngs) -> Vit:
  """ViT-tiny analogue: width 64, depth 2, 2 heads, patch 4."""
  return Vit(
    width=64,
    depth=2,
    num_heads=2,
    image_size=image_size,
    channels=channels,
    lora_rank=lora_rank,
    rngs=rngs,
  )


def vit_s(*, image_size: int = 32, channels: int = 3, lora_rank: int = 0, rngs: nnx.Rngs) -> Vit:
  """ViT-small analogue: width 96, depth 4, 3 heads, patch 4."""
  return Vit(
    width=96,
    depth=4,
    num_heads=3,
    image_size=image_size,
    channels=channels,
    lora_rank=lora_rank,
    rngs=rngs,
  )


def vit_b(*, image_size: int = 32, channels: int = 3, lora_rank: int = 0, rngs: nnx.Rngs) -> Vit:
  """ViT-base analogue: width 128, depth 6, 4 heads, patch 4."""
  return Vit(
    width=128,
    depth=6,
    num_heads=4,
    image_size=image_size,
    channels=channels,
    lora_rank=lora_rank,
    rngs=rngs,
  )


def vitc_t(*, image_size: int = 32, channels: int = 3, lora_rank: int = 0, rngs: nnx.Rngs) -> Vit:
  """``vit_t`` with a conv stem: width 64, depth 2, 2 heads, 8x8 tokens at 32x32."""
  return Vit(
    width=64,
    depth=2,
    num_heads=2,
    stem="conv",
    image_size=image_size,
    channels=channels,
    lora_rank=lora_rank,
    rngs=rngs,
  )


def vitc_s(*, image_size: int = 32, channels: int = 3, lora_rank: int = 0, rngs: nnx.Rngs) -> Vit:
  """``vit_s`` with a conv stem: width 96, depth 4, 3 heads, 8x8 tokens at 32x32."""
  return Vit(
    width=96,
    depth=4,
    num_heads=3,
    stem="conv",
    image_size=image_size,
    channels=channels,
    lora_rank=lora_rank,
    rngs=rngs,
  )


def vitc_b(*, image_size: int = 32, channels: int = 3, lora_rank: int = 0, rngs: nnx.Rngs) -> Vit:
  """``vit_b`` with a conv stem: width 128, depth 6, 4 heads, 8x8 tokens at 32x32."""
  return Vit(
    width=128,
    depth=6,
    num_heads=4,
    stem="conv",
    image_size=image_size,
    channels=channels,
    lora_rank=lora_rank,
    rngs=rngs,
  )
