r"""FedX's relational loss (Han et al., "FedX: Unsupervised Federated Learning with
Cross Knowledge Distillation", ECCV 2022, Sec. 3, eqs. (3)-(6); code Sungwon-Han/FEDX).

FedX trains each client on four terms: a contrastive loss (SimCLR's NT-Xent,
:func:`fedjax_mm.losses.nt_xent`) and a *relational* loss, both once among the
local model's outputs ("local knowledge distillation") and once against the frozen
global model received at the start of the round ("global knowledge distillation").
The relational loss asks two embeddings of the same sample to relate alike to a
batch of anchors: each embedding gives a softmax over its cosine similarities to the
anchors, and the loss is the Jensen-Shannon-style divergence between the two:

.. math::
  r^{(t)}(x)_j = \frac{e^{\cos(x, a_j) / t}}{\sum_l e^{\cos(x, a_l) / t}},\qquad
  m = \tfrac12 \big(r^{(t_2)}(x_1) + r^{(t_2)}(x_2)\big),

  \ell = \tfrac12 \big(\mathrm{KL}(m \,\|\, r^{(t)}(x_1)) + \mathrm{KL}(m \,\|\, r^{(t)}(x_2))\big)

(``KL(m || r) = sum_j m_j (log m_j - log r_j)``, the direction of PyTorch's
``kl_div(log r, m)`` in the FedX code). The mixture ``m`` is not detached (the code
differentiates through it). With ``t = t_2`` (the code's default, 0.1 for both) this is
the Jensen-Shannon divergence of the two distributions, zero exactly when they agree;
with ``t != t_2`` (the code's ``--ts`` / ``--tt``) it is not zero even then.

Imports only ``jax``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_mm.losses.fedrgb import task_loss
from fedjax_mm.losses.simclr import nt_xent

Array = jax.Array

#: FedX's temperatures (the code's ``--temperature``, ``--ts``, ``--tt`` defaults).
TAU = 0.1


def _normalise(x: Array) -> Array:
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def relational_loss(
  x1: Array,
  x2: Array,
  anchors: Array,
  *,
  tau: float | Array = TAU,
  target_tau: float | Array = TAU,
  where: Array | None = None,
) -> Array:
  r"""FedX's relational (JS) loss of each sample between two of its embeddings.

  Args:
    x1: ``[n, d]`` one embedding of each sample (need not be normalised).
    x2: ``[n, d]`` the other embedding of the same samples.
    anchors: ``[m, d]`` the anchors the similarities are taken to.
    tau: temperature ``t`` of the two distributions that are compared.
    target_tau: temperature ``t_2`` of the mixture target.
    where: optional ``bool [m]``: which anchors count (the others are left out of the
      softmax).

  Returns:
    ``[n]``: ``(KL(m || r(x1)) + KL(m || r(x2))) / 2`` per sample; the FedX code's
    batch mean is the caller's.

  >>> x = jnp.eye(3)
  >>> bool(jnp.abs(relational_loss(x, x, x)).max() < 1e-6)  # the same distributions
  True
  """
  if x1.ndim != 2 or x1.shape != x2.shape or anchors.ndim != 2 or anchors.shape[1] != x1.shape[1]:
    raise ValueError(
      f"relational_loss: expected x1, x2 [n, d] and anchors [m, d], got {x1.shape}, "
      f"{x2.shape}, {anchors.shape}."
    )
  a = _normalise(anchors)
  s1, s2 = _normalise(x1) @ a.T, _normalise(x2) @ a.T
  if where is not None:
    s1 = jnp.where(where[None], s1, -jnp.inf)
    s2 = jnp.where(where[None], s2, -jnp.inf)
  log_r1 = jax.nn.log_softmax(s1 / tau, axis=-1)
  log_r2 = jax.nn.log_softmax(s2 / tau, axis=-1)
  m = 0.5 * (jax.nn.softmax(s1 / target_tau, axis=-1) + jax.nn.softmax(s2 / target_tau, axis=-1))
  log_m = jnp.log(jnp.where(m > 0, m, 1.0))
  kl = lambda log_r: jnp.sum(jnp.where(m > 0, m * (log_m - jnp.where(m > 0, log_r, 0.0)), 0.0), -1)
  return 0.5 * (kl(log_r1) + kl(log_r2))


def fedx_terms(
  z_img: Array,
  z_txt: Array,
  g_img: Array,
  g_txt: Array,
  local_anchors: Array,
  global_anchors: Array,
  *,
  task_tau: float | Array,
  tau: float | Array = TAU,
  target_tau: float | Array = TAU,
) -> dict[str, Array]:
  r"""FedX's four terms per pair, adapted to image-text pairs (FedRGB's FedX row).

  Args:
    z_img, z_txt: ``[n, d]`` the local model's image and text embeddings of the batch.
    g_img, g_txt: ``[n, d]`` the frozen global model's of the same pairs (the caller
      stops their gradient).
    local_anchors, global_anchors: ``[m, d]`` the local / global model's embeddings of
      the anchors.
    task_tau: the temperature of ``L_task``, the local contrastive term.
    tau, target_tau: FedX's relational (and global contrastive) temperature and the
      relational target's.

  Returns:
    ``[n]`` each: ``local_contrastive`` (``L_task(z_I, z_T)``), ``local_relational``
    (``L_rel(z_I, z_T; local anchors)``), ``global_contrastive`` (``(NT-Xent(z_I, g_T) +
    NT-Xent(z_T, g_I)) / 2``) and ``global_relational`` (``(L_rel(z_I, g_I) + L_rel(z_T,
    g_T)) / 2`` over the global anchors).
  """
  rel = lambda a, b, anchors: relational_loss(a, b, anchors, tau=tau, target_tau=target_tau)
  return {
    "local_contrastive": task_loss(z_img, z_txt, tau=task_tau),
    "local_relational": rel(z_img, z_txt, local_anchors),
    "global_contrastive": 0.5 * (nt_xent(z_img, g_txt, tau=tau) + nt_xent(z_txt, g_img, tau=tau)),
    "global_relational": 0.5
    * (rel(z_img, g_img, global_anchors) + rel(z_txt, g_txt, global_anchors)),
  }
