"""Client faults simulated inside a round: dropout, stragglers, Byzantine clients.

Real federations lose clients mid-round, wait on slow ones and may receive
garbage. This module holds the pure pieces that the algorithms wire into their
rounds, so a fault means the same thing in every system:

* **dropout** — a fraction of the round's participants drop out after
  training has started: whatever they would send (an update, a representation
  matrix) never arrives, and aggregation renormalises over the others (their
  weight becomes 0). If every participant drops, the server's state is left
  as it was.
* **stragglers** — a fraction of the surviving participants finishes only a
  uniformly drawn fraction ``u ~ U[0, 1)`` of its ``E * ceil(n_k / b)`` local
  steps: ``floor(u * steps)`` are taken, the rest are masked exactly as the
  engine masks padding steps (:func:`fedjax_mm.core.client.local_update`'s
  ``max_steps``).
* **Byzantine clients** — a fraction (or a fixed number) of the surviving
  participants sends corrupted data instead of the honest one: ``"random"``
  (Gaussian noise ``N(0, 1)`` of the update's shape; for representations,
  uniformly random unit vectors, which is what a normalised encoder could
  send) or ``"scaled"`` (the honest update or representations times
  ``byzantine_scale``, e.g. -10: the classic sign-flip / boosting attack).

Everything is off by default (:attr:`Faults.enabled` is a static Python
bool), and the algorithms take the fault-free code path when it is off, so a
run without faults is the same computation, bit for bit, as before faults
existed.

Masks come from a key that the algorithms derive with ``jax.random.fold_in``
from the round's key, so a resumed run draws the same faults as the
uninterrupted one. Counts are exact per round: of ``n`` active clients,
``round(p * n)`` drop (chosen uniformly by ranking i.i.d. uniform scores);
stragglers and Byzantine clients are drawn the same way among the survivors
(their counts are also fractions of ``n``, capped by the number of
survivors), with independent keys. No Python loop over clients: ranking is a
double ``argsort`` and corruption is a ``vmap`` of a one-client function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from fedjax_mm.core.client import client_uniform

Array = jax.Array
PyTree = Any
PathPredicate = Callable[[tuple[Any, ...]], bool]

MODES = ("random", "scaled")
#: Folded into a round's key to get the fault key: disjoint from the small
#: integers (groups, epochs) the algorithms already fold in.
SALT = 0xFA017


@dataclasses.dataclass(frozen=True)
class Faults:
  """Which faults a run simulates (hashable: jitted rounds close over it).

  Attributes:
    dropout: fraction of each round's participants that drop out, in [0, 1].
    stragglers: fraction of participants that take only part of their local
      steps, in [0, 1].
    byzantine: fraction of participants that send corrupted data, in [0, 1].
    byzantine_count: a fixed number of Byzantine participants per round
      instead of the fraction (0: use ``byzantine``).
    byzantine_mode: ``"random"`` or ``"scaled"``.
    byzantine_scale: the factor of ``"scaled"`` (e.g. -10).
  """

  dropout: float = 0.0
  stragglers: float = 0.0
  byzantine: float = 0.0
  byzantine_count: int = 0
  byzantine_mode: str = "random"
  byzantine_scale: float = -10.0

  @property
  def enabled(self) -> bool:
    """Whether any fault is switched on (static: selects the code path)."""
    return self.dropout > 0 or self.stragglers > 0 or self.byzantine > 0 or self.byzantine_count > 0

  @property
  def has_byzantine(self) -> bool:
    return self.byzantine > 0 or self.byzantine_count > 0

  def validate(self) -> None:
    """Raises ``ValueError`` with a one-line message for an impossible setting."""
    for name in ("dropout", "stragglers", "byzantine"):
      value = getattr(self, name)
      if not 0.0 <= value <= 1.0:
        raise ValueError(f"faults.{name} must be in [0, 1], got {value!r}.")
    if not isinstance(self.byzantine_count, int) or self.byzantine_count < 0:
      raise ValueError(f"faults.byzantine_count must be an int >= 0, got {self.byzantine_count!r}.")
    if self.byzantine_mode not in MODES:
      raise ValueError(
        f"faults.byzantine_mode must be one of {MODES}, got {self.byzantine_mode!r}."
      )

  @classmethod
  def from_config(cls, config: Any) -> Faults:
    """From a config's ``faults`` ConfigDict (or mapping); defaults when absent (``None``)."""
    if config is None:
      return cls()
    if callable(getattr(config, "to_dict", None)):
      config = config.to_dict()
    return cls(**config)


#: No faults: the default of every algorithm.
NONE = Faults()


@struct.dataclass
class FaultMasks:
  """One round's faults over ``K`` clients.

  Attributes:
    dropped: ``bool [K]`` participants whose data never arrives.
    straggler: ``bool [K]`` survivors that stop early.
    work: ``float32 [K]`` fraction of its local steps a client takes (1 for
      all but stragglers, ``U[0, 1)`` for those).
    byzantine: ``bool [K]`` survivors that send corrupted data.
  """

  dropped: Array
  straggler: Array
  work: Array
  byzantine: Array

  def counts(self) -> dict[str, Array]:
    """``int32`` scalars for the round's metrics: dropped, stragglers, Byzantine."""
    return {
      "dropped": jnp.sum(self.dropped, dtype=jnp.int32),
      "stragglers": jnp.sum(self.straggler, dtype=jnp.int32),
      "byzantine": jnp.sum(self.byzantine, dtype=jnp.int32),
    }


def _uniform(key: Array, client_mask: Array | None, shape) -> Array:
  """``U[0, 1)`` per client; by rank among ``client_mask`` when given (see ``client_uniform``)."""
  if client_mask is None:
    return jax.random.uniform(key, shape)
  return client_uniform(key, client_mask)


def _choose(key: Array, eligible: Array, count: Array, client_mask: Array | None) -> Array:
  """``bool [K]``: ``count`` of the ``eligible`` clients, uniformly (all of them if fewer)."""
  scores = jnp.where(eligible, _uniform(key, client_mask, eligible.shape), 2.0)
  rank = jnp.argsort(jnp.argsort(scores, stable=True), stable=True)
  return eligible & (rank < count)


def draw(
  key: Array, active: Array, faults: Faults, *, client_mask: Array | None = None
) -> FaultMasks:
  """The round's faults among the ``active`` clients.

  Args:
    key: fault key of the round (``fold_in(round_key, SALT)``, then per group
      if the algorithm draws per group).
    active: ``bool [K]`` the round's participants (padding clients excluded).
    faults: the configuration (static).
    client_mask: ``bool [K]`` the real clients, when padding clients may sit
      anywhere (several padded groups concatenated): every draw is then
      indexed by a client's rank among the real ones
      (:func:`fedjax_mm.core.client_uniform`), so the padding
      changes none. None: by position (padding, if any, at the end).

  Returns:
    :class:`FaultMasks` over ``K``; every mask is False outside ``active``,
    ``straggler`` and ``byzantine`` are False for dropped clients.
  """
  active = jnp.asarray(active, bool)
  n = jnp.sum(active)
  k_drop, k_slow, k_work, k_byz = (jax.random.fold_in(key, i) for i in range(4))
  count = lambda p: jnp.round(p * n).astype(jnp.int32)
  dropped = _choose(k_drop, active, count(faults.dropout), client_mask)
  survivors = active & ~dropped
  straggler = _choose(k_slow, survivors, count(faults.stragglers), client_mask)
  work = jnp.where(straggler, _uniform(k_work, client_mask, active.shape), 1.0)
  byz_count = faults.byzantine_count if faults.byzantine_count > 0 else count(faults.byzantine)
  byzantine = _choose(k_byz, survivors, byz_count, client_mask)
  return FaultMasks(dropped=dropped, straggler=straggler, work=work, byzantine=byzantine)


def corruption_key(key: Array, index: int = 0) -> Array:
  """The key of corruption ``index`` (e.g. a group) under a fault key :func:`draw` also reads.

  :func:`draw` uses ``fold_in(key, 0..3)``; corruption keys start above them.
  """
  return jax.random.fold_in(key, 4 + index)


def step_budget(work: Array, num_samples: Array, *, num_epochs: int, batch_size: int) -> Array:
  """``int32 [K]``: local steps each client may take, ``floor(work * E * ceil(n_k / b))``.

  A client's real steps per epoch are ``ceil(n_k / b)`` (the engine masks the
  rest), so ``work = 1`` leaves every client its full budget.
  """
  steps = num_epochs * ((num_samples + batch_size - 1) // batch_size)
  return jnp.floor(work * steps).astype(jnp.int32)


def _corrupt_leaf(key: Array, x: Array, faults: Faults) -> Array:
  if faults.byzantine_mode == "scaled":
    return x * jnp.asarray(faults.byzantine_scale, x.dtype)
  return jax.random.normal(key, x.shape, x.dtype)


def corrupt_client_update(
  key: Array,
  update: PyTree,
  byzantine: Array,
  faults: Faults,
  *,
  select: PathPredicate | None = None,
) -> PyTree:
  """The update ONE client sends: honest, or corrupted if ``byzantine``.

  Args:
    key: this client's key (leaf ``i`` draws from ``fold_in(key, i)``).
    update: pytree of the client's update (new parameters minus the start).
    byzantine: ``bool`` scalar.
    faults: the mode and scale (static).
    select: optional path predicate; unselected leaves (the personal layers
      that are never sent) stay honest.

  Returns:
    pytree like ``update``.
  """
  leaves, treedef = jax.tree_util.tree_flatten_with_path(update)
  out = []
  for i, (path, x) in enumerate(leaves):
    if select is not None and not select(path):
      out.append(x)
      continue
    out.append(jnp.where(byzantine, _corrupt_leaf(jax.random.fold_in(key, i), x, faults), x))
  return jax.tree_util.tree_unflatten(treedef, out)


def corrupt_update(
  key: Array,
  update: PyTree,
  byzantine: Array,
  faults: Faults,
  *,
  select: PathPredicate | None = None,
) -> PyTree:
  """:func:`corrupt_client_update` of every client: ``update`` leaves ``[K, ...]``.

  Client ``k`` uses ``fold_in(key, k)``, so the result equals a loop over
  clients (tested).

  Args:
    key: the round's fault key for these clients.
    update: pytree of ``[K, ...]`` updates.
    byzantine: ``bool [K]``.
    faults: the mode and scale (static).
    select: optional path predicate of the leaves that are sent.
  """
  k = jnp.shape(byzantine)[0]
  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(k))
  one = lambda kk, u, b: corrupt_client_update(kk, u, b, faults, select=select)
  return jax.vmap(one)(keys, update, byzantine)


def corrupt_client_representations(key: Array, z: Array, byzantine: Array, faults: Faults) -> Array:
  """The representation matrix ONE client sends: ``z [..., d]``, honest or corrupted.

  ``"random"``: i.i.d. uniformly random unit vectors (normalised Gaussians)
  of the same shape; ``"scaled"``: ``byzantine_scale * z``.
  """
  if faults.byzantine_mode == "scaled":
    bad = z * jnp.asarray(faults.byzantine_scale, z.dtype)
  else:
    noise = jax.random.normal(key, z.shape, z.dtype)
    bad = noise / jnp.linalg.norm(noise, axis=-1, keepdims=True)
  return jnp.where(byzantine, bad, z)


def corrupt_representations(key: Array, z: Array, byzantine: Array, faults: Faults) -> Array:
  """:func:`corrupt_client_representations` of every client: ``z [K, ..., d]``, ``byzantine [K]``.

  Client ``k`` uses ``fold_in(key, k)`` (equals a loop over clients).
  """
  k = byzantine.shape[0]
  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(k))
  fn = lambda kk, zz, b: corrupt_client_representations(kk, zz, b, faults)
  return jax.vmap(fn)(keys, z, byzantine)


def send_updates(
  key: Array,
  start: PyTree,
  trained: PyTree,
  masks: FaultMasks,
  faults: Faults,
  *,
  select: PathPredicate | None = None,
) -> PyTree:
  """What the server receives as parameters, ``[K, ...]``, after the round's faults.

  Byzantine clients' updates ``trained - start`` are corrupted (the selected
  leaves only); dropped clients' training is lost, so they hold ``start``
  again (and the caller gives them weight 0).

  Args:
    key: the fault key for these clients.
    start: ``[K, ...]`` parameters at the start of local training.
    trained: ``[K, ...]`` parameters after it.
    masks: the round's :class:`FaultMasks`.
    faults: the configuration (static).
    select: optional path predicate of the leaves that are sent.
  """
  out = trained
  if faults.has_byzantine:
    update = jax.tree.map(lambda t, s: t - s, trained, start)
    bad = corrupt_update(key, update, masks.byzantine, faults, select=select)
    bad = jax.tree.map(lambda s, u: s + u, start, bad)
    # Honest clients (and unsent leaves) keep their exact trained values.
    byz = masks.byzantine

    def pick(path, t, b):
      if select is not None and not select(path):
        return t
      return jnp.where(byz.reshape(byz.shape + (1,) * (t.ndim - 1)), b, t)

    out = jax.tree_util.tree_map_with_path(pick, trained, bad)
  return keep_where(masks.dropped, start, out)


def keep_where(mask: Array, old: PyTree, new: PyTree) -> PyTree:
  """Per client, ``old`` where ``mask [K]`` else ``new`` (every leaf ``[K, ...]``)."""

  def pick(o, n):
    return jnp.where(mask.reshape(mask.shape + (1,) * (n.ndim - 1)), o, n)

  return jax.tree.map(pick, old, new)
