"""FedAvg and FedProx within groups of clients that share an architecture.

McMahan et al. (2017), "Communication-Efficient Learning of Deep Networks from
Decentralized Data": each round a fraction of the clients trains locally from
the global model, and the server replaces the global model by the mean of their
models weighted by sample count. Li et al. (2020), "Federated Optimization in
Heterogeneous Networks" (FedProx): the local objective gains
``mu / 2 * ||w - w_global||^2``.

Groups of different architectures are averaged separately (one global model
per group). ``select`` restricts averaging to some parameters (by path), which
is how adapter-only or subspace-only federation is expressed; the other
parameters stay personal.

Client faults (:mod:`fedjax_mm.core.faults`, off by default): dropped
participants' updates are lost and aggregation renormalises over the others
(if all drop, the global model stays as it was); stragglers take only their
drawn share of local steps; Byzantine participants send a corrupted update
(``trained - start``, Gaussian noise or scaled) in place of theirs.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from fedjax_mm import server
from fedjax_mm.algorithms.base import Algorithm, FederatedState
from fedjax_mm.core import faults as faults_lib
from fedjax_mm.core.client import ClientData, ClientState, GroupDef, train_group


def fedavg(
  groups: Sequence[GroupDef],
  *,
  clients_per_round: int | None = None,
  prox_mu: float = 0.0,
  reset_optimizer: bool = True,
  select: server.aggregate.PathPredicate | None = None,
  faults: faults_lib.Faults = faults_lib.NONE,
) -> Algorithm:
  """FedAvg (``prox_mu = 0``) or FedProx (``prox_mu > 0``).

  Args:
    groups: the groups; each has its own global model.
    clients_per_round: participants sampled per group and round (default all).
    prox_mu: FedProx's proximal coefficient.
    reset_optimizer: re-initialise each client's optimizer state every round
      (the usual choice: local optimizers are stateless across rounds).
    select: path predicate of the federated parameters (default: all).
    faults: simulated client faults (default: none). With faults the stats
      of each group gain ``faults`` (the masks) and ``fault_counts``.

  Returns:
    An :class:`Algorithm`. ``init(states, key)`` expects states built with
    ``same_init=True`` (every client starts from the same global model).
  """
  groups = tuple(groups)

  def init(states: Sequence[ClientState], key: jax.Array) -> FederatedState:
    return FederatedState(round=jnp.zeros((), jnp.int32), rng=key, groups=tuple(states))

  def round_fn(state: FederatedState, data: Sequence[ClientData]):
    key = jax.random.fold_in(state.rng, state.round)
    new_groups, stats = [], {}
    for g, (group, client_state, client_data) in enumerate(
      zip(groups, state.groups, data, strict=True)
    ):
      active = client_data.client_mask
      if clients_per_round is not None:
        active = server.sample_clients(
          jax.random.fold_in(key, g), client_data.client_mask, clients_per_round
        )
      if reset_optimizer:
        client_state = client_state.replace(opt_state=jax.vmap(group.tx.init)(client_state.params))
      if faults.enabled:
        client_state, group_stats = _train_with_faults(
          jax.random.fold_in(jax.random.fold_in(key, faults_lib.SALT), g),
          group,
          client_state,
          client_data,
          active,
        )
      else:
        client_state, group_stats = train_group(
          group, client_state, client_data, prox_mu=prox_mu, active=active
        )
        weights = client_data.num_samples * active
        params, _ = server.fedavg(client_state.params, weights, select=select)
        client_state = client_state.replace(params=params)
      new_groups.append(client_state)
      stats[group.name] = group_stats | {"active": active}
    return state.replace(round=state.round + 1, groups=tuple(new_groups)), stats

  def _train_with_faults(fault_key, group, client_state, client_data, active):
    """Local training and aggregation of one group under the round's faults."""
    masks = faults_lib.draw(fault_key, active, faults)
    budget = faults_lib.step_budget(
      masks.work,
      client_data.num_samples,
      num_epochs=group.local_epochs,
      batch_size=group.batch_size,
    )
    start = client_state.params
    client_state, group_stats = train_group(
      group, client_state, client_data, prox_mu=prox_mu, active=active, max_steps=budget
    )
    sent = faults_lib.send_updates(
      faults_lib.corruption_key(fault_key), start, client_state.params, masks, faults, select=select
    )
    weights = client_data.num_samples * (active & ~masks.dropped)
    params, _ = server.fedavg(sent, weights, select=select)
    # Nobody's update arrived: the global model (every client's start) stays.
    params = jax.tree.map(lambda p, s: jnp.where(jnp.sum(weights) > 0, p, s), params, start)
    stats = group_stats | {"faults": masks, "fault_counts": masks.counts()}
    return client_state.replace(params=params), stats

  return Algorithm(init=init, round=round_fn)
