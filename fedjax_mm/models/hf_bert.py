"""BERT (Devlin et al., 2019) as ``transformers``' ``BertModel`` computes it, in Flax NNX.

Post-LN encoder layers (the original Transformer's order)::

    e = LayerNorm(word[ids] + position[0..L-1] + token_type[types])
    a = LayerNorm(h + dense(Attention(query h, key h, value h; mask)))
    h = LayerNorm(a + dense(act(intermediate(a))))
    pooled = tanh(pooler(h[:, 0]))                    only if the checkpoint has a pooler

MiniLM, DistilBERT-free BERT variants and sentence-transformers' BERT models
(all-MiniLM-L6-v2) share this layout. Attribute names follow the PyTorch
module tree, so ``encoder.layer.3.attention.self.query.weight`` fills
``encoder.layer[3].attention.self.query.kernel``. LoRA (``lora_rank > 0``)
adapts query, key, value, the attention output and both MLP dense layers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from fedjax_mm.models.hf_layers import EncoderOutput, activation, attend, key_mask
from fedjax_mm.models.lora import dense

__all__ = ["BertConfig", "BertModel"]


@dataclasses.dataclass(frozen=True)
class BertConfig:
  """The ``config.json`` keys BertModel reads (defaults: ``transformers.BertConfig``'s)."""

  vocab_size: int = 30522
  hidden_size: int = 768
  num_hidden_layers: int = 12
  num_attention_heads: int = 12
  intermediate_size: int = 3072
  hidden_act: str = "gelu"
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  layer_norm_eps: float = 1e-12
  pad_token_id: int = 0
  position_embedding_type: str = "absolute"


def _norm(width: int, eps: float, rngs: nnx.Rngs) -> nnx.LayerNorm:
  return nnx.LayerNorm(width, epsilon=eps, rngs=rngs)


class BertEmbeddings(nnx.Module):
  def __init__(self, c: BertConfig, *, rngs: nnx.Rngs):
    self.word_embeddings = nnx.Embed(c.vocab_size, c.hidden_size, rngs=rngs)
    self.position_embeddings = nnx.Embed(c.max_position_embeddings, c.hidden_size, rngs=rngs)
    self.token_type_embeddings = nnx.Embed(c.type_vocab_size, c.hidden_size, rngs=rngs)
    self.LayerNorm = _norm(c.hidden_size, c.layer_norm_eps, rngs)

  def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array) -> jax.Array:
    positions = jnp.arange(input_ids.shape[1])
    h = (
      self.word_embeddings(input_ids)
      + self.position_embeddings(positions)[None]
      + self.token_type_embeddings(token_type_ids)
    )
    return self.LayerNorm(h)


class BertSelfAttention(nnx.Module):
  def __init__(self, c: BertConfig, *, lora_rank: int, rngs: nnx.Rngs):
    w = c.hidden_size
    self.num_heads = c.num_attention_heads
    self.query = dense(w, w, lora_rank=lora_rank, rngs=rngs)
    self.key = dense(w, w, lora_rank=lora_rank, rngs=rngs)
    self.value = dense(w, w, lora_rank=lora_rank, rngs=rngs)

  def __call__(self, h: jax.Array, mask: jax.Array | None) -> jax.Array:
    return attend(self.query(h), self.key(h), self.value(h), self.num_heads, mask)


class BertDenseNorm(nnx.Module):
  """``LayerNorm(residual + dense(x))``: BertSelfOutput and BertOutput."""

  def __init__(self, fan_in: int, c: BertConfig, *, lora_rank: int, rngs: nnx.Rngs):
    self.dense = dense(fan_in, c.hidden_size, lora_rank=lora_rank, rngs=rngs)
    self.LayerNorm = _norm(c.hidden_size, c.layer_norm_eps, rngs)

  def __call__(self, x: jax.Array, residual: jax.Array) -> jax.Array:
    return self.LayerNorm(residual + self.dense(x))


class BertAttention(nnx.Module):
  def __init__(self, c: BertConfig, *, lora_rank: int, rngs: nnx.Rngs):
    # `self.self` mirrors PyTorch's `attention.self`, so checkpoint names are paths.
    self.self = BertSelfAttention(c, lora_rank=lora_rank, rngs=rngs)
    self.output = BertDenseNorm(c.hidden_size, c, lora_rank=lora_rank, rngs=rngs)

  def __call__(self, h: jax.Array, mask: jax.Array | None) -> jax.Array:
    return self.output(self.self(h, mask), h)


class BertIntermediate(nnx.Module):
  def __init__(self, c: BertConfig, *, lora_rank: int, rngs: nnx.Rngs):
    self.dense = dense(c.hidden_size, c.intermediate_size, lora_rank=lora_rank, rngs=rngs)
    self.act = c.hidden_act

  def __call__(self, h: jax.Array) -> jax.Array:
    return activation(self.act)(self.dense(h))


class BertLayer(nnx.Module):
  def __init__(self, c: BertConfig, *, lora_rank: int, rngs: nnx.Rngs):
    self.attention = BertAttention(c, lora_rank=lora_rank, rngs=rngs)
    self.intermediate = BertIntermediate(c, lora_rank=lora_rank, rngs=rngs)
    self.output = BertDenseNorm(c.intermediate_size, c, lora_rank=lora_rank, rngs=rngs)

  def __call__(self, h: jax.Array, mask: jax.Array | None) -> jax.Array:
    a = self.attention(h, mask)
    return self.output(self.intermediate(a), a)


class BertEncoder(nnx.Module):
  def __init__(self, c: BertConfig, *, lora_rank: int, rngs: nnx.Rngs):
    self.layer = nnx.List(
      [BertLayer(c, lora_rank=lora_rank, rngs=rngs) for _ in range(c.num_hidden_layers)]
    )

  def __call__(self, h: jax.Array, mask: jax.Array | None) -> jax.Array:
    for layer in self.layer:
      h = layer(h, mask)
    return h


class BertPooler(nnx.Module):
  def __init__(self, c: BertConfig, *, rngs: nnx.Rngs):
    self.dense = nnx.Linear(c.hidden_size, c.hidden_size, rngs=rngs)

  def __call__(self, h: jax.Array) -> jax.Array:
    return jnp.tanh(self.dense(h[:, 0]))


class BertModel(nnx.Module):
  """``transformers.BertModel`` (inference: no dropout) in NNX.

  Args:
    config: the checkpoint's :class:`BertConfig`.
    pooler: whether the checkpoint has a pooler (``pooler.dense``); without
      one, ``pooled`` is the first token's state.
    lora_rank: LoRA rank on attention and MLP dense layers (0 = none).
    rngs: random streams (the loader overwrites every base parameter).

  Attributes:
    features: ``hidden_size``; ``modality``: ``"text"``.
  """

  modality = "text"

  def __init__(
    self, config: BertConfig, *, pooler: bool = True, lora_rank: int = 0, rngs: nnx.Rngs
  ):
    if config.position_embedding_type != "absolute":
      raise ValueError(
        f"position_embedding_type {config.position_embedding_type!r} is not supported "
        "(only 'absolute')."
      )
    activation(config.hidden_act)  # fail at build time on an unknown activation
    self.config = config
    self.features = config.hidden_size
    self.embeddings = BertEmbeddings(config, rngs=rngs)
    self.encoder = BertEncoder(config, lora_rank=lora_rank, rngs=rngs)
    self.pooler = BertPooler(config, rngs=rngs) if pooler else None

  def __call__(
    self,
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    token_type_ids: jax.Array | None = None,
  ) -> EncoderOutput:
    """Encodes token ids.

    Args:
      input_ids: int ``[b, L]`` (tokenizer ids; ``L <= max_position_embeddings``).
      attention_mask: optional ``[b, L]`` 1 for real tokens, 0 for padding
        (default: all ones). Padded positions still get states, as in
        ``transformers``; pool with :func:`~fedjax_mm.models.hf.mean_pool`.
      token_type_ids: optional int ``[b, L]`` segment ids (default 0).

    Returns:
      :class:`~fedjax_mm.models.hf_layers.EncoderOutput`: ``states [b, L, h]``,
      ``pooled [b, h]`` (``tanh(pooler(states[:, 0]))``, or ``states[:, 0]``
      without a pooler).
    """
    if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
      raise ValueError(f"expected int input_ids [b, L], got {input_ids.dtype} {input_ids.shape}.")
    if input_ids.shape[1] > self.config.max_position_embeddings:
      raise ValueError(
        f"sequence length {input_ids.shape[1]} exceeds max_position_embeddings "
        f"{self.config.max_position_embeddings}."
      )
    if token_type_ids is None:
      token_type_ids = jnp.zeros_like(input_ids)
    h = self.embeddings(input_ids, token_type_ids)
    h = self.encoder(h, key_mask(attention_mask))
    pooled = self.pooler(h) if self.pooler is not None else h[:, 0]
    return EncoderOutput(h, pooled)
