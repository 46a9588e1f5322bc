r"""RCSR's client losses (eqs. 2-5) and prototypes, as pure functions of embeddings.

RCSR (retrieval-centric semantic routing, ``../shared/papers/rcsr.txt``, Sec. 4.2)
trains a dual encoder on clients that hold image-text pairs, images only or texts
only. With L2-normalised embeddings ``z_I, z_T`` of a batch of ``B`` samples:

.. math::
  \mathcal{L}_{NCE} = -\frac{1}{2B}\sum_i \Big[\log\frac{e^{z_I^i\cdot z_T^i/\tau}}
      {\sum_j e^{z_I^i\cdot z_T^j/\tau}} + \log\frac{e^{z_T^i\cdot z_I^i/\tau}}
      {\sum_j e^{z_T^i\cdot z_I^j/\tau}}\Big]                                  \quad (2)

.. math::
  \mathcal{L}_{anchor} = 1 - \frac1B\sum_i \cos(z_i, \bar p_{\neg m_k})       \quad (3)

.. math::
  \mathcal{L}_{reg} = \frac{\lambda_a}{2}\sum_{v\in\mathcal{M}_k}(1-\cos(p^k_v,\bar p_v))
      + \lambda_s\|\theta_k-\theta\|^2_2                                      \quad (4)

.. math::
  \mathcal{L}_k = \mathcal{L}_{NCE} + \mathcal{L}_{reg} \;\text{(paired)},\qquad
  \lambda_{anc}\mathcal{L}_{anchor} + \mathcal{L}_{reg} \;\text{(single-modality)} \quad (5)

Choices where the paper is silent or contradicts itself (each one declared here):

* **Table 3's "lambda_align (contrastive weight) = 0.1" is eq. (4)'s lambda_a**, the
  weight of the prototype-proximal term: it is the only unnamed weight of eqs. 2-5 with
  an alignment role (it aligns local to global prototypes). Eq. (5) gives L_NCE weight
  1, so the "contrastive weight" gloss cannot be read literally; we keep L_NCE at 1.
* **p^k_v inside eq. (4) during training is the batch prototype** (the normalised mean
  of the batch's embeddings of modality v), so the term has a gradient; the prototype
  the client *reports* (eq. 6) is computed over its whole local set after training.
* **||theta_k - theta||^2** runs over the trained (sent) parameters only (adapters +
  heads): the frozen encoders never move, so their distance is 0 anyway.
* tau_NCE = 0.07 is fixed (no learnt logit scale), as Table 3.

Every function takes a ``where`` mask of valid (non-padding) samples so padded
batches give the losses of the unpadded ones; shapes are for one client.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedjax_mm.losses.contrastive import symmetric_info_nce

Array = jax.Array
PyTree = Any

__all__ = [
  "TAU_NCE",
  "anchor_loss",
  "cosine",
  "moon_loss",
  "nce_loss",
  "normalize",
  "parameter_proximal",
  "prototype",
  "prototype_proximal",
  "rcsr_client_loss",
]

TAU_NCE = 0.07
_EPS = 1e-12  # squared: 1e-24, still a normal float32


def normalize(x: Array, axis: int = -1) -> Array:
  """``x / ||x||`` along ``axis``; 0 stays 0 with a finite (zero) gradient."""
  sq = jnp.sum(x * x, axis=axis, keepdims=True)
  return x * jax.lax.rsqrt(jnp.maximum(sq, _EPS * _EPS))


def cosine(a: Array, b: Array) -> Array:
  """Cosine similarity along the last axis (broadcasting); 0 against a zero vector."""
  return jnp.sum(normalize(a) * normalize(b), axis=-1)


def nce_loss(
  z_image: Array, z_text: Array, *, temperature: float = TAU_NCE, where: Array | None = None
) -> Array:
  r"""Eq. (2), symmetric InfoNCE: ``[B]`` per-pair values whose mean is L_NCE.

  Each value is ``(InfoNCE(I->T)_i + InfoNCE(T->I)_i) / 2``; a padded pair (``where``
  False) is neither an anchor nor a candidate and gets 0.

  Examples:
    >>> import jax.numpy as jnp
    >>> z = jnp.eye(2)
    >>> [round(float(v), 4) for v in nce_loss(z, z, temperature=1.0)]  # log(1 + 1/e)
    [0.3133, 0.3133]

  Args:
    z_image: ``[B, d]`` L2-normalised image embeddings.
    z_text: ``[B, d]`` L2-normalised text embeddings of the same ``B`` pairs.
    temperature: ``tau_NCE`` (0.07 in Table 3).
    where: optional ``bool [B]`` valid pairs.

  Returns:
    ``[B]`` per-pair losses.
  """
  return symmetric_info_nce(z_image, z_text, temperature=temperature, where=where)


def moon_loss(
  z: Array, z_global: Array, z_previous: Array, *, temperature: float = 0.5, where=None
) -> Array:
  r"""MOON's model-contrastive loss (Li, He & Song, CVPR 2021, eq. 2): ``[B]`` values.

  ``-log( e^{cos(z, z_glob)/tau} / (e^{cos(z, z_glob)/tau} + e^{cos(z, z_prev)/tau}) )``:
  the local representation of a sample is pulled to the global model's and pushed from
  the client's previous local model's. RCSR's Sec. 5.1: temperature 0.5, weight 1.0.
  Padded samples (``where`` False) get 0.

  Examples:
    >>> import jax.numpy as jnp
    >>> z = jnp.asarray([[1.0, 0.0]])
    >>> round(float(moon_loss(z, z, z)[0]), 4)  # equal similarities: log 2
    0.6931
  """
  pos = cosine(z, z_global) / temperature
  neg = cosine(z, z_previous) / temperature
  values = jnp.logaddexp(pos, neg) - pos
  return values if where is None else jnp.where(where, values, 0.0)


def anchor_loss(z: Array, anchor: Array, *, where: Array | None = None) -> Array:
  r"""Eq. (3) per sample: ``1 - cos(z_i, anchor)``; the mean over valid samples is L_anchor.

  Args:
    z: ``[B, d]`` embeddings of the client's one modality.
    anchor: ``[d]`` global prototype of the *missing* modality.
    where: optional ``bool [B]`` valid samples (padding gets 0).

  Returns:
    ``[B]`` per-sample values.
  """
  loss = 1.0 - cosine(z, anchor[None, :])
  if where is not None:
    loss = jnp.where(where, loss, 0.0)
  return loss


def prototype(z: Array, *, where: Array | None = None) -> Array:
  """The normalised mean of the valid rows of ``z`` (``[B, d] -> [d]``), Sec. 4.2."""
  if where is None:
    mean = z.mean(axis=0)
  else:
    w = where.astype(z.dtype)
    mean = (z * w[:, None]).sum(axis=0) / jnp.maximum(w.sum(), 1.0)
  return normalize(mean)


def prototype_proximal(local: Array, global_: Array, available: Array) -> Array:
  r"""Eq. (4)'s first sum without its weight: ``sum_{v in M_k} (1 - cos(p^k_v, pbar_v))``.

  Args:
    local: ``[2, d]`` local prototypes (image, text).
    global_: ``[2, d]`` global EMA prototypes.
    available: ``bool [2]`` the client's modalities ``M_k`` (its mask ``m_k``).

  Returns:
    Scalar.
  """
  per_v = 1.0 - cosine(local, global_)
  return jnp.sum(jnp.where(available, per_v, 0.0))


def parameter_proximal(params: PyTree, global_params: PyTree) -> Array:
  r"""Eq. (4)'s ``||theta_k - theta||_2^2`` over every leaf of the two pytrees."""
  sq = jax.tree.map(lambda a, b: jnp.sum(jnp.square(a - b)), params, global_params)
  return sum(jax.tree.leaves(sq), jnp.zeros((), jnp.float32))


def rcsr_client_loss(
  z_image: Array,
  z_text: Array,
  *,
  modality: Array,
  global_prototypes: Array,
  prox: Array,
  where: Array | None = None,
  temperature: float = TAU_NCE,
  lambda_a: float = 0.1,
  lambda_s: float = 0.01,
  lambda_anc: float = 1.0,
) -> tuple[Array, dict[str, Array]]:
  r"""Eq. (5) for one batch of one client, selected by its modality mask.

  Both towers' embeddings are always computed (one compiled program for every client
  type); the mask decides which terms count. A paired client (``[1, 1]``) gets L_NCE,
  an image-only client (``[1, 0]``) L_anchor of its images to ``pbar_T``, a text-only
  client (``[0, 1]``) L_anchor of its texts to ``pbar_I``; all get L_reg over their
  available modalities.

  Args:
    z_image: ``[B, d]`` normalised image embeddings (garbage where absent).
    z_text: ``[B, d]`` normalised text embeddings (garbage where absent).
    modality: ``bool [2]`` the client's mask ``m_k`` (image, text); not ``[0, 0]``.
    global_prototypes: ``[2, d]`` ``(pbar_I, pbar_T)`` received this round.
    prox: scalar ``||theta_k - theta||^2`` (:func:`parameter_proximal`).
    where: optional ``bool [B]`` valid samples.
    temperature: tau_NCE.
    lambda_a: eq. (4)'s prototype-proximal weight (Table 3's lambda_align).
    lambda_s: eq. (4)'s parameter-proximal weight.
    lambda_anc: eq. (5)'s anchoring weight.

  Returns:
    ``(loss, terms)``: the scalar L_k and its terms ``nce``, ``anchor``, ``reg``.
  """
  valid = jnp.ones(z_image.shape[:1], bool) if where is None else where
  count = jnp.maximum(valid.sum(), 1).astype(z_image.dtype)
  has_i, has_t = modality[0], modality[1]
  paired = has_i & has_t
  nce = nce_loss(z_image, z_text, temperature=temperature, where=valid).sum() / count
  anchor_i = anchor_loss(z_image, global_prototypes[1], where=valid).sum() / count
  anchor_t = anchor_loss(z_text, global_prototypes[0], where=valid).sum() / count
  anchor = jnp.where(has_i, anchor_i, anchor_t)
  local = jnp.stack([prototype(z_image, where=valid), prototype(z_text, where=valid)])
  reg = lambda_a / 2 * prototype_proximal(local, global_prototypes, modality) + lambda_s * prox
  main = jnp.where(paired, nce, lambda_anc * anchor)
  return main + reg, {
    "nce": jnp.where(paired, nce, 0.0),
    "anchor": jnp.where(paired, 0.0, anchor),
    "reg": reg,
  }
