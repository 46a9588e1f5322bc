"""Orbax checkpoints of the whole federated state, plus JSON metadata per step.

The federated state of a run is one arbitrary pytree: ``flax.struct`` dataclasses
of stacked client groups (params, optax states, PRNG keys, masks, every leaf
``[K, ...]``), replicated server state, and Python ints such as the round
number. :class:`Checkpointer` saves that pytree whole, so that a resumed run
reproduces an uninterrupted one exactly (``DESIGN.md`` section 3: everything
seeded), and it saves a JSON document beside it (the config, the round, the
communication ledger's :meth:`~fedjax_mm.core.ledger.Ledger.to_dict`) that can
be read without knowing the state's structure.

Layout on disk (one ``orbax.checkpoint.CheckpointManager`` directory)::

  <directory>/<step>/state/      # the pytree, Orbax StandardSave (OCDBT/Zarr)
  <directory>/<step>/metadata/   # the JSON document, Orbax JsonSave
  <directory>/<step>/checksums/  # CRC-32 of every array and of the document, JsonSave
  <directory>/<step>.damaged-<YYYYmmdd-HHMMSS>/   # a step set aside, see below

Guarantees and choices:

* **Atomic saves.** Orbax writes each step into ``<step>.orbax-checkpoint-tmp``
  and renames it to ``<step>`` only once every item is on disk (on object
  stores it writes a ``commit_success.txt`` marker instead). A crash at any
  moment therefore leaves the previous steps untouched. :meth:`latest_step`
  reports *finalised* steps only: those whose directory carries Orbax's
  ``_CHECKPOINT_METADATA`` file, which excludes tmp directories, a save still
  in flight in this process, and a bare step directory left by a crash on a
  file system without atomic rename. Leftover tmp directories are deleted when
  a :class:`Checkpointer` opens the directory.
* **Asynchronous saves.** :meth:`save` returns once the arrays have been copied
  off the accelerator; writing continues in a background thread. The caller
  may then donate or overwrite the state (``jit(..., donate_argnums=...)``).
  :meth:`wait` blocks until the write is finalised; :meth:`close` waits too.
* **Restore into a target.** :meth:`restore` takes the structure, shapes,
  dtypes and shardings from a *target*: usually ``jax.eval_shape(init_fn, ...)``
  (nothing is computed), or a concrete state. Each array leaf is restored onto
  the target leaf's sharding when it has one (a ``ShapeDtypeStruct`` built with
  ``sharding=NamedSharding(mesh, P("clients"))``, or a committed ``jax.Array``),
  so a stacked group is read shard by shard straight onto its devices. A leaf
  without a sharding (a plain ``ShapeDtypeStruct``, an uncommitted array as
  made outside ``jit``) comes back as an *uncommitted* array on the default
  device, exactly like the output of ``init_fn`` run eagerly, so ``jit`` may
  place it anywhere. Sharded layouts stored in the checkpoint are never used
  implicitly: a run saved on 8 GPUs restores on a 1-CPU laptop. Numpy leaves
  come back as numpy and Python scalars as Python scalars.
* **Typed PRNG keys** (``jax.random.key``, dtype ``key<fry>``) need no special
  handling here: Orbax 0.12 stores a key array as its ``jax.random.key_data``
  (``uint32[..., 2]`` for threefry) and records the key implementation in the
  step's array metadata, then rewraps the data with ``jax.random.wrap_key_data``
  on restore. Restored keys are typed keys of the same implementation,
  bit-identical, on the target's sharding (tested for ``threefry2x32`` and
  ``rbg``). Legacy ``jax.random.PRNGKey`` keys are plain ``uint32[2]`` arrays.
* **Metadata** must be JSON: numpy and jax scalars/arrays are converted to
  Python numbers/lists, and any object with a ``to_dict()`` method (an
  ``ml_collections.ConfigDict``, a :class:`~fedjax_mm.core.ledger.Ledger`) is
  stored as that dict.
* **Verified reads.** A flipped bit in an array file goes unnoticed by Orbax:
  the chunk decodes and the restore returns wrong numbers (tested), which a
  resumed run would train on silently. :meth:`save` therefore records a CRC-32
  of every array leaf's bytes (computed on the host before the save starts)
  and of the JSON document, in the step's ``checksums`` item, written by Orbax
  in the same atomic step. :meth:`restore` and :meth:`restore_metadata` check
  what they read against it and raise :class:`DamagedCheckpointError` on a
  mismatch. CRC-32 detects accidental damage (disk, copy, truncation), not
  tampering, at about 4 GB/s. Steps written before checksums existed (Orbax's
  step metadata lists no ``checksums`` item) are read unverified. An array split over
  several processes' devices along its first axis (the runners' client states in a job of
  several processes, :func:`~fedjax_mm.core.sharding.job_mesh`) gets the CRC-32 of its
  global value without being gathered: each process sums the pieces it holds, the processes
  exchange one number per piece, and the sums are combined in row order (zlib's
  ``crc32_combine``), so a checkpoint saved by several processes records the checksums one
  process saving the same values records, and it verifies on any mesh. An array split
  along another axis is not checksummed. An array replicated over the processes is
  checksummed from each process's own copy.
* **Several processes** (``jax.distributed``): every process calls
  :meth:`~Checkpointer.save` and the restores, as Orbax requires, and Orbax writes
  each array once. An array that lives on this process's devices only (FedMuscle's
  runner computes the whole run in every process, on
  :func:`~fedjax_mm.core.sharding.local_mesh`) is taken to be the same on every
  process: it is saved as one array replicated over the first device of every
  process (Orbax refuses process-local arrays), and a target leaf placed on this
  process only is restored the same way, then copied onto its sharding. Such
  leaves are checksummed and verified like any other. The JSON items are written
  by process 0; renaming a damaged step too, while the others wait.
* **Damaged steps are set aside, never deleted.**
  :meth:`restore_latest_good` tries the steps newest first; a step that fails
  to read (an exception, missing files, a checksum mismatch) is renamed to
  ``<step>.damaged-<timestamp>``, a name Orbax neither lists nor garbage
  collects, with one WARNING line per step, and the run resumes from the
  newest intact step. When no step is intact nothing is renamed and
  :class:`CheckpointError` says so: a relaunch must not silently restart from
  round 0 over a run whose every checkpoint is unreadable.

Typical use (big_vision's order: resume first when the workdir holds a
checkpoint)::

  ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=2)
  abstract = jax.eval_shape(init_fn, rng)          # optionally with shardings
  start = 0
  if (restored := ckpt.restore_latest_good(abstract)) is not None:
    start, state = restored
    meta = ckpt.restore_metadata(start)            # the same step's document
  else:
    state = init_fn(rng)
  for r in range(start, num_rounds):
    state, metrics = round_fn(state, ...)
    ckpt.save(r + 1, state, metadata={"round": r + 1, "ledger": ledger})
  ckpt.close()
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import os
import signal
import sys
import threading
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fedjax_mm.core import processes

__all__ = ["CheckpointError", "Checkpointer", "DamagedCheckpointError"]

_STATE = "state"
_METADATA = "metadata"
_CHECKSUMS = "checksums"
# Longest exception text quoted in a one-line message about a damaged step.
_MAX_REASON_CHARS = 160
# Written by the CheckpointManager into a step directory before it is
# finalised (renamed or committed); its presence marks a complete step.
_STEP_METADATA_FILE = "_CHECKPOINT_METADATA"


_log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
  """No checkpoint can be resumed from; the message is one line and says what to do.

  ``experiments/main.py`` prints it as ``error: ...`` and exits with status 2.
  """


class DamagedCheckpointError(CheckpointError):
  """A step reads back different from what was written (checksum mismatch)."""


def _to_json(obj: Any) -> Any:
  """``json.dumps`` fallback for numpy/jax values and ``to_dict()`` objects."""
  if isinstance(obj, np.generic):
    return obj.item()
  if isinstance(obj, np.ndarray | jax.Array):
    return np.asarray(obj).tolist()
  if callable(getattr(obj, "to_dict", None)):
    return obj.to_dict()
  if isinstance(obj, set | frozenset):
    return sorted(obj)
  raise TypeError(f"Checkpoint metadata must be JSON-serialisable; got {type(obj).__name__}.")


def _is_prng_key(x: Any) -> bool:
  return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _target_sharding(leaf: Any) -> jax.sharding.Sharding | None:
  """The sharding to restore a target leaf onto, or None (uncommitted default)."""
  if isinstance(leaf, jax.Array):
    return leaf.sharding if leaf.committed else None
  return getattr(leaf, "sharding", None)


def _crc32(data: np.ndarray | bytes) -> int:
  if isinstance(data, np.ndarray):
    data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
  return zlib.crc32(data)


def _document_crc32(document: Any) -> int:
  """CRC-32 of a JSON document in canonical form (sorted keys, compact)."""
  return _crc32(json.dumps(document, sort_keys=True, separators=(",", ":")).encode())


def _gf2_apply(matrix: tuple[int, ...], vector: int) -> int:
  """A 32x32 matrix over GF(2), given as its columns, times a 32-bit vector."""
  out = 0
  for column in matrix:
    if not vector:
      break
    if vector & 1:
      out ^= column
    vector >>= 1
  return out


def _gf2_product(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
  """The matrix ``a @ b`` over GF(2), both given as their columns."""
  return tuple(_gf2_apply(a, column) for column in b)


@functools.cache
def _zero_bytes_power(i: int) -> tuple[int, ...]:
  """The CRC register's map for appending ``2**i`` zero bytes."""
  if i == 0:
    bit = (0xEDB88320, *(1 << k for k in range(31)))  # One zero bit.
    two = _gf2_product(bit, bit)
    four = _gf2_product(two, two)
    return _gf2_product(four, four)  # Eight zero bits.
  half = _zero_bytes_power(i - 1)
  return _gf2_product(half, half)


@functools.cache
def _zero_bytes(length: int) -> tuple[int, ...]:
  """The CRC register's map for appending ``length`` zero bytes (cached: the pieces of
  a split array mostly share one length, so each combine is then one product)."""
  operator = tuple(1 << k for k in range(32))  # The identity.
  for i in range(length.bit_length()):
    if length >> i & 1:
      operator = _gf2_product(_zero_bytes_power(i), operator)
  return operator


def _crc32_combine(crc1: int, crc2: int, length2: int) -> int:
  """``zlib.crc32(a + b)`` from ``zlib.crc32(a)``, ``zlib.crc32(b)`` and ``len(b)``.

  zlib's ``crc32_combine``, which Python's ``zlib`` does not expose. Appending a zero
  bit to a message maps the CRC register by a fixed linear map over GF(2) (a shift
  right, the reflected polynomial xored in when the dropped bit was set), and the
  pre- and post-inversion cancel between ``a + b`` and ``b``, so
  ``crc32(a + b) = Z^(8 len(b)) crc32(a) xor crc32(b)``. ``Z`` is raised to that
  power from cached powers of two (:func:`_zero_bytes`).
  """
  return _gf2_apply(_zero_bytes(length2), crc1) ^ crc2


def _row_pieces(x: jax.Array) -> list[tuple[int, int, jax.Device]] | None:
  """The distinct pieces of a split array as ``(first row, end row, device holding it)``,
  in row order, or None when they are not whole rows that tile the first axis.

  Every process computes the same list from the sharding alone; a piece held by
  several devices is attributed to the one with the smallest id.
  """
  if x.ndim == 0:
    return None
  pieces: dict[tuple[int, int], jax.Device] = {}
  for device, index in x.sharding.devices_indices_map(x.shape).items():
    bounds = [s.indices(n)[:2] for s, n in zip(index, x.shape, strict=True)]
    if any(b != (0, n) for b, n in zip(bounds[1:], x.shape[1:], strict=True)):
      return None
    if bounds[0] not in pieces or device.id < pieces[bounds[0]].id:
      pieces[bounds[0]] = device
  rows, ordered = 0, []
  for (start, stop), device in sorted(pieces.items()):
    if start != rows:
      return None
    ordered.append((start, stop, device))
    rows = stop
  return ordered if rows == x.shape[0] else None


def _array_checksums(tree: Any) -> dict[str, dict[str, Any]]:
  """``{keystr(path): {"dtype", "shape", "crc32"}}`` of every array leaf of ``tree``.

  Typed PRNG keys are summed as their key data, Python scalars skipped. An array
  replicated over several processes is summed from this process's copy; one split
  over them along its first axis from its pieces (see the module docstring), with
  one ``process_allgather`` of a number per piece for all such arrays (a collective:
  every process holds the same split arrays, so all of them call it or none); one
  split otherwise is skipped. One ``device_get`` for all local data, so that
  accelerator arrays are copied in parallel.
  """
  order, paths, arrays, split, owned = [], [], [], [], []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    order.append(jax.tree_util.keystr(path))
    if isinstance(leaf, jax.Array):
      if not leaf.is_fully_addressable:
        if not leaf.is_fully_replicated:
          if (pieces := _row_pieces(leaf)) is not None:
            split.append((jax.tree_util.keystr(path), leaf, pieces))
          continue
        leaf = _local_copy(leaf)
      if _is_prng_key(leaf):
        leaf = jax.random.key_data(leaf)
    elif not isinstance(leaf, np.ndarray):
      continue
    paths.append(jax.tree_util.keystr(path))
    arrays.append(leaf)
  offset = 0
  for _, leaf, pieces in split:
    shards = {shard.device: shard.data for shard in leaf.addressable_shards}
    for k, (_, _, device) in enumerate(pieces):
      if device.process_index == jax.process_index():
        data = shards[device]
        owned.append((offset + k, jax.random.key_data(data) if _is_prng_key(data) else data))
    offset += len(pieces)
  host = jax.device_get(arrays + [data for _, data in owned])
  checksums = {
    path: {"dtype": str(x.dtype), "shape": list(x.shape), "crc32": _crc32(np.asarray(x))}
    for path, x in zip(paths, host[: len(arrays)], strict=True)
  }
  if split:
    sums = np.zeros(offset, np.uint32)
    for (k, _), x in zip(owned, host[len(arrays) :], strict=True):
      sums[k] = _crc32(np.asarray(x))
    table = np.asarray(multihost_utils.process_allgather(sums))  # [processes, pieces]
    offset = 0
    for path, leaf, pieces in split:
      data = jax.eval_shape(jax.random.key_data, leaf) if _is_prng_key(leaf) else leaf
      row_bytes = data.dtype.itemsize * int(np.prod(data.shape[1:], dtype=np.int64))
      crc = 0  # zlib.crc32(b"")
      for k, (start, stop, device) in enumerate(pieces):
        piece = int(table[device.process_index, offset + k])
        crc = _crc32_combine(crc, piece, (stop - start) * row_bytes)
      checksums[path] = {"dtype": str(data.dtype), "shape": list(data.shape), "crc32": crc}
      offset += len(pieces)
  return {path: checksums[path] for path in order if path in checksums}  # In tree order.


def _reason(error: BaseException) -> str:
  """One short line about why a step could not be read."""
  text = " ".join(str(error).split())
  if len(text) > _MAX_REASON_CHARS:
    text = text[: _MAX_REASON_CHARS - 3] + "..."
  return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _quiet_closed_loop_noise() -> None:
  """Drops the "Event loop is closed" errors that follow a failed Orbax read.

  Orbax runs each read in a fresh asyncio loop and closes it as soon as one
  TensorStore read fails; the reads still in flight then complete into the
  closed loop, and Python prints each ``RuntimeError('Event loop is closed')``
  through ``sys.unraisablehook`` as a traceback, at random moments up to exit.
  They carry no information (the failure itself is raised), so from the first
  restore on this process ignores exactly that error (installed before the
  read, as the orphans may fail while the first error is still propagating);
  every other unraisable exception still reaches the previous hook. asyncio's
  "exception was never retrieved" records of the same orphans are filtered by
  :func:`_drop_orphaned_orbax_reads`.
  """
  if getattr(sys.unraisablehook, "_drops_closed_loop_noise", False):
    return
  previous = sys.unraisablehook

  def hook(unraisable):
    error = unraisable.exc_value
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
      return
    previous(unraisable)

  hook._drops_closed_loop_noise = True
  sys.unraisablehook = hook
  logging.getLogger("asyncio").addFilter(_drop_orphaned_orbax_reads)


def _drop_orphaned_orbax_reads(record: logging.LogRecord) -> bool:
  """Filters asyncio's "... exception was never retrieved" for Orbax reads.

  When one read of a damaged step fails, Orbax abandons its sibling reads; those
  that fail too are garbage-collected with their exception unread, and asyncio
  logs each (an Orbax task with its traceback, or a bare TensorStore future) at
  random moments up to exit. The failure was already raised and reported in one
  line, so only records whose exception was raised inside Orbax or carries a
  TensorStore spec are dropped; any other task's stays.
  """
  message = record.getMessage()
  if not message.partition("\n")[0].endswith("exception was never retrieved"):
    return True
  error = record.exc_info[1] if record.exc_info else None
  if error is None:
    return True
  if "tensorstore_spec" in str(error):
    return False
  tb = error.__traceback__
  while tb is not None:
    if "orbax" in tb.tb_frame.f_code.co_filename:
      return False
    tb = tb.tb_next
  return True


def _close_manager(manager: ocp.CheckpointManager) -> None:
  """Closes ``manager`` once the clean-up it started on opening has finished.

  A manager opened with ``cleanup_tmp_directories`` scans the root for unfinished
  folders in a background thread, and its ``close()`` does not wait for that
  thread (orbax-checkpoint 0.12.8). A process that exits first, e.g. after
  a few refused restores each reopened a manager, has the thread fail at interpreter
  shutdown ("cannot schedule new futures after shutdown") with a traceback.
  """
  cleanup = getattr(manager, "_cleanup_tmp_directory_future", None)
  try:
    if cleanup is not None:
      cleanup.result()
  finally:
    manager.close()


@contextlib.contextmanager
def _signals_held():
  """Holds SIGTERM and SIGINT back until the block ends, then delivers them.

  ``CheckpointManager.save`` creates ``<step>.orbax-checkpoint-tmp`` and then
  hands the write to its background thread. A signal whose handler raises
  (``KeyboardInterrupt``, a runner's stop exception) in between would abandon the
  folder: the save never finishes, and :meth:`Checkpointer.close` has nothing to
  wait for. Held back, the signal is raised once the save is in flight, so the
  close that the unwinding runs finishes it. Python runs signal handlers in the
  main thread only; elsewhere the block runs as it is.
  """
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  held: list[int] = []
  previous = {}
  for signum in (signal.SIGTERM, signal.SIGINT):
    handler = signal.getsignal(signum)
    if callable(handler):  # Not SIG_DFL, SIG_IGN or a handler installed outside Python.
      previous[signum] = handler
      signal.signal(signum, lambda s, frame: held.append(s))
  try:
    yield
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)
    for signum in dict.fromkeys(held):
      signal.raise_signal(signum)


def _process_local(sharding: jax.sharding.Sharding | None) -> bool:
  """Whether a leaf on ``sharding`` (None: not placed yet) lives on this process only, in a job
  of several processes: a value every process holds alike, which Orbax cannot write as it is."""
  return jax.process_count() > 1 and (sharding is None or sharding.is_fully_addressable)


def _over_processes() -> NamedSharding:
  """Replicated over the first device of every process: one copy per process."""
  devices = [jax.local_devices(process_index=p)[0] for p in range(jax.process_count())]
  return NamedSharding(Mesh(np.array(devices), ("processes",)), P())


def _lift(leaf: Any) -> Any:
  """A process-local array as one array over every process (see the module docstring)."""
  if not isinstance(leaf, jax.Array) or not _process_local(leaf.sharding):
    return leaf
  if _is_prng_key(leaf):
    return jax.random.wrap_key_data(
      _lift(jax.random.key_data(leaf)), impl=jax.random.key_impl(leaf)
    )
  local = jax.device_put(leaf, jax.local_devices()[0])
  return jax.make_array_from_single_device_arrays(leaf.shape, _over_processes(), [local])


def _local_copy(x: jax.Array) -> jax.Array:
  """Inverse of :func:`_lift`: this process's copy of an array replicated over processes."""
  if _is_prng_key(x):
    return jax.random.wrap_key_data(
      _local_copy(jax.random.key_data(x)), impl=jax.random.key_impl(x)
    )
  return x.addressable_data(0)


def _uncommit(x: jax.Array) -> jax.Array:
  """Re-creates ``x`` as an uncommitted array on the default device.

  Arrays restored by Orbax are committed to the sharding they were read onto;
  an uncommitted copy behaves like a freshly built array, which ``jit`` may move
  next to state that lives on a mesh.
  """
  if _is_prng_key(x):
    impl = jax.random.key_impl(x)
    return jax.random.wrap_key_data(_uncommit(jax.random.key_data(x)), impl=impl)
  return jnp.asarray(np.asarray(x))


class Checkpointer:
  """Saves and restores the federated state pytree with Orbax.

  A thin wrapper around ``orbax.checkpoint.CheckpointManager`` that fixes the
  layout (one pytree item plus one JSON item per step), reports only finalised
  steps, and restores onto a target's structure and shardings. See the module
  docstring for the guarantees.

  Args:
    directory: root directory of the checkpoints (created if missing). Local
      paths are made absolute; ``gs://`` style paths are used as given.
    max_to_keep: number of most recent steps kept on disk; older ones are
      deleted after each successful save. ``None`` keeps all.
    save_interval_steps: :meth:`save` writes only steps that are multiples of
      this (unless ``force=True``).
  """

  def __init__(
    self,
    directory: str | os.PathLike[str],
    *,
    max_to_keep: int | None = 2,
    save_interval_steps: int = 1,
  ):
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}.")
    if save_interval_steps < 1:
      raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}.")
    directory = os.fspath(directory)
    if "://" not in directory:
      directory = os.path.abspath(directory)
    self._directory = epath.Path(directory)
    self._options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep,
      save_interval_steps=save_interval_steps,
      cleanup_tmp_directories=True,
      create=True,
    )
    self._manager = self._open()

  def _open(self) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
      self._directory, options=self._options, item_names=(_STATE, _METADATA, _CHECKSUMS)
    )

  def _reopen(self) -> None:
    """A fresh manager: after a failed read, or after steps moved under the old one.

    The manager caches the steps it saw when it opened; one that still listed a
    step set aside would skip saving that step again (``should_save`` refuses
    steps at or below its latest) and try to garbage collect a missing folder.
    """
    try:
      _close_manager(self._manager)
    except Exception as e:  # A manager that failed a read may fail to close too.
      _log.info("closing the checkpoint manager after a failure: %s", _reason(e))
    self._manager = self._open()

  @property
  def directory(self) -> epath.Path:
    """The root checkpoint directory."""
    return self._directory

  def save(
    self,
    step: int,
    state: Any,
    *,
    metadata: dict[str, Any] | None = None,
    force: bool = False,
  ) -> bool:
    """Starts saving ``state`` (and ``metadata``) as ``step``.

    Returns once the arrays are copied to host memory and checksummed (see
    the module docstring); the write finishes in the background (see
    :meth:`wait`). Errors of a previous background save are raised here.

    Args:
      step: the step number, usually the number of completed rounds.
      state: any pytree of arrays (jax, numpy, typed PRNG keys), Python
        scalars and empty nodes (``None``, optax ``EmptyState``).
      metadata: JSON document stored beside the state (see the module
        docstring for the conversions applied). ``None`` stores ``{}``.
      force: save even if ``step`` is not a multiple of ``save_interval_steps``.

    Returns:
      Whether a save was started (``False`` when skipped by the interval).

    Raises:
      TypeError: if ``metadata`` is not JSON-serialisable.
    """
    # Serialise now, not in the background thread, so that a bad document
    # fails loudly here and later mutation of ``metadata`` cannot race.
    document = json.loads(json.dumps(metadata or {}, default=_to_json))
    if not force and not self._manager.should_save(int(step)):
      return False  # Skipped by the interval: spare the checksums' host copy.
    checksums = {
      "algorithm": "crc32",
      _STATE: _array_checksums(state),
      _METADATA: _document_crc32(document),
    }
    with _signals_held():
      return self._manager.save(
        int(step),
        args=ocp.args.Composite(
          **{
            _STATE: ocp.args.StandardSave(jax.tree.map(_lift, state)),
            _METADATA: ocp.args.JsonSave(document),
            _CHECKSUMS: ocp.args.JsonSave(checksums),
          }
        ),
        force=force,
      )

  def all_steps(self) -> list[int]:
    """The finalised steps on disk, in increasing order."""
    steps = []
    for step in self._manager.all_steps():
      if (self._directory / str(step) / _STEP_METADATA_FILE).exists():
        steps.append(int(step))
    return sorted(steps)

  def latest_step(self) -> int | None:
    """The most recent finalised step, or ``None`` if there is none.

    A save still being written is not reported until it is finalised (call
    :meth:`wait` first to include it).
    """
    steps = self.all_steps()
    return steps[-1] if steps else None

  def _resolve_step(self, step: int | None) -> int:
    self.wait()  # A step being written (or garbage collected) is never read.
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"No finalised checkpoint in {self._directory}.")
    elif int(step) not in self.all_steps():
      raise FileNotFoundError(
        f"No finalised checkpoint for step {step} in {self._directory}; "
        f"available: {self.all_steps()}."
      )
    return int(step)

  def restore(self, target: Any, step: int | None = None) -> Any:
    """Restores a saved state into the structure and shardings of ``target``.

    Args:
      target: a pytree with the structure of the saved state: the output of
        ``jax.eval_shape(init_fn, ...)`` (optionally with shardings on its
        ``ShapeDtypeStruct`` leaves) or a concrete state. Shapes and dtypes
        must match the checkpoint.
      step: the step to restore; ``None`` means :meth:`latest_step`.

    Returns:
      A pytree with the tree structure of ``target``: array leaves restored
      onto the target leaf's sharding, or uncommitted on the default device
      when the target leaf has none (see the module docstring).

    Raises:
      FileNotFoundError: if there is no such finalised step.
      DamagedCheckpointError: an array reads back with another checksum,
        shape or dtype than it was saved with.
      Exception: whatever Orbax raises for files it cannot read.
    """
    step = self._resolve_step(step)
    _quiet_closed_loop_noise()  # Before the read: its orphans may fail at once.
    expected = self._read_checksums(step)
    restored = self._restore_state(step, target)
    if expected is not None:
      actual = _array_checksums(restored)
      for path, want in expected[_STATE].items():
        got = actual.get(path)
        if got is not None and got != want:
          raise DamagedCheckpointError(
            f"array {path} of step {step} reads back as {got['dtype']}{got['shape']} with "
            f"crc32 {got['crc32']}, saved as {want['dtype']}{want['shape']} with crc32 {want['crc32']}"
          )
    return restored

  def _read_checksums(self, step: int) -> dict[str, Any] | None:
    """The step's checksums, or None for a step saved before they existed.

    Orbax's step metadata names the items a step was saved with, so a step
    that had checksums and lost them is damaged, not taken for an old one.
    """
    step_metadata = json.loads((self._directory / str(step) / _STEP_METADATA_FILE).read_text())
    items = step_metadata.get("item_handlers")
    if not isinstance(items, dict) or _CHECKSUMS not in items:
      return None
    args = ocp.args.Composite(**{_CHECKSUMS: ocp.args.JsonRestore()})
    return dict(self._manager.restore(step, args=args)[_CHECKSUMS])

  def _restore_state(self, step: int, target: Any) -> Any:
    def abstract(leaf):
      if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
        sharding = _target_sharding(leaf)
        if _process_local(sharding):
          sharding = _over_processes()  # As saved (_lift); made local again in finish.
        elif sharding is None:
          sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
      return leaf

    restored = self._manager.restore(
      step,
      args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(jax.tree.map(abstract, target))}),
    )[_STATE]

    def finish(leaf, value):
      if not isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
        return value
      sharding = _target_sharding(leaf)
      if _process_local(sharding):
        value = _local_copy(value)
        return _uncommit(value) if sharding is None else jax.device_put(value, sharding)
      return _uncommit(value) if sharding is None else value

    return jax.tree.map(finish, target, restored)

  def restore_metadata(self, step: int | None = None) -> dict[str, Any]:
    """The JSON metadata saved with ``step`` (default: the latest finalised step).

    Raises:
      FileNotFoundError: if there is no such finalised step.
      DamagedCheckpointError: the document reads back with another checksum.
    """
    step = self._resolve_step(step)
    _quiet_closed_loop_noise()
    expected = self._read_checksums(step)
    restored = self._manager.restore(
      step, args=ocp.args.Composite(**{_METADATA: ocp.args.JsonRestore()})
    )
    document = dict(restored[_METADATA])
    if expected is not None and _document_crc32(document) != expected[_METADATA]:
      raise DamagedCheckpointError(f"the metadata of step {step} does not match its checksum")
    return document

  def restore_latest_good(self, target: Any) -> tuple[int, Any] | None:
    """Restores the newest step that reads back intact; sets newer, damaged ones aside.

    Steps are tried newest first. A step is intact when its state restores into
    ``target`` (:meth:`restore`, checksums verified) and its metadata reads back
    (:meth:`restore_metadata`, verified too). Every newer step that failed is
    renamed to ``<step>.damaged-<YYYYmmdd-HHMMSS>`` in the same directory (never
    deleted; Orbax ignores the name), with one WARNING line each::

      checkpoint of round 3 is damaged (DamagedCheckpointError: ...); set aside as
      <dir>/3.damaged-20250101-120000; resuming from round 2

    so that the run's next saves may write those steps again.

    Args:
      target: as for :meth:`restore`.

    Returns:
      ``(step, state)`` of the newest intact step (read its metadata with
      ``restore_metadata(step)``), or None when there is no finalised step.

    Raises:
      CheckpointError: there are steps and none is intact. Nothing is renamed
        then: the message lists each step's failure and leaves the decision to
        the user (a relaunch would otherwise restart from round 0 unasked).
    """
    self.wait()
    failures: list[tuple[int, str]] = []
    for step in reversed(self.all_steps()):
      try:
        state = self.restore(target, step)
        self.restore_metadata(step)
      except Exception as e:  # Whatever the cause, this step cannot be resumed from.
        failures.append((step, _reason(e)))
        self._reopen()
        continue
      if failures:
        if processes.is_primary():  # One rename per step; the others wait for it.
          for bad, reason in failures:
            aside = self._set_aside(bad)
            _log.warning(
              "checkpoint of round %d is damaged (%s); set aside as %s; resuming from round %d",
              bad,
              reason,
              aside,
              step,
            )
        processes.sync("fedjax_mm_checkpoint_set_aside")
        self._reopen()
      return step, state
    if not failures:
      return None
    listed = "; ".join(f"round {s}: {reason}" for s, reason in failures)
    raise CheckpointError(
      f"no intact checkpoint in {self._directory} ({listed}); nothing was moved: "
      f"to start the run again from round 0, move {self._directory} aside."
    )

  def _set_aside(self, step: int) -> epath.Path:
    """Renames a step's folder to a free ``<step>.damaged-<timestamp>[-n]`` and returns it."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    aside = self._directory / f"{step}.damaged-{stamp}"
    n = 2
    while aside.exists():
      aside = self._directory / f"{step}.damaged-{stamp}-{n}"
      n += 1
    (self._directory / str(step)).rename(aside)
    return aside

  def wait(self) -> None:
    """Blocks until every started save is finalised on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager's resources."""
    _close_manager(self._manager)

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()
