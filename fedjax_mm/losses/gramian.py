r"""The Gramian (volume) contrastive loss of Cicchetti et al. (2025).

As the FedMuscle paper's Appendix J writes it: the anchor ``z^n_i`` and one
vector from each of the ``M`` other models, all from sample ``j``, span a
parallelotope whose volume is the square root of the determinant of their
``(M+1) x (M+1)`` Gram matrix. Aligned tuples have small volume, so the logit
of candidate ``j`` is ``-Vol / tau``:

.. math::
  \mathrm{Vol}(i, j) &= \sqrt{\det \mathcal{G}(z^n_i, z^1_j, \dots, z^M_j)} \\
  \ell_i &= -\log \frac{\exp(-\mathrm{Vol}(i, i) / \tau)}
                       {\sum_{j \in [B]} \exp(-\mathrm{Vol}(i, j) / \tau)}

Unlike the Muscle loss it has one temperature, only ``B`` candidates per anchor
(the others always come from the same sample ``j``), and with ``M = 1`` it is not
InfoNCE: the volume ``sqrt(1 - (a . b)^2)`` is blind to the sign of the
similarity, so an anti-aligned pair looks as good as an aligned one
(Appendix J, "Consistency with InfoNCE"). With ``M + 1 > d`` every volume is 0.

Reference: G. Cicchetti, E. Grassucci, L. Sigillo, D. Comminiello. Gramian
Multimodal Representation Learning and Alignment. ICLR 2025.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _safe_sqrt(x: Array) -> Array:
  """``sqrt(max(x, 0))`` with a zero (not infinite) gradient at 0."""
  positive = x > 0
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, x, 1.0)), 0.0)


def gram_volumes(anchor: Array, others: Array) -> Array:
  """Volumes of the parallelotopes spanned by ``z^n_i`` and ``z^1_j..z^M_j``.

  Args:
    anchor: ``[B, d]`` anchor representations.
    others: ``[M, B, d]`` representations of the other models.

  Returns:
    ``[B, B]`` volumes, anchor ``i`` by candidate sample ``j``.
  """
  batch = anchor.shape[0]
  num_others = others.shape[0]
  anchor_norms = jnp.sum(anchor * anchor, axis=-1)  # [B]
  cross = jnp.einsum("id,mjd->ijm", anchor, others)  # [B, B, M]
  per_sample = jnp.einsum("mjd,njd->jmn", others, others)  # [B, M, M]
  gram = jnp.empty((batch, batch, num_others + 1, num_others + 1), anchor.dtype)
  gram = gram.at[:, :, 0, 0].set(anchor_norms[:, None])
  gram = gram.at[:, :, 0, 1:].set(cross)
  gram = gram.at[:, :, 1:, 0].set(cross)
  gram = gram.at[:, :, 1:, 1:].set(
    jnp.broadcast_to(per_sample[None], (batch, batch, num_others, num_others))
  )
  return _safe_sqrt(jnp.linalg.det(gram))


def gramian_loss(anchor: Array, others: Array, *, tau: float | Array) -> Array:
  """Gramian contrastive loss of each anchor (FedMuscle paper, Appendix J).

  Args:
    anchor: ``[B, d]`` L2-normalised anchor representations ``Z^n``.
    others: ``[M, B, d]`` L2-normalised representations of the other models.
    tau: scalar temperature.

  Returns:
    ``[B]`` per-anchor losses.
  """
  if anchor.ndim != 2 or others.ndim != 3 or others.shape[1:] != anchor.shape:
    raise ValueError(
      f"anchor must be [B, d] and others [M, B, d]; got {anchor.shape} and {others.shape}."
    )
  logits = -gram_volumes(anchor, others) / tau
  return jax.nn.logsumexp(logits, axis=-1) - jnp.diagonal(logits)
