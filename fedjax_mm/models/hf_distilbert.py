"""DistilBERT (Sanh et al., 2019) as ``transformers``' ``DistilBertModel`` computes it, in NNX.

BERT's post-LN layers with BERT's halved depth, no token types and no pooler::

    e = LayerNorm(word[ids] + position[0..L-1])
    a = sa_layer_norm(h + out_lin(Attention(q_lin h, k_lin h, v_lin h; mask)))
    h = output_layer_norm(a + lin2(act(lin1(a))))
    pooled = h[:, 0]                        (what DistilBertForSequenceClassification reads)

FedMuscle's text users fine-tune DistilBERT. Sinusoidal position tables
(``sinusoidal_pos_embds``) are stored in PyTorch checkpoints as the embedding
weight, so they load like learnt ones. LoRA adapts ``q_lin``, ``k_lin``,
``v_lin``, ``out_lin``, ``lin1`` and ``lin2``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from fedjax_mm.models.hf_layers import EncoderOutput, activation, attend, key_mask
from fedjax_mm.models.lora import dense

__all__ = ["DistilBertConfig", "DistilBertModel"]

_EPS = 1e-12  # fixed in transformers' DistilBERT (not a config key)


@dataclasses.dataclass(frozen=True)
class DistilBertConfig:
  """The ``config.json`` keys DistilBertModel reads (defaults: transformers')."""

  vocab_size: int = 30522
  max_position_embeddings: int = 512
  n_layers: int = 6
  n_heads: int = 12
  dim: int = 768
  hidden_dim: int = 3072
  activation: str = "gelu"
  pad_token_id: int = 0


class Embeddings(nnx.Module):
  def __init__(self, c: DistilBertConfig, *, rngs: nnx.Rngs):
    self.word_embeddings = nnx.Embed(c.vocab_size, c.dim, rngs=rngs)
    self.position_embeddings = nnx.Embed(c.max_position_embeddings, c.dim, rngs=rngs)
    self.LayerNorm = nnx.LayerNorm(c.dim, epsilon=_EPS, rngs=rngs)

  def __call__(self, ids: jax.Array) -> jax.Array:
    positions = jnp.arange(ids.shape[1])
    return self.LayerNorm(self.word_embeddings(ids) + self.position_embeddings(positions)[None])


class MultiHeadSelfAttention(nnx.Module):
  def __init__(self, c: DistilBertConfig, *, lora_rank: int, rngs: nnx.Rngs):
    self.num_heads = c.n_heads
    self.q_lin = dense(c.dim, c.dim, lora_rank=lora_rank, rngs=rngs)
    self.k_lin = dense(c.dim, c.dim, lora_rank=lora_rank, rngs=rngs)
    self.v_lin = dense(c.dim, c.dim, lora_rank=lora_rank, rngs=rngs)
    self.out_lin = dense(c.dim, c.dim, lora_rank=lora_rank, rngs=rngs)

  def __call__(self, h: jax.Array, mask: jax.Array | None) -> jax.Array:
    return self.out_lin(attend(self.q_lin(h), self.k_lin(h), self.v_lin(h), self.num_heads, mask))


class FFN(nnx.Module):
  def __init__(self, c: DistilBertConfig, *, lora_rank: int, rngs: nnx.Rngs):
    self.act = c.activation
    self.lin1 = dense(c.dim, c.hidden_dim, lora_rank=lora_rank, rngs=rngs)
    self.lin2 = dense(c.hidden_dim, c.dim, lora_rank=lora_rank, rngs=rngs)

  def __call__(self, h: jax.Array) -> jax.Array:
    return self.lin2(activation(self.act)(self.lin1(h)))


class TransformerBlock(nnx.Module):
  def __init__(self, c: DistilBertConfig, *, lora_rank: int, rngs: nnx.Rngs):
    self.attention = MultiHeadSelfAttention(c, lora_rank=lora_rank, rngs=rngs)
    self.sa_layer_norm = nnx.LayerNorm(c.dim, epsilon=_EPS, rngs=rngs)
    self.ffn = FFN(c, lora_rank=lora_rank, rngs=rngs)
    self.output_layer_norm = nnx.LayerNorm(c.dim, epsilon=_EPS, rngs=rngs)

  def __call__(self, h: jax.Array, mask: jax.Array | None) -> jax.Array:
    a = self.sa_layer_norm(h + self.attention(h, mask))
    return self.output_layer_norm(a + self.ffn(a))


class Transformer(nnx.Module):
  def __init__(self, c: DistilBertConfig, *, lora_rank: int, rngs: nnx.Rngs):
    self.layer = nnx.List(
      [TransformerBlock(c, lora_rank=lora_rank, rngs=rngs) for _ in range(c.n_layers)]
    )

  def __call__(self, h: jax.Array, mask: jax.Array | None) -> jax.Array:
    for layer in self.layer:
      h = layer(h, mask)
    return h


class DistilBertModel(nnx.Module):
  """``transformers.DistilBertModel`` (inference) in NNX.

  Called as ``model(input_ids, attention_mask=None)`` -> ``EncoderOutput(states
  [b, L, dim], pooled = states[:, 0])``.
  """

  modality = "text"

  def __init__(self, config: DistilBertConfig, *, lora_rank: int = 0, rngs: nnx.Rngs):
    activation(config.activation)
    self.config = config
    self.features = config.dim
    self.embeddings = Embeddings(config, rngs=rngs)
    self.transformer = Transformer(config, lora_rank=lora_rank, rngs=rngs)

  def __call__(
    self, input_ids: jax.Array, attention_mask: jax.Array | None = None
  ) -> EncoderOutput:
    if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
      raise ValueError(f"expected int input_ids [b, L], got {input_ids.dtype} {input_ids.shape}.")
    if input_ids.shape[1] > self.config.max_position_embeddings:
      raise ValueError(
        f"sequence length {input_ids.shape[1]} exceeds max_position_embeddings "
        f"{self.config.max_position_embeddings}."
      )
    h = self.transformer(self.embeddings(input_ids), key_mask(attention_mask))
    return EncoderOutput(h, h[:, 0])
