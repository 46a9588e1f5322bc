r"""MFCPL's client terms on a dual encoder, as pure functions of embeddings (RCSR's Table 1).

Paper: Le, Thwal, Qiao, Tun, Nguyen, Huh and Hong, "Cross-Modal Prototype based
Multimodal Federated Learning under Severely Missing Modality" (Information Fusion
122, 103219, 2025; arXiv 2401.13898, first titled "MFCPL: Multimodal Federated Cross
Prototype Learning for Missing Modalities and Data Heterogeneity"). MFCPL sends
per-class prototypes of every modality to the server, which aggregates them into
*complete* (all-modality) global prototypes, and trains clients with three terms:
cross-modal prototype contrast (CMPC, modality-specific level), cross-modal prototype
regularisation (CMPR, modality-shared level) and cross-modal alignment (CMA). RCSR's
Sec. 5.1 keeps "10 prototypes per modality; CMPC + CMPR + CMA losses" on its frozen
encoders, adapters and heads.

**What could be read and what is reconstructed.** Only the paper's abstract and its
components' names and roles were reachable from here, not its equations. The terms
below follow those roles in the prototype-learning form MFCPL builds on (FedProto,
Tan et al. 2022; FPL, Huang et al. 2023: contrast against prototypes, a squared
distance to an unbiased prototype), mapped onto RCSR's model, which has one
L2-normalised embedding per modality (no separate shared / specific features):

.. math::
  \mathrm{CMPC}_v(i) = -\log\frac{e^{\cos(z_{v,i},\,P_{\bar v, y_i})/\tau}}
      {\sum_{c\,\mathrm{valid}} e^{\cos(z_{v,i},\,P_{\bar v, c})/\tau}}

(the *other* modality's class prototypes: the positive is the same class, the
negatives the other classes; a single-modality client thus learns from the missing
modality's prototypes, built by other clients),

.. math::
  \mathrm{CMPR}_v(i) = \| z_{v,i} - \bar P_{y_i} \|_2^2, \qquad
  \bar P_c = \mathrm{mean}_{v\,\mathrm{valid}}\, P_{v,c}

(the complete prototype, the mean over modalities, as the modality-shared target),

.. math::
  \mathrm{CMA}(i) = 1 - \cos(z_{I,i}, z_{T,i})

(a paired sample's two modality-specific embeddings aligned; single-modality clients
have no pair and get 0). A prototype is *valid* when it is not the zero vector (a
class no client has reported).

Every function takes one client's batch; ``where`` masks padding (0 there); the
caller reduces.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_mm.losses.rcsr import cosine, normalize

Array = jax.Array

__all__ = [
  "class_prototypes",
  "complete_prototypes",
  "cross_modal_alignment",
  "prototype_contrastive",
  "prototype_regularization",
  "valid_prototypes",
]


def valid_prototypes(prototypes: Array) -> Array:
  """``bool [..., C]``: the prototypes that are not the zero vector (``[..., C, d]``)."""
  return jnp.sum(prototypes * prototypes, axis=-1) > 0


def class_prototypes(
  z: Array, labels: Array, num_classes: int, *, where: Array | None = None
) -> tuple[Array, Array]:
  r"""Per-class prototypes: the normalised mean of each class's valid rows.

  Examples:
    >>> import jax.numpy as jnp
    >>> z = jnp.asarray([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    >>> p, n = class_prototypes(z, jnp.asarray([0, 1, 1]), 3)
    >>> p.tolist(), n.tolist()  # class 2 is empty: the zero vector, count 0
    ([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], [1.0, 2.0, 0.0])

  Args:
    z: ``[n, d]`` embeddings.
    labels: ``int [n]`` class ids in ``[0, num_classes)``.
    num_classes: ``C``.
    where: optional ``bool [n]`` valid rows.

  Returns:
    ``(prototypes [C, d], counts [C])``; an empty class has the zero vector, count 0.
  """
  w = jnp.ones(z.shape[:1], z.dtype) if where is None else where.astype(z.dtype)
  onehot = jax.nn.one_hot(labels, num_classes, dtype=z.dtype) * w[:, None]  # [n, C]
  counts = onehot.sum(0)
  sums = onehot.T @ z
  return normalize(sums / jnp.maximum(counts, 1.0)[:, None]), counts


def complete_prototypes(prototypes: Array) -> Array:
  r"""``[2, C, d] -> [C, d]``: the mean over the modalities whose prototype is valid."""
  valid = valid_prototypes(prototypes).astype(prototypes.dtype)  # [2, C]
  total = jnp.einsum("vc,vcd->cd", valid, prototypes)
  return total / jnp.maximum(valid.sum(0), 1.0)[:, None]


def prototype_contrastive(
  z: Array,
  labels: Array,
  prototypes: Array,
  *,
  temperature: float = 0.07,
  where: Array | None = None,
) -> Array:
  r"""CMPC per sample: InfoNCE of ``z_i`` against the other modality's class prototypes.

  Examples:
    >>> import jax.numpy as jnp
    >>> p = jnp.eye(2)  # two classes
    >>> z = jnp.asarray([[1.0, 0.0]])
    >>> round(float(prototype_contrastive(z, jnp.asarray([0]), p, temperature=1.0)[0]), 4)
    0.3133

  Args:
    z: ``[B, d]`` L2-normalised embeddings of one modality ``v``.
    labels: ``int [B]`` class ids.
    prototypes: ``[C, d]`` the *other* modality's global class prototypes
      (zero vectors are invalid and left out of the softmax).
    temperature: ``tau``.
    where: optional ``bool [B]`` valid samples.

  Returns:
    ``[B]`` values (0 for padding, and for a sample whose class has no valid prototype).
  """
  valid = valid_prototypes(prototypes)  # [C]
  logits = cosine(z[:, None, :], prototypes[None, :, :]) / temperature  # [B, C]
  logits = jnp.where(valid[None, :], logits, -jnp.inf)
  pos = jnp.take_along_axis(logits, labels[:, None], axis=1)[:, 0]
  has = valid[labels]
  if where is not None:
    has = has & where
  # The safe branch keeps -inf - (-inf) (a class without a prototype) out of the gradient.
  safe_pos = jnp.where(has, pos, 0.0)
  safe_logits = jnp.where(has[:, None], logits, 0.0)
  values = jax.nn.logsumexp(safe_logits, axis=1) - safe_pos
  return jnp.where(has, values, 0.0)


def prototype_regularization(
  z: Array, labels: Array, complete: Array, *, where: Array | None = None
) -> Array:
  r"""CMPR per sample: ``||z_i - Pbar_{y_i}||^2`` to the complete class prototype.

  Args:
    z: ``[B, d]`` embeddings of one modality.
    labels: ``int [B]`` class ids.
    complete: ``[C, d]`` complete prototypes (:func:`complete_prototypes`).
    where: optional ``bool [B]`` valid samples.

  Returns:
    ``[B]`` values (0 for padding).
  """
  values = jnp.sum(jnp.square(z - complete[labels]), axis=-1)
  return values if where is None else jnp.where(where, values, 0.0)


def cross_modal_alignment(z_image: Array, z_text: Array, *, where: Array | None = None) -> Array:
  r"""CMA per pair: ``1 - cos(z_I, z_T)`` of a sample's two embeddings (``[B]``)."""
  values = 1.0 - cosine(z_image, z_text)
  return values if where is None else jnp.where(where, values, 0.0)
