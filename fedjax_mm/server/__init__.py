"""Pure server transforms of stacked client updates and representations."""

from fedjax_mm.server.aggregate import (
  average_within_classes,
  broadcast,
  fedavg,
  path_contains,
  sample_clients,
  weighted_mean,
)
from fedjax_mm.server.dro import chi2_divergence, dro_update, project_chi2_ball, project_simplex
from fedjax_mm.server.fedscmr import fedcmr_correction, fedcmr_weights, fedscmr_weights

__all__ = [
  "average_within_classes",
  "broadcast",
  "chi2_divergence",
  "dro_update",
  "fedavg",
  "fedcmr_correction",
  "fedcmr_weights",
  "fedscmr_weights",
  "path_contains",
  "project_chi2_ball",
  "project_simplex",
  "sample_clients",
  "weighted_mean",
]
