"""What every algorithm is: a pair of pure functions over a state dataclass.

Following fedjax's ``FederatedAlgorithm`` and optax's ``GradientTransformation``:
``init(...) -> state`` and ``round(state, data) -> (state, metrics)``. No hidden
state; ``round`` is traceable and is jitted once, at the top, by the caller
(``jax.jit(alg.round, donate_argnums=0)``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
from flax import struct
from jax.sharding import Mesh

from fedjax_mm.core import features
from fedjax_mm.core.client import ClientState, GroupDef
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


def classes_of(keys: Sequence[Hashable]) -> tuple[int, ...]:
  """A class id per entry: equal keys share one (ids in order of first appearance).

  Examples:
    >>> classes_of([("mlc", "vit_s"), ("ic10", "vit_t"), ("mlc", "vit_s")])
    (0, 1, 0)
  """
  ids: dict[Hashable, int] = {}
  return tuple(ids.setdefault(k, len(ids)) for k in keys)


def task_classes(groups: Sequence[GroupDef]) -> tuple[int, ...]:
  """A class id per group: groups that solve one task share it.

  The task as its raw group states it (:func:`fedjax_mm.core.features.source_task`):
  a group that reads its frozen encoder's cached features solves its images' task.
  """
  return classes_of(features.source_task(g.task) for g in groups)


def check_same_shapes(states: Sequence[ClientState], classes: Sequence[int]) -> None:
  """Raises ``ValueError`` unless groups of one class have identical parameter trees.

  Parameter averaging across groups (:func:`fedjax_mm.server.average_within_classes`)
  needs the same architecture: the same tree, leaf shapes (client axis aside)
  and dtypes.
  """
  first: dict[int, tuple[int, Any]] = {}
  for g, (state, c) in enumerate(zip(states, classes, strict=True)):
    spec = jax.tree.map(lambda x: (x.shape[1:], x.dtype), state.params)
    if c not in first:
      first[c] = (g, spec)
    elif jax.tree.structure(spec) != jax.tree.structure(first[c][1]) or jax.tree.leaves(
      spec
    ) != jax.tree.leaves(first[c][1]):
      raise ValueError(
        f"groups {first[c][0]} and {g} are averaged together but their parameters differ "
        "in structure or shape: give them different architecture keys."
      )
