"""Optimisers and schedules the papers name that optax does not ship.

* :func:`adamp`: AdamP (Heo et al., "AdamP: Slowing Down the Slowdown for Momentum
  Optimizers on Scale-invariant Weights", ICLR 2021), CreamFL's server optimiser (Sec.
  4.1; its code's ``optimizer: adamp``, from the ``adamp`` package).
* :func:`cosine_annealing`: the factor of PyTorch's ``CosineAnnealingLR`` stepped once
  a round (CreamFL's server: ``T_max`` = the 30 rounds of its code's defaults).
* :func:`at_rate`: an optimiser whose every update is scaled by a factor, which for
  Adam-type optimisers with decoupled weight decay (AdamW, AdamP) is the same as
  scaling the learning rate, weight decay included.

AdamP is Adam whose step on a weight that looks scale-invariant (one followed by a
normalisation, whose gradient is orthogonal to it) loses its radial component, so that
momentum does not inflate the weight's norm; such weights also get ``wd_ratio`` of the
weight decay. A weight ``w`` (2-D or more) is scale-invariant when the largest
``|cos(grad, w)|`` over its output channels is below ``delta / sqrt(channel size)``
(each channel projected on its own), or else when ``|cos(grad, w)|`` over the whole
tensor is below ``delta / sqrt(w.size)`` (one projection). 1-D weights (biases, norm
scales) take Adam's step.

Layouts. The reference reads a weight's output channels on its first axis, PyTorch's
layout (``Linear`` ``[out, in]``, ``Conv2d`` ``[out, in, kh, kw]``, ``Embedding``
``[num, dim]``). Flax keeps them last in kernels (``[in, out]``, ``[kh, kw, in, out]``)
and first in embeddings, so :func:`flax_channel_axes` picks ``-1`` for leaves named
``kernel`` and ``0`` for the rest; ``channel_axes`` takes any such pytree (or a function
of the parameters that gives one).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

PyTree = Any


class AdamPState(NamedTuple):
  """AdamP's state: the step count and Adam's two moments."""

  count: jax.Array
  mu: PyTree
  nu: PyTree


def flax_channel_axes(params: PyTree) -> PyTree:
  """The output-channel axis of each leaf in Flax's layouts: ``-1`` for ``kernel``, else ``0``."""

  def axis(path, _):
    # The leaf's name: the last key of its path that is not an NNX Variable's own field
    # (``nnx.split``'s state holds ``Param(value=...)``, reached as ``.../kernel/value``).
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    while names and names[-1] in ("value", "raw_value"):
      names.pop()
    return -1 if names and names[-1] == "kernel" else 0

  return jax.tree_util.tree_map_with_path(axis, params)


def _rows(x: jax.Array, axis: int) -> jax.Array:
  """``x`` as ``[channels, rest]``, the channels on ``axis`` (PyTorch's ``view(size(0), -1)``)."""
  return jnp.moveaxis(x, axis, 0).reshape(x.shape[axis], -1)


def _cosine(x: jax.Array, y: jax.Array, eps: float) -> jax.Array:
  """``|cos|`` of each row pair: ``|x . y| / max(|x| |y|, eps)`` (``F.cosine_similarity``)."""
  dot = jnp.sum(x * y, axis=-1)
  norms = jnp.linalg.norm(x, axis=-1) * jnp.linalg.norm(y, axis=-1)
  return jnp.abs(dot / jnp.maximum(norms, eps))


def _project(p, g, u, axis: int, delta: float, wd_ratio: float, eps: float):
  """AdamP's projection of the step ``u`` of weight ``p`` with gradient ``g``.

  Returns ``(u', decay factor)``: the channel projection where the channel test
  holds, else the layer projection where the layer test holds, else ``(u, 1)``.
  """
  p2, g2, u2 = (_rows(x, axis) for x in (p, g, u))
  by_channel = jnp.max(_cosine(g2, p2, eps)) < delta / math.sqrt(p2.shape[1])
  by_layer = _cosine(g2.reshape(1, -1), p2.reshape(1, -1), eps)[0] < delta / math.sqrt(p.size)

  pn = p2 / (jnp.linalg.norm(p2, axis=1, keepdims=True) + eps)
  channel = u2 - pn * jnp.sum(pn * u2, axis=1, keepdims=True)
  pn = p2 / (jnp.linalg.norm(p2) + eps)
  layer = u2 - pn * jnp.sum(pn * u2)
  out = jnp.where(by_channel, channel, jnp.where(by_layer, layer, u2))
  out = jnp.moveaxis(out.reshape(jnp.moveaxis(p, axis, 0).shape), 0, axis)
  decay = jnp.where(by_channel | by_layer, wd_ratio, 1.0)
  return out, decay


def adamp(
  learning_rate: optax.ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 0.0,
  delta: float = 0.1,
  wd_ratio: float = 0.1,
  nesterov: bool = False,
  channel_axes: PyTree | Callable[[PyTree], PyTree] = flax_channel_axes,
) -> optax.GradientTransformation:
  """AdamP as an optax transformation (the ``adamp`` package's ``AdamP.step``).

  Per weight ``w`` with gradient ``g`` at step ``t``: Adam's moments ``m, v``, the
  step ``s = m / (sqrt(v) / sqrt(1 - b2^t) + eps)`` (Nesterov: ``b1 m + (1 - b1) g`` in
  place of ``m``), projected as the module docstring says for weights of 2 or more
  dimensions, and the update ``-lr / (1 - b1^t) s - lr weight_decay r w`` with ``r =
  wd_ratio`` for a projected weight and 1 otherwise (decoupled decay of the weight
  before the step, as the reference applies it).

  Args:
    learning_rate: a float, or a schedule of the step count (as optax's).
    b1, b2, eps: Adam's.
    weight_decay: decoupled weight decay (the reference's default is 0).
    delta: the threshold of the scale-invariance tests.
    wd_ratio: the weight decay's factor on projected weights.
    nesterov: Nesterov momentum in the step.
    channel_axes: each leaf's output-channel axis, a pytree of ints matching the
      parameters or a function of them (default :func:`flax_channel_axes`).

  Returns:
    An ``optax.GradientTransformation`` whose ``update`` needs ``params``.
  """

  def init(params):
    # Two trees of zeros, not one shared: a donated state must not alias its buffers.
    mu, nu = (jax.tree.map(jnp.zeros_like, params) for _ in range(2))
    return AdamPState(jnp.zeros([], jnp.int32), mu, nu)

  def update(grads, state, params=None):
    if params is None:
      raise ValueError("adamp needs the parameters: call update(grads, state, params).")
    count = optax.safe_increment(state.count)
    t = count.astype(jnp.result_type(float))  # float64 under jax_enable_x64
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    step_size = lr / (1 - b1**t)
    root_bc2 = jnp.sqrt(1 - b2**t)
    axes = channel_axes(params) if callable(channel_axes) else channel_axes

    def leaf(g, m, v, p, axis):
      denom = jnp.sqrt(v) / root_bc2 + eps
      u = ((b1 * m + (1 - b1) * g) if nesterov else m) / denom
      decay = 1.0
      if p.ndim > 1:
        u, decay = _project(p, g, u, axis, delta, wd_ratio, eps)
      out = -step_size * u
      if weight_decay > 0:
        out = out - lr * weight_decay * decay * p
      return out.astype(p.dtype)

    updates = jax.tree.map(leaf, grads, mu, nu, params, axes)
    return updates, AdamPState(count, mu, nu)

  return optax.GradientTransformation(init, update)


def cosine_annealing(round_index: jax.Array, rounds: int) -> jax.Array:
  """PyTorch's ``CosineAnnealingLR(T_max=rounds)`` factor for a 0-based round (``eta_min = 0``).

  ``(1 + cos(pi r / rounds)) / 2``: 1 in the first round, falling towards 0 by the end
  of ``rounds``, as the scheduler gives when stepped once after every round.
  """
  if rounds < 1:
    raise ValueError(f"cosine_annealing needs rounds >= 1, got {rounds}.")
  r = jnp.asarray(round_index).astype(jnp.result_type(float))
  return 0.5 * (1.0 + jnp.cos(jnp.pi * r / rounds))


def at_rate(tx: optax.GradientTransformation, factor: jax.Array) -> optax.GradientTransformation:
  """``tx`` with every update times ``factor`` (its state as ``tx``'s).

  For AdamW and AdamP (decoupled weight decay, both terms times the learning rate) this
  is exactly ``tx`` with the learning rate times ``factor``: a per-round schedule on an
  optimiser whose step count does not say the round.
  """

  def update(grads, state, params=None):
    updates, state = tx.update(grads, state, params)
    return jax.tree.map(lambda u: (factor * u).astype(u.dtype), updates), state

  return optax.GradientTransformation(tx.init, update)
