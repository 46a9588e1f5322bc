r"""FedEMA's divergence-aware EMA update of a client's model (Zhuang et al., ICLR 2022).

"Divergence-aware Federated Self-Supervised Learning", Sec. 5; the authors' code is
EasyFL's ``applications/fedssl`` (``client.py``: ``ema_online``,
``_calculate_weight_scaler``). At the start of round ``r`` client ``k`` does not
replace its online network by the global one; it takes an EMA of the global model
``W_g^r`` with its own model of the last round ``W_k^{r-1}``:

.. math::
  W_k^r = \mu W_k^{r-1} + (1 - \mu) W_g^r, \qquad
  \mu = \min(\lambda_k \lVert W_g^r - W_k^{r-1} \rVert, 1),

so the more the client has drifted from the global model, the more of its own model it
keeps (up to all of it). The scaler ``lambda_k`` is set once per client, the first time
its divergence is measured, so that this first ``mu`` equals a target ``tau``:
``lambda_k = tau / ||W_g - W_k||`` (the code's ``auto_scaler``; default target 0.8,
``--auto_scaler_target``).

Choices (the paper's form against the authors' code):

* **Divergence** is the L2 norm of the difference of the whole parameter vector (every
  leaf given), the paper's ``||W_g^r - W_k^{r-1}||``. The code instead averages the
  per-layer L2 distances of the encoder's conv weights, measured between the model at
  the start and at the end of the client's previous local training; the scaler absorbs
  the overall scale, not the difference between the two measures.
* ``divergence="code"`` (:func:`layer_divergence`, the caller stores it) is the
  authors' code's measure instead: the mean over weight matrices (leaves of rank >= 2,
  the analogue of its conv weights) of the L2 distance between the client's model at the
  start and at the end of its last local training. With the paper's measure the
  divergence to a global model the client no longer takes in can only grow, so ``mu``
  can lock at 1 (measured on the world, FedRGB runner, seed 0: ``mu`` = 0, 0.8, then 1
  from round 3 on); the code's measure is the size of one round's training, which does
  not accumulate.
* **Scaler unset** is ``lambda_k = 0``: a client whose model equals the global one
  (divergence 0, e.g. in the first round, when every client starts from the global
  model) keeps ``lambda_k = 0`` and takes ``mu = 0``; ``lambda_k`` is set at the first
  round its divergence is positive, where ``mu = min(tau, 1)``. With ``W_k == W_g`` the
  update returns ``W_g`` whatever ``mu``.

All functions take ONE client's pytrees (vmap over clients); they import only ``jax``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any
Array = jax.Array

#: The code's default ``auto_scaler_target``: the first EMA update keeps this share of
#: the client's own model.
AUTOSCALER_TARGET = 0.8


def divergence(global_params: PyTree, local_params: PyTree) -> Array:
  """``||W_g - W_k||``: the L2 norm of the difference over every leaf (a scalar)."""
  sq = jax.tree.map(lambda g, w: jnp.sum((g - w) ** 2), global_params, local_params)
  return jnp.sqrt(sum(jax.tree.leaves(sq), jnp.zeros((), jnp.float32)))


def layer_divergence(before: PyTree, after: PyTree) -> Array:
  """The code's divergence: mean L2 distance over the leaves of rank >= 2 (a scalar)."""
  dist = [
    jnp.sqrt(jnp.sum((a - b) ** 2))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
    if a.ndim >= 2
  ]
  return sum(dist, jnp.zeros((), jnp.float32)) / max(len(dist), 1)


def decay(div: Array, scaler: Array, *, tau: float = AUTOSCALER_TARGET) -> tuple[Array, Array]:
  """``(mu, lambda_k)`` of one client from its divergence and its scaler (0 = unset).

  An unset scaler becomes ``tau / div`` where ``div > 0`` (so ``mu = min(tau, 1)``);
  ``mu = min(lambda_k div, 1)``, 0 while the scaler is unset.
  """
  positive = div > 0
  scaler = jnp.where((scaler == 0) & positive, tau / jnp.where(positive, div, 1.0), scaler)
  mu = jnp.minimum(scaler * div, 1.0)
  return mu, scaler


def ema_update(global_params: PyTree, local_params: PyTree, mu: Array) -> PyTree:
  """``mu W_k + (1 - mu) W_g``, leaf by leaf."""
  return jax.tree.map(lambda g, w: mu * w + (1.0 - mu) * g, global_params, local_params)


def fedema_start(
  global_params: PyTree,
  local_params: PyTree,
  scaler: Array,
  *,
  tau: float = AUTOSCALER_TARGET,
  div: Array | None = None,
) -> tuple[PyTree, Array, Array, Array]:
  """One client's model at the start of a round: ``(W_k^r, mu, lambda_k, divergence)``.

  ``div``: the divergence ``mu`` is computed from (default the paper's
  :func:`divergence` of the two models; the code's is :func:`layer_divergence` of the
  client's last training, stored by the caller).
  """
  div = divergence(global_params, local_params) if div is None else div
  mu, scaler = decay(div, scaler, tau=tau)
  return ema_update(global_params, local_params, mu), mu, scaler, div
