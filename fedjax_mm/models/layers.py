"""Transformer building blocks shared by the ViT and the text Transformer.

Pre-LN blocks (Xiong et al., 2020)::

    x = x + Attention(LayerNorm(x), key_mask)
    x = x + MLP(LayerNorm(x))

Attention is written out (rather than ``nnx.MultiHeadAttention``) so that its
four projections are plain dense layers that :func:`fedjax_mm.models.lora.dense`
can adapt, and so that fully masked rows are well defined: masked logits are
set to the most negative finite float instead of ``-inf``, so a query whose
keys are all padding gets a uniform (finite) softmax rather than NaN. Callers
discard those rows (masked pooling), which keeps the gradient finite as well.

All modules are stateless apart from ``nnx.Param``/``nnx.LoRAParam``: no
dropout, no batch statistics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fedjax_mm.models.lora import dense

__all__ = ["Attention", "Mlp", "TransformerBlock"]


class Attention(nnx.Module):
  """Multi-head self-attention with an optional key-padding mask.

  Attributes:
    query, key, value, out: dense layers ``[w, w]`` (LoRA-adapted when asked).
  """

  def __init__(self, width: int, num_heads: int, *, lora_rank: int = 0, rngs: nnx.Rngs):
    if width % num_heads:
      raise ValueError(f"width {width} is not divisible by num_heads {num_heads}.")
    self.num_heads = num_heads
    self.head_dim = width // num_heads
    self.query = dense(width, width, lora_rank=lora_rank, rngs=rngs)
    self.key = dense(width, width, lora_rank=lora_rank, rngs=rngs)
    self.value = dense(width, width, lora_rank=lora_rank, rngs=rngs)
    self.out = dense(width, width, lora_rank=lora_rank, rngs=rngs)

  def __call__(self, x: jax.Array, key_mask: jax.Array | None = None) -> jax.Array:
    """Attends over the sequence axis.

    Args:
      x: ``[b, n, w]`` tokens.
      key_mask: optional ``[b, n]`` bool; False keys receive no attention.

    Returns:
      ``[b, n, w]``.
    """
    b, n, _ = x.shape
    split = lambda t: t.reshape(b, n, self.num_heads, self.head_dim)
    q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(self.head_dim).astype(x.dtype)
    if key_mask is not None:
      logits = jnp.where(key_mask[:, None, None, :], logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(logits, axis=-1)
    y = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, n, -1)
    return self.out(y)


class Mlp(nnx.Module):
  """Two dense layers with a GELU between them: ``w -> hidden -> w``."""

  def __init__(self, width: int, hidden: int, *, lora_rank: int = 0, rngs: nnx.Rngs):
    self.fc1 = dense(width, hidden, lora_rank=lora_rank, rngs=rngs)
    self.fc2 = dense(hidden, width, lora_rank=lora_rank, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(jax.nn.gelu(self.fc1(x)))


class TransformerBlock(nnx.Module):
  """A pre-LN Transformer encoder block."""

  def __init__(
    self,
    width: int,
    num_heads: int,
    *,
    mlp_ratio: int = 4,
    lora_rank: int = 0,
    rngs: nnx.Rngs,
  ):
    self.norm1 = nnx.LayerNorm(width, rngs=rngs)
    self.attn = Attention(width, num_heads, lora_rank=lora_rank, rngs=rngs)
    self.norm2 = nnx.LayerNorm(width, rngs=rngs)
    self.mlp = Mlp(width, mlp_ratio * width, lora_rank=lora_rank, rngs=rngs)

  def __call__(self, x: jax.Array, key_mask: jax.Array | None = None) -> jax.Array:
    """``[b, n, w] -> [b, n, w]``; ``key_mask`` ``[b, n]`` as in :class:`Attention`."""
    x = x + self.attn(self.norm1(x), key_mask)
    return x + self.mlp(self.norm2(x))
