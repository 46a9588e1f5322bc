r"""Masked-image reconstruction (MAE: He et al., "Masked Autoencoders Are Scalable Vision
Learners", CVPR 2022; federated as Fed-MAE by Yan et al., "Label-efficient
self-supervised federated learning for tackling data heterogeneity in medical imaging",
IEEE TMI 2023).

An image is cut into non-overlapping ``p x p`` patches (:func:`patchify`); a random
share of them is masked; the model predicts the pixels of every patch, and the loss is
the mean squared error over the **masked** patches only (MAE Sec. 3, "Reconstruction
target"). With ``norm_pix`` (MAE's ``norm_pix_loss``, which Fed-MAE's pre-training
scripts pass) the target is each patch's pixels normalised by the patch's own mean and
variance:

.. math::
  \hat y_{ij} = \frac{y_{ij} - \mu_i}{\sqrt{\sigma_i^2 + 10^{-6}}},\qquad
  \ell = \frac{\sum_i M_i \,\frac1D \sum_j (x_{ij} - \hat y_{ij})^2}{\sum_i M_i}

over patches ``i`` (``D`` pixels each, mask ``M_i = 1`` for masked). Imports only ``jax``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

#: MAE's masking ratio (He et al. 2022, Sec. 4: 75% works best).
MASK_RATIO = 0.75


def patchify(images: Array, patch: int) -> Array:
  """``[..., S, S, C] -> [..., (S/p)^2, p p C]``: row-major patches, pixels row-major.

  >>> patchify(jnp.zeros((2, 8, 8, 3)), 4).shape
  (2, 4, 48)
  """
  *lead, h, w, c = images.shape
  if h % patch or w % patch:
    raise ValueError(f"patchify: image {h}x{w} is not divisible by the patch size {patch}.")
  gh, gw = h // patch, w // patch
  x = images.reshape(*lead, gh, patch, gw, patch, c)
  n = len(lead)
  x = jnp.moveaxis(x, n + 2, n + 1)  # [..., gh, gw, p, p, c]
  return x.reshape(*lead, gh * gw, patch * patch * c)


def unpatchify(patches: Array, patch: int, channels: int) -> Array:
  """The inverse of :func:`patchify` for square images."""
  *lead, num, _ = patches.shape
  g = int(round(num**0.5))
  n = len(lead)
  x = patches.reshape(*lead, g, g, patch, patch, channels)
  x = jnp.moveaxis(x, n + 1, n + 2)  # [..., g, p, g, p, c]
  return x.reshape(*lead, g * patch, g * patch, channels)


def masked_reconstruction_loss(
  pred: Array, target: Array, mask: Array, *, norm_pix: bool = True, eps: float = 1e-6
) -> Array:
  r"""MAE's loss of each image: mean squared error over its masked patches.

  Args:
    pred: ``[n, P, D]`` predicted pixels of every patch.
    target: ``[n, P, D]`` the image's patches (:func:`patchify`).
    mask: ``[n, P]``, 1 (or True) for a masked patch, whose error counts.
    norm_pix: normalise each target patch by its own mean and variance (MAE's
      ``norm_pix_loss``).
    eps: added to the patch variance.

  Returns:
    ``[n]``: per image, the mean over its masked patches of the per-pixel mean squared
    error (0 for an image with no masked patch); the caller reduces.

  >>> x = jnp.ones((1, 4, 3))
  >>> float(masked_reconstruction_loss(x, x, jnp.ones((1, 4)), norm_pix=False)[0])
  0.0
  """
  if pred.ndim != 3 or pred.shape != target.shape or mask.shape != pred.shape[:2]:
    raise ValueError(
      f"masked_reconstruction_loss: expected pred, target [n, P, D] and mask [n, P], got "
      f"{pred.shape}, {target.shape}, {mask.shape}."
    )
  if norm_pix:
    mean = target.mean(-1, keepdims=True)
    var = target.var(-1, keepdims=True, ddof=1)  # MAE's torch .var() is unbiased
    target = (target - mean) / jnp.sqrt(var + eps)
  per_patch = jnp.mean(jnp.square(pred - target), -1)
  m = mask.astype(per_patch.dtype)
  return jnp.sum(per_patch * m, -1) / jnp.maximum(jnp.sum(m, -1), 1.0)
