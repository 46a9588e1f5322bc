"""CLIP (Radford et al., 2021) as ``transformers``' ``CLIPModel`` computes it, in Flax NNX.

Both towers are pre-LN Transformers (``layer_norm1`` -> attention -> residual,
``layer_norm2`` -> MLP -> residual)::

    text:    x = token[ids] + position[0..L-1]; causal + padding mask
             states = final_layer_norm(layers(x))
             pooled = states[b, eos_b]      eos_b: first id == eos_token_id
                                            (argmax of ids for legacy configs with eos_token_id 2)
    vision:  x = pre_layrnorm([class; patches(pixels) W] + position)
             states = layers(x)             (no final norm, as transformers returns it)
             pooled = post_layernorm(states[:, 0])
    joint:   t = normalize(pooled_text W_t), v = normalize(pooled_image W_v)
             logits_per_text = exp(logit_scale) t v^T

``pre_layrnorm`` keeps the original checkpoint's spelling, so names are paths.
LoRA adapts q/k/v/out projections and ``fc1``/``fc2`` of both towers; the
joint projections and ``logit_scale`` are plain parameters.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from fedjax_mm.models.hf_layers import (
  EncoderOutput,
  PatchEmbed,
  activation,
  attend,
  check_image,
  key_mask,
)
from fedjax_mm.models.lora import dense
from fedjax_mm.models.user_model import l2_normalize

__all__ = [
  "CLIPModel",
  "CLIPTextConfig",
  "CLIPTextTransformer",
  "CLIPVisionConfig",
  "CLIPVisionTransformer",
  "ClipOutput",
]


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig:
  """``text_config`` keys (defaults: ``transformers.CLIPTextConfig``'s)."""

  vocab_size: int = 49408
  hidden_size: int = 512
  intermediate_size: int = 2048
  num_hidden_layers: int = 12
  num_attention_heads: int = 8
  max_position_embeddings: int = 77
  hidden_act: str = "quick_gelu"
  layer_norm_eps: float = 1e-5
  pad_token_id: int = 1
  eos_token_id: int = 49407


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig:
  """``vision_config`` keys (defaults: ``transformers.CLIPVisionConfig``'s)."""

  hidden_size: int = 768
  intermediate_size: int = 3072
  num_hidden_layers: int = 12
  num_attention_heads: int = 12
  num_channels: int = 3
  image_size: int = 224
  patch_size: int = 32
  hidden_act: str = "quick_gelu"
  layer_norm_eps: float = 1e-5


class CLIPAttention(nnx.Module):
  def __init__(self, c, *, lora_rank: int, rngs: nnx.Rngs):
    w = c.hidden_size
    self.num_heads = c.num_attention_heads
    self.q_proj = dense(w, w, lora_rank=lora_rank, rngs=rngs)
    self.k_proj = dense(w, w, lora_rank=lora_rank, rngs=rngs)
    self.v_proj = dense(w, w, lora_rank=lora_rank, rngs=rngs)
    self.out_proj = dense(w, w, lora_rank=lora_rank, rngs=rngs)

  def __call__(self, h: jax.Array, mask: jax.Array | None) -> jax.Array:
    y = attend(self.q_proj(h), self.k_proj(h), self.v_proj(h), self.num_heads, mask)
    return self.out_proj(y)


class CLIPMLP(nnx.Module):
  def __init__(self, c, *, lora_rank: int, rngs: nnx.Rngs):
    self.act = c.hidden_act
    self.fc1 = dense(c.hidden_size, c.intermediate_size, lora_rank=lora_rank, rngs=rngs)
    self.fc2 = dense(c.intermediate_size, c.hidden_size, lora_rank=lora_rank, rngs=rngs)

  def __call__(self, h: jax.Array) -> jax.Array:
    return self.fc2(activation(self.act)(self.fc1(h)))


class CLIPEncoderLayer(nnx.Module):
  def __init__(self, c, *, lora_rank: int, rngs: nnx.Rngs):
    w, eps = c.hidden_size, c.layer_norm_eps
    self.self_attn = CLIPAttention(c, lora_rank=lora_rank, rngs=rngs)
    self.layer_norm1 = nnx.LayerNorm(w, epsilon=eps, rngs=rngs)
    self.mlp = CLIPMLP(c, lora_rank=lora_rank, rngs=rngs)
    self.layer_norm2 = nnx.LayerNorm(w, epsilon=eps, rngs=rngs)

  def __call__(self, h: jax.Array, mask: jax.Array | None) -> jax.Array:
    h = h + self.self_attn(self.layer_norm1(h), mask)
    return h + self.mlp(self.layer_norm2(h))


class CLIPEncoder(nnx.Module):
  def __init__(self, c, *, lora_rank: int, rngs: nnx.Rngs):
    self.layers = nnx.List(
      [CLIPEncoderLayer(c, lora_rank=lora_rank, rngs=rngs) for _ in range(c.num_hidden_layers)]
    )

  def __call__(self, h: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    for layer in self.layers:
      h = layer(h, mask)
    return h


class CLIPTextEmbeddings(nnx.Module):
  def __init__(self, c: CLIPTextConfig, *, rngs: nnx.Rngs):
    self.token_embedding = nnx.Embed(c.vocab_size, c.hidden_size, rngs=rngs)
    self.position_embedding = nnx.Embed(c.max_position_embeddings, c.hidden_size, rngs=rngs)

  def __call__(self, ids: jax.Array) -> jax.Array:
    return self.token_embedding(ids) + self.position_embedding(jnp.arange(ids.shape[1]))[None]


class CLIPTextTransformer(nnx.Module):
  """CLIP's text tower (``text_model``): ``(input_ids, attention_mask) -> EncoderOutput``."""

  modality = "text"

  def __init__(self, config: CLIPTextConfig, *, lora_rank: int = 0, rngs: nnx.Rngs):
    activation(config.hidden_act)
    self.config = config
    self.features = config.hidden_size
    self.embeddings = CLIPTextEmbeddings(config, rngs=rngs)
    self.encoder = CLIPEncoder(config, lora_rank=lora_rank, rngs=rngs)
    self.final_layer_norm = nnx.LayerNorm(
      config.hidden_size, epsilon=config.layer_norm_eps, rngs=rngs
    )

  def __call__(
    self, input_ids: jax.Array, attention_mask: jax.Array | None = None
  ) -> EncoderOutput:
    """``int [b, L]`` (+ optional 0/1 mask) -> ``states [b, L, w]``, ``pooled [b, w]`` (EOS state)."""
    c = self.config
    if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
      raise ValueError(f"expected int input_ids [b, L], got {input_ids.dtype} {input_ids.shape}.")
    if input_ids.shape[1] > c.max_position_embeddings:
      raise ValueError(
        f"sequence length {input_ids.shape[1]} exceeds max_position_embeddings "
        f"{c.max_position_embeddings}."
      )
    n = input_ids.shape[1]
    mask = jnp.tril(jnp.ones((n, n), bool))[None, None]
    if attention_mask is not None:
      mask = mask & key_mask(attention_mask)
    h = self.final_layer_norm(self.encoder(self.embeddings(input_ids), mask))
    if c.eos_token_id == 2:  # transformers' legacy rule: the EOS is the largest id
      eos = jnp.argmax(input_ids, axis=-1)
    else:
      eos = jnp.argmax(input_ids == c.eos_token_id, axis=-1)
    return EncoderOutput(h, h[jnp.arange(h.shape[0]), eos])


class CLIPVisionEmbeddings(nnx.Module):
  def __init__(self, c: CLIPVisionConfig, *, rngs: nnx.Rngs):
    n = (c.image_size // c.patch_size) ** 2
    self.class_embedding = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (c.hidden_size,)))
    self.patch_embedding = PatchEmbed(
      c.num_channels, c.hidden_size, c.patch_size, use_bias=False, rngs=rngs
    )
    self.position_embedding = nnx.Embed(n + 1, c.hidden_size, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    p = self.patch_embedding(x)
    cls = jnp.broadcast_to(self.class_embedding[...], (p.shape[0], 1, p.shape[-1]))
    h = jnp.concatenate([cls, p], axis=1)
    return h + self.position_embedding(jnp.arange(h.shape[1]))[None]


class CLIPVisionTransformer(nnx.Module):
  """CLIP's image tower (``vision_model``): ``[b, H, W, C] -> EncoderOutput``."""

  modality = "image"

  def __init__(self, config: CLIPVisionConfig, *, lora_rank: int = 0, rngs: nnx.Rngs):
    if config.image_size % config.patch_size:
      raise ValueError(
        f"image_size {config.image_size} is not a multiple of patch_size {config.patch_size}."
      )
    activation(config.hidden_act)
    self.config = config
    self.grid = config.image_size // config.patch_size
    self.width = config.hidden_size
    self.features = config.hidden_size
    w, eps = config.hidden_size, config.layer_norm_eps
    self.embeddings = CLIPVisionEmbeddings(config, rngs=rngs)
    self.pre_layrnorm = nnx.LayerNorm(w, epsilon=eps, rngs=rngs)
    self.encoder = CLIPEncoder(config, lora_rank=lora_rank, rngs=rngs)
    self.post_layernorm = nnx.LayerNorm(w, epsilon=eps, rngs=rngs)

  def __call__(self, pixel_values: jax.Array) -> EncoderOutput:
    """``states [b, 1 + n, w]`` (class token first), ``pooled [b, w]``."""
    c = self.config
    check_image(pixel_values, c.image_size, c.num_channels)
    h = self.encoder(self.pre_layrnorm(self.embeddings(pixel_values)))
    return EncoderOutput(h, self.post_layernorm(h[:, 0]))


class ClipOutput(NamedTuple):
  """``CLIPModel``'s outputs: logits ``[b_img, b_txt]`` / ``[b_txt, b_img]``, unit embeddings."""

  logits_per_image: jax.Array
  logits_per_text: jax.Array
  text_embeds: jax.Array
  image_embeds: jax.Array


class CLIPModel(nnx.Module):
  """Both towers, their projections into the joint space and the learnt ``logit_scale``.

  Args:
    text_config, vision_config: the towers' configs.
    projection_dim: joint-space width.
    lora_rank: LoRA rank on both towers' attention and MLP layers.
    rngs: random streams.
  """

  def __init__(
    self,
    text_config: CLIPTextConfig,
    vision_config: CLIPVisionConfig,
    *,
    projection_dim: int = 512,
    logit_scale_init_value: float = 2.6592,
    lora_rank: int = 0,
    rngs: nnx.Rngs,
  ):
    self.projection_dim = projection_dim
    self.text_model = CLIPTextTransformer(text_config, lora_rank=lora_rank, rngs=rngs)
    self.vision_model = CLIPVisionTransformer(vision_config, lora_rank=lora_rank, rngs=rngs)
    self.text_projection = nnx.Linear(
      text_config.hidden_size, projection_dim, use_bias=False, rngs=rngs
    )
    self.visual_projection = nnx.Linear(
      vision_config.hidden_size, projection_dim, use_bias=False, rngs=rngs
    )
    self.logit_scale = nnx.Param(jnp.asarray(logit_scale_init_value, jnp.float32))

  def get_text_features(
    self, input_ids: jax.Array, attention_mask: jax.Array | None = None
  ) -> jax.Array:
    """Projected (not normalised) text embeddings ``[b, projection_dim]``."""
    return self.text_projection(self.text_model(input_ids, attention_mask).pooled)

  def get_image_features(self, pixel_values: jax.Array) -> jax.Array:
    """Projected (not normalised) image embeddings ``[b, projection_dim]``."""
    return self.visual_projection(self.vision_model(pixel_values).pooled)

  def __call__(
    self,
    input_ids: jax.Array,
    pixel_values: jax.Array,
    attention_mask: jax.Array | None = None,
  ) -> ClipOutput:
    """Unit embeddings of both towers and their scaled cosine similarities."""
    t = l2_normalize(self.get_text_features(input_ids, attention_mask))
    v = l2_normalize(self.get_image_features(pixel_values))
    logits_per_text = jnp.exp(self.logit_scale[...]) * t @ v.T
    return ClipOutput(logits_per_text.T, logits_per_text, t, v)
