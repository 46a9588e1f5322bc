"""Pure server transforms of stacked client updates.

Each function takes stacked arrays (every leaf ``[K, ...]``) and per-client
weights ``[K]`` and returns arrays; nothing loops over clients in Python.
Padding clients and clients that did not take part simply carry weight 0.

* :func:`weighted_mean` — FedAvg's aggregate ``sum_k w_k x_k / sum_k w_k``.
* :func:`broadcast` — the server's answer, copied back to every client.
* :func:`fedavg` — both, restricted to the parameters a path predicate selects
  (all of them by default; adapters only, or a common subspace only, for the
  algorithms that federate a part of the model).
* :func:`sample_clients` — uniform sampling of a fixed number of participants.
* :func:`average_within_classes` — FedAvg across several groups at once, among
  the groups of one class (same task and architecture: FedDF, FedRCL).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fedjax_mm.core.client import client_uniform

Array = jax.Array
PyTree = Any
PathPredicate = Callable[[tuple[Any, ...]], bool]


def weighted_mean(stacked: PyTree, weights: Array) -> PyTree:
  """Weighted mean over the leading client axis of every leaf.

  Args:
    stacked: pytree of ``[K, ...]`` arrays.
    weights: ``[K]`` non-negative weights (0 for padding / absent clients).

  Returns:
    pytree of ``[...]`` arrays. If every weight is 0 the result is 0.
  """
  weights = jnp.asarray(weights, jnp.float32)
  _check_stacked(stacked, weights)
  total = jnp.sum(weights)
  safe = jnp.where(total > 0, weights / jnp.where(total > 0, total, 1.0), 0.0)

  def mean(x):
    w = safe.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype)
    return jnp.sum(w * x, axis=0)

  return jax.tree.map(mean, stacked)


def _check_stacked(stacked: PyTree, weights: Array) -> None:
  """Raises unless ``weights`` is ``[K]`` and every leaf of ``stacked`` is ``[K, ...]``.

  Static shapes only, so it costs nothing under ``jit``; without it a mismatch is a
  broadcasting error (or, for a ``[K, K]`` leaf and ``K`` weights of another
  meaning, a silently wrong mean).
  """
  if jnp.ndim(weights) != 1:
    raise ValueError(f"weights must be [K], one per client, got shape {jnp.shape(weights)}.")
  num_clients = jnp.shape(weights)[0]
  leaves = jax.tree_util.tree_leaves_with_path(stacked)
  bad = [
    f"{jax.tree_util.keystr(path) or 'the array'} {jnp.shape(x)}"
    for path, x in leaves
    if jnp.ndim(x) == 0 or jnp.shape(x)[0] != num_clients
  ]
  if bad:
    raise ValueError(
      f"every leaf must be stacked over the K={num_clients} clients of the weights "
      f"([K, ...]); these are not: {', '.join(bad[:5])}"
      + (f" and {len(bad) - 5} more." if len(bad) > 5 else ".")
    )


def broadcast(tree: PyTree, num_clients: int) -> PyTree:
  """Copies each leaf to a new leading client axis of size ``num_clients``."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_clients,) + x.shape), tree)


def _path_names(path: tuple[Any, ...]) -> tuple[str, ...]:
  names = []
  for entry in path:
    for attr in ("key", "name", "idx"):
      if hasattr(entry, attr):
        names.append(str(getattr(entry, attr)))
        break
    else:
      names.append(str(entry))
  return tuple(names)


def path_contains(*names: str) -> PathPredicate:
  """A predicate selecting leaves whose path has any of ``names`` as a component."""
  wanted = set(names)
  return lambda path: bool(wanted & set(_path_names(path)))


def fedavg(
  stacked: PyTree,
  weights: Array,
  *,
  receive: Array | None = None,
  select: PathPredicate | None = None,
) -> tuple[PyTree, PyTree]:
  """FedAvg over the selected leaves: aggregate, then send back.

  Args:
    stacked: pytree of ``[K, ...]`` client parameters (or updates).
    weights: ``[K]`` aggregation weights (e.g. sample counts of participants).
    receive: optional ``bool [K]``: clients that receive the aggregate
      (default: all). The others keep their values.
    select: optional path predicate; unselected leaves are left untouched
      (each client keeps its own) and do not appear in the aggregate.

  Returns:
    ``(new_stacked, aggregate)`` where ``aggregate`` holds the weighted means of
    the selected leaves (``None`` for unselected ones).
  """
  selected = jax.tree_util.tree_map_with_path(
    lambda path, x: x if select is None or select(path) else None, stacked
  )
  _check_stacked(selected, jnp.asarray(weights))
  num_clients = jnp.shape(weights)[0]

  def one(path, x):
    if select is not None and not select(path):
      return x, None
    mean = weighted_mean(x, weights)
    new = jnp.broadcast_to(mean, x.shape)
    if receive is not None:
      new = jnp.where(receive.reshape((num_clients,) + (1,) * (x.ndim - 1)), new, x)
    return new, mean

  pairs = jax.tree_util.tree_map_with_path(one, stacked)
  is_pair = lambda t: isinstance(t, tuple) and len(t) == 2
  new = jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair)
  aggregate = jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair)
  return new, aggregate


def sample_clients(key: Array, client_mask: Array, num: int) -> Array:
  """``bool [K]``: ``num`` participants drawn uniformly among valid clients.

  The draw is :func:`client_uniform`'s, so padding clients change no choice.

  Args:
    key: PRNG key of this round.
    client_mask: ``bool [K]`` valid (non-padding) clients.
    num: participants per round (static). If it exceeds the number of valid
      clients, every valid client takes part.

  Returns:
    ``bool [K]`` participation mask.
  """
  scores = jnp.where(client_mask, client_uniform(key, client_mask), -1.0)
  num = min(num, client_mask.shape[0])
  threshold = jax.lax.top_k(scores, num)[0][-1]
  return client_mask & (scores >= threshold)


def average_within_classes(
  stacked: Sequence[PyTree],
  weights: Sequence[Array],
  classes: Sequence[Hashable],
  *,
  receive: Sequence[Array] | None = None,
  select: PathPredicate | None = None,
) -> tuple[PyTree, ...]:
  """FedAvg among the groups of each class; every client receives its class's mean.

  Groups (each a stacked pytree ``[K_g, ...]``) of one class must have the same
  structure and shapes (the same architecture) in the leaves averaged (with
  ``select``, only those; the rest may differ): their clients are joined along
  the client axis, averaged by ``weights`` and the mean sent back to every
  client of the class. A class of one group is a plain FedAvg within the group;
  a class whose weights are all 0 keeps its parameters, and so does a class of
  a single client (exactly: its mean is itself).

  Args:
    stacked: per group, a pytree of ``[K_g, ...]`` arrays.
    weights: per group, ``[K_g]`` non-negative weights (e.g. ``n_k``, 0 for
      padding clients).
    classes: per group, a static, hashable class id (``classes[g] ==
      classes[h]``: the two groups average together).
    receive: per group, ``bool [K_g]``, the clients that take the mean (every
      client when ``None``); the others keep their parameters exactly. Their
      weights still count towards the mean.
    select: a predicate of a leaf's key path (as ``jax.tree_util`` gives it):
      only the leaves it accepts are averaged; the others keep their values
      (every leaf when ``None``).

  Returns:
    per group, the pytree of ``[K_g, ...]`` arrays after averaging.
  """
  if not len(stacked) == len(weights) == len(classes):
    raise ValueError("stacked, weights and classes need one entry per group.")
  if receive is not None and len(receive) != len(stacked):
    raise ValueError("receive needs one entry per group.")
  flat = [
    {jax.tree_util.keystr(path): x for path, x in jax.tree_util.tree_flatten_with_path(t)[0]}
    for t in stacked
  ]
  out = list(stacked)
  for c in dict.fromkeys(classes):
    members = [g for g, cg in enumerate(classes) if cg == c]
    if len(members) == 1 and jax.tree.leaves(stacked[members[0]])[0].shape[0] == 1:
      continue  # one client: its mean is itself
    w = jnp.concatenate([jnp.asarray(weights[g], jnp.float32) for g in members])
    positive = jnp.sum(w) > 0
    means: dict[str, Array] = {}  # per leaf, computed once for the class

    def mean_of(key, members=members, w=w, means=means):
      if key not in means:
        means[key] = weighted_mean(jnp.concatenate([flat[h][key] for h in members]), w)
      return means[key]

    for g in members:
      take = positive if receive is None else positive & jnp.asarray(receive[g], bool)

      def leaf(path, x, take=take, mean_of=mean_of):
        if select is not None and not select(path):
          return x
        m = mean_of(jax.tree_util.keystr(path))
        return jnp.where(take.reshape(take.shape + (1,) * (x.ndim - take.ndim)), m, x)

      out[g] = jax.tree_util.tree_map_with_path(leaf, stacked[g])
  return tuple(out)
