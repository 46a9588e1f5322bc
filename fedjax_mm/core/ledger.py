"""The communication ledger: bytes that cross the simulated wire, per user and round.

Federated algorithms differ mostly in *what* they send: FedAvg-style methods ship
parameters (or adapters, or a linear subspace), FedMuscle and CreamFL ship
representations of a public set, the server answers with aggregated matrices or
weights. To compare them honestly the library counts every array that crosses
the wire, from the pytrees actually sent, and reports bytes up (user to server)
and bytes down (server to user), per user and per round.

What is counted:

* The dense payload of every array leaf: ``size * dtype.itemsize``. A bfloat16
  matrix costs half of a float32 one, an int8 quantised update a quarter. Typed
  PRNG keys count their key data (8 bytes per threefry key). Python scalars
  count as the array ``jnp.asarray`` would make of them (4 bytes under jax's
  default 32-bit mode).
* Nothing else: no framing, headers, compression or tree structure. The ledger
  measures the information an algorithm chooses to send, not a transport.

Counting only needs shapes and dtypes, so every function here also accepts
``jax.ShapeDtypeStruct`` leaves: the cost of a round can be read off
``jax.eval_shape(round_fn, ...)`` without running it.

Stacked client groups (every leaf ``[K, ...]``, see ``DESIGN.md`` section 3)
are counted per client by :func:`per_client_bytes`, which gives padding
clients (mask 0) zero bytes, since they do not exist.

The :class:`Ledger` itself is host-side bookkeeping, deliberately outside jit:
byte counts are static (they depend on shapes only), and jax's default 32-bit
integers would overflow after 2 GiB. Totals are numpy ``int64`` (exact up to
8 EiB) and per-round records hold Python ints, so a ledger converts losslessly
to JSON (:meth:`Ledger.to_dict`) and back (:meth:`Ledger.from_dict`); this is how
a checkpoint carries it and a resumed run continues the same counts.

Typical use inside a training loop::

  ledger = Ledger.zeros(num_users)
  for r in range(num_rounds):
    ...
    up = per_client_bytes(sent_by_group, client_mask=group.mask)    # [K]
    down = per_client_bytes(received_by_group, client_mask=group.mask)
    ledger = ledger.add(up=up, down=down, user_ids=group.user_ids, round=r)
  print(format_bytes(ledger.total_up))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "Ledger",
  "format_bytes",
  "leaf_bytes",
  "per_client_bytes",
  "tree_bytes",
]

_PYTHON_SCALARS = (bool, int, float, complex)


def _shape_and_dtype(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
  """Returns the (shape, dtype) of an array-like leaf, or raises TypeError."""
  shape = getattr(leaf, "shape", None)
  dtype = getattr(leaf, "dtype", None)
  if shape is not None and dtype is not None:  # Arrays, numpy scalars (np.float64 is a float).
    return tuple(shape), dtype
  if isinstance(leaf, _PYTHON_SCALARS):
    return (), np.dtype(jnp.result_type(leaf))
  raise TypeError(
    f"Cannot count the bytes of a leaf of type {type(leaf).__name__}: expected an "
    "array, a jax.ShapeDtypeStruct or a Python scalar."
  )


def leaf_bytes(leaf: Any) -> int:
  """Bytes of one array-like leaf: ``size * itemsize``.

  Args:
    leaf: a ``jax.Array``, ``np.ndarray``, numpy scalar, ``jax.ShapeDtypeStruct``
      or Python scalar. Typed PRNG key dtypes report the itemsize of their key
      data (8 bytes for threefry).

  Returns:
    The number of bytes, as a Python int.
  """
  shape, dtype = _shape_and_dtype(leaf)
  return math.prod(shape) * dtype.itemsize


def tree_bytes(tree: Any) -> int:
  """Total bytes of all array leaves of a pytree.

  Works on concrete pytrees and on the abstract output of ``jax.eval_shape``.

  >>> import jax.numpy as jnp
  >>> tree_bytes({"w": jnp.zeros((3, 4), jnp.float32), "b": jnp.zeros(4, jnp.bfloat16)})
  56

  Args:
    tree: any pytree whose leaves are arrays, ``jax.ShapeDtypeStruct`` or Python
      scalars. ``None`` and empty containers contribute nothing.

  Returns:
    ``sum(size * itemsize)`` over the leaves, as a Python int.
  """
  return sum(leaf_bytes(leaf) for leaf in jax.tree.leaves(tree))


def per_client_bytes(stacked_tree: Any, *, client_mask: Any = None) -> np.ndarray:
  """Bytes per client of a stacked pytree (every leaf ``[K, ...]``).

  Each client sends its own slice ``leaf[k]`` of every leaf, so a dense stack
  costs the same for every real client; padding clients (mask 0) cost nothing.

  Args:
    stacked_tree: pytree whose leaves (arrays or ``jax.ShapeDtypeStruct``) share
      a leading client axis of size ``K``.
    client_mask: optional ``[K]`` array; entries that are 0 / False mark padding
      clients. Must be concrete (the ledger runs on the host, outside jit).

  Returns:
    ``np.ndarray`` of shape ``[K]``, dtype ``int64``: bytes sent per client.

  Raises:
    ValueError: if the tree is empty, a leaf is a scalar, leading axes
      disagree, or the mask does not have shape ``[K]``.
  """
  leaves = jax.tree.leaves(stacked_tree)
  if not leaves:
    raise ValueError("per_client_bytes needs at least one stacked leaf to know K.")
  num_clients = None
  per_client = 0
  for leaf in leaves:
    shape, dtype = _shape_and_dtype(leaf)
    if not shape:
      raise ValueError("per_client_bytes got a scalar leaf; every leaf needs a [K, ...] axis.")
    if num_clients is None:
      num_clients = shape[0]
    elif shape[0] != num_clients:
      raise ValueError(
        f"Leaves disagree on the client axis: {shape[0]} vs {num_clients} (shape {shape})."
      )
    per_client += math.prod(shape[1:]) * dtype.itemsize
  counts = np.full((num_clients,), per_client, dtype=np.int64)
  if client_mask is not None:
    mask = np.asarray(client_mask)
    if mask.shape != (num_clients,):
      raise ValueError(f"client_mask has shape {mask.shape}, expected ({num_clients},).")
    counts = np.where(mask != 0, counts, 0).astype(np.int64)
  return counts


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_bytes(n: float) -> str:
  """Formats a byte count with binary units.

  >>> format_bytes(512), format_bytes(1536), format_bytes(3 * 2**20 // 2)
  ('512 B', '1.5 KiB', '1.5 MiB')

  Args:
    n: a number of bytes (int or float, may be negative).

  Returns:
    ``"<n> B"`` below 1 KiB, otherwise one decimal and the largest binary unit
    (KiB, MiB, ..., EiB) that keeps the number at or above 1.
  """
  n = float(n)
  sign = "-" if n < 0 else ""
  n = abs(n)
  if n < 1024:
    return f"{sign}{n:.0f} B"
  exponent = min(int(math.log(n, 1024)), len(_UNITS) - 1)
  value = n / 1024**exponent
  if round(value, 1) >= 1024 and exponent < len(_UNITS) - 1:  # 1023.96 KiB -> 1.0 MiB.
    exponent += 1
    value = n / 1024**exponent
  return f"{sign}{value:.1f} {_UNITS[exponent]}"


def _frozen(array: np.ndarray) -> np.ndarray:
  array.setflags(write=False)
  return array


@dataclasses.dataclass(frozen=True, eq=False)
class Ledger:
  """Cumulative bytes up and down per user, plus one record per round.

  Immutable: :meth:`add` returns a new ledger. Host-side numpy ``int64`` (see
  the module docstring for why this is not a jax pytree).

  Attributes:
    up: ``[num_users]`` int64, cumulative bytes each user sent to the server.
    down: ``[num_users]`` int64, cumulative bytes each user received.
    rounds: one JSON-ready dict per recorded round, in increasing round order:
      ``{"round": r, "up_bytes": [...], "down_bytes": [...]}`` with one Python
      int per user (users absent from the round have 0).
  """

  up: np.ndarray
  down: np.ndarray
  rounds: tuple[dict[str, Any], ...] = ()

  def __post_init__(self):
    up = np.asarray(self.up, dtype=np.int64)
    down = np.asarray(self.down, dtype=np.int64)
    if up.ndim != 1 or up.shape != down.shape:
      raise ValueError(f"up and down must both be [num_users]; got {up.shape} and {down.shape}.")
    object.__setattr__(self, "up", _frozen(up.copy()))
    object.__setattr__(self, "down", _frozen(down.copy()))
    object.__setattr__(self, "rounds", tuple(self.rounds))

  @classmethod
  def zeros(cls, num_users: int) -> Ledger:
    """An empty ledger for ``num_users`` users."""
    if num_users < 1:
      raise ValueError(f"num_users must be >= 1, got {num_users}.")
    return cls(np.zeros(num_users, np.int64), np.zeros(num_users, np.int64))

  @property
  def num_users(self) -> int:
    return int(self.up.shape[0])

  @property
  def total_up(self) -> int:
    """Bytes sent to the server by all users, all rounds."""
    return int(self.up.sum())

  @property
  def total_down(self) -> int:
    """Bytes received from the server by all users, all rounds."""
    return int(self.down.sum())

  def _per_user(self, values: Any, user_ids: np.ndarray, name: str) -> np.ndarray:
    """Scatters ``values`` (scalar or ``[len(user_ids)]``) into a ``[num_users]`` array."""
    out = np.zeros(self.num_users, np.int64)
    if values is None:
      return out
    values = np.asarray(values)
    if values.ndim == 0:
      values = np.broadcast_to(values, user_ids.shape)
    if values.shape != user_ids.shape:
      raise ValueError(f"{name} has shape {values.shape} but user_ids has shape {user_ids.shape}.")
    if np.any(values < 0):
      raise ValueError(f"{name} byte counts must be non-negative.")
    # Rounding rather than truncation: float counts (e.g. a mean) stay honest.
    np.add.at(out, user_ids, np.rint(values).astype(np.int64))
    return out

  def add(
    self,
    *,
    up: Any = None,
    down: Any = None,
    user_ids: Sequence[int] | np.ndarray | None = None,
    round: int | None = None,
  ) -> Ledger:
    """Records bytes sent and received by some users in one round.

    Several calls for the same round (one per client group, say) merge into one
    round record. Rounds must be recorded in non-decreasing order.

    Args:
      up: bytes each user sent, a scalar (same for every listed user) or an
        array aligned with ``user_ids`` (e.g. :func:`per_client_bytes`).
      down: bytes each user received, same layout as ``up``.
      user_ids: indices in ``[0, num_users)`` of the users ``up``/``down``
        refer to (the users of one client group); repeated ids accumulate.
        Defaults to all users in order. Padding clients should carry 0 bytes
        (as :func:`per_client_bytes` gives them) and any valid id.
      round: the round number. ``None`` opens a new round right after the last
        recorded one (round 0 on an empty ledger).

    Returns:
      A new ledger with the counts added to the totals and the round record.

    Raises:
      ValueError: on out-of-range ids, mismatched shapes, negative counts, or
        a round earlier than the last recorded one.
    """
    if user_ids is None:
      ids = np.arange(self.num_users)
    else:
      ids = np.asarray(user_ids, dtype=np.int64).reshape(-1)
      if ids.size and (ids.min() < 0 or ids.max() >= self.num_users):
        raise ValueError(f"user_ids must lie in [0, {self.num_users}); got {ids.tolist()}.")
    up_round = self._per_user(up, ids, "up")
    down_round = self._per_user(down, ids, "down")

    last = self.rounds[-1]["round"] if self.rounds else None
    if round is None:
      round = 0 if last is None else last + 1
    round = int(round)
    if last is not None and round < last:
      raise ValueError(f"Round {round} recorded after round {last}; the ledger is append-only.")

    records = list(self.rounds)
    up_record, down_record = up_round, down_round
    if last is not None and round == last:
      previous = records.pop()
      up_record = up_record + np.asarray(previous["up_bytes"], np.int64)
      down_record = down_record + np.asarray(previous["down_bytes"], np.int64)
    records.append(
      {"round": round, "up_bytes": up_record.tolist(), "down_bytes": down_record.tolist()}
    )
    return Ledger(self.up + up_round, self.down + down_round, tuple(records))

  def round_summary(self, round: int | None = None) -> dict[str, Any]:
    """The JSON-ready record of one round (default: the last recorded one).

    Returns:
      The record, a dict of ``round``, ``up_bytes`` and ``down_bytes`` (per user),
      ``total_up`` and ``total_down`` (ints).

    Raises:
      KeyError: if that round was never recorded.
    """
    if not self.rounds:
      raise KeyError("The ledger has no rounds yet.")
    if round is None:
      record = self.rounds[-1]
    else:
      matches = [r for r in self.rounds if r["round"] == round]
      if not matches:
        raise KeyError(f"Round {round} was not recorded.")
      record = matches[0]
    return {
      "round": record["round"],
      "up_bytes": list(record["up_bytes"]),
      "down_bytes": list(record["down_bytes"]),
      "total_up": int(sum(record["up_bytes"])),
      "total_down": int(sum(record["down_bytes"])),
    }

  def to_dict(self) -> dict[str, Any]:
    """A JSON-serialisable snapshot (Python ints and lists only).

    Returns:
      ``{"num_users", "up_bytes", "down_bytes", "total_up", "total_down",
      "rounds"}``; :meth:`from_dict` inverts it exactly.
    """
    return {
      "num_users": self.num_users,
      "up_bytes": self.up.tolist(),
      "down_bytes": self.down.tolist(),
      "total_up": self.total_up,
      "total_down": self.total_down,
      "rounds": [
        {"round": r["round"], "up_bytes": list(r["up_bytes"]), "down_bytes": list(r["down_bytes"])}
        for r in self.rounds
      ],
    }

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> Ledger:
    """Rebuilds a ledger from :meth:`to_dict` output (e.g. checkpoint metadata)."""
    return cls(
      np.asarray(d["up_bytes"], np.int64),
      np.asarray(d["down_bytes"], np.int64),
      tuple(
        {
          "round": int(r["round"]),
          "up_bytes": [int(v) for v in r["up_bytes"]],
          "down_bytes": [int(v) for v in r["down_bytes"]],
        }
        for r in d.get("rounds", ())
      ),
    )

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, Ledger):
      return NotImplemented
    return (
      np.array_equal(self.up, other.up)
      and np.array_equal(self.down, other.down)
      and self.rounds == other.rounds
    )
