r"""Supervised cross-modal retrieval losses: DSCMR and FedSCMR (import only ``jax``).

Li, Li and Shao (2024), "Federated learning for supervised cross-modal
retrieval" (FedSCMR), Section 4.1, built on Zhen et al. (2019), "Deep
Supervised Cross-Modal Retrieval" (DSCMR). A client maps a batch of ``b``
image-text pairs into a common subspace ``S`` (``s_img``, ``s_txt``, ``[b, d]``),
predicts labels from ``S`` with a linear classifier (``p_img``, ``p_txt``,
``[b, c]``) and maps ``S`` again into a second common subspace ``S'`` with
EnhanceNets (``e_img``, ``e_txt``, ``[b, d']``; ``d' = d`` for eqs. 5-6).

===========================  ===========================================  =============
term                         what it pulls / pushes                       paper
===========================  ===========================================  =============
:func:`label_space_loss`     predictions of both modalities to labels     eq. (1)
:func:`discrimination_loss`  same-label pairs together, others apart      eq. (2)
:func:`consistency_loss`     image to its text in ``S`` and ``S'``        eq. (3)
:func:`cross_subspace_loss`  ``S'`` of one modality to the other's ``S``  eqs. (5)-(7)
:func:`fedscmr_loss`         ``alpha L_cs + beta L_ccs + L_imd``          eqs. (4), (8)
:func:`dscmr_loss`           DSCMR's own objective (the baselines)        DSCMR eq. (5)
===========================  ===========================================  =============

Norms. The paper writes eqs. (1), (3), (5) and (6) with Frobenius norms of
``[n, d]`` matrices (and eq. (1) with a ``1/n`` in front). We follow the DSCMR
reference implementation instead: every ``||A - B||`` is the **per-sample**
Euclidean norm ``||a_i - b_i||_2`` averaged over the (valid) samples of the
batch, so the losses do not grow with the batch size and a padded batch equals
the batch without its padding. In eqs. (5)-(6) each of the two norms is
replaced in this way and the hinge is taken of their difference (one hinge per
batch, as the paper's ``max(0, ||.||_F - ||.||_F)``).

Label predictions are the raw outputs of the linear classifier on ``S``, as in
DSCMR (its ``linearLayer2``), regressed onto one-hot (or multi-hot) labels.

Every function takes an optional ``where`` ``bool [b]`` mask of valid samples
(pairs count when both samples are valid) and returns a scalar: the terms of
eqs. (2)-(7) are batch-level (a mean over all pairs, a hinge of two batch
means), so there is no per-example value to hand back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _mask(x: Array, where: Array | None) -> Array:
  """``float [b]`` weights of the valid samples (all ones without a mask)."""
  if where is None:
    return jnp.ones(x.shape[0], x.dtype)
  return jnp.asarray(where, bool).astype(x.dtype)


def _mean(values: Array, weights: Array) -> Array:
  """Weighted mean, 0 when every weight is 0."""
  total = jnp.sum(weights)
  return jnp.sum(values * weights) / jnp.where(total > 0, total, 1)


def _row_norm(x: Array) -> Array:
  """``[b]`` Euclidean norms of the rows, with a gradient that is finite at 0."""
  squared = jnp.sum(jnp.square(x), axis=-1)
  safe = jnp.where(squared > 0, squared, 1)
  return jnp.where(squared > 0, jnp.sqrt(safe), 0)


def mean_distance(a: Array, b: Array, *, where: Array | None = None) -> Array:
  r"""Mean over samples of ``||a_i - b_i||_2``: the per-sample norm used throughout.

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import losses
    >>> print(losses.mean_distance(jnp.array([[3.0, 4.0], [0.0, 0.0]]), jnp.zeros((2, 2))))
    2.5

  Args:
    a: ``[b, d]``.
    b: ``[b, d]``.
    where: optional ``bool [b]`` valid samples.

  Returns:
    Scalar ``sum_i w_i ||a_i - b_i|| / sum_i w_i`` (0 if no sample is valid).
  """
  return _mean(_row_norm(a - b), _mask(a, where))


def label_space_loss(
  p_img: Array, p_txt: Array, labels: Array, *, where: Array | None = None
) -> Array:
  r"""Label-space discrimination loss ``L_imd`` (FedSCMR eq. 1, DSCMR's first term).

  .. math::
    L_{imd} = \frac{1}{n}\sum_i \|\hat p(v_i) - l_i\|_2
            + \frac{1}{n}\sum_i \|\hat p(t_i) - l_i\|_2

  (per-sample norms, see the module docstring).

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import losses
    >>> labels = jnp.eye(2)
    >>> print(losses.label_space_loss(labels, jnp.zeros((2, 2)), labels))
    1.0

  Args:
    p_img: ``[b, c]`` label predictions from the images' ``S`` features.
    p_txt: ``[b, c]`` label predictions from the texts' ``S`` features.
    labels: ``[b, c]`` one-hot (or multi-hot) labels.
    where: optional ``bool [b]`` valid samples.

  Returns:
    Scalar loss.
  """
  labels = labels.astype(p_img.dtype)
  return mean_distance(p_img, labels, where=where) + mean_distance(p_txt, labels, where=where)


def _half_cosine(x: Array, y: Array) -> Array:
  """``[b, b]`` matrix ``Gamma_ij = cos(x_i, y_j) / 2``."""
  xn = x / jnp.maximum(_row_norm(x), 1e-6)[:, None]
  yn = y / jnp.maximum(_row_norm(y), 1e-6)[:, None]
  return 0.5 * (xn @ yn.T)


def discrimination_loss(
  s_img: Array, s_txt: Array, labels: Array, *, where: Array | None = None
) -> Array:
  r"""Semantic discrimination loss ``l_csd`` in ``S`` (FedSCMR eq. 2, DSCMR eq. 3).

  With :math:`\Gamma^{xy}_{ij} = \frac12 \cos(x_i, y_j)` and
  :math:`\delta_{ij} = 1` when samples ``i`` and ``j`` share a label (0
  otherwise), the negative log-likelihood of the label agreements:

  .. math::
    l_{csd} = \sum_{(x, y)} \frac{1}{n^2} \sum_{i,j}
      \left(\log(1 + e^{\Gamma^{xy}_{ij}}) - \delta_{ij}\Gamma^{xy}_{ij}\right),
    \qquad (x, y) \in \{(V, V), (V, T), (T, T)\}.

  The sum runs over image-image, image-text and text-text pairs as in DSCMR.
  The paper's double sum over ``x, y = 1..2`` also counts ``(T, V)``, which
  equals ``(V, T)`` transposed; it would double the cross-modal term.

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import losses
    >>> s = jnp.array([[1.0, 0.0], [0.0, 1.0]])
    >>> print(f"{losses.discrimination_loss(s, s, jnp.eye(2)):.4f}")
    1.7508

  Args:
    s_img: ``[b, d]`` image features in ``S``.
    s_txt: ``[b, d]`` text features in ``S``.
    labels: ``[b, c]`` one-hot or multi-hot labels; ``delta_ij = [l_i . l_j > 0]``.
    where: optional ``bool [b]`` valid samples; the mean runs over valid pairs.

  Returns:
    Scalar loss.
  """
  w = _mask(s_img, where)
  pair_w = w[:, None] * w[None, :]
  labels = labels.astype(s_img.dtype)
  delta = (labels @ labels.T > 0).astype(s_img.dtype)

  def term(x, y):
    gamma = _half_cosine(x, y)
    return _mean(jax.nn.softplus(gamma) - delta * gamma, pair_w)

  return term(s_img, s_img) + term(s_img, s_txt) + term(s_txt, s_txt)


def consistency_loss(
  s_img: Array, s_txt: Array, e_img: Array, e_txt: Array, *, where: Array | None = None
) -> Array:
  r"""Semantic consistency loss ``l_csc`` across ``S`` and ``S'`` (FedSCMR eq. 3).

  .. math::
    l_{csc} = \frac1n\sum_i \|s^V_i - s^T_i\|_2 + \frac1n\sum_i \|s'^V_i - s'^T_i\|_2

  Its first term is DSCMR's modality-invariance loss (DSCMR eq. 4).

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import losses
    >>> a, b = jnp.zeros((1, 2)), jnp.array([[3.0, 4.0]])
    >>> print(losses.consistency_loss(a, b, a, a))
    5.0

  Args:
    s_img: ``[b, d]`` image features in ``S``.
    s_txt: ``[b, d]`` text features in ``S``.
    e_img: ``[b, d']`` image features in ``S'``.
    e_txt: ``[b, d']`` text features in ``S'``.
    where: optional ``bool [b]`` valid samples.

  Returns:
    Scalar loss.
  """
  return mean_distance(s_img, s_txt, where=where) + mean_distance(e_img, e_txt, where=where)


def cross_subspace_loss(
  s_img: Array, s_txt: Array, e_img: Array, e_txt: Array, *, where: Array | None = None
) -> Array:
  r"""Cross-subspace hinge loss ``L_ccs`` (FedSCMR eqs. 5-7).

  .. math::
    L_{ccs,V} = \max\left(0, \overline{\|s'^V - s^T\|} - \overline{\|s'^V - s^V\|}\right),
    \quad
    L_{ccs,T} = \max\left(0, \overline{\|s'^T - s^V\|} - \overline{\|s'^T - s^T\|}\right),

  :math:`L_{ccs} = L_{ccs,V} + L_{ccs,T}`, where :math:`\overline{\|a - b\|}`
  is the batch mean of the per-sample norms (module docstring). It is zero
  once each modality's ``S'`` features lie, on average, at least as close to
  the *other* modality's ``S`` features as to their own.

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import losses
    >>> s_img, s_txt = jnp.array([[0.0, 0.0]]), jnp.array([[2.0, 0.0]])
    >>> print(losses.cross_subspace_loss(s_img, s_txt, s_img, s_txt))  # S' = S: 2 + 2
    4.0

  Args:
    s_img: ``[b, d]`` image features in ``S``.
    s_txt: ``[b, d]`` text features in ``S``.
    e_img: ``[b, d]`` image features in ``S'``.
    e_txt: ``[b, d]`` text features in ``S'``.
    where: optional ``bool [b]`` valid samples.

  Returns:
    Scalar loss.
  """
  d = lambda a, b: mean_distance(a, b, where=where)
  image = jax.nn.relu(d(e_img, s_txt) - d(e_img, s_img))
  text = jax.nn.relu(d(e_txt, s_img) - d(e_txt, s_txt))
  return image + text


def fedscmr_terms(
  s_img: Array,
  s_txt: Array,
  e_img: Array,
  e_txt: Array,
  p_img: Array,
  p_txt: Array,
  labels: Array,
  *,
  where: Array | None = None,
) -> dict[str, Array]:
  """Every term of FedSCMR's local loss, unweighted: ``imd, csd, csc, cs, ccs``.

  Args: as :func:`fedscmr_loss`.

  Returns:
    Dict of scalars; ``cs = csd + csc`` (eq. 4).
  """
  csd = discrimination_loss(s_img, s_txt, labels, where=where)
  csc = consistency_loss(s_img, s_txt, e_img, e_txt, where=where)
  return {
    "imd": label_space_loss(p_img, p_txt, labels, where=where),
    "csd": csd,
    "csc": csc,
    "cs": csd + csc,
    "ccs": cross_subspace_loss(s_img, s_txt, e_img, e_txt, where=where),
  }


def fedscmr_loss(
  s_img: Array,
  s_txt: Array,
  e_img: Array,
  e_txt: Array,
  p_img: Array,
  p_txt: Array,
  labels: Array,
  *,
  alpha: float = 0.1,
  beta: float = 0.1,
  where: Array | None = None,
) -> Array:
  r"""FedSCMR's local loss (eq. 8): ``alpha * L_cs + beta * L_ccs + L_imd``.

  .. math::
    L_{total} = \alpha (l_{csd} + l_{csc}) + \beta (L_{ccs,V} + L_{ccs,T}) + L_{imd}

  The paper's ablations are ``alpha = 0`` (without ``L_cs``) and ``beta = 0``
  (without ``L_ccs``); its best setting (Fig. 4-5) is ``alpha = beta = 0.1``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import losses
    >>> s, labels = jnp.eye(2), jnp.eye(2)
    >>> loss = losses.fedscmr_loss(s, s, s, s, labels, labels, labels, alpha=0.1, beta=0.1)
    >>> print(f"{loss:.4f}")  # only l_csd is non-zero: 0.1 * 1.7508
    0.1751

  Args:
    s_img: ``[b, d]`` image features in ``S`` (BaseNet outputs).
    s_txt: ``[b, d]`` text features in ``S``.
    e_img: ``[b, d]`` image features in ``S'`` (EnhanceNet outputs).
    e_txt: ``[b, d]`` text features in ``S'``.
    p_img: ``[b, c]`` label predictions from ``s_img``.
    p_txt: ``[b, c]`` label predictions from ``s_txt``.
    labels: ``[b, c]`` one-hot or multi-hot labels.
    alpha: keyword-only weight of ``L_cs``.
    beta: keyword-only weight of ``L_ccs``.
    where: optional ``bool [b]`` valid samples.

  Returns:
    Scalar loss.
  """
  t = fedscmr_terms(s_img, s_txt, e_img, e_txt, p_img, p_txt, labels, where=where)
  return alpha * t["cs"] + beta * t["ccs"] + t["imd"]


def dscmr_loss(
  s_img: Array,
  s_txt: Array,
  p_img: Array,
  p_txt: Array,
  labels: Array,
  *,
  alpha: float = 0.1,
  beta: float = 0.1,
  where: Array | None = None,
) -> Array:
  r"""DSCMR's objective: ``L_imd + alpha * l_csd + beta * (1/n) sum_i ||s^V_i - s^T_i||``.

  The loss of the baselines (DSCMR per client, FedAvg, FedProx, FedCMR): the
  label-space loss (eq. 1), the discrimination loss (eq. 2) and the
  modality-invariance loss in ``S`` (the first term of eq. 3); no ``S'``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import losses
    >>> s, labels = jnp.eye(2), jnp.eye(2)
    >>> print(f"{losses.dscmr_loss(s, s, labels, labels, labels, alpha=1.0, beta=1.0):.4f}")
    1.7508

  Args:
    s_img: ``[b, d]`` image features in ``S``.
    s_txt: ``[b, d]`` text features in ``S``.
    p_img: ``[b, c]`` label predictions from ``s_img``.
    p_txt: ``[b, c]`` label predictions from ``s_txt``.
    labels: ``[b, c]`` one-hot or multi-hot labels.
    alpha: keyword-only weight of the discrimination loss.
    beta: keyword-only weight of the modality-invariance loss.
    where: optional ``bool [b]`` valid samples.

  Returns:
    Scalar loss.
  """
  return (
    label_space_loss(p_img, p_txt, labels, where=where)
    + alpha * discrimination_loss(s_img, s_txt, labels, where=where)
    + beta * mean_distance(s_img, s_txt, where=where)
  )
