"""Pieces shared by the Hugging Face encoders (:mod:`fedjax_mm.models.hf`).

The modules of ``hf_bert``, ``hf_vit`` and ``hf_clip`` name their attributes
exactly as the PyTorch modules of ``transformers`` do (``encoder.layer.0.
attention.self.query``), so a checkpoint tensor's dotted name *is* the path of
the variable it fills; :func:`fedjax_mm.models.hf.torch_names` derives the
leaf renames (``weight`` -> ``kernel``/``scale``/``embedding``) from the type of
the owning module. Every projection of attention and MLP is built with
:func:`fedjax_mm.models.lora.dense`, so ``lora_rank > 0`` adapts exactly those
and the base paths stay those of the plain model.

Nothing here draws randomness at call time (no dropout): the encoders are pure
functions of their ``nnx.Param`` variables, like the rest of the zoo.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = [
  "ACTIVATIONS",
  "EncoderOutput",
  "PatchEmbed",
  "activation",
  "attend",
  "from_dict",
  "mean_pool",
]


class EncoderOutput(NamedTuple):
  """What an HF encoder returns (a tuple, so it passes through ``jit``/``vmap``).

  Attributes:
    states: ``[b, L, h]`` final token states (``last_hidden_state``).
    pooled: ``[b, h']`` the pooled output the checkpoint defines
      (``pooler_output``: BERT/ViT pooler, CLIP's EOS / class token).
  """

  states: jax.Array
  pooled: jax.Array


def _quick_gelu(x: jax.Array) -> jax.Array:
  return x * jax.nn.sigmoid(1.702 * x)


#: ``hidden_act`` names of ``transformers``' configs -> functions (same formulas as its ACT2FN).
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
  "gelu": functools.partial(jax.nn.gelu, approximate=False),
  "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
  "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
  "gelu_fast": functools.partial(jax.nn.gelu, approximate=True),
  "quick_gelu": _quick_gelu,
  "relu": jax.nn.relu,
  "silu": jax.nn.silu,
  "swish": jax.nn.silu,
  "tanh": jnp.tanh,
}


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
  """The activation ``name`` (a ``hidden_act`` value); ``ValueError`` if unknown."""
  if name not in ACTIVATIONS:
    raise ValueError(
      f"unsupported activation {name!r}; supported: {', '.join(sorted(ACTIVATIONS))}."
    )
  return ACTIVATIONS[name]


def from_dict(cls: type, body: Mapping[str, Any]):
  """A frozen config dataclass from a ``config.json`` mapping: known keys, others ignored."""
  names = {f.name for f in dataclasses.fields(cls)}
  return cls(**{k: v for k, v in body.items() if k in names})


def attend(
  q: jax.Array, k: jax.Array, v: jax.Array, num_heads: int, mask: jax.Array | None = None
) -> jax.Array:
  """Scaled dot-product attention over heads.

  Args:
    q, k, v: ``[b, n, w]`` projected queries, keys, values.
    num_heads: heads; ``w / num_heads`` is the head width.
    mask: optional bool, broadcastable to ``[b, heads, n_q, n_k]``; False pairs
      get the most negative finite logit (as ``transformers`` adds
      ``finfo.min``), so a fully masked row is uniform rather than NaN.

  Returns:
    ``[b, n, w]`` (before the output projection).
  """
  b, n, w = q.shape
  split = lambda t: t.reshape(t.shape[0], t.shape[1], num_heads, w // num_heads)
  q, k, v = split(q), split(k), split(v)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(w // num_heads).astype(q.dtype)
  if mask is not None:
    logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
  weights = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, n, w)


def key_mask(attention_mask: jax.Array | None) -> jax.Array | None:
  """``[b, n]`` 0/1 attention mask -> bool ``[b, 1, 1, n]`` over keys (None stays None)."""
  if attention_mask is None:
    return None
  return (attention_mask > 0)[:, None, None, :]


def mean_pool(states: jax.Array, mask: jax.Array) -> jax.Array:
  """Sentence embeddings: the mean of ``states [b, L, h]`` over ``mask [b, L]`` tokens.

  What sentence-transformers' ``Pooling(mode="mean")`` computes for
  all-MiniLM-L6-v2 (before its ``Normalize``): ``sum_t m_t s_t / max(sum_t
  m_t, 1e-9)``; an all-zero mask row gives 0.
  """
  m = mask.astype(states.dtype)[..., None]
  return (states * m).sum(axis=1) / jnp.maximum(m.sum(axis=1), 1e-9)


class PatchEmbed(nnx.Module):
  """Non-overlapping ``p x p`` patches -> ``[b, n, w]`` (a stride-``p`` convolution).

  Written as a reshape and one matmul with an HWIO kernel ``[p, p, C, w]``
  (PyTorch's ``Conv2d.weight`` is OIHW; :mod:`~fedjax_mm.models.hf` transposes
  it on load), so a ``vmap`` over clients' kernels stays a batched matmul.
  """

  def __init__(self, channels: int, width: int, patch: int, *, use_bias: bool, rngs: nnx.Rngs):
    self.patch = patch
    init = nnx.initializers.lecun_normal()
    self.kernel = nnx.Param(init(rngs.params(), (patch, patch, channels, width)))
    self.bias = nnx.Param(jnp.zeros((width,))) if use_bias else None

  def __call__(self, x: jax.Array) -> jax.Array:
    """``[b, H, W, C] -> [b, (H/p)(W/p), w]``, patches in row-major order."""
    b, height, width, c = x.shape
    p = self.patch
    if height % p or width % p:
      raise ValueError(f"image {height}x{width} is not a multiple of the patch size {p}.")
    x = x.reshape(b, height // p, p, width // p, p, c).transpose(0, 1, 3, 2, 4, 5)
    y = jnp.einsum("bijpqc,pqcw->bijw", x, self.kernel[...])
    if self.bias is not None:
      y = y + self.bias[...]
    return y.reshape(b, -1, y.shape[-1])


def check_image(x: jax.Array, image_size: int, channels: int) -> None:
  if x.ndim != 4 or x.shape[1:] != (image_size, image_size, channels):
    raise ValueError(
      f"expected pixel_values [b, {image_size}, {image_size}, {channels}] (channels last), "
      f"got shape {x.shape}."
    )
