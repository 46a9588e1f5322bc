"""Local training: every client trains on its own data, nothing is sent.

The baseline of every paper's table (``M_local`` in FedMuscle's Delta).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from fedjax_mm.algorithms.base import Algorithm, FederatedState
from fedjax_mm.core.client import ClientData, ClientState, GroupDef, train_group


def local_training(groups: Sequence[GroupDef]) -> Algorithm:
  """Local training of a tuple of groups, as an :class:`Algorithm`."""
  groups = tuple(groups)

  def init(states: Sequence[ClientState], key: jax.Array) -> FederatedState:
    return FederatedState(round=jnp.zeros((), jnp.int32), rng=key, groups=tuple(states))

  def round_fn(state: FederatedState, data: Sequence[ClientData]):
    new_groups, stats = [], {}
    for group, client_state, client_data in zip(groups, state.groups, data, strict=True):
      client_state, group_stats = train_group(group, client_state, client_data)
      new_groups.append(client_state)
      stats[group.name] = group_stats
    return state.replace(round=state.round + 1, groups=tuple(new_groups)), stats

  return Algorithm(init=init, round=round_fn)
