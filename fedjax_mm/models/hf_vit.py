"""ViT (Dosovitskiy et al., 2021) as ``transformers``' ``ViTModel`` computes it, in Flax NNX.

Pre-LN encoder layers with a class token::

    x = [cls; patches(pixels) W + b] + position            [b, 1 + n, w]
    x = x + dense(Attention(layernorm_before(x)))
    x = x + output(act(intermediate(layernorm_after(x))))
    states = layernorm(x)
    pooled = pooler_act(pooler(states[:, 0]))              only with a pooler (ViTModel)

Checkpoints of ``ViTForImageClassification`` carry no pooler: their ``pooled``
is ``states[:, 0]``, what that head reads. ``pixel_values`` are channels-last
``[b, H, W, C]``, already normalised as the checkpoint's image processor does
(``preprocessor_config.json``: ``image_mean``, ``image_std``); PyTorch's
``Conv2d`` patch kernel (OIHW) is stored here as HWIO. Position embeddings are
not interpolated: images must have the checkpoint's ``image_size``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from fedjax_mm.models.hf_layers import (
  EncoderOutput,
  PatchEmbed,
  activation,
  attend,
  check_image,
)
from fedjax_mm.models.lora import dense

__all__ = ["ViTConfig", "ViTModel"]


@dataclasses.dataclass(frozen=True)
class ViTConfig:
  """The ``config.json`` keys ViTModel reads (defaults: ``transformers.ViTConfig``'s)."""

  hidden_size: int = 768
  num_hidden_layers: int = 12
  num_attention_heads: int = 12
  intermediate_size: int = 3072
  hidden_act: str = "gelu"
  layer_norm_eps: float = 1e-12
  image_size: int = 224
  patch_size: int = 16
  num_channels: int = 3
  qkv_bias: bool = True
  pooler_output_size: int | None = None
  pooler_act: str = "tanh"


class ViTEmbeddings(nnx.Module):
  def __init__(self, c: ViTConfig, *, rngs: nnx.Rngs):
    n = (c.image_size // c.patch_size) ** 2
    self.cls_token = nnx.Param(jnp.zeros((1, 1, c.hidden_size)))
    self.patch_embeddings = ViTPatchEmbeddings(c, rngs=rngs)
    self.position_embeddings = nnx.Param(
      nnx.initializers.normal(0.02)(rngs.params(), (1, n + 1, c.hidden_size))
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    p = self.patch_embeddings(x)
    cls = jnp.broadcast_to(self.cls_token[...], (p.shape[0], 1, p.shape[-1]))
    return jnp.concatenate([cls, p], axis=1) + self.position_embeddings[...]


class ViTPatchEmbeddings(nnx.Module):
  def __init__(self, c: ViTConfig, *, rngs: nnx.Rngs):
    self.projection = PatchEmbed(
      c.num_channels, c.hidden_size, c.patch_size, use_bias=True, rngs=rngs
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.projection(x)


class ViTSelfAttention(nnx.Module):
  def __init__(self, c: ViTConfig, *, lora_rank: int, rngs: nnx.Rngs):
    w, bias = c.hidden_size, c.qkv_bias
    self.num_heads = c.num_attention_heads
    self.query = dense(w, w, lora_rank=lora_rank, use_bias=bias, rngs=rngs)
    self.key = dense(w, w, lora_rank=lora_rank, use_bias=bias, rngs=rngs)
    self.value = dense(w, w, lora_rank=lora_rank, use_bias=bias, rngs=rngs)

  def __call__(self, h: jax.Array) -> jax.Array:
    return attend(self.query(h), self.key(h), self.value(h), self.num_heads)


class ViTDense(nnx.Module):
  """A module holding one ``dense`` (PyTorch's ViTSelfOutput / ViTIntermediate / ViTOutput)."""

  def __init__(self, fan_in: int, fan_out: int, *, lora_rank: int, rngs: nnx.Rngs):
    self.dense = dense(fan_in, fan_out, lora_rank=lora_rank, rngs=rngs)

  def __call__(self, h: jax.Array) -> jax.Array:
    return self.dense(h)


class ViTAttention(nnx.Module):
  def __init__(self, c: ViTConfig, *, lora_rank: int, rngs: nnx.Rngs):
    self.attention = ViTSelfAttention(c, lora_rank=lora_rank, rngs=rngs)
    self.output = ViTDense(c.hidden_size, c.hidden_size, lora_rank=lora_rank, rngs=rngs)

  def __call__(self, h: jax.Array) -> jax.Array:
    return self.output(self.attention(h))


class ViTLayer(nnx.Module):
  def __init__(self, c: ViTConfig, *, lora_rank: int, rngs: nnx.Rngs):
    w, eps = c.hidden_size, c.layer_norm_eps
    self.act = c.hidden_act
    self.layernorm_before = nnx.LayerNorm(w, epsilon=eps, rngs=rngs)
    self.attention = ViTAttention(c, lora_rank=lora_rank, rngs=rngs)
    self.layernorm_after = nnx.LayerNorm(w, epsilon=eps, rngs=rngs)
    self.intermediate = ViTDense(w, c.intermediate_size, lora_rank=lora_rank, rngs=rngs)
    self.output = ViTDense(c.intermediate_size, w, lora_rank=lora_rank, rngs=rngs)

  def __call__(self, h: jax.Array) -> jax.Array:
    h = h + self.attention(self.layernorm_before(h))
    return h + self.output(activation(self.act)(self.intermediate(self.layernorm_after(h))))


class ViTEncoder(nnx.Module):
  def __init__(self, c: ViTConfig, *, lora_rank: int, rngs: nnx.Rngs):
    self.layer = nnx.List(
      [ViTLayer(c, lora_rank=lora_rank, rngs=rngs) for _ in range(c.num_hidden_layers)]
    )

  def __call__(self, h: jax.Array) -> jax.Array:
    for layer in self.layer:
      h = layer(h)
    return h


class ViTPooler(nnx.Module):
  def __init__(self, c: ViTConfig, *, rngs: nnx.Rngs):
    self.dense = nnx.Linear(c.hidden_size, c.pooler_output_size or c.hidden_size, rngs=rngs)
    self.act = c.pooler_act

  def __call__(self, h: jax.Array) -> jax.Array:
    return activation(self.act)(self.dense(h[:, 0]))


class ViTModel(nnx.Module):
  """``transformers.ViTModel`` (inference) in NNX, channels-last input.

  Args:
    config: the checkpoint's :class:`ViTConfig`.
    pooler: whether the checkpoint has a pooler (``pooler.dense``).
    lora_rank: LoRA rank on attention and MLP dense layers (0 = none).
    rngs: random streams (the loader overwrites every base parameter).

  Attributes:
    features: width of ``pooled``; ``grid``: patches per side;
    ``modality``: ``"image"``.
  """

  modality = "image"

  def __init__(self, config: ViTConfig, *, pooler: bool = True, lora_rank: int = 0, rngs: nnx.Rngs):
    if config.image_size % config.patch_size:
      raise ValueError(
        f"image_size {config.image_size} is not a multiple of patch_size {config.patch_size}."
      )
    activation(config.hidden_act)
    self.config = config
    self.grid = config.image_size // config.patch_size
    self.width = config.hidden_size
    self.features = (config.pooler_output_size or config.hidden_size) if pooler else self.width
    self.embeddings = ViTEmbeddings(config, rngs=rngs)
    self.encoder = ViTEncoder(config, lora_rank=lora_rank, rngs=rngs)
    self.layernorm = nnx.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps, rngs=rngs)
    self.pooler = ViTPooler(config, rngs=rngs) if pooler else None

  def __call__(self, pixel_values: jax.Array) -> EncoderOutput:
    """``[b, H, W, C]`` -> ``EncoderOutput(states [b, 1 + n, w], pooled [b, features])``.

    ``states[:, 0]`` is the class token; ``states[:, 1:]`` the patches in
    row-major order over the ``grid x grid`` patch grid.
    """
    c = self.config
    check_image(pixel_values, c.image_size, c.num_channels)
    h = self.layernorm(self.encoder(self.embeddings(pixel_values)))
    pooled = self.pooler(h) if self.pooler is not None else h[:, 0]
    return EncoderOutput(h, pooled)
