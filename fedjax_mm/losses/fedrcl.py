r"""FedRCL's relaxed contrastive loss: supervised contrast plus a divergence penalty.

Paper: Seo, Kim, Kim and Han, "Relaxed Contrastive Learning for Federated
Learning", CVPR 2024 (arXiv 2401.04928), Section 4. Every client adds to its
cross-entropy a supervised contrastive loss (SCL) on its own labelled batch,
which the paper derives to reduce the deviation of local gradients, and a
*divergence penalty* on same-class pairs that are already too similar, which
keeps SCL from collapsing each class onto a point (the paper's
"representation collapse"). With cosine similarities ``s_ij = z_i . z_j``,
positives ``P_i`` (same label, ``j != i``) and negatives ``N_i`` (other
labels), for anchor ``i``:

.. math::
  \ell^{SCL}_i = \frac{1}{|P_i|} \sum_{p \in P_i}
    -\log \frac{e^{s_{ip}/\tau}}{e^{s_{ip}/\tau} + \sum_{n \in N_i} e^{s_{in}/\tau}}

.. math::
  \ell^{div}_i = -\log \frac{e^{s_{ii}/\tau}}{e^{s_{ii}/\tau} + \sum_{j \in S_i} e^{s_{ij}/\tau}},
  \qquad S_i = \{ j \in P_i : s_{ij} > \lambda \}

.. math::
  \ell^{RCL}_i = \ell^{SCL}_i + \beta\, \ell^{div}_i .

The penalty contrasts each sample with itself, its own positive, against the
same-class samples above the threshold ``lambda``: it pushes them apart until
their similarity falls below ``lambda``, and is 0 once no pair is above it
(``S_i`` empty). This is the form of
the authors' code (``utils/loss.py``'s ``MetricLoss`` with
``configs/client/fedrcl.yaml``: the second pair, ``unsupervised`` positives =
the sample itself, ``intra_class_thresholding`` negatives above
``threshold = 0.7``, ``temp = 0.05``, weight 1). Differences, all deliberate:
the code keeps only the hardest positive and the two hardest negatives
(``topk_pos = 1``, ``topk_neg = 2``) and the least similar same-class sample
for the penalty, and applies the loss at five depths of a ResNet; here every
pair counts and the loss is applied to the user's representation ``z`` only,
the layer all FedMuscle baselines share.

Positives beyond single labels (the caller builds ``positive``): see
:func:`label_positives` (classes), :func:`set_positives` (label sets:
multi-label, or the classes present in a segmentation mask).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def label_positives(labels: Array) -> Array:
  """``bool [b, b]``: same class (``labels [b]`` integers); the diagonal included."""
  return labels[:, None] == labels[None, :]


def set_positives(sets: Array, *, min_jaccard: float = 0.5) -> Array:
  """``bool [b, b]``: label sets ``[b, C]`` (multi-hot) with Jaccard index ``>= min_jaccard``.

  Two empty sets count as identical (Jaccard 1), as in multi-label SupCon
  (Zhang et al., 2024).
  """
  sets = sets.astype(jnp.float32)
  inter = sets @ sets.T
  union = sets.sum(-1)[:, None] + sets.sum(-1)[None, :] - inter
  return jnp.where(union > 0, inter / jnp.maximum(union, 1.0), 1.0) >= min_jaccard


def _pair_masks(positive: Array, where: Array | None) -> tuple[Array, Array, Array]:
  b = positive.shape[0]
  valid = jnp.ones(b, bool) if where is None else where
  pair = valid[:, None] & valid[None, :] & ~jnp.eye(b, dtype=bool)
  return valid, pair & positive, pair & ~positive


def supervised_contrastive(
  z: Array, positive: Array, *, tau: float = 0.05, where: Array | None = None
) -> Array:
  r"""``\ell^{SCL}_i`` of each anchor (0 for an anchor with no positive).

  Args:
    z: ``[b, d]`` L2-normalised representations.
    positive: ``bool [b, b]`` which pairs share a label (diagonal ignored).
    tau: temperature.
    where: optional ``bool [b]`` valid samples (padding is neither anchor nor
      candidate).

  Returns:
    ``[b]`` per-anchor losses.
  """
  valid, pos, neg = _pair_masks(positive, where)
  s = z @ z.T / tau
  neg_lse = jax.nn.logsumexp(jnp.where(neg, s, -jnp.inf), axis=-1, keepdims=True)  # [b, 1]
  # -log e^{s_ip} / (e^{s_ip} + sum_n e^{s_in}) = softplus(lse_n - s_ip); -inf lse -> 0.
  per_pair = jax.nn.softplus(neg_lse - s)
  count = pos.sum(-1)
  loss = jnp.sum(jnp.where(pos, per_pair, 0.0), -1) / jnp.maximum(count, 1)
  return jnp.where(valid & (count > 0), loss, 0.0)


def divergence_penalty(
  z: Array,
  positive: Array,
  *,
  tau: float = 0.05,
  threshold: float = 0.7,
  where: Array | None = None,
) -> Array:
  r"""``\ell^{div}_i``: each sample against its same-class samples more similar than ``lambda``.

  Args:
    z: ``[b, d]`` L2-normalised representations.
    positive: ``bool [b, b]`` which pairs share a label.
    tau: temperature.
    threshold: ``lambda``; pairs with ``s_ij > lambda`` are penalised (the
      selection carries no gradient, the similarities do).
    where: optional ``bool [b]`` valid samples.

  Returns:
    ``[b]`` per-anchor penalties (exactly 0 where no pair is above ``lambda``).
  """
  valid, pos, _ = _pair_masks(positive, where)
  sim = z @ z.T
  close = pos & (jax.lax.stop_gradient(sim) > threshold)
  s = sim / tau
  self_s = jnp.diagonal(s)
  close_lse = jax.nn.logsumexp(jnp.where(close, s, -jnp.inf), axis=-1)
  loss = jax.nn.softplus(close_lse - self_s)  # -log e^{s_ii} / (e^{s_ii} + sum_S e^{s_ij})
  return jnp.where(valid & close.any(-1), loss, 0.0)


def relaxed_contrastive_loss(
  z: Array,
  positive: Array,
  *,
  tau: float = 0.05,
  threshold: float = 0.7,
  beta: float = 1.0,
  where: Array | None = None,
) -> Array:
  r"""``\ell^{RCL}_i = \ell^{SCL}_i + \beta \ell^{div}_i`` per anchor ``[b]``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import losses
    >>> z = jnp.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])  # two identical samples of class 0
    >>> pos = losses.label_positives(jnp.array([0, 0, 1]))
    >>> [round(float(v), 4) for v in losses.relaxed_contrastive_loss(z, pos, tau=1.0)]
    [1.0064, 1.0064, 0.0]
  """
  scl = supervised_contrastive(z, positive, tau=tau, where=where)
  div = divergence_penalty(z, positive, tau=tau, threshold=threshold, where=where)
  return scl + beta * div
