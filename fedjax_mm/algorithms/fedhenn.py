r"""FedHeNN: local training with a CKA proximal term on shared representations.

Paper: Makhija, Han, Ho and Ghosh, "Architecture Agnostic Federated Learning
for Neural Networks", ICML 2022 (arXiv 2202.07757), Algorithm 1. Clients with
arbitrary architectures never exchange parameters. Each round:

1. the server picks a *representation alignment dataset* (RAD) ``X`` and every
   client sends the kernel (Gram matrix) of its representations of ``X``,
   ``K_i = phi(X; W_i) phi(X; W_i)^T``, from its current model;
2. the server aggregates them, ``K_bar = sum_i w_i K_i``, and sends
   ``K_bar`` back;
3. every client trains on its own data with the proximal objective
   ``f_j(W_j) + eta * d(K(W_j, X), K_bar)``, ``d`` built on centred kernel
   alignment (:func:`fedjax_mm.losses.cka_distance`: ``1 - CKA``).

Adaptation to FedMuscle's users, every choice:

* **The RAD is a public batch**: FedHeNN draws it from data the server may
  use; here, the first ``rad_size`` samples of the round's public-set order
  (:func:`fedjax_mm.algorithms.fedmuscle.public_batches` from the same round
  key, so with ``rad_size = B`` it is FedMuscle's first CL batch of the
  round), fresh every round and fixed within it. Text users read the first
  caption of each sample, image users the image.
* **phi is the user's representation** ``z`` (encoder + projector,
  L2-normalised), the layer every user has whatever its task; the kernel is
  linear, as the paper's.
* **K_bar** is the uniform mean over present users of the kernels of their
  start-of-round models (the previous round's results, as the paper's
  ``W^{t-1}``), each user's own kernel included.
* **eta is constant** (``eta``); the paper grows ``eta`` over rounds, a
  schedule the FedMuscle paper does not give.
* Task heterogeneity needs nothing else: only representations of the same
  public samples are compared, never outputs. Every term of the local loss is
  evaluated at every local step, on the whole RAD.

What crosses the wire per round: each user uploads its ``[R, R]`` kernel (or,
equivalently, its ``[R, d]`` representations) and downloads ``K_bar``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from fedjax_mm import losses, server
from fedjax_mm.algorithms.base import Algorithm, FederatedState
from fedjax_mm.algorithms.fedmuscle import public_batches
from fedjax_mm.core.client import ClientData, ClientState, GroupDef, train_group

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class FedHeNNConfig:
  """FedHeNN's proximal term.

  Attributes:
    eta: weight of the CKA distance in every local step.
    rad_size: ``R``, public samples in the round's alignment set.
  """

  eta: float = 1.0
  rad_size: int = 32


def representations(group: GroupDef, params, shared, x: Array) -> Array:
  """``z`` ``[K, R, d]`` of every client of a group on the same inputs."""
  return jax.vmap(lambda p: group.merge(p, shared).represent(x))(params)


def proximal_objective(config: FedHeNNConfig, group: GroupDef, shared, *, x: Array, target: Array):
  """One client's FedHeNN objective: task loss + ``eta (1 - CKA(K(W, X), K_bar))``.

  Args:
    config: the proximal term's weight.
    group: the client's group; ``shared`` its frozen parameters.
    x: ``[R, ...]`` the round's alignment inputs.
    target: ``[R, R]`` the server's ``K_bar``.
  """

  def objective(params, batch, batch_mask, step_key):
    model = group.merge(params, shared)
    outputs = model(group.task.inputs(batch, step_key))
    task_loss = group.task.loss(outputs, batch[group.task.target_key], batch_mask)
    proximal = losses.cka_distance(model.represent(x), target)
    return task_loss + config.eta * proximal, {"cka_distance": proximal}

  return objective


def fedhenn(groups: Sequence[GroupDef], config: FedHeNNConfig) -> Algorithm:
  """FedHeNN over a tuple of groups, as an :class:`Algorithm`.

  ``round(state, data, public)`` returns each group's local-training stats
  and ``cka_distance`` ``[N]``: each user's ``1 - CKA(K_i, K_bar)`` at the
  start of the round.
  """
  groups = tuple(groups)

  def init(states: Sequence[ClientState], key: Array) -> FederatedState:
    return FederatedState(round=jnp.zeros((), jnp.int32), rng=key, groups=tuple(states))

  def round_fn(state: FederatedState, data: Sequence[ClientData], public: dict[str, Array]):
    key = jax.random.fold_in(state.rng, state.round)
    batches, _ = public_batches(jax.random.fold_in(key, 0), public, config.rad_size)
    rad = jax.tree.map(lambda x: x[0], batches)
    inputs = [g.task.inputs(rad) for g in groups]
    z = jnp.concatenate(
      [
        representations(g, s.params, s.shared, x)
        for g, s, x in zip(groups, state.groups, inputs, strict=True)
      ]
    )
    kernels = jax.vmap(losses.linear_kernel)(z)  # [N, R, R]: what the users send
    present = jnp.concatenate([d.client_mask for d in data])
    target = server.weighted_mean(kernels, present)  # K_bar, sent back to every user
    distance = jax.vmap(losses.cka_distance, in_axes=(0, None))(z, target)

    new_groups, stats = [], {}
    for group, client_state, client_data, x in zip(groups, state.groups, data, inputs, strict=True):
      objective_fn = functools.partial(proximal_objective, config, x=x, target=target)
      client_state, group_stats = train_group(
        group, client_state, client_data, objective_fn=objective_fn
      )
      new_groups.append(client_state)
      stats[group.name] = group_stats
    stats["cka_distance"] = jnp.where(present, distance, 0.0)
    return state.replace(round=state.round + 1, groups=tuple(new_groups)), stats

  return Algorithm(init=init, round=round_fn)
