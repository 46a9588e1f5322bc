r"""The Muscle loss: multi-model contrastive learning over B^M tuples.

FedMuscle paper (``fedmuscle_muscle_loss.txt``), eq. (3) and eq. (5). User
``n`` holds anchor representations ``Z^n`` ``[B, d]``; ``M`` other users send
``Z^m`` ``[M, B, d]`` of the same ``B`` public samples. Every tuple
``j = (j_1, ..., j_M)`` in ``[B]^M`` is a candidate for anchor ``i``, and
``(i, ..., i)`` is its positive. With

.. math::
  A_m[i, k]          &= z^n_i \cdot z^m_k / \tau_{n,m}
      \quad\text{(anchor-other similarities)} \\
  G_{m,m'}[k, l]     &= z^m_k \cdot z^{m'}_l
      \quad\text{(other-other similarities)} \\
  \log\alpha_{\mathbf j} &= -\sum_{m<m'} \gamma_{m,m'} G_{m,m'}[j_m, j_{m'}] \\
  \mathrm{logit}(i, \mathbf j) &= \sum_m A_m[i, j_m] + \log\alpha_{\mathbf j}

the loss of anchor ``i`` is

.. math::
  \ell_i = \operatorname{logsumexp}_{\mathbf j \in [B]^M} \mathrm{logit}(i, \mathbf j)
           - \mathrm{logit}(i, (i, \dots, i)).

The paper writes ``alpha`` with half the sum over ordered pairs
``m != m'``; for a symmetric ``gamma`` that is the sum over ``m < m'`` used
here (a non-symmetric ``gamma`` is symmetrised, which is what the paper's
double sum computes). ``gamma_{m,m'} = 1/tau^{(M)}_{m,m'} - 1/tau^{(M+1)}_{m,m'}``
(:func:`muscle_gamma`), positive by the paper's Appendix C.

How it is computed. The denominator is a log-sum-exp over a broadcast tensor of
shape ``[B, B, ..., B]`` (``M + 1`` axes: the anchor and one per other model)
built by adding ``M`` matrices ``A_m`` and ``M(M-1)/2`` matrices
``-gamma G``, each ``B x B``. The cost is ``O(B^(M+1))`` additions and
exponentials with no factor ``d``; nothing of size ``B^M x d`` is formed. When
the tensor would exceed a memory budget, anchors are processed in chunks with
``jax.lax.map`` under ``jax.checkpoint``, so the backward pass re-computes a
chunk instead of storing every chunk's tensor.

Two protocols, one loss:

* **factored** (the fast path): the server sends user ``n`` the
  :class:`MuscleTargets` — ``Z^m / tau`` ``[M, B, d]`` and the pairwise terms
  ``-gamma G`` ``[M(M-1)/2, B, B]`` — and the user evaluates
  :func:`muscle_client_loss`. The server never sees the anchor.
* **paper**: the server sends ``S^n`` ``[B^M, d]`` (rows ``s_j = sum_m
  z^m_{j_m} / tau_m``) and ``alpha^n`` ``[B^M]`` (eq. (5)); the user evaluates
  :func:`muscle_loss_from_paper_targets`. Kept to prove equivalence and to count
  what the paper's downlink costs; it is exponentially larger.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array

# Elements of one chunk's [c, B, ..., B] logit tensor. The backward pass holds a
# few tensors of this size (logits, softmax, a reduction buffer), so 2**25
# float32 elements (128 MiB) keeps the temporary memory under about 1 GiB.
DEFAULT_CHUNK_ELEMENTS = 2**25


class MuscleTargets(NamedTuple):
  """What the server sends user ``n`` under the factored protocol.

  Attributes:
    scaled_others: ``[M, B, d]``, the others' representations divided by their
      anchor temperatures, ``Z^m / tau_{n,m}``.
    pair_logits: ``[M(M-1)/2, B, B]``, ``-gamma_{m,m'} Z^m Z^{m'}^T`` for each
      pair ``m < m'`` in ``itertools.combinations(range(M), 2)`` order.
  """

  scaled_others: Array
  pair_logits: Array


def muscle_gamma(tau_full: float | Array, tau_reduced: float | Array) -> Array:
  r"""Other-other weights ``gamma = 1/tau_reduced - 1/tau_full``.

  ``tau_full`` is the paper's ``tau^{(M+1)}`` (all ``M + 1`` models in the
  tuple) and ``tau_reduced`` its ``tau^{(M)}``; Appendix C shows
  ``tau^{(M)} < tau^{(M+1)}``, so ``gamma > 0``.

  Examples:
    >>> from fedjax_mm import losses
    >>> round(float(losses.muscle_gamma(0.2, 0.15)), 4)  # the paper's default
    1.6667

  Args:
    tau_full: scalar or ``[M, M]`` temperatures ``tau^{(M+1)}``.
    tau_reduced: scalar or ``[M, M]`` temperatures ``tau^{(M)}``.

  Returns:
    ``gamma`` with the broadcast shape of the inputs.
  """
  return 1.0 / jnp.asarray(tau_reduced) - 1.0 / jnp.asarray(tau_full)


def _pairs(num_others: int) -> tuple[tuple[int, int], ...]:
  return tuple(itertools.combinations(range(num_others), 2))


def _place(x: Array, axes: tuple[int, ...], ndim: int) -> Array:
  """Reshapes ``x`` so its dims sit on ``axes`` (increasing) of an ndim tensor."""
  shape = [1] * ndim
  for axis, size in zip(axes, x.shape, strict=True):
    shape[axis] = size
  return x.reshape(shape)


def _temperatures(tau: float | Array, num_others: int, dtype) -> Array:
  tau = jnp.asarray(tau, dtype)
  if tau.ndim > 1 or (tau.ndim == 1 and tau.shape[0] != num_others):
    raise ValueError(f"tau must be a scalar or [M={num_others}], got shape {tau.shape}.")
  return jnp.broadcast_to(tau, (num_others,))


def _gamma_matrix(gamma: float | Array, num_others: int, dtype) -> Array:
  gamma = jnp.asarray(gamma, dtype)
  if gamma.ndim == 0:
    return jnp.full((num_others, num_others), gamma)
  if gamma.shape != (num_others, num_others):
    raise ValueError(
      f"gamma must be a scalar or [M, M] = [{num_others}, {num_others}], got {gamma.shape}."
    )
  return 0.5 * (gamma + gamma.T)


def _check_others(others: Array) -> tuple[int, int, int]:
  if others.ndim != 3:
    raise ValueError(f"others must be [M, B, d], got shape {others.shape}.")
  num_others, batch, _ = others.shape
  if num_others < 1:
    raise ValueError("the Muscle loss needs at least one other model (M >= 1).")
  if batch < 2:
    raise ValueError(f"the Muscle loss needs a batch of at least 2 samples, got B={batch}.")
  return others.shape


def muscle_server_targets(
  others: Array, *, tau: float | Array, gamma: float | Array
) -> MuscleTargets:
  """Server half of the Muscle loss under the factored protocol.

  Args:
    others: ``[M, B, d]`` L2-normalised representations of the ``M`` users
      selected as partners of user ``n``.
    tau: scalar or ``[M]`` anchor-other temperatures ``tau^{(M+1)}_{n,m}``.
    gamma: scalar or ``[M, M]`` other-other weights (diagonal ignored).

  Returns:
    :class:`MuscleTargets`: ``M*B*d + M(M-1)/2*B*B`` numbers in all.
  """
  num_others, batch, _ = _check_others(others)
  tau = _temperatures(tau, num_others, others.dtype)
  gamma = _gamma_matrix(gamma, num_others, others.dtype)
  scaled = others / tau[:, None, None]
  pairs = _pairs(num_others)
  if pairs:
    first, second = (jnp.asarray(idx) for idx in zip(*pairs, strict=True))
    similarity = jnp.einsum("pkd,pld->pkl", others[first], others[second])
    pair_logits = -gamma[first, second][:, None, None] * similarity
  else:
    pair_logits = jnp.zeros((0, batch, batch), others.dtype)
  return MuscleTargets(scaled_others=scaled, pair_logits=pair_logits)


def _log_alpha_tensor(pair_logits: Array, num_others: int, batch: int) -> Array:
  """``log alpha`` as a ``[B] * M`` tensor, summed from its pairwise terms."""
  log_alpha = jnp.zeros((batch,) * num_others, pair_logits.dtype)
  for term, axes in zip(pair_logits, _pairs(num_others), strict=True):
    log_alpha = log_alpha + _place(term, axes, num_others)
  return log_alpha


def default_chunk_size(batch: int, num_others: int) -> int:
  """Anchors per chunk that keep one chunk's tensor within the memory budget."""
  return max(1, min(batch, DEFAULT_CHUNK_ELEMENTS // batch**num_others))


def muscle_client_loss(
  anchor: Array, targets: MuscleTargets, *, chunk_size: int | None = None
) -> Array:
  """Client half of the Muscle loss (eq. (3)) from the factored server targets.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from fedjax_mm import losses
    >>> keys = jax.random.split(jax.random.key(0), 2)
    >>> unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    >>> anchor = unit(jax.random.normal(keys[0], (4, 8)))
    >>> others = unit(jax.random.normal(keys[1], (3, 4, 8)))
    >>> targets = losses.muscle_server_targets(others, tau=0.2, gamma=losses.muscle_gamma(0.2, 0.15))
    >>> loss = losses.muscle_client_loss(anchor, targets)
    >>> loss.shape
    (4,)
    >>> bool(jnp.allclose(loss, losses.muscle_loss(anchor, others, tau=0.2, gamma=1 / 0.15 - 1 / 0.2)))
    True

  Args:
    anchor: ``[B, d]`` L2-normalised anchor representations ``Z^n``.
    targets: what :func:`muscle_server_targets` returned for the same batch.
    chunk_size: anchors per chunk of the ``[B]^(M+1)`` tensor; ``None`` picks
      the largest chunk within :data:`DEFAULT_CHUNK_ELEMENTS`, and no chunking
      at all when the whole tensor fits.

  Returns:
    ``[B]`` per-anchor losses.
  """
  num_others, batch, _ = _check_others(targets.scaled_others)
  if anchor.ndim != 2 or anchor.shape[0] != batch:
    raise ValueError(f"anchor must be [B={batch}, d], got shape {anchor.shape}.")
  # a[i, m, k] = z^n_i . z^m_k / tau_m: the only place the dimension d appears.
  a = jnp.einsum("id,mkd->imk", anchor, targets.scaled_others)
  log_alpha = _log_alpha_tensor(targets.pair_logits, num_others, batch)

  def one_anchor_lse(a_i: Array) -> Array:
    # a_i: [M, B] -> scalar log-sum-exp over the [B]^M tuples.
    logits = log_alpha
    for m in range(num_others):
      logits = logits + _place(a_i[m], (m,), num_others)
    return jax.nn.logsumexp(logits)

  chunk = default_chunk_size(batch, num_others) if chunk_size is None else int(chunk_size)
  if chunk < 1:
    raise ValueError(f"chunk_size must be positive, got {chunk_size}.")
  if chunk >= batch:
    lse = jax.vmap(one_anchor_lse)(a)
  else:
    lse = jax.lax.map(jax.checkpoint(one_anchor_lse), a, batch_size=chunk)
  positive = jnp.einsum("imi->i", a) + jnp.einsum("pii->i", targets.pair_logits)
  return lse - positive


def muscle_loss(
  anchor: Array,
  others: Array,
  *,
  tau: float | Array,
  gamma: float | Array,
  chunk_size: int | None = None,
) -> Array:
  r"""The Muscle loss of each anchor (FedMuscle paper, eq. (3)).

  Equivalent to ``muscle_client_loss(anchor, muscle_server_targets(others,
  ...))``; gradients flow to both ``anchor`` and ``others``. With ``M = 1`` it
  is :func:`~fedjax_mm.losses.info_nce`; with ``gamma = 0`` it is
  :func:`~fedjax_mm.losses.pairwise_info_nce` (Appendix B).

  Args:
    anchor: ``[B, d]`` L2-normalised anchor representations ``Z^n``.
    others: ``[M, B, d]`` L2-normalised representations of the other models.
    tau: scalar or ``[M]`` anchor-other temperatures ``tau^{(M+1)}_{n,m}``.
    gamma: scalar or ``[M, M]`` other-other weights
      (:func:`muscle_gamma`); the diagonal is ignored.
    chunk_size: see :func:`muscle_client_loss`.

  Returns:
    ``[B]`` per-anchor losses.
  """
  targets = muscle_server_targets(others, tau=tau, gamma=gamma)
  return muscle_client_loss(anchor, targets, chunk_size=chunk_size)


def muscle_paper_targets(
  others: Array, *, tau: float | Array, gamma: float | Array
) -> tuple[Array, Array]:
  r"""The paper's downlink (eq. (5)): ``S^n`` ``[B^M, d]`` and ``log alpha^n`` ``[B^M]``.

  Row ``j`` (flattened row-major from ``(j_1, ..., j_M)``) of ``S`` is
  ``s_j = sum_m z^m_{j_m} / tau_m``. Its size grows as ``B^M``: this exists to
  prove the factored protocol equal and to count what the paper's protocol
  would send, not to train with.

  Args:
    others: ``[M, B, d]`` L2-normalised partner representations.
    tau: scalar or ``[M]`` anchor-other temperatures.
    gamma: scalar or ``[M, M]`` other-other weights.

  Returns:
    ``(S, log_alpha)`` with shapes ``[B^M, d]`` and ``[B^M]``.
  """
  targets = muscle_server_targets(others, tau=tau, gamma=gamma)
  num_others, batch, dim = targets.scaled_others.shape
  s = jnp.zeros((batch,) * num_others + (dim,), others.dtype)
  for m in range(num_others):
    s = s + _place(targets.scaled_others[m], (m, num_others), num_others + 1)
  log_alpha = _log_alpha_tensor(targets.pair_logits, num_others, batch)
  return s.reshape(batch**num_others, dim), log_alpha.reshape(-1)


def muscle_loss_from_paper_targets(anchor: Array, s: Array, log_alpha: Array) -> Array:
  r"""The Muscle loss of eq. (5) from the paper's ``S^n`` and ``log alpha^n``.

  .. math::
    \ell_i = \operatorname{logsumexp}_j (z^n_i \cdot s_j + \log\alpha_j)
             - (z^n_i \cdot s_{(i..i)} + \log\alpha_{(i..i)})

  Args:
    anchor: ``[B, d]`` anchor representations.
    s: ``[B^M, d]`` aggregated matrix from :func:`muscle_paper_targets`.
    log_alpha: ``[B^M]`` log weighting coefficients.

  Returns:
    ``[B]`` per-anchor losses.
  """
  batch = anchor.shape[0]
  if batch < 2:
    raise ValueError(f"the Muscle loss needs B >= 2, got B={batch}.")
  num_tuples = s.shape[0]
  num_others = round(math.log(num_tuples) / math.log(batch))
  if batch**num_others != num_tuples or log_alpha.shape != (num_tuples,):
    raise ValueError(
      f"S must be [B^M, d] and log_alpha [B^M] with B={batch}; got {s.shape} and {log_alpha.shape}."
    )
  logits = anchor @ s.T + log_alpha
  # The flat index of the tuple (i, ..., i) is i * (1 + B + ... + B^(M-1)).
  diagonal = jnp.arange(batch) * ((batch**num_others - 1) // (batch - 1))
  positive = logits[jnp.arange(batch), diagonal]
  return jax.nn.logsumexp(logits, axis=-1) - positive
