"""Pure server transforms of stacked client updates and representations."""

from fedjax_mm.server.aggregate import (
  broadcast,
  fedavg,
  path_contains,
  sample_clients,
  weighted_mean,
)

__all__ = ["broadcast", "fedavg", "path_contains", "sample_clients", "weighted_mean"]
