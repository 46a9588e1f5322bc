"""SegFormer (Xie et al., NeurIPS 2021) as ``transformers``' ``SegformerModel`` computes it.

The Mix Transformer encoder (MiT-B0 ... B5) and the all-MLP decode head of
``SegformerForSemanticSegmentation``, in Flax NNX, channels-last. Four stages
(``num_encoder_blocks``); stage ``i`` of width ``c_i``::

    x  = LayerNorm(Conv_{k_i, stride s_i, pad k_i // 2}(map_{i-1}))       overlapping patches
    for each layer of the stage (pre-LN, residual):
      x = x + output(Attention(q = query(LN1 x),
                               k, v = key, value(LN(Conv_{r_i, stride r_i}(LN1 x))))  r_i > 1
      x = x + dense2(act(DWConv_3x3(dense1(LN2 x))))                              Mix-FFN
    map_i = LayerNorm(x) on its h_i x w_i grid                                     [b, h_i, w_i, c_i]

The spatial-reduction convolution (``sr``, kernel = stride = ``sr_ratios[i]``,
no padding) shortens keys and values by ``r_i^2`` (the paper's efficient
self-attention); with ``r_i = 1`` keys and values are the queries' tokens.
Mix-FFN's 3x3 depthwise convolution (padding 1) is what gives positions: there
are no position embeddings, so any image size works, as long as every stage's
grid is at least as large as its reduction ratio (a 32 x 32 image gives grids
8, 4, 2, 1 with B0's strides and ratios 8, 4, 2, 1).

The decode head (Sec. 3.2)::

    e_i   = upsample(linear_c[i](map_i)) to map_1's grid (H/4 x W/4)   bilinear, align_corners=False
    fused = ReLU(BatchNorm(linear_fuse([e_N; ...; e_1])))                   1x1 conv, no bias
    logits = classifier(fused)                                             [b, H/4, W/4, num_labels]

The concatenation runs from the last stage to the first, as PyTorch's does;
the upsampling is PyTorch's ``interpolate(mode="bilinear",
align_corners=False)`` written as two interpolation matrices (exact for every
size ratio, and a matmul under ``vmap``); BatchNorm uses its running
statistics (inference form). Those statistics are ``nnx.BatchStat``
variables, not parameters: nothing trains them, and the engine's
``nnx.split(model, trainable, ...)`` keeps them with the frozen rest.

Faithful details of ``transformers``' PyTorch model: every LayerNorm has
PyTorch's default ``eps = 1e-5`` (``config.layer_norm_eps`` is not read by
it); dropout and stochastic depth are inference no-ops. Deprecated
``reshape_last_stage = False`` changes only the shape PyTorch returns the last
stage in; here every stage is a map.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fedjax_mm.models.conv import conv2d, depthwise_conv2d
from fedjax_mm.models.hf_layers import activation, attend
from fedjax_mm.models.lora import dense

__all__ = ["SegformerConfig", "SegformerModel", "SegformerOutput", "resize_bilinear"]

#: PyTorch's ``nn.LayerNorm`` / ``nn.BatchNorm2d`` default, which SegFormer's modules keep.
EPS = 1e-5

_STAGE_KEYS = (
  "depths",
  "sr_ratios",
  "hidden_sizes",
  "patch_sizes",
  "strides",
  "num_attention_heads",
  "mlp_ratios",
)


@dataclasses.dataclass(frozen=True)
class SegformerConfig:
  """The ``config.json`` keys SegformerModel reads (defaults: ``transformers.SegformerConfig``'s,
  MiT-B0). Per-stage keys are tuples of ``num_encoder_blocks`` entries.
  """

  num_channels: int = 3
  num_encoder_blocks: int = 4
  depths: tuple[int, ...] = (2, 2, 2, 2)
  sr_ratios: tuple[int, ...] = (8, 4, 2, 1)
  hidden_sizes: tuple[int, ...] = (32, 64, 160, 256)
  patch_sizes: tuple[int, ...] = (7, 3, 3, 3)
  strides: tuple[int, ...] = (4, 2, 2, 2)
  num_attention_heads: tuple[int, ...] = (1, 2, 5, 8)
  mlp_ratios: tuple[float, ...] = (4, 4, 4, 4)
  hidden_act: str = "gelu"
  decoder_hidden_size: int = 256
  num_labels: int = 2

  @classmethod
  def from_json(cls, body: Mapping[str, Any]) -> SegformerConfig:
    """From a ``config.json`` mapping: lists become tuples; ``num_labels`` from ``id2label``."""
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in body.items() if k in names}
    if "num_labels" not in kwargs and body.get("id2label"):
      kwargs["num_labels"] = len(body["id2label"])
    return cls(**kwargs)

  def __post_init__(self):
    n = self.num_encoder_blocks
    for key in _STAGE_KEYS:
      if len(getattr(self, key)) != n:
        raise ValueError(
          f"SegFormer config: {key} has {len(getattr(self, key))} entries, "
          f"num_encoder_blocks is {n}."
        )
    for width, heads in zip(self.hidden_sizes, self.num_attention_heads, strict=True):
      if width % heads:
        raise ValueError(
          f"SegFormer config: hidden size {width} is not a multiple of {heads} heads."
        )


class SegformerOutput(NamedTuple):
  """What :class:`SegformerModel` returns (a tuple: it passes through ``jit`` / ``vmap``).

  Attributes:
    hidden_states: per stage, ``[b, h_i, w_i, c_i]`` (PyTorch's
      ``hidden_states`` with ``output_hidden_states=True``, channels last).
    pooled: ``[b, c_N]`` the mean of the last stage's tokens (what
      ``SegformerForImageClassification`` feeds its classifier).
    decoded: ``[b, h_1, w_1, decoder_hidden_size]`` the decode head's fused map
      (after BatchNorm and ReLU, what its classifier reads), or None without a head.
    logits: ``[b, h_1, w_1, num_labels]`` the decode head's logits at 1/4
      resolution (PyTorch's ``logits``, channels last), or None without a head.
  """

  hidden_states: tuple[jax.Array, ...]
  pooled: jax.Array
  decoded: jax.Array | None
  logits: jax.Array | None


class Conv2d(nnx.Module):
  """PyTorch's ``Conv2d`` (square kernel, stride, symmetric zero padding; dense or depthwise).

  ``kernel`` is HWIO ``[k, k, C_in / groups, C_out]``;
  :func:`fedjax_mm.models.hf.torch_names` maps it to PyTorch's OIHW ``weight``.
  Dense convolutions run as im2col (:func:`~fedjax_mm.models.conv.conv2d`),
  depthwise ones (``groups = C_in = C_out``) as shifted views times taps.
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    kernel_size: int,
    *,
    stride: int = 1,
    padding: int = 0,
    depthwise: bool = False,
    use_bias: bool = True,
    rngs: nnx.Rngs,
  ):
    if depthwise and in_features != out_features:
      raise ValueError(
        f"a depthwise convolution keeps its width, got {in_features} -> {out_features}."
      )
    shape = (kernel_size, kernel_size, 1 if depthwise else in_features, out_features)
    self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), shape))
    self.bias = nnx.Param(jnp.zeros((out_features,))) if use_bias else None
    self.stride, self.padding, self.depthwise = stride, padding, depthwise

  def __call__(self, x: jax.Array) -> jax.Array:
    """``[b, H, W, C_in] -> [b, floor((H + 2p - k) / stride) + 1, ..., C_out]``."""
    if self.depthwise:
      if self.stride != 1:
        raise ValueError("depthwise convolutions here have stride 1.")
      y = depthwise_conv2d(x, self.kernel[...], padding=self.padding)
    else:
      y = conv2d(x, self.kernel[...], stride=self.stride, padding=self.padding)
    return y if self.bias is None else y + self.bias[...]


class BatchNorm2d(nnx.Module):
  """PyTorch's ``BatchNorm2d`` in inference form: ``(x - mean) / sqrt(var + eps) * weight + bias``.

  ``weight`` and ``bias`` are parameters; ``running_mean`` / ``running_var``
  are ``nnx.BatchStat`` (loaded from the checkpoint, never trained).
  Attribute names are PyTorch's, so they are the tensors' names.
  """

  def __init__(self, features: int, *, eps: float = EPS):
    self.weight = nnx.Param(jnp.ones((features,)))
    self.bias = nnx.Param(jnp.zeros((features,)))
    self.running_mean = nnx.BatchStat(jnp.zeros((features,)))
    self.running_var = nnx.BatchStat(jnp.ones((features,)))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.weight[...] * jax.lax.rsqrt(self.running_var[...] + self.eps)
    return (x - self.running_mean[...]) * scale + self.bias[...]


def _interpolation_matrix(n_in: int, n_out: int) -> np.ndarray:
  """``[n_out, n_in]`` weights of PyTorch's 1-D linear interpolation, ``align_corners=False``.

  Output ``o`` samples the input at ``max((o + 1/2) n_in / n_out - 1/2, 0)``
  between its two nearest inputs (the last input repeated past the end).
  """
  src = np.maximum((np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5, 0.0)
  lo = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
  hi = np.minimum(lo + 1, n_in - 1)
  frac = src - lo
  m = np.zeros((n_out, n_in))
  np.add.at(m, (np.arange(n_out), lo), 1.0 - frac)
  np.add.at(m, (np.arange(n_out), hi), frac)
  return m


def resize_bilinear(x: jax.Array, size: tuple[int, int]) -> jax.Array:
  """``[b, h, w, c] -> [b, H, W, c]`` as ``torch.nn.functional.interpolate(mode="bilinear",
  align_corners=False)`` (no antialiasing), for any sizes.
  """
  rows = jnp.asarray(_interpolation_matrix(x.shape[1], size[0]), x.dtype)
  cols = jnp.asarray(_interpolation_matrix(x.shape[2], size[1]), x.dtype)
  return jnp.einsum("Hh,Ww,bhwc->bHWc", rows, cols, x)


# --- Encoder -------------------------------------------------------------------------


class SegformerOverlapPatchEmbeddings(nnx.Module):
  def __init__(self, c: SegformerConfig, i: int, *, rngs: nnx.Rngs):
    fan_in = c.num_channels if i == 0 else c.hidden_sizes[i - 1]
    k = c.patch_sizes[i]
    self.proj = Conv2d(fan_in, c.hidden_sizes[i], k, stride=c.strides[i], padding=k // 2, rngs=rngs)
    self.layer_norm = nnx.LayerNorm(c.hidden_sizes[i], epsilon=EPS, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """``[b, H, W, C] -> [b, h, w, c]`` (LayerNorm over channels)."""
    return self.layer_norm(self.proj(x))


class SegformerEfficientSelfAttention(nnx.Module):
  def __init__(self, c: SegformerConfig, i: int, *, lora_rank: int, rngs: nnx.Rngs):
    w = c.hidden_sizes[i]
    self.num_heads, self.sr_ratio = c.num_attention_heads[i], c.sr_ratios[i]
    self.query = dense(w, w, lora_rank=lora_rank, rngs=rngs)
    self.key = dense(w, w, lora_rank=lora_rank, rngs=rngs)
    self.value = dense(w, w, lora_rank=lora_rank, rngs=rngs)
    if self.sr_ratio > 1:
      r = self.sr_ratio
      self.sr = Conv2d(w, w, r, stride=r, rngs=rngs)
      self.layer_norm = nnx.LayerNorm(w, epsilon=EPS, rngs=rngs)

  def __call__(self, h: jax.Array) -> jax.Array:
    """``[b, h, w, c]`` map -> ``[b, h w, c]`` attended tokens (before the output projection)."""
    b, _, _, w = h.shape
    tokens = h.reshape(b, -1, w)
    kv = tokens
    if self.sr_ratio > 1:
      kv = self.layer_norm(self.sr(h).reshape(b, -1, w))
    return attend(self.query(tokens), self.key(kv), self.value(kv), self.num_heads)


class SegformerSelfOutput(nnx.Module):
  def __init__(self, width: int, *, lora_rank: int, rngs: nnx.Rngs):
    self.dense = dense(width, width, lora_rank=lora_rank, rngs=rngs)

  def __call__(self, h: jax.Array) -> jax.Array:
    return self.dense(h)


class SegformerAttention(nnx.Module):
  def __init__(self, c: SegformerConfig, i: int, *, lora_rank: int, rngs: nnx.Rngs):
    # `self.self` mirrors PyTorch's `attention.self`, so checkpoint names are paths.
    self.self = SegformerEfficientSelfAttention(c, i, lora_rank=lora_rank, rngs=rngs)
    self.output = SegformerSelfOutput(c.hidden_sizes[i], lora_rank=lora_rank, rngs=rngs)

  def __call__(self, h: jax.Array) -> jax.Array:
    return self.output(self.self(h))


class SegformerDWConv(nnx.Module):
  def __init__(self, width: int, *, rngs: nnx.Rngs):
    self.dwconv = Conv2d(width, width, 3, padding=1, depthwise=True, rngs=rngs)

  def __call__(self, h: jax.Array) -> jax.Array:
    return self.dwconv(h)


class SegformerMixFFN(nnx.Module):
  def __init__(self, c: SegformerConfig, i: int, *, lora_rank: int, rngs: nnx.Rngs):
    w = c.hidden_sizes[i]
    hidden = int(w * c.mlp_ratios[i])
    self.act = c.hidden_act
    self.dense1 = dense(w, hidden, lora_rank=lora_rank, rngs=rngs)
    self.dwconv = SegformerDWConv(hidden, rngs=rngs)
    self.dense2 = dense(hidden, w, lora_rank=lora_rank, rngs=rngs)

  def __call__(self, h: jax.Array) -> jax.Array:
    """``[b, h, w, c]`` map -> same shape."""
    return self.dense2(activation(self.act)(self.dwconv(self.dense1(h))))


class SegformerLayer(nnx.Module):
  def __init__(self, c: SegformerConfig, i: int, *, lora_rank: int, rngs: nnx.Rngs):
    w = c.hidden_sizes[i]
    self.layer_norm_1 = nnx.LayerNorm(w, epsilon=EPS, rngs=rngs)
    self.attention = SegformerAttention(c, i, lora_rank=lora_rank, rngs=rngs)
    self.layer_norm_2 = nnx.LayerNorm(w, epsilon=EPS, rngs=rngs)
    self.mlp = SegformerMixFFN(c, i, lora_rank=lora_rank, rngs=rngs)

  def __call__(self, h: jax.Array) -> jax.Array:
    """``[b, h, w, c]`` map -> same shape (attention over its ``h w`` tokens)."""
    h = h + self.attention(self.layer_norm_1(h)).reshape(h.shape)
    return h + self.mlp(self.layer_norm_2(h))


class SegformerEncoder(nnx.Module):
  def __init__(self, c: SegformerConfig, *, lora_rank: int, rngs: nnx.Rngs):
    n = c.num_encoder_blocks
    self.patch_embeddings = nnx.List(
      [SegformerOverlapPatchEmbeddings(c, i, rngs=rngs) for i in range(n)]
    )
    self.block = nnx.List(
      [
        nnx.List([SegformerLayer(c, i, lora_rank=lora_rank, rngs=rngs) for _ in range(c.depths[i])])
        for i in range(n)
      ]
    )
    self.layer_norm = nnx.List(
      [nnx.LayerNorm(c.hidden_sizes[i], epsilon=EPS, rngs=rngs) for i in range(n)]
    )

  def __call__(self, x: jax.Array) -> tuple[jax.Array, ...]:
    maps = []
    for embed, layers, norm in zip(self.patch_embeddings, self.block, self.layer_norm, strict=True):
      x = embed(x)
      for layer in layers:
        x = layer(x)
      x = norm(x)
      maps.append(x)
    return tuple(maps)


# --- Decode head -----------------------------------------------------------------------


class SegformerMLP(nnx.Module):
  def __init__(self, fan_in: int, width: int, *, rngs: nnx.Rngs):
    self.proj = nnx.Linear(fan_in, width, rngs=rngs)

  def __call__(self, h: jax.Array) -> jax.Array:
    return self.proj(h)


class SegformerDecodeHead(nnx.Module):
  """The all-MLP decoder (``decode_head.*`` of ``SegformerForSemanticSegmentation``)."""

  def __init__(self, c: SegformerConfig, *, rngs: nnx.Rngs):
    d, n = c.decoder_hidden_size, c.num_encoder_blocks
    self.linear_c = nnx.List([SegformerMLP(c.hidden_sizes[i], d, rngs=rngs) for i in range(n)])
    self.linear_fuse = Conv2d(n * d, d, 1, use_bias=False, rngs=rngs)
    self.batch_norm = BatchNorm2d(d)
    self.classifier = Conv2d(d, c.num_labels, 1, rngs=rngs)

  def fuse(self, maps: tuple[jax.Array, ...]) -> jax.Array:
    """Per-stage maps -> the fused map ``[b, h_1, w_1, d]`` (after BatchNorm and ReLU)."""
    size = maps[0].shape[1:3]
    upsampled = [resize_bilinear(mlp(m), size) for mlp, m in zip(self.linear_c, maps, strict=True)]
    fused = self.linear_fuse(jnp.concatenate(upsampled[::-1], axis=-1))
    return jax.nn.relu(self.batch_norm(fused))

  def __call__(self, maps: tuple[jax.Array, ...]) -> jax.Array:
    return self.classifier(self.fuse(maps))


# --- The model -------------------------------------------------------------------------


def stage_sizes(c: SegformerConfig, height: int, width: int) -> list[tuple[int, int]]:
  """Each stage's grid for an ``height x width`` image (PyTorch's convolution arithmetic)."""
  sizes = []
  for k, s in zip(c.patch_sizes, c.strides, strict=True):
    height = (height + 2 * (k // 2) - k) // s + 1
    width = (width + 2 * (k // 2) - k) // s + 1
    sizes.append((height, width))
  return sizes


class SegformerModel(nnx.Module):
  """``transformers.SegformerModel`` (inference), with the decode head when the checkpoint has one.

  Args:
    config: the checkpoint's :class:`SegformerConfig`.
    decode_head: build ``decode_head`` (``SegformerForSemanticSegmentation``).
    lora_rank: LoRA rank on attention query / key / value / output and the
      Mix-FFN's ``dense1`` / ``dense2`` (0 = none); the decode head is not adapted.
    rngs: random streams (the loader overwrites every base parameter).

  Attributes:
    features: width of ``pooled`` (the last stage's); ``width``: of the map
      a segmentation reader gets (``decoder_hidden_size`` with a decode head,
      else the last stage's); ``modality``: ``"image"``; ``beside_prefix``:
      top-level modules a task checkpoint stores outside its ``segformer.``
      prefix (``("decode_head",)`` with a head).
  """

  modality = "image"

  def __init__(
    self,
    config: SegformerConfig,
    *,
    decode_head: bool = False,
    lora_rank: int = 0,
    rngs: nnx.Rngs,
  ):
    activation(config.hidden_act)
    self.config = config
    self.features = config.hidden_sizes[-1]
    self.width = config.decoder_hidden_size if decode_head else self.features
    self.beside_prefix = ("decode_head",) if decode_head else ()
    self.encoder = SegformerEncoder(config, lora_rank=lora_rank, rngs=rngs)
    self.decode_head = SegformerDecodeHead(config, rngs=rngs) if decode_head else None

  def check_image(self, x: jax.Array) -> None:
    """``ValueError`` unless ``x`` is ``[b, H, W, num_channels]`` with every stage's grid
    at least its reduction ratio (PyTorch would fail in the ``sr`` convolution)."""
    c = self.config
    if x.ndim != 4 or x.shape[-1] != c.num_channels:
      raise ValueError(
        f"expected pixel_values [b, H, W, {c.num_channels}] (channels last), got shape {x.shape}."
      )
    for i, (size, r) in enumerate(zip(stage_sizes(c, *x.shape[1:3]), c.sr_ratios, strict=True)):
      if min(size) < max(r, 1):
        raise ValueError(
          f"image {x.shape[1]}x{x.shape[2]} is too small for SegFormer: stage {i + 1}'s grid "
          f"{size[0]}x{size[1]} is below its reduction ratio {r}."
        )

  def __call__(self, pixel_values: jax.Array) -> SegformerOutput:
    """``[b, H, W, C]`` pixels (normalised as the checkpoint's processor does) -> outputs."""
    self.check_image(pixel_values)
    maps = self.encoder(pixel_values)
    last = maps[-1]
    pooled = last.reshape(last.shape[0], -1, last.shape[-1]).mean(axis=1)
    if self.decode_head is None:
      return SegformerOutput(maps, pooled, None, None)
    decoded = self.decode_head.fuse(maps)
    return SegformerOutput(maps, pooled, decoded, self.decode_head.classifier(decoded))
