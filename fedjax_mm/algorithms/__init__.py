"""One module per federated algorithm, each an ``init`` / ``round`` pair."""

from fedjax_mm.algorithms.base import Algorithm, FederatedState
from fedjax_mm.algorithms.fedavg import fedavg
from fedjax_mm.algorithms.local import local_training

__all__ = ["Algorithm", "FederatedState", "fedavg", "local_training"]
