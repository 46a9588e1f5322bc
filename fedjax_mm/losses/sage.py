r"""SAGE's pseudo-labels corrected by confidence discrepancy, and its unlabelled loss.

Paper: Liu, Shang, Zhang, Lu, Gong, Xue and Wang, "Mind the Gap: Confidence
Discrepancy Can Guide Federated Semi-Supervised Learning Across
Pseudo-Mismatch", CVPR 2025 (arXiv 2503.13227), Sec. 4: Collaborative
Pseudo-label Generation (CPG) and Confidence-Driven Soft Correction (CDSC).
The authors' code (github.com/Jay-Codeman/SAGE, ``SAGE.py``,
``Local.fixmatch_train``) fixes every constant below.

On the weak view of an unlabelled sample the *local* model (the one being
trained, its output detached) and the *global* model (the round's starting
model, frozen) give class probabilities ``p_l = softmax(f_l / T)`` and
``p_g = softmax(f_g / T)``, with confidences ``c = max p``, hard labels
``y = onehot(argmax p)``:

.. math::
  m_l = [c_l \ge \tau], \quad m_g = [c_g \ge \tau], \quad m = \max(m_l, m_g)
  \qquad \text{(CPG: the sample counts if either model is confident)}

  \delta = \mathrm{clip}(|c_l - c_g| + 10^{-6}, 10^{-6}, 1), \quad
  \lambda = \mathrm{clip}(e^{-\kappa \delta}, 10^{-6}, 1)

  \hat y = \lambda y_l + (1 - \lambda) y_g \ \text{if } m_l \text{ else } y_g
  \qquad \text{(CDSC)}

  \mathcal L_u = m \cdot \mathrm{KL}(\hat y \,\|\, \mathrm{softmax}(f_l(x_{strong})))

with ``tau = 0.95``, ``T = 1`` and ``kappa = ln 2 / 0.05`` (the code's: ``lambda
= 1/2`` at a confidence gap of 0.05; its unused ``--kappa`` flag aside). The
smaller the gap, the more the local label counts; a large gap hands the label
to the global model. The code adds ``1e-10`` to both distributions before the
KL; here ``0 log 0 = 0`` instead (the same value to ``1e-9``).

The task kinds of the engine, each reduced to SAGE's softmax rule:

==================  ==============================================================
kind                rule
==================  ==============================================================
``classification``  as above, over the ``C`` classes
``multilabel``      each label its own two-class problem (absent, present): the
                    sigmoid is the softmax of the logits ``(0, f)``, so ``c =
                    max(p, 1 - p)``, ``y = [p > 1/2]``, a mask and a ``lambda`` per
                    label, the Bernoulli KL; the loss is the mean over labels
``segmentation``    the classification rule per pixel, the mean over pixels
==================  ==============================================================
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.scipy.special import xlogy

Array = jax.Array

KINDS = ("classification", "multilabel", "segmentation")
#: The authors' sensitivity: ``lambda = exp(-kappa delta) = 1/2`` at ``delta = 0.05``.
KAPPA = math.log(2.0) / 0.05


def sage_targets(
  local_logits: Array,
  global_logits: Array,
  *,
  kind: str = "classification",
  threshold: float = 0.95,
  kappa: float = KAPPA,
  temperature: float = 1.0,
) -> tuple[Array, Array]:
  r"""CPG + CDSC: the corrected soft pseudo-targets and which of them count.

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import losses
    >>> confident = jnp.array([[9.0, 0.0]])  # c = 0.9999 for both models
    >>> t, m = losses.sage_targets(confident, confident)
    >>> [round(float(x), 3) for x in t[0]], bool(m[0])
    ([1.0, 0.0], True)

  Args:
    local_logits: ``[b, C]`` (``[b, H, W, C]`` for segmentation) the local
      model's logits on the weak view (treated as constants).
    global_logits: the same shape, the global model's.
    kind: ``"classification"``, ``"multilabel"`` or ``"segmentation"``.
    threshold: ``tau``, the confidence a pseudo-label needs (0.95).
    kappa: the sensitivity of ``lambda`` to the confidence gap.
    temperature: ``T`` of both softmaxes (1).

  Returns:
    ``(targets, mask)``: soft targets of the logits' shape (for multi-label the
    probability of "present" per label) and ``float32`` mask ``m``: ``[b]``
    (classification), ``[b, C]`` (multi-label: per label) or ``[b, H, W]``
    (segmentation: per pixel).
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
  f_l = jax.lax.stop_gradient(local_logits) / temperature
  f_g = jax.lax.stop_gradient(global_logits) / temperature
  if kind == "multilabel":
    p_l, p_g = jax.nn.sigmoid(f_l), jax.nn.sigmoid(f_g)
    c_l, c_g = jnp.maximum(p_l, 1 - p_l), jnp.maximum(p_g, 1 - p_g)
    y_l, y_g = (p_l > 0.5).astype(jnp.float32), (p_g > 0.5).astype(jnp.float32)
  else:
    p_l, p_g = jax.nn.softmax(f_l, axis=-1), jax.nn.softmax(f_g, axis=-1)
    c_l, c_g = p_l.max(-1), p_g.max(-1)
    num = f_l.shape[-1]
    y_l = jax.nn.one_hot(jnp.argmax(f_l, axis=-1), num, dtype=jnp.float32)
    y_g = jax.nn.one_hot(jnp.argmax(f_g, axis=-1), num, dtype=jnp.float32)
  m_l, m_g = c_l >= threshold, c_g >= threshold
  delta = jnp.clip(jnp.abs(c_l - c_g) + 1e-6, 1e-6, 1.0)
  lam = jnp.clip(jnp.exp(-kappa * delta), 1e-6, 1.0)
  if kind != "multilabel":  # one lambda and mask per sample (pixel), over its classes
    lam, m_l_b = lam[..., None], m_l[..., None]
  else:
    m_l_b = m_l
  targets = jnp.where(m_l_b, lam * y_l + (1 - lam) * y_g, y_g)
  return targets, (m_l | m_g).astype(jnp.float32)


def sage_unlabeled_loss(
  strong_logits: Array,
  targets: Array,
  mask: Array,
  *,
  kind: str = "classification",
  where: Array | None = None,
) -> Array:
  r"""``m * KL(targets || prediction on the strong view)``, per example.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import losses
    >>> f = jnp.array([[2.0, 0.0, -1.0]])
    >>> p = jax.nn.softmax(f)
    >>> float(losses.sage_unlabeled_loss(f, p, jnp.ones(1))[0]) < 1e-6  # already agrees
    True

  Args:
    strong_logits: ``[b, C]`` (``[b, H, W, C]``) the local model's logits on
      the strong view (the only term that carries a gradient).
    targets: :func:`sage_targets`' soft targets.
    mask: its mask ``m``.
    kind: the task kind.
    where: optional ``bool [b]``: examples that count (others give 0).

  Returns:
    ``[b]``: the masked KL (mean over labels for multi-label, over pixels for
    segmentation); the caller averages over the batch, as the code's ``.mean()``.
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
  t = jax.lax.stop_gradient(targets)
  m = jax.lax.stop_gradient(mask)
  if kind == "multilabel":
    kl = (
      xlogy(t, t)
      - t * jax.nn.log_sigmoid(strong_logits)
      + xlogy(1 - t, 1 - t)
      - (1 - t) * jax.nn.log_sigmoid(-strong_logits)
    )
    loss = (kl * m).mean(-1)
  else:
    kl = jnp.sum(xlogy(t, t) - t * jax.nn.log_softmax(strong_logits, axis=-1), axis=-1)
    loss = (kl * m).reshape(kl.shape[0], -1).mean(-1)
  if where is not None:
    loss = jnp.where(where, loss, 0.0)
  return loss
