r"""Aggregation weights of FedSCMR and FedCMR, as pure functions of stacked client values.

FedSCMR (Li, Li and Shao, 2024), Section 4.2: the server averages the
common-subspace layers ``W^k_t`` of the ``K`` clients with weights
``lambda^k_t`` (eq. 9, :func:`fedjax_mm.server.fedavg` with these weights and
a path selection), where

.. math::
  \Omega^k = \frac{n^k}{\sum_j n^j}\cdot\frac{c^k}{\sum_j c^j}            \quad (10)
  \qquad
  \Psi^k_t = \exp\left(-\frac{l^k_t}{\frac1K\sum_j l^j_t}\right)        \quad (11)
  \qquad
  \Phi^k_t = \frac{v^k_t}{\sum_j v^j_t}                                 \quad (12)

.. math::
  \lambda^k_t = \frac{e^{\Omega^k + \Psi^k_t + \gamma\Phi^k_t}}
                     {\sum_j e^{\Omega^j + \Psi^j_t + \gamma\Phi^j_t}}   \quad (13)

with ``n^k`` the client's samples, ``c^k`` its number of label categories,
``l^k_t`` its local loss and ``v^k_t`` its retrieval mAP in round ``t``.
``gamma = 0`` removes the mAP term (the paper's ablation FedSCMR-Phi).

FedCMR (Zong et al., 2021) is the FedSCMR paper's strongest baseline; it also
weights clients by samples and categories, as ``n^k c^k / sum_j n^j c^j`` (eq. (10)
is the product of the two shares, which differs from it by a constant factor:
inside the softmax that matters). Its paper gives no formula; its authors' code
(github.com/hasakiXie123/FedCMR, ``utils.parameterCooperation`` and
``utils.calc``, called from ``train.py``) aggregates the common linear layer with

.. math::
  \lambda^k_{FedCMR} = \operatorname{softmax}_k\left(
      \frac{n^k c^k}{\sum_j n^j c^j}
      + 100\, e^{-\exp\left(L^k / \frac1K\sum_j L^j\right)}\right),

with ``L^k`` the client's loss *summed* over the round's local steps
(:func:`fedcmr_weights`), and then moves every client back along its own
update, ``W^k <- W - 0.5 (W^k - W^k_start)`` (:func:`fedcmr_correction`).
The data term is at most 1 while the loss term spans up to ``100 / e``, so the
loss decides: the client with the smallest summed loss (often the one with the
fewest steps) gets most of the weight.

Every function takes ``[K]`` arrays and an optional ``where`` ``bool [K]``
mask of the clients that take part (padding clients, non-participants): they
get weight 0 and enter no sum or mean.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array
PyTree = Any

__all__ = [
  "data_share",
  "fedcmr_correction",
  "fedcmr_weights",
  "fedscmr_weights",
  "loss_term",
  "map_share",
  "num_categories",
]


def _valid(x: Array, where: Array | None) -> Array:
  return jnp.ones(jnp.shape(x), bool) if where is None else jnp.asarray(where, bool)


def _share(x: Array, valid: Array) -> Array:
  x = jnp.where(valid, jnp.asarray(x, jnp.float32), 0.0)
  total = jnp.sum(x)
  return x / jnp.where(total > 0, total, 1.0)


def num_categories(labels: Array, mask: Array, num_classes: int) -> Array:
  """``c^k``: distinct labels among a client's valid samples.

  Args:
    labels: ``int [n]`` labels of one client (vmap over clients).
    mask: ``bool [n]`` valid samples.
    num_classes: number of classes (static).

  Returns:
    ``int32`` scalar.
  """
  present = jnp.zeros(num_classes, bool).at[labels].max(jnp.asarray(mask, bool))
  return jnp.sum(present, dtype=jnp.int32)


def data_share(num_samples: Array, num_categories: Array, *, where: Array | None = None) -> Array:
  r"""``Omega^k`` (eq. 10): sample share times category share.

  Examples:
    >>> import jax.numpy as jnp
    >>> print(data_share(jnp.array([1, 3]), jnp.array([2, 2])))
    [0.125 0.375]

  Args:
    num_samples: ``[K]`` ``n^k``.
    num_categories: ``[K]`` ``c^k``.
    where: optional ``bool [K]`` participating clients.

  Returns:
    ``float32 [K]``, 0 for clients outside ``where``.
  """
  valid = _valid(num_samples, where)
  return _share(num_samples, valid) * _share(num_categories, valid)


def loss_term(losses: Array, *, where: Array | None = None) -> Array:
  r"""``Psi^k`` (eq. 11): ``exp(-l^k / mean_j l^j)``; lower loss, larger term.

  Examples:
    >>> import jax.numpy as jnp
    >>> print(loss_term(jnp.array([1.0, 1.0])))  # exp(-1)
    [0.36787945 0.36787945]

  Args:
    losses: ``[K]`` local losses ``l^k_t`` (positive).
    where: optional ``bool [K]`` participating clients.

  Returns:
    ``float32 [K]``, 0 for clients outside ``where``.
  """
  valid = _valid(losses, where)
  losses = jnp.asarray(losses, jnp.float32)
  count = jnp.maximum(jnp.sum(valid), 1)
  mean = jnp.sum(jnp.where(valid, losses, 0.0)) / count
  safe = jnp.where(mean > 0, mean, 1.0)
  return jnp.where(valid, jnp.exp(-losses / safe), 0.0)


def map_share(maps: Array, *, where: Array | None = None) -> Array:
  r"""``Phi^k`` (eq. 12): the client's share of the summed retrieval mAP.

  Args:
    maps: ``[K]`` mAP ``v^k_t`` of each client this round.
    where: optional ``bool [K]`` participating clients.

  Returns:
    ``float32 [K]`` summing to 1 over ``where`` (all 0 if every mAP is 0).
  """
  return _share(maps, _valid(maps, where))


def fedscmr_weights(
  num_samples: Array,
  num_categories: Array,
  losses: Array,
  maps: Array,
  *,
  gamma: float,
  where: Array | None = None,
) -> Array:
  r"""FedSCMR's adaptive contributions ``lambda^k_t`` (eq. 13).

  A softmax over the participating clients of
  ``Omega^k + Psi^k_t + gamma * Phi^k_t``.

  Examples:
    >>> import jax.numpy as jnp
    >>> w = fedscmr_weights(jnp.array([1, 1]), jnp.array([1, 1]), jnp.array([1.0, 1.0]),
    ...                     jnp.array([0.2, 0.6]), gamma=4.0)
    >>> print(", ".join(f"{x:.4f}" for x in w))  # softmax of 4 * (0.25, 0.75)
    0.1192, 0.8808

  Args:
    num_samples: ``[K]`` ``n^k``.
    num_categories: ``[K]`` ``c^k``.
    losses: ``[K]`` local losses ``l^k_t``.
    maps: ``[K]`` retrieval mAP ``v^k_t``.
    gamma: keyword-only weight of the mAP term (the paper's best: 30).
    where: optional ``bool [K]`` participating clients.

  Returns:
    ``float32 [K]`` weights summing to 1 over ``where``, 0 elsewhere.
  """
  valid = _valid(num_samples, where)
  score = (
    data_share(num_samples, num_categories, where=valid)
    + loss_term(losses, where=valid)
    + gamma * map_share(maps, where=valid)
  )
  score = jnp.where(valid, score, -jnp.inf)
  return jnp.where(valid, jax.nn.softmax(score), 0.0)


def fedcmr_weights(
  num_samples: Array, num_categories: Array, losses: Array, *, where: Array | None = None
) -> Array:
  r"""FedCMR's aggregation weights, as its authors' code computes them.

  ``softmax_k( n^k c^k / sum_j n^j c^j + 100 exp(-exp(L^k / mean_j L^j)) )``
  over the participating clients; source: ``parameterCooperation`` in
  ``utils.py`` of github.com/hasakiXie123/FedCMR (the ``weights`` it receives
  are ``n^k c^k / sum_j c^j``, built in ``main.py``, which it renormalises to
  ``n^k c^k / sum_j n^j c^j``; its ``loss`` is each client's loss summed over
  the round's local steps, ``train.py``).

  Examples:
    >>> import jax.numpy as jnp
    >>> w = fedcmr_weights(jnp.array([1, 3]), jnp.array([2, 2]), jnp.array([1.0, 1.0]))
    >>> print(w)  # equal losses: softmax of the data shares (0.25, 0.75)
    [0.37754068 0.62245935]

  Args:
    num_samples: ``[K]`` ``n^k``.
    num_categories: ``[K]`` ``c^k``.
    losses: ``[K]`` local losses ``L^k``, summed over the round's local steps
      (positive).
    where: optional ``bool [K]`` participating clients.

  Returns:
    ``float32 [K]`` weights summing to 1 over ``where``, 0 elsewhere.
  """
  valid = _valid(num_samples, where)
  n = jnp.asarray(num_samples, jnp.float32) * jnp.asarray(num_categories, jnp.float32)
  share = _share(n, valid)
  losses = jnp.asarray(losses, jnp.float32)
  count = jnp.maximum(jnp.sum(valid), 1)
  mean = jnp.sum(jnp.where(valid, losses, 0.0)) / count
  ratio = losses / jnp.where(mean > 0, mean, 1.0)
  score = share + 100.0 * jnp.exp(-jnp.exp(ratio))
  score = jnp.where(valid, score, -jnp.inf)
  return jnp.where(valid, jax.nn.softmax(score), 0.0)


def fedcmr_correction(
  aggregated: PyTree,
  trained: PyTree,
  start: PyTree,
  *,
  scale: float = 0.5,
  where: Array | None = None,
) -> PyTree:
  r"""FedCMR's post-aggregation step: ``W^k <- W - scale * (W^k - W^k_start)``.

  After the server's aggregate ``W`` arrives, each client steps back from it
  by ``scale`` times its own update of the round (``calc`` in ``utils.py`` of
  github.com/hasakiXie123/FedCMR, with ``beta = -0.5``). Applied leaf by leaf
  to whatever pytrees it is given (the caller passes the federated layer).

  Args:
    aggregated: ``[K, ...]`` leaves, the aggregate each client received.
    trained: ``[K, ...]`` leaves, each client's own parameters after local
      training (its honest values, whatever it sent).
    start: ``[K, ...]`` leaves, its parameters at the start of the round.
    scale: keyword-only step back (FedCMR: 0.5).
    where: optional ``bool [K]``: clients that received the aggregate; the
      others keep ``aggregated`` unchanged.

  Returns:
    pytree like ``aggregated``.
  """

  def one(w, t, s):
    out = w - jnp.asarray(scale, w.dtype) * (t - s)
    if where is None:
      return out
    return jnp.where(jnp.reshape(where, (-1,) + (1,) * (w.ndim - 1)), out, w)

  return jax.tree.map(one, aggregated, trained, start)
