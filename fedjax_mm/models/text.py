"""Text encoders: a small Transformer family and a GRU.

Every encoder maps token ids ``x: int32 [b, L]`` (0 = PAD, ``mask = x != 0``)
to a pair::

    pooled  [b, features]       sentence feature
    tokens  [b, L, features]    per-token features, exactly 0 at PAD positions

Padding never changes the result: the Transformer masks PAD keys in attention
and mean-pools over non-PAD tokens only; the GRU does not advance its state on
PAD steps. Appending PAD tokens, or changing what a PAD position embeds to,
leaves ``pooled`` and the non-PAD ``tokens`` unchanged. An all-PAD row gives a
zero pooled vector (finite, with finite gradients).

+-------------------+-----------------------------------------------+----------+
| name              | kind                                          | features |
+===================+===============================================+==========+
| ``transformer_t`` | width 64, depth 2, 2 heads, masked mean pool  | 64       |
+-------------------+-----------------------------------------------+----------+
| ``transformer_s`` | width 128, depth 4, 4 heads, masked mean pool | 128      |
+-------------------+-----------------------------------------------+----------+
| ``gru``           | embed 64, GRU 128, state at the last non-PAD  | 128      |
+-------------------+-----------------------------------------------+----------+

LoRA adapters (``lora_rank > 0``) go on the attention/MLP dense layers of the
Transformers and on the input and recurrent projections of the GRU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fedjax_mm.models.layers import TransformerBlock
from fedjax_mm.models.lora import dense

__all__ = ["Gru", "TextTransformer", "gru", "transformer_s", "transformer_t"]

PAD_ID = 0


def _check_tokens(x: jax.Array, max_len: int | None = None) -> None:
  if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"expected int token ids [b, L], got {x.dtype} {x.shape}.")
  if max_len is not None and x.shape[1] > max_len:
    raise ValueError(f"sequence length {x.shape[1]} exceeds max_len {max_len}.")


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean of ``x [b, L, h]`` over positions where ``mask [b, L]``; 0 for empty rows."""
  mask = mask.astype(x.dtype)[..., None]
  return (x * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)


class TextTransformer(nnx.Module):
  """Token + learned positional embeddings, pre-LN blocks, final LayerNorm.

  Args:
    vocab_size: number of token ids (id 0 is PAD).
    max_len: longest sequence accepted (size of the positional table).
    width: token width (= ``features``).
    depth: number of blocks.
    num_heads: attention heads.
    mlp_ratio: MLP hidden width / width.
    lora_rank: LoRA rank for attention and MLP dense layers (0 = none).
    rngs: random streams.
  """

  def __init__(
    self,
    *,
    vocab_size: int,
    max_len: int,
    width: int,
    depth: int,
    num_heads: int,
    mlp_ratio: int = 4,
    lora_rank: int = 0,
    rngs: nnx.Rngs,
  ):
    self.max_len = max_len
    self.features = width
    self.embed = nnx.Embed(vocab_size, width, rngs=rngs)
    self.pos = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (max_len, width)))
    self.blocks = nnx.List(
      [
        TransformerBlock(width, num_heads, mlp_ratio=mlp_ratio, lora_rank=lora_rank, rngs=rngs)
        for _ in range(depth)
      ]
    )
    self.norm = nnx.LayerNorm(width, rngs=rngs)

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[b, L] int -> ([b, width], [b, L, width])``."""
    _check_tokens(x, self.max_len)
    mask = x != PAD_ID
    h = self.embed(x) + self.pos[: x.shape[1]]
    for block in self.blocks:
      h = block(h, mask)
    h = self.norm(h) * mask[..., None]
    return masked_mean(h, mask), h


class Gru(nnx.Module):
  """A single-layer GRU (Cho et al., 2014) over token embeddings.

  With ``x_t`` the embedded token and ``h`` the state (PyTorch's convention)::

      r = sigmoid(W_r x_t + U_r h + b_r)
      u = sigmoid(W_u x_t + U_u h + b_u)
      n = tanh(W_n x_t + r * (U_n h + c_n))
      h <- (1 - u) * n + u * h        only where x_t is not PAD

  The pooled feature is the final state, i.e. the state after the last non-PAD
  token (0 for an all-PAD row).

  Attributes:
    embed: token embedding ``[vocab, embed]``.
    inputs: dense ``embed -> 3 * hidden`` (all timesteps at once).
    recurrent: dense ``hidden -> 3 * hidden`` (inside the scan).
  """

  def __init__(
    self,
    *,
    vocab_size: int,
    max_len: int,
    embed_dim: int = 64,
    hidden: int = 128,
    lora_rank: int = 0,
    rngs: nnx.Rngs,
  ):
    self.max_len = max_len
    self.hidden = hidden
    self.features = hidden
    self.embed = nnx.Embed(vocab_size, embed_dim, rngs=rngs)
    self.inputs = dense(embed_dim, 3 * hidden, lora_rank=lora_rank, rngs=rngs)
    self.recurrent = dense(
      hidden,
      3 * hidden,
      lora_rank=lora_rank,
      kernel_init=nnx.initializers.orthogonal(),
      rngs=rngs,
    )

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[b, L] int -> ([b, hidden], [b, L, hidden])``."""
    _check_tokens(x, self.max_len)
    mask = x != PAD_ID
    xs = self.inputs(self.embed(x))  # [b, L, 3h]: input projections hoisted out of the scan

    def step(h, inputs):
      xt, mt = inputs
      xr, xu, xn = jnp.split(xt, 3, axis=-1)
      hr, hu, hn = jnp.split(self.recurrent(h), 3, axis=-1)
      r = jax.nn.sigmoid(xr + hr)
      u = jax.nn.sigmoid(xu + hu)
      n = jnp.tanh(xn + r * hn)
      h_new = jnp.where(mt[:, None], (1.0 - u) * n + u * h, h)
      return h_new, h_new * mt[:, None]

    h0 = jnp.zeros((x.shape[0], self.hidden), xs.dtype)
    final, outs = jax.lax.scan(step, h0, (jnp.swapaxes(xs, 0, 1), mask.T))
    return final, jnp.swapaxes(outs, 0, 1)


# --- Named constructors (the registry's entries) -------------------------------
# Each takes (*, vocab_size, max_len, lora_rank, rngs).


def transformer_t(
  *, vocab_size: int = 1000, max_len: int = 32, lora_rank: int = 0, rngs: nnx.Rngs
) -> TextTransformer:
  """Tiny text Transformer: width 64, depth 2, 2 heads."""
  return TextTransformer(
    vocab_size=vocab_size,
    max_len=max_len,
    width=64,
    depth=2,
    num_heads=2,
    lora_rank=lora_rank,
    rngs=rngs,
  )


def transformer_s(
  *, vocab_size: int = 1000, max_len: int = 32, lora_rank: int = 0, rngs: nnx.Rngs
) -> TextTransformer:
  """Small text Transformer: width 128, depth 4, 4 heads."""
  return TextTransformer(
    vocab_size=vocab_size,
    max_len=max_len,
    width=128,
    depth=4,
    num_heads=4,
    lora_rank=lora_rank,
    rngs=rngs,
  )


def gru(*, vocab_size: int = 1000, max_len: int = 32, lora_rank: int = 0, rngs: nnx.Rngs) -> Gru:
  """GRU text encoder: embedding 64, hidden 128."""
  return Gru(vocab_size=vocab_size, max_len=max_len, lora_rank=lora_rank, rngs=rngs)
