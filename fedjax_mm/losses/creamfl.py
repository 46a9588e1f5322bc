r"""CreamFL's local contrastive regularisation (LCR) and its distillation distance.

CreamFL paper (``creamfl.txt``), Section 3.2 and eq. (7). A client holds local
representations of a batch of public samples; the server sent the global
representations of the WHOLE public set in both modalities. For the ``k``-th
public sample and a local representation ``l_k`` of modality ``m`` (``o`` the
other modality):

* **inter-modal contrast** (eq. (1)): ``l_k`` against every global
  representation of the other modality, its own pair ``g^o_k`` positive:

  .. math::
    \ell^{inter}_k = -\log \frac{\exp(l_k \cdot g^o_k / \tau)}
                               {\sum_{j=1}^{P} \exp(l_k \cdot g^o_j / \tau)}

* **intra-modal contrast** (eq. (2), MOON-style): the global representation of
  the same modality ``g^m_k`` is the positive and the representation ``p_k``
  made by the client's own model at the start of the round the negative:

  .. math::
    \ell^{intra}_k = -\log \frac{\exp(l_k \cdot g^m_k / \tau)}
                               {\exp(l_k \cdot g^m_k / \tau) + \exp(l_k \cdot p_k / \tau)}

* **representation distance** (eq. (7)): the server distils the aggregated
  representation ``a_k`` into its own output ``f_k`` by the l2 distance
  ``||f_k - a_k||_2``.

The paper writes eqs. (1) and (2) without a temperature; the reference
implementation divides by a temperature (0.5), so both take ``temperature`` (1 recovers
the equations as printed). Every function takes representation matrices, returns
one value per anchor (the caller reduces) and imports only ``jax``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _check(name: str, x: Array, ndim: int = 2) -> None:
  if x.ndim != ndim:
    raise ValueError(f"{name} must have {ndim} dimensions, got shape {x.shape}.")


def inter_modal_contrast(
  local: Array,
  global_other: Array,
  index: Array,
  *,
  temperature: float | Array = 0.5,
  where: Array | None = None,
) -> Array:
  r"""Inter-modal contrast (CreamFL eq. (1)): local vs. all global other-modality reps.

  Anchor ``b`` is the local representation of public sample ``index[b]``; its
  candidates are all ``P`` rows of ``global_other`` and the positive is row
  ``index[b]``. Unlike :func:`~fedjax_mm.losses.info_nce` the candidates are
  the whole public set, not the batch.

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import losses
    >>> g = jnp.eye(3)  # three public samples
    >>> loss = losses.inter_modal_contrast(g[:2], g, jnp.array([0, 1]), temperature=1.0)
    >>> [round(float(v), 4) for v in loss]  # log(e + 2) - 1
    [0.5514, 0.5514]

  Args:
    local: ``[B, d]`` local representations of a batch of public samples.
    global_other: ``[P, d]`` global representations of the other modality of
      the whole public set.
    index: ``int [B]`` public index of each anchor.
    temperature: positive scalar ``tau``.
    where: optional ``bool [B]`` valid anchors; an invalid anchor's loss is 0.

  Returns:
    ``[B]`` per-anchor losses.
  """
  _check("local", local)
  _check("global_other", global_other)
  _check("index", index, 1)
  logits = local @ global_other.T / temperature  # [B, P]
  positive = jnp.take_along_axis(logits, index[:, None], axis=1)[:, 0]
  loss = jax.nn.logsumexp(logits, axis=-1) - positive
  return loss if where is None else jnp.where(where, loss, 0.0)


def intra_modal_contrast(
  local: Array,
  global_same: Array,
  previous: Array,
  *,
  temperature: float | Array = 0.5,
  where: Array | None = None,
) -> Array:
  r"""Intra-modal contrast (CreamFL eq. (2)): global same-modality positive, own old model negative.

  ``\ell_b = log(exp(s^+) + exp(s^-)) - s^+ = softplus(s^- - s^+)`` with
  ``s^+ = l_b . g_b / tau`` and ``s^- = l_b . p_b / tau``. ``previous`` is a
  constant for the client (the caller stops its gradient).

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import losses
    >>> l = jnp.array([[1.0, 0.0]])
    >>> loss = losses.intra_modal_contrast(l, l, jnp.array([[0.0, 1.0]]), temperature=1.0)
    >>> round(float(loss[0]), 4)  # log(1 + exp(-1))
    0.3133

  Args:
    local: ``[B, d]`` local representations.
    global_same: ``[B, d]`` global representations of the same samples and modality.
    previous: ``[B, d]`` representations of the same samples by the client's
      model at the start of the round.
    temperature: positive scalar ``tau``.
    where: optional ``bool [B]`` valid anchors; an invalid anchor's loss is 0.

  Returns:
    ``[B]`` per-anchor losses.
  """
  for name, x in (("local", local), ("global_same", global_same), ("previous", previous)):
    _check(name, x)
  positive = jnp.sum(local * global_same, axis=-1) / temperature
  negative = jnp.sum(local * previous, axis=-1) / temperature
  loss = jax.nn.softplus(negative - positive)
  return loss if where is None else jnp.where(where, loss, 0.0)


def representation_distance(
  prediction: Array, target: Array, *, where: Array | None = None
) -> Array:
  r"""The l2 distance of CreamFL's distillation (eq. (7)): ``||f_b - a_b||_2``.

  The square root is clamped at ``1e-12`` so that identical rows give a zero
  (not NaN) gradient.

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import losses
    >>> losses.representation_distance(jnp.array([[3.0, 4.0]]), jnp.zeros((1, 2)))
    Array([5.], dtype=float32)

  Args:
    prediction: ``[B, d]`` the server's representations ``f``.
    target: ``[B, d]`` the aggregated representations ``a`` (constants).
    where: optional ``bool [B]`` valid rows; an invalid row's distance is 0.

  Returns:
    ``[B]`` distances.
  """
  _check("prediction", prediction)
  _check("target", target)
  squared = jnp.sum(jnp.square(prediction - target), axis=-1)
  distance = jnp.sqrt(jnp.maximum(squared, 1e-12))
  return distance if where is None else jnp.where(where, distance, 0.0)
