"""A 2-D convolution that stays fast when ``vmap``-ped over clients.

Every client of a group has its own kernel, so the engine's ``jax.vmap`` over
clients batches the *kernel* of each convolution. JAX's batching rule for
``lax.conv_general_dilated`` turns that into one grouped convolution with
``K * C_in`` input channels and ``feature_group_count = K``. XLA:CPU runs
grouped convolutions far below its dense-convolution speed: measured on a
2-core CPU for 64 clients, batch 8, 3x3 kernels, the gradient of a vmapped
``32x32x32 -> 64`` stride-2 convolution took 2.65 s against 0.22 s for a
Python loop over the 64 clients, and a single-client group (``K = 1``) of
``cnn_m`` trained 25x slower under ``vmap`` than without it.

:func:`conv2d` therefore lowers a convolution as *im2col*: the ``kh * kw``
shifted (strided) views of the zero-padded input are concatenated along the
channel axis and multiplied by the kernel reshaped to ``[kh*kw*C_in, C_out]``.
A matrix product batches into a batched ``dot_general``, which XLA runs at
dense speed on every backend, so the vmapped convolution costs what the loop
costs (tested equal to ``lax.conv_general_dilated`` in
``tests/test_models_conv.py``). ``impl="xla"`` keeps the native convolution,
which is the better choice for un-vmapped code on accelerators.

On accelerators the zero-padded input is passed through
``lax.optimization_barrier`` before its views are taken, so XLA materialises
it once instead of fusing its producer (the previous layer's GroupNorm and
ReLU, or the input's cast to the compute dtype) and the padding into the copy
of every view and into that copy's gradient. On an NVIDIA H200, 512 vmapped
``cnn_s`` clients (10 steps of batch 8), a barrier on the unpadded input made
the round 1.22x faster in float32 and 1.08x in bfloat16, paired in one
process: the patch copies and their gradients had been half of the round's
GPU time, writing the patches at about a ninth of the memory bandwidth.
Moving it after the padding gained 1.007x in float32 and 1.067x in bfloat16
more (paired, 7 rounds each, every round of the one faster than every round
of the other). Values and gradients are bit for bit the same. XLA:CPU gains
nothing from it (64 clients on a 2-core CPU: the default scan engine equally
fast, the loop over clients 2% slower, paired), so on a CPU there is no
barrier. Other forms measured on the GPU lost and were not kept: views
stacked on a new axis before the channels; the first layer's patches built by
``lax.conv_general_dilated_patches`` (cuDNN's one-hot convolution was slower
than the copy it replaced); the first layer's 27-wide patch rows padded with
zeros to 32 (with the barrier after the padding 0.98x of it in both
precisions; with the barrier on the input 1.027x in float32 but 1.035x in
bfloat16, below the barrier after the padding's 1.067x).
The GPU section of docs/engine.md has the figures.

Padding is ``"SAME"`` exactly as XLA computes it
(``lax.padtype_to_pads``), so the two implementations agree for every stride,
kernel size and input size.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["Conv", "conv2d", "depthwise_conv2d"]

IMPLS = ("im2col", "xla")
_DIMENSION_NUMBERS = ("NHWC", "HWIO", "NHWC")


def conv2d(
  x: jax.Array,
  kernel: jax.Array,
  *,
  stride: int = 1,
  padding: str | int = "SAME",
  impl: str = "im2col",
) -> jax.Array:
  """2-D convolution of one batch of images, ``"SAME"``-padded by default.

  Args:
    x: ``[b, H, W, C_in]`` images (NHWC).
    kernel: ``[kh, kw, C_in, C_out]`` (HWIO, the layout of ``nnx.Conv``).
    stride: the same stride along both spatial axes.
    padding: ``"SAME"`` (XLA's split of the padding), or an int ``p``: ``p``
      zeros on every side, as PyTorch's ``Conv2d(padding=p)`` pads.
    impl: ``"im2col"`` (patches @ kernel; fast under ``vmap`` over kernels)
      or ``"xla"`` (``lax.conv_general_dilated``).

  Returns:
    ``[b, H', W', C_out]``: ``H' = ceil(H / stride)`` for ``"SAME"``,
    ``floor((H + 2p - kh) / stride) + 1`` for an int ``p``.
  """
  kh, kw, cin, cout = kernel.shape
  height, width = x.shape[1:3]
  if padding == "SAME":
    pads = jax.lax.padtype_to_pads((height, width), (kh, kw), (stride, stride), "SAME")
  elif isinstance(padding, int) and not isinstance(padding, bool) and padding >= 0:
    pads = [(padding, padding), (padding, padding)]
  else:
    raise ValueError(f'padding must be "SAME" or an int >= 0, got {padding!r}.')
  if impl == "xla":
    return jax.lax.conv_general_dilated(
      x, kernel, (stride, stride), pads, dimension_numbers=_DIMENSION_NUMBERS
    )
  if impl != "im2col":
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}.")
  if x.shape[-1] != cin:
    raise ValueError(f"kernel expects {cin} input channels, images have {x.shape[-1]}.")
  (top, bottom), (left, right) = pads
  padded = jnp.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)))
  if jax.default_backend() != "cpu":
    # Materialise the padded input before its kh * kw views are copied out: without the
    # barrier XLA fuses the producer (the previous layer's normalisation and activation, and
    # the padding) into the copies and their gradient. See the module docstring; XLA:CPU
    # gains nothing from it.
    padded = jax.lax.optimization_barrier(padded)
  out_h = (height + top + bottom - kh) // stride + 1
  out_w = (width + left + right - kw) // stride + 1
  views = [
    jax.lax.slice(
      padded,
      (0, i, j, 0),
      (x.shape[0], i + (out_h - 1) * stride + 1, j + (out_w - 1) * stride + 1, cin),
      (1, stride, stride, 1),
    )
    for i in range(kh)
    for j in range(kw)
  ]
  patches = views[0] if len(views) == 1 else jnp.concatenate(views, axis=-1)
  # Channel order of `patches` is (i, j, c), the row-major order of the kernel's first 3 axes.
  # The product is taken on the [b * H' * W', kh * kw * C_in] matrix, not the 4-D patches:
  # the kernel's gradient is then one (rows)^T @ (rows) product that XLA:CPU runs on the
  # row-major cotangent, where the 4-D form made it transpose the cotangent first (a copy of
  # the layer's whole output). Same values bit for bit; a cnn_s step ran 1.24x faster.
  rows = patches.reshape(-1, kh * kw * cin) @ kernel.reshape(kh * kw * cin, cout)
  return rows.reshape(*patches.shape[:-1], cout)


class Conv(nnx.Module):
  """``nnx.Conv``'s parameters (``kernel`` HWIO, optional ``bias``), ``"SAME"`` padding.

  A drop-in for the square-stride, undilated, ungrouped ``nnx.Conv`` layers of
  this model zoo, computed by :func:`conv2d` (im2col by default). Parameter
  names, shapes and initialisers (LeCun normal kernel, zero bias) are those of
  ``nnx.Conv``, so checkpoints move between the two.

  Args:
    in_features: ``C_in``.
    out_features: ``C_out``.
    kernel_size: ``(kh, kw)``.
    strides: spatial stride.
    use_bias: add a learnt bias.
    impl: see :func:`conv2d`.
    rngs: random streams (``params``).
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    kernel_size: Sequence[int],
    *,
    strides: int = 1,
    use_bias: bool = True,
    impl: str = "im2col",
    rngs: nnx.Rngs,
  ):
    if impl not in IMPLS:
      raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}.")
    shape = (*kernel_size, in_features, out_features)
    self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), shape))
    self.bias = nnx.Param(jnp.zeros((out_features,))) if use_bias else None
    self.strides = strides
    self.impl = impl

  def __call__(self, x: jax.Array) -> jax.Array:
    """``[b, H, W, C_in] -> [b, H / stride, W / stride, C_out]``."""
    y = conv2d(x, self.kernel[...], stride=self.strides, impl=self.impl)
    return y if self.bias is None else y + self.bias[...]


def depthwise_conv2d(x: jax.Array, kernel: jax.Array, *, padding: int) -> jax.Array:
  """Stride-1 depthwise convolution (one filter per channel), ``padding`` zeros on every side.

  PyTorch's ``Conv2d(C, C, k, padding=p, groups=C)``. Written as a sum of the
  ``kh * kw`` shifted views times the kernel's taps (elementwise), so a
  ``vmap`` over clients' kernels stays elementwise too.

  Args:
    x: ``[b, H, W, C]``.
    kernel: ``[kh, kw, 1, C]`` (HWIO with one input channel per group, the
      layout of ``nnx.Conv(feature_group_count=C)``).
    padding: zeros added on every side.

  Returns:
    ``[b, H + 2p - kh + 1, W + 2p - kw + 1, C]``.
  """
  kh, kw, one, c = kernel.shape
  if one != 1 or x.shape[-1] != c:
    raise ValueError(
      f"depthwise kernel {kernel.shape} does not fit images with {x.shape[-1]} channels."
    )
  padded = jnp.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
  out_h = x.shape[1] + 2 * padding - kh + 1
  out_w = x.shape[2] + 2 * padding - kw + 1
  out = 0.0
  for i in range(kh):
    for j in range(kw):
      out = out + padded[:, i : i + out_h, j : j + out_w, :] * kernel[i, j, 0]
  return out
