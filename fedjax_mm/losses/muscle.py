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

The same denominator as a tensor contraction. In the exp domain the summand
of anchor ``i`` factorises into ``M`` anchor-sample factors and ``M(M-1)/2``
sample-sample factors, each touching one or two of the ``j_m``:

.. math::
  \sum_{\mathbf j} e^{\mathrm{logit}(i, \mathbf j)}
    = e^{c_i} \sum_{\mathbf j} \prod_m E_m[i, j_m] \prod_{m<m'} K_{m,m'}[j_m, j_{m'}],
  \qquad E_m = e^{A_m - \max_k A_m[i, k]}, \quad K_{m,m'} = e^{P_{m,m'} - \max P_{m,m'}},

with ``P = -gamma G`` and ``c_i`` the sum of the subtracted maxima: one
``einsum`` of ``M`` matrices ``[b, B]`` and ``M(M-1)/2`` matrices ``[B, B]``,
which XLA runs as batched matrix products instead of ``B^(M+1)``
exponentials (``method="contract"``). For ``M <= 3`` the anchor-free factors
``K`` are first multiplied into one ``[B]^M`` tensor shared by all anchors, so
the contraction is one matrix product and ``M - 1`` matrix-vector products per
anchor (1.25x a plain greedy ``einsum`` of the same factors at ``M = 3`` on a
2-core CPU); for larger ``M`` it is opt_einsum's greedy order. Every factor lies in ``[e^{-r}, 1]``
where ``r`` is its logit range, so every product (and every partial sum the
contraction forms) is at least ``e^{-R}`` with ``R = sum_m 2 / tau_m +
sum_{m<m'} 2 |gamma_{m,m'}|`` for L2-normalised inputs
(:func:`muscle_logit_range`), and at most ``B^M``: nothing under- or overflows
while ``e^{-R}`` is a normal number of the dtype. ``method="auto"`` (the
default) contracts when ``R`` is known statically (``tau`` and ``gamma``
concrete) and at most :data:`CONTRACT_MAX_RANGE` for a float32/float64
computation, and falls back to the log-domain path otherwise (small
temperatures, large ``gamma``, traced ``tau``/``gamma``, float16/bfloat16
inputs, whose exponent range or mantissa is too small for the exp domain).

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
import numpy as np

from fedjax_mm.losses.contrastive import check_positive, stack_others

Array = jax.Array

# Elements of one chunk's [c, B, ..., B] logit tensor. The backward pass holds a
# few tensors of this size (logits, softmax, a reduction buffer), so 2**25
# float32 elements (128 MiB) keeps the temporary memory under about 1 GiB.
DEFAULT_CHUNK_ELEMENTS = 2**25
#: How the client computes the denominator (see the module docstring).
METHODS = ("auto", "contract", "logsumexp")
#: Largest static logit range ``R`` (nats) for which ``method="auto"`` contracts
#: in the exp domain: ``e^{-R}`` stays a normal number (float32's smallest is
#: ``e^{-87.3}``, float64's ``e^{-708.4}``), with a margin for rounding.
CONTRACT_MAX_RANGE = {"float32": 85.0, "float64": 700.0}
#: Largest ``M`` whose contraction first multiplies the pairwise kernels into
#: one ``[B]^M`` tensor (see ``_contracted_lse``).
KERNEL_MAX_OTHERS = 3


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


def muscle_logit_range(tau: float | Array, gamma: float | Array, num_others: int) -> float | None:
  r"""Static bound ``R`` on the spread of the Muscle logits, or ``None`` if traced.

  For L2-normalised inputs ``A_m[i, k] = z_i . z_k / tau_m`` spans at most
  ``2 / |tau_m|`` and ``-gamma_{m,m'} G[k, l]`` at most ``2 |gamma_{m,m'}|``, so
  every term of the exp-domain contraction is at least ``e^{-R}`` with

  .. math:: R = \sum_m \frac{2}{|\tau_m|} + \sum_{m<m'} 2|\gamma_{m,m'}|.

  Args:
    tau: scalar or ``[M]`` anchor-other temperatures.
    gamma: scalar or ``[M, M]`` other-other weights (symmetrised, diagonal ignored).
    num_others: ``M``.

  Returns:
    ``R`` as a Python float, or ``None`` when ``tau`` or ``gamma`` is a tracer
    (then ``method="auto"`` uses the log-domain path).
  """
  try:
    tau = np.abs(np.broadcast_to(np.asarray(tau, np.float64), (num_others,)))
    gamma = np.asarray(gamma, np.float64)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return None
  if gamma.ndim == 0:
    gamma = np.full((num_others, num_others), gamma)
  gamma = 0.5 * (gamma + gamma.T)
  pairs = sum(abs(gamma[a, b]) for a, b in _pairs(num_others))
  return float(np.sum(2.0 / tau) + 2.0 * pairs)


def _use_contraction(method: str, logit_range: float | None, dtype) -> bool:
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
  if method != "auto":
    return method == "contract"
  limit = CONTRACT_MAX_RANGE.get(jnp.dtype(dtype).name)
  return logit_range is not None and limit is not None and logit_range <= limit


def _pairs(num_others: int) -> tuple[tuple[int, int], ...]:
  return tuple(itertools.combinations(range(num_others), 2))


def _place(x: Array, axes: tuple[int, ...], ndim: int) -> Array:
  """Reshapes ``x`` so its dims sit on ``axes`` (increasing) of an ndim tensor."""
  shape = [1] * ndim
  for axis, size in zip(axes, x.shape, strict=True):
    shape[axis] = size
  return x.reshape(shape)


def _temperatures(tau: float | Array, num_others: int, dtype) -> Array:
  check_positive("tau", tau)
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
      selected as partners of user ``n`` (or a sequence of ``M`` arrays ``[B, d]``).
    tau: scalar or ``[M]`` anchor-other temperatures ``tau^{(M+1)}_{n,m}``.
    gamma: scalar or ``[M, M]`` other-other weights (diagonal ignored).

  Returns:
    :class:`MuscleTargets`: ``M*B*d + M(M-1)/2*B*B`` numbers in all.
  """
  others = stack_others(others)
  num_others, batch, _ = _check_others(others)
  tau = _temperatures(tau, num_others, others.dtype)
  gamma = _gamma_matrix(gamma, num_others, others.dtype)
  scaled = others / tau[:, None, None]
  pairs = _pairs(num_others)
  if pairs:
    # Static slices, not an index gather: a gather's gradient is a scatter-add
    # into a zeroed [M, B, d] buffer (two of them, and their copies, per call).
    first, second = (jnp.stack([others[m] for m in idx]) for idx in zip(*pairs, strict=True))
    similarity = jnp.einsum("pkd,pld->pkl", first, second)
    weights = jnp.stack([gamma[m, n] for m, n in pairs])
    pair_logits = -weights[:, None, None] * similarity
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
  anchor: Array,
  targets: MuscleTargets,
  *,
  chunk_size: int | None = None,
  method: str = "auto",
  logit_range: float | None = None,
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
    chunk_size: anchors per chunk (of the ``[B]^(M+1)`` tensor, or of the
      contraction's ``[b, B^(M-1)]`` intermediates); ``None`` picks the largest
      chunk within :data:`DEFAULT_CHUNK_ELEMENTS`, and no chunking at all when
      everything fits.
    method: ``"auto"``, ``"contract"`` (exp-domain einsum) or ``"logsumexp"``
      (log-domain broadcast tensor); see the module docstring.
    logit_range: the static bound :func:`muscle_logit_range` of the ``tau`` and
      ``gamma`` the targets were built with; ``"auto"`` contracts only when it
      is given and small enough (the targets alone do not say).

  Returns:
    ``[B]`` per-anchor losses.
  """
  num_others, batch, dim = _check_others(targets.scaled_others)
  if anchor.ndim != 2 or anchor.shape != (batch, dim):
    raise ValueError(f"anchor must be [B={batch}, d={dim}], got shape {anchor.shape}.")
  if not jnp.issubdtype(anchor.dtype, jnp.floating):
    raise ValueError(f"anchor must be floating-point representations, got dtype {anchor.dtype}.")
  # a[m, i, k] = z^n_i . z^m_k / tau_m: the only place the dimension d appears. Each
  # partner's [B, B] block is contiguous, as the contraction reads them one at a time.
  a = jnp.einsum("id,mkd->mik", anchor, targets.scaled_others)
  positive = jnp.einsum("mii->i", a) + jnp.einsum("pii->i", targets.pair_logits)
  if _use_contraction(method, logit_range, a.dtype):
    return _contracted_lse(a, targets.pair_logits, chunk_size) - positive
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
    lse = jax.vmap(one_anchor_lse, in_axes=1)(a)
  else:
    lse = jax.lax.map(jax.checkpoint(one_anchor_lse), jnp.moveaxis(a, 1, 0), batch_size=chunk)
  return lse - positive


def _contraction_subscripts(num_others: int) -> str:
  """``"ia,ib,ic,ab,ac,bc->i"`` for ``M = 3``: the factor graph as an einsum."""
  letters = "abcdefghjklmnopqrstuvwxyz"[:num_others]
  anchors = [f"i{letter}" for letter in letters]
  pairs = [letters[m] + letters[n] for m, n in _pairs(num_others)]
  return ",".join(anchors + pairs) + "->i"


def _kernel_tensor(kernels: Array, num_others: int, batch: int) -> Array:
  """``prod_{m<m'} K_{m,m'}[j_m, j_{m'}]`` as a ``[B] * M`` tensor (ones for ``M = 1``)."""
  product = jnp.ones((batch,) * num_others, kernels.dtype)
  for kernel, axes in zip(kernels, _pairs(num_others), strict=True):
    product = product * _place(kernel, axes, num_others)
  return product


def _contracted_lse(a: Array, pair_logits: Array, chunk_size: int | None) -> Array:
  """Per-anchor log-sum-exp over ``[B]^M`` by an exp-domain contraction.

  Args:
    a: ``[M, b, B]`` anchor-other logits ``A_m[i, k]``.
    pair_logits: ``[M(M-1)/2, B, B]`` the terms ``-gamma G`` of ``log alpha``.
    chunk_size: anchors per chunk (``None``: automatic).

  Returns:
    ``[b]`` log-sum-exps. The ``max`` shifts are held constant under
    ``stop_gradient``: the result does not depend on them, so the gradient
    stays exact.

  Two orders of the same sum. For ``M <= 3`` (:data:`KERNEL_MAX_OTHERS`) the
  anchor-free factors are multiplied first into ``Y = prod K`` ``[B]^M`` (``B^3``
  numbers at most, shared by every anchor), then ``E_1 @ Y`` is one matrix
  product ``[b, B] x [B, B^(M-1)]`` and each remaining ``E_m`` a batched
  matrix-vector product. For larger ``M`` the gradient of ``Y``'s ``B^M``
  entries (a reduction per pair) costs more than the contraction, and
  opt_einsum's greedy order is used instead; it never forms ``Y``.
  """
  num_others, batch, width = a.shape
  pair_shift = jax.lax.stop_gradient(jnp.max(pair_logits, axis=(1, 2)))  # [P]
  kernels = jnp.exp(pair_logits - pair_shift[:, None, None])
  shift = jnp.sum(pair_shift)
  if num_others <= KERNEL_MAX_OTHERS:
    kernel_tensor = _kernel_tensor(kernels, num_others, width).reshape(width, -1)

  def lse_of(a_chunk: Array) -> Array:
    row_shift = jax.lax.stop_gradient(jnp.max(a_chunk, axis=-1))  # [M, c]
    factors = jnp.exp(a_chunk - row_shift[..., None])  # [M, c, B]
    if num_others <= KERNEL_MAX_OTHERS:
      # [c, B^(M-1)], then j_M, ..., j_2 summed out one at a time.
      total = (factors[0] @ kernel_tensor).reshape((-1,) + (width,) * (num_others - 1))
      for m in range(num_others - 1, 0, -1):
        total = jnp.einsum("i...k,ik->i...", total, factors[m])
    else:
      # opt_einsum's greedy order eliminates one j at a time by matrix products;
      # on a 2-core CPU it ran loss + gradient 8x faster than a hand-written
      # elimination at M = 4 and 20x at M = 5 ("optimal" takes long to plan for
      # M = 5 and was not faster).
      total = jnp.einsum(
        _contraction_subscripts(num_others),
        *factors,
        *kernels,
        optimize="greedy",
      )
    return jnp.log(total) + jnp.sum(row_shift, axis=0) + shift

  # The largest intermediate is about [c, B^(M-1)] (one j eliminated at a time).
  default = max(1, DEFAULT_CHUNK_ELEMENTS // width ** max(num_others - 1, 1))
  chunk = min(batch, default if chunk_size is None else int(chunk_size))
  if chunk >= batch:
    return lse_of(a)
  pad = -batch % chunk
  padded = jnp.pad(a, ((0, 0), (0, pad), (0, 0)))
  chunks = jnp.moveaxis(padded.reshape(num_others, -1, chunk, width), 1, 0)  # [n, M, c, B]
  out = jax.lax.map(jax.checkpoint(lse_of), chunks)
  return out.reshape(-1)[:batch]


def muscle_loss(
  anchor: Array,
  others: Array,
  *,
  tau: float | Array,
  gamma: float | Array,
  chunk_size: int | None = None,
  method: str = "auto",
) -> Array:
  r"""The Muscle loss of each anchor (FedMuscle paper, eq. (3)).

  Equivalent to ``muscle_client_loss(anchor, muscle_server_targets(others,
  ...))``; gradients flow to both ``anchor`` and ``others``. With ``M = 1`` it
  is :func:`~fedjax_mm.losses.info_nce`; with ``gamma = 0`` it is
  :func:`~fedjax_mm.losses.pairwise_info_nce` (Appendix B).

  Args:
    anchor: ``[B, d]`` L2-normalised anchor representations ``Z^n``.
    others: ``[M, B, d]`` L2-normalised representations of the other models (or a
      sequence of ``M`` arrays ``[B, d]``).
    tau: scalar or ``[M]`` anchor-other temperatures ``tau^{(M+1)}_{n,m}``.
    gamma: scalar or ``[M, M]`` other-other weights
      (:func:`muscle_gamma`); the diagonal is ignored.
    chunk_size: see :func:`muscle_client_loss`.
    method: ``"auto"`` (contract when :func:`muscle_logit_range` of ``tau``
      and ``gamma`` allows it), ``"contract"`` or ``"logsumexp"``.

  Returns:
    ``[B]`` per-anchor losses.
  """
  others = stack_others(others)
  if others.ndim == 3 and jnp.shape(anchor) != others.shape[1:]:
    raise ValueError(
      f"anchor [B, d] and others [M, B, d] must share B and d, got anchor "
      f"{jnp.shape(anchor)} and others {others.shape}."
    )
  targets = muscle_server_targets(others, tau=tau, gamma=gamma)
  logit_range = muscle_logit_range(tau, gamma, others.shape[0])
  return muscle_client_loss(
    anchor, targets, chunk_size=chunk_size, method=method, logit_range=logit_range
  )


def muscle_paper_targets(
  others: Array, *, tau: float | Array, gamma: float | Array
) -> tuple[Array, Array]:
  r"""The paper's downlink (eq. (5)): ``S^n`` ``[B^M, d]`` and ``log alpha^n`` ``[B^M]``.

  Row ``j`` (flattened row-major from ``(j_1, ..., j_M)``) of ``S`` is
  ``s_j = sum_m z^m_{j_m} / tau_m``. Its size grows as ``B^M``: this exists to
  prove the factored protocol equal and to count what the paper's protocol
  would send, not to train with.

  Args:
    others: ``[M, B, d]`` L2-normalised partner representations (or a
      sequence of ``M`` arrays ``[B, d]``).
    tau: scalar or ``[M]`` anchor-other temperatures.
    gamma: scalar or ``[M, M]`` other-other weights.

  Returns:
    ``(S, log_alpha)`` with shapes ``[B^M, d]`` and ``[B^M]``.
  """
  others = stack_others(others)
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
