"""The client engine: stacked groups, vmapped local training, sharding, ledger, checkpoints."""

from fedjax_mm.core.client import (
  ClientData,
  ClientState,
  GroupDef,
  evaluate_client,
  evaluate_group,
  finite_per_client,
  init_group,
  local_update,
  make_client_data,
  map_clients,
  parse_client_map,
  resolve_client_map,
  supervised_objective,
  train_group,
  with_proximal_term,
)
from fedjax_mm.core.sharding import (
  client_mesh,
  jit_round,
  padded_size,
  replicate,
  shard_clients,
  shardings_of,
)
from fedjax_mm.core.tasks import Task

__all__ = [
  "ClientData",
  "ClientState",
  "GroupDef",
  "Task",
  "client_mesh",
  "evaluate_client",
  "evaluate_group",
  "finite_per_client",
  "init_group",
  "jit_round",
  "local_update",
  "make_client_data",
  "map_clients",
  "parse_client_map",
  "resolve_client_map",
  "padded_size",
  "replicate",
  "shard_clients",
  "shardings_of",
  "supervised_objective",
  "train_group",
  "with_proximal_term",
]
