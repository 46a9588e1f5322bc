r"""CreamFL's Table 1 "model homogeneous" baselines: FedAvg and FedIoT, per modality.

Paper: ``creamfl.txt`` (Yu et al., 2023), Section 4.1: "All uni-modal
algorithms are extended to multimodal scenarios by operating on each modality
separately [...] For FedAvg and FedIoT, we distribute public data to multimodal
clients and adopt client model of the same size as our server model for
evaluation." Fig. 4: they send parameters, hence more bytes per round than the
representation-sending rows.

* **FedAvg** (McMahan et al., "Communication-Efficient Learning of Deep Networks
  from Decentralized Data", AISTATS 2017): every selected client starts the round
  from the global model, trains ``E`` local epochs, and the server replaces the
  global model by the mean of the clients' models weighted by sample count.
* **FedIoT** (Zhao et al., "Multimodal Federated Learning on IoT Data", IoTDI
  2022): the same, with the multimodal clients' weights multiplied by 100 in the
  aggregation (``CreamConfig.iot_weight``; the paper's reamFL+IoT uses the same
  factor on representations).

"Operating on each modality separately": the global model is the server's
:class:`~fedjax_mm.algorithms.creamfl.DualEncoder` (encoder + projector per
modality), so every client holds towers of the SERVER's architecture: an image
client is a ``UserModel`` with the server's image encoder and a projector (its
``encoder``, ``projector``) plus its private classification head, a text client
likewise with the server's text encoder, a multimodal client a ``DualEncoder``
of the server's size. Each round:

1. the same clients as in the other rows are selected
   (:func:`fedjax_mm.server.aggregate.sample_clients` on the same key);
2. each selected client receives the server's towers of its modalities (its head
   stays its own, as heads are not shared between tasks) and a fresh optimizer;
3. it trains ``E`` epochs on its private task only (no public-set regulariser);
   the multimodal clients' private sets are extended with the whole public set
   (:func:`with_public`), the "public data distributed to multimodal clients";
4. per modality, the server's tower becomes the mean of the selected clients'
   towers of that modality, weighted by ``n_k`` (FedAvg) or ``n_k`` times
   ``iot_weight`` for multimodal clients (FedIoT; ``n_k`` counts the public
   pairs a multimodal client holds); a modality no selected client has keeps its
   tower.

The server does not train on the public set itself (its public data went to
the multimodal clients); it is evaluated like every row of the experiment.
Client faults are not modelled here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fedjax_mm.algorithms import creamfl
from fedjax_mm.algorithms.base import Algorithm
from fedjax_mm.core.client import (
  ClientData,
  ClientState,
  all_finite,
  finite_per_client,
  train_group,
)
from fedjax_mm.server import aggregate

Array = jax.Array
PyTree = Any

#: The server's attributes of each modality's tower (:class:`creamfl.DualEncoder`).
TOWERS = {"image": ("image_encoder", "image_projector"), "text": ("text_encoder", "text_projector")}


def client_towers(client: creamfl.ClientGroup) -> dict[str, dict[str, str]]:
  """``{modality: {server attribute: client attribute}}`` of the towers a client holds."""
  if client.multimodal:
    return {m: {a: a for a in TOWERS[m]} for m in creamfl.MODALITIES}
  (m,) = client.modalities
  encoder, projector = TOWERS[m]
  return {m: {encoder: "encoder", projector: "projector"}}


def with_public(data: ClientData, public: dict[str, Array]) -> ClientData:
  """Every client's private set followed by the whole public set (``P`` more samples each).

  Args:
    data: a group's :class:`ClientData` with ``image [K, n, ...]`` and ``caption [K, n, C, L]``.
    public: ``image [P, ...]`` and ``caption [P, C, L]``.
  """
  k = data.num_clients
  arrays = {
    key: jnp.concatenate(
      [value, jnp.broadcast_to(public[key], (k,) + public[key].shape).astype(value.dtype)], axis=1
    )
    for key, value in data.arrays.items()
  }
  extra = jnp.broadcast_to(data.client_mask[:, None], (k, public["image"].shape[0]))
  return data.replace(arrays=arrays, sample_mask=jnp.concatenate([data.sample_mask, extra], 1))


def receive(params: PyTree, server_params: PyTree, names: dict[str, str], active: Array):
  """The active clients' towers replaced by the server's (stacked ``[K, ...]`` params)."""
  params = jax.tree.map(lambda x: x, params)  # a new container; leaves are not copied
  for server_name, client_name in names.items():

    def take(server_leaf, client_leaf):
      mask = active.reshape((-1,) + (1,) * server_leaf.ndim)
      return jnp.where(mask, server_leaf[None], client_leaf)

    params[client_name] = jax.tree.map(take, server_params[server_name], params[client_name])
  return params


def average_towers(
  server_params: PyTree,
  towers: dict[str, Sequence[dict[str, PyTree]]],
  weights: dict[str, Sequence[Array]],
) -> tuple[PyTree, dict[str, Array]]:
  """Step 4: each modality's server tower <- the weighted mean of the clients' towers.

  Args:
    server_params: the server's :class:`creamfl.DualEncoder` parameters.
    towers: per modality, per group, ``{server attribute: stacked [K, ...] subtree}``.
    weights: per modality, per group, ``[K]`` weights (0 for clients not selected).

  Returns:
    ``(server_params, received)``: a modality whose weights are all 0 keeps its
    tower; ``received[m]`` counts the clients with a positive weight.
  """
  server_params = jax.tree.map(lambda x: x, server_params)  # a new container
  received = {}
  for m in creamfl.MODALITIES:
    stacked = jax.tree.map(lambda *xs: jnp.concatenate(xs), *towers[m])
    w = jnp.concatenate(weights[m])
    mean = aggregate.weighted_mean(stacked, w)
    total = jnp.sum(w)
    received[m] = jnp.sum(w > 0)
    keep = lambda new, old, total=total: jnp.where(total > 0, new, old)
    for name in TOWERS[m]:
      server_params[name] = jax.tree.map(keep, mean[name], server_params[name])
  return server_params, received


def fedavg_towers(clients: Sequence[creamfl.ClientGroup], config: creamfl.CreamConfig) -> Algorithm:
  """FedAvg / FedIoT per modality tower, as an :class:`Algorithm` over :class:`creamfl.CreamState`.

  ``init(server_params, client_states, key)`` and ``round(state, data,
  multimodal_factor) -> (state, stats)``: ``data`` per group (the multimodal
  group's already :func:`with_public`), ``multimodal_factor`` the multimodal
  clients' weight factor (1: FedAvg, ``iot_weight``: FedIoT; an argument, so
  both rows share one compiled round). ``stats``: ``active`` per group, each
  client's mean local loss, ``received`` (towers per modality) and finiteness
  flags. ``server_opt`` is empty: the server takes no optimizer step.
  """
  clients = tuple(clients)

  def init(server_params: PyTree, states: Sequence[ClientState], key: Array) -> creamfl.CreamState:
    return creamfl.CreamState(
      round=jnp.zeros((), jnp.int32),
      rng=key,
      server_params=server_params,
      server_opt=(),
      server_rng=jax.random.fold_in(key, 1),
      groups=tuple(states),
    )

  def round_fn(state: creamfl.CreamState, data: Sequence[ClientData], multimodal_factor: Array):
    key = jax.random.fold_in(state.rng, state.round)
    valid = jnp.concatenate([d.client_mask for d in data])
    selected = aggregate.sample_clients(jax.random.fold_in(key, 0), valid, config.num_selected)
    active = creamfl._split(selected, [d.num_clients for d in data])
    towers = {m: [] for m in creamfl.MODALITIES}
    weights = {m: [] for m in creamfl.MODALITIES}
    new_groups, client_losses = [], []
    for client, cstate, d, act in zip(clients, state.groups, data, active, strict=True):
      names = client_towers(client)
      params = cstate.params
      for m in names:
        params = receive(params, state.server_params, names[m], act)
      cstate = cstate.replace(params=params, opt_state=jax.vmap(client.group.tx.init)(params))
      cstate, stats = train_group(
        client.group,
        cstate,
        d,
        objective_fn=creamfl._private_objective(client),
        active=act,
      )
      new_groups.append(cstate)
      client_losses.append(stats["loss"])
      factor = multimodal_factor if client.multimodal else 1.0
      w = act.astype(jnp.float32) * d.num_samples.astype(jnp.float32) * factor
      for m, pairs in names.items():
        towers[m].append({s: cstate.params[c] for s, c in pairs.items()})
        weights[m].append(w)

    server_params, received = average_towers(state.server_params, towers, weights)
    state = state.replace(server_params=server_params, groups=tuple(new_groups))
    stats = {
      "active": tuple(active),
      "client_loss": tuple(client_losses),
      "received": received,
      "server_finite": all_finite(server_params),
      "client_finite": tuple(finite_per_client(g.params) for g in state.groups),
    }
    return state.replace(round=state.round + 1), stats

  return Algorithm(init=init, round=round_fn)
