"""What every algorithm is: a pair of pure functions over a state dataclass.

Following fedjax's ``FederatedAlgorithm`` and optax's ``GradientTransformation``:
``init(...) -> state`` and ``round(state, data) -> (state, metrics)``. No hidden
state; ``round`` is traceable and is jitted once, at the top, by the caller
(``jax.jit(alg.round, donate_argnums=0)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from flax import struct
from jax.sharding import Mesh

from fedjax_mm.core.client import ClientState
from fedjax_mm.core.sharding import replicate


class Algorithm(NamedTuple):
  """A federated algorithm as ``init`` and ``round`` pure functions."""

  init: Callable[..., Any]
  round: Callable[..., tuple[Any, dict[str, Any]]]


@struct.dataclass
class FederatedState:
  """State shared by the parameter-averaging algorithms.

  Attributes:
    round: ``int32`` scalar, rounds completed.
    rng: typed PRNG key of the server (client sampling), folded with the round.
    groups: one stacked :class:`~fedjax_mm.core.client.ClientState` per group.
  """

  round: jax.Array
  rng: jax.Array
  groups: tuple[ClientState, ...]

  def place(self, mesh: Mesh) -> FederatedState:
    """Client state split over ``mesh``'s ``clients`` axis, the rest replicated."""
    server_part = replicate((self.round, self.rng), mesh)
    return FederatedState(*server_part, groups=tuple(g.place(mesh) for g in self.groups))
