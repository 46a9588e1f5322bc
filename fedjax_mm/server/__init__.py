"""Pure server transforms of stacked client updates and representations."""

from fedjax_mm.server.aggregate import (
  broadcast,
  fedavg,
  path_contains,
  sample_clients,
  weighted_mean,
)
from fedjax_mm.server.fedscmr import fedcmr_correction, fedcmr_weights, fedscmr_weights

__all__ = [
  "broadcast",
  "fedavg",
  "fedcmr_correction",
  "fedcmr_weights",
  "fedscmr_weights",
  "path_contains",
  "sample_clients",
  "weighted_mean",
]
