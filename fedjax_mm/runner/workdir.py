"""The experiment workdir: one folder per run, its config, and the resume decision.

A run owns one *workdir*. Everything it produces lives there: ``config.json``
(the exact configuration, written once at the start), ``metrics.jsonl`` and
``tb/`` (:mod:`fedjax_mm.runner.writers`), Orbax checkpoints and the final
report. :func:`prepare_workdir` is called once, before anything else is
written, and decides between three outcomes:

============================================  ==========================================
state of ``<workdir>``                        outcome
============================================  ==========================================
missing, or an empty folder                   create it, write ``config.json``; fresh run
holds a ``config.json`` equal to ``config``   resume (nothing is written)
holds a different ``config.json``             :class:`WorkdirError`; with ``overwrite``:
                                              move it aside, fresh run
non-empty folder without ``config.json``      :class:`WorkdirError`; with ``overwrite``:
                                              move it aside, fresh run
a file, not a folder                          :class:`WorkdirError` (even with ``overwrite``)
============================================  ==========================================

Design choices:

* **Resume is decided by the config, not by the command line.** Relaunching the
  same command after a crash or a preemption continues the run (big_vision's
  order: resume first when the workdir already holds state); this holds even
  when ``overwrite=True``, so a preemptible job launched with ``--overwrite``
  does not restart from scratch at every relaunch. To restart a run with an
  unchanged config, move or delete its workdir, or choose another.
* **Configs are compared canonically.** Both sides go through JSON with sorted
  keys, so key order and tuple-versus-list (``(1, 2)`` and ``[1, 2]``) do not
  matter, while ``1`` versus ``1.0`` and ``"1"`` versus ``1`` do.
* **Nothing is ever deleted.** ``overwrite=True`` renames the old workdir to
  ``<workdir>.old-<YYYYmmdd-HHMMSS>`` (with a ``-2``, ``-3`` ... suffix if that
  name is taken) and starts a fresh one; the caller can delete the old folder
  when it is sure. Errors are one line and say which flag to pass.
* **Atomic config write.** ``config.json`` is written to a temporary file and
  renamed, so a crash never leaves a half-written config that would block the
  next launch.
* **One run per workdir.** :func:`lock_workdir` holds ``<workdir>/.lock``
  (created with ``O_CREAT | O_EXCL``, so exactly one process wins) for the
  whole run. Two runs writing one workdir would interleave ``metrics.jsonl``
  and race on the checkpoints; the second launch is refused in one line before
  it writes anything. A lock whose process has died (killed, preempted, the
  machine rebooted) is taken over, so a relaunch after a crash needs no manual
  cleanup. :func:`prepare_workdir` does not count the lock as content, and
  with ``overwrite`` the lock of this process stays with the workdir's name,
  not with the folder moved aside.

* **One writer per job.** In a job of several processes (``jax.distributed``)
  :func:`claim_workdir` takes the lock and prepares the workdir on process 0
  only, and tells every process whether the run resumes (or that process 0
  refused the workdir: then every process raises :class:`WorkdirError`).

This module is host-side bookkeeping and imports neither jax nor numpy, except
:func:`claim_workdir`, which imports :mod:`fedjax_mm.core.processes` when called.

Typical use::

  config_dict = config.to_dict()            # ml_collections.ConfigDict -> dict
  with claim_workdir(workdir, config_dict, overwrite=FLAGS.overwrite) as resumed:
    if resumed:                             # after validation, before any write
      ...  # restore the latest checkpoint, if any (a crash may precede the first one)
    ...  # the whole run

which, with one process, is::

  with lock_workdir(workdir):
    resumed = prepare_workdir(workdir, config_dict, overwrite=FLAGS.overwrite)
    ...
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = [
  "CONFIG_FILE",
  "LOCK_FILE",
  "WorkdirError",
  "claim_workdir",
  "config_diff",
  "lock_workdir",
  "prepare_workdir",
]

#: Name of the config file inside a workdir.
CONFIG_FILE = "config.json"
#: Name of the lock file inside a workdir (see :func:`lock_workdir`).
LOCK_FILE = ".lock"

# How many differing keys a WorkdirError names before "... and N more".
_MAX_KEYS_IN_MESSAGE = 3
# Longest rendering of one value in a diff line; longer values are cut.
_MAX_VALUE_CHARS = 60

_MISSING = object()

# A lock file is created empty and then filled in; a reader that finds it empty
# waits this long for the content before calling it unreadable.
_LOCK_READ_PATIENCE_S = 1.0
# Lost races (another process took a stale lock first) before giving up.
_LOCK_ATTEMPTS = 5

_log = logging.getLogger(__name__)


class WorkdirError(ValueError):
  """The workdir cannot be used as asked; the message says why and what to do."""


def _canonical(config: Any) -> str:
  """Returns the canonical JSON text of ``config`` (sorted keys, compact).

  Raises:
    TypeError: if ``config`` is not JSON-serialisable.
  """
  try:
    return json.dumps(config, sort_keys=True, separators=(",", ":"))
  except (TypeError, ValueError) as e:
    raise TypeError(
      f"config must be a JSON-serialisable mapping (pass ConfigDict.to_dict()): {e}"
    ) from e


def _render(value: Any) -> str:
  """Renders one config value for a diff line (JSON, cut to a readable length)."""
  if value is _MISSING:
    return "<missing>"
  text = json.dumps(value, sort_keys=True)
  if len(text) > _MAX_VALUE_CHARS:
    text = text[: _MAX_VALUE_CHARS - 3] + "..."
  return text


def config_diff(a: Any, b: Any) -> list[str]:
  """Lists the differences between two configs as ``"dotted.key: a != b"`` lines.

  Nested mappings are walked key by key; any other value (lists included) is
  compared whole, after both sides go through JSON, so tuples equal lists. A
  key present on one side only shows ``<missing>`` on the other. Values are
  printed as JSON (strings quoted), long ones cut to about 60 characters.

  Example:
    >>> config_diff({"muscle": {"tau_full": 0.2}, "seed": 0},
    ...             {"muscle": {"tau_full": 0.3}, "seed": 0})
    ['muscle.tau_full: 0.2 != 0.3']

  Args:
    a: a JSON-serialisable config, usually a nested dict (the one on disk).
    b: another one (the one of this run).

  Returns:
    One line per differing leaf, sorted by key; empty when the configs are
    canonically equal. Differing non-mapping roots give one line keyed
    ``<root>``.
  """
  a = json.loads(_canonical(a))
  b = json.loads(_canonical(b))
  lines: list[str] = []

  def walk(x: Any, y: Any, prefix: str) -> None:
    if isinstance(x, dict) and isinstance(y, dict):
      for key in sorted(set(x) | set(y)):
        path = f"{prefix}.{key}" if prefix else str(key)
        walk(x.get(key, _MISSING), y.get(key, _MISSING), path)
    elif x is _MISSING or y is _MISSING or _canonical(x) != _canonical(y):
      lines.append(f"{prefix or '<root>'}: {_render(x)} != {_render(y)}")

  walk(a, b, "")
  return lines


def _aside_name(workdir: Path) -> Path:
  """Returns a free sibling path ``<workdir>.old-<timestamp>[-n]``."""
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  candidate = workdir.with_name(f"{workdir.name}.old-{stamp}")
  n = 2
  while candidate.exists() or candidate.is_symlink():
    candidate = workdir.with_name(f"{workdir.name}.old-{stamp}-{n}")
    n += 1
  return candidate


def _refuse_file(workdir: Path) -> None:
  if workdir.exists() and not workdir.is_dir():
    raise WorkdirError(f"--workdir {workdir} is a file, not a folder; choose another --workdir.")


def _carry_own_lock(aside: Path, workdir: Path) -> None:
  """Moves this process's lock from the folder just moved aside back into ``workdir``.

  ``os.link`` fails if ``workdir/.lock`` exists, so a process that locked the
  new folder in the instant it did not exist keeps it and this run stops.
  """
  holder = _read_lock(aside / LOCK_FILE, patience_s=0.0)
  if not holder or holder.get("pid") != os.getpid() or holder.get("host") != socket.gethostname():
    return
  try:
    os.link(aside / LOCK_FILE, workdir / LOCK_FILE)
  except FileExistsError:
    raise WorkdirError(
      f"--workdir {workdir} was locked by another run while its old content moved to {aside}; "
      "choose another --workdir."
    ) from None
  (aside / LOCK_FILE).unlink()


def _write_config(workdir: Path, text: str) -> None:
  """Writes ``config.json`` atomically (temporary file, then rename)."""
  target = workdir / CONFIG_FILE
  tmp = workdir / f".{CONFIG_FILE}.tmp"
  tmp.write_text(text + "\n", encoding="utf-8")
  os.replace(tmp, target)


def prepare_workdir(
  workdir: str | os.PathLike[str], config: Mapping[str, Any], *, overwrite: bool = False
) -> bool:
  """Creates or checks a run's workdir and tells whether the run resumes.

  See the module docstring for the full table. In short: a missing or empty
  folder starts a fresh run; a folder whose ``config.json`` equals ``config``
  (canonically: key order and tuple-versus-list ignored) resumes, whatever
  ``overwrite`` says; anything else is refused, unless ``overwrite=True``, in
  which case the old folder is **moved aside** to
  ``<workdir>.old-<YYYYmmdd-HHMMSS>`` (never deleted) and a fresh run starts.
  ``.lock`` (:func:`lock_workdir`) is not content: a folder holding only it
  counts as empty, and a lock of this process stays in ``workdir``.

  Args:
    workdir: the run's folder; parents are created as needed.
    config: the run's config as a plain JSON-serialisable mapping (for an
      ``ml_collections.ConfigDict``, pass ``config.to_dict()``).
    overwrite: move a conflicting workdir aside instead of refusing it.

  Returns:
    True when this is a resume (``config.json`` already there and equal), in
    which case nothing was written; False for a fresh run, in which case
    ``<workdir>/config.json`` now holds ``config`` (sorted keys, indent 2).

  Raises:
    WorkdirError: ``workdir`` is a file; or it holds a different config (the
      message names the first differing dotted keys); or it is a non-empty
      folder without ``config.json``, or with an unreadable one. The last two
      are lifted by ``overwrite=True``; a file never is.
    TypeError: ``config`` is not JSON-serialisable.
  """
  workdir = Path(workdir).expanduser()
  canonical = _canonical(config)
  pretty = json.dumps(json.loads(canonical), sort_keys=True, indent=2)

  _refuse_file(workdir)

  if workdir.is_dir() and any(p.name != LOCK_FILE for p in workdir.iterdir()):
    config_path = workdir / CONFIG_FILE
    problem: str
    if config_path.is_file():
      try:
        stored = json.loads(config_path.read_text(encoding="utf-8"))
      except (OSError, ValueError) as e:
        problem = f"holds an unreadable {CONFIG_FILE} ({type(e).__name__}: {e})"
      else:
        if _canonical(stored) == canonical:
          return True
        diff = config_diff(stored, config)
        shown = "; ".join(diff[:_MAX_KEYS_IN_MESSAGE])
        more = len(diff) - _MAX_KEYS_IN_MESSAGE
        if more > 0:
          shown += f"; ... and {more} more"
        problem = f"holds a run with a different config (stored != this run: {shown})"
    else:
      problem = f"is not empty and has no {CONFIG_FILE}, so it is not a run of this library"
    if not overwrite:
      raise WorkdirError(
        f"--workdir {workdir} {problem}; pass --overwrite to move it aside and start "
        "afresh, or choose another --workdir."
      )
    aside = _aside_name(workdir)
    workdir.rename(aside)
    workdir.mkdir(parents=True)
    _carry_own_lock(aside, workdir)

  workdir.mkdir(parents=True, exist_ok=True)
  _write_config(workdir, pretty)
  return False


# ---------------------------------------------------------------------------
# The workdir lock


def _process_start(pid: int) -> int | None:
  """The start time of process ``pid`` in clock ticks since boot, or None (not Linux).

  A pid alone names a process only while it lives: after a crash and a reboot,
  the dead run's pid may belong to an unrelated process. The pair (pid, start
  time) does not recur.
  """
  try:
    stat = Path(f"/proc/{pid}/stat").read_text()
  except OSError:
    return None
  # Fields after the command name, which may itself hold spaces and parentheses.
  fields = stat[stat.rindex(")") + 2 :].split()
  return None if fields[0] == "Z" else int(fields[19])  # state, ..., starttime (field 22)


def _is_alive(holder: Mapping[str, Any]) -> bool:
  """Whether the process recorded in a lock may still run (True when unsure)."""
  if holder.get("host") != socket.gethostname():
    return True  # Another machine's processes cannot be checked from here.
  pid = holder.get("pid")
  if not isinstance(pid, int) or pid <= 0:
    return True
  try:
    os.kill(pid, 0)  # Signal 0: only checks that the process exists.
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # It exists, under another user.
  if Path("/proc").is_dir() and Path(f"/proc/{pid}").is_dir():
    start = _process_start(pid)
    if start is None:  # A zombie: it has exited, its parent has not reaped it yet.
      return False
    return holder.get("start") in (None, start)
  return True


def _read_lock(path: Path, *, patience_s: float = _LOCK_READ_PATIENCE_S) -> dict[str, Any] | None:
  """The lock's record, None if there is no lock; ``{}`` if it stays unreadable."""
  deadline = time.monotonic() + patience_s
  while True:
    try:
      text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
      return None
    try:
      record = json.loads(text)
      if isinstance(record, dict):
        return record
    except ValueError:
      pass
    # Empty or partial: its creator may be writing it right now.
    if time.monotonic() >= deadline:
      return {}
    time.sleep(0.05)


def _create_lock(path: Path, record: Mapping[str, Any]) -> bool:
  """Creates ``path`` holding ``record`` if it does not exist (atomically); False if it does."""
  try:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
  except FileExistsError:
    return False
  with os.fdopen(fd, "w", encoding="utf-8") as f:
    json.dump(record, f)
    f.write("\n")
  return True


def _take_over(path: Path, stale: Mapping[str, Any], token: str) -> None:
  """Removes the stale lock ``stale`` at ``path``, unless another process replaced it.

  Two relaunches may find the same stale lock. Each renames it to a name of its
  own (atomic: one wins) and deletes it only if it is still the stale record; a
  fresh lock grabbed by mistake (created by the winner meanwhile) is linked
  back, then both race again on ``O_EXCL``.
  """
  grabbed = path.with_name(f"{LOCK_FILE}.stale-{token}")
  try:
    os.rename(path, grabbed)
  except FileNotFoundError:
    return  # Someone else removed it first.
  if _read_lock(grabbed, patience_s=0.0) != stale:
    with contextlib.suppress(FileExistsError):
      os.link(grabbed, path)
  grabbed.unlink()


@contextlib.contextmanager
def lock_workdir(workdir: str | os.PathLike[str]) -> Iterator[Path]:
  """Holds ``<workdir>/.lock`` for the duration of a ``with`` block: one run per workdir.

  The lock is a file created with ``O_CREAT | O_EXCL`` (atomic on local and
  NFSv3+ file systems) holding this process's pid, host name, start time and a
  random token. Take it after validating the config and before
  :func:`prepare_workdir`, so that a refused launch writes nothing, and hold it
  until the run has written its last file. The workdir (and its parents) is
  created if missing.

  A lock held by a live process refuses at once. A lock whose process is gone
  (same host, pid absent or a zombie, or a pid reused by a process that started
  later) is taken over with an INFO log line. A lock from another host is
  never taken over: its process cannot be checked from here.

  Args:
    workdir: the run's folder.

  Yields:
    ``workdir`` as a :class:`~pathlib.Path`.

  Raises:
    WorkdirError: ``workdir`` is a file, or cannot be created or written (a
      parent is a file, no permission, a read-only file system); or another live
      process holds it (the message names the pid and host and says what to do);
      or its lock file is unreadable.
  """
  workdir = Path(workdir).expanduser()
  _refuse_file(workdir)
  try:
    workdir.mkdir(parents=True, exist_ok=True)
  except OSError as e:  # A parent is a file, a read-only file system, no permission.
    raise WorkdirError(
      f"--workdir {workdir} cannot be created ({e.strerror or e}); choose another --workdir."
    ) from e
  path = workdir / LOCK_FILE
  token = uuid.uuid4().hex
  record = {
    "pid": os.getpid(),
    "host": socket.gethostname(),
    "start": _process_start(os.getpid()),
    "since": datetime.datetime.now().isoformat(timespec="seconds"),
    "token": token,
  }
  for _ in range(_LOCK_ATTEMPTS):
    try:
      created = _create_lock(path, record)
    except OSError as e:  # Not FileExistsError: _create_lock answers that with False.
      raise WorkdirError(
        f"--workdir {workdir}: its lock {path} cannot be written ({e.strerror or e}); "
        "choose another --workdir."
      ) from e
    if created:
      break
    holder = _read_lock(path)
    if holder is None:
      continue  # Released between our attempt and the read.
    if not holder:
      raise WorkdirError(
        f"--workdir {workdir} holds an unreadable lock file {path}; if no run is using this "
        "workdir, delete that file, or choose another --workdir."
      )
    if _is_alive(holder):
      pid, host = holder.get("pid"), holder.get("host")
      remedy = (
        "wait for that run to end or stop it"
        if host == socket.gethostname()
        else f"if that run is over, delete {path}"
      )
      raise WorkdirError(
        f"--workdir {workdir} is in use by pid {pid} on host {host} "
        f"(since {holder.get('since')}); {remedy}, or choose another --workdir."
      )
    _log.info(
      "workdir %s: taking over the lock of pid %s, which is no longer running",
      workdir,
      holder.get("pid"),
    )
    _take_over(path, holder, token)
  else:
    raise WorkdirError(f"--workdir {workdir}: other runs keep taking its lock; try again.")
  try:
    yield workdir
  finally:
    # Only our own lock: never one that replaced it (e.g. after a manual delete).
    if (_read_lock(path, patience_s=0.0) or {}).get("token") == token:
      path.unlink()


@contextlib.contextmanager
def claim_workdir(
  workdir: str | os.PathLike[str], config: Mapping[str, Any], *, overwrite: bool = False
) -> Iterator[bool]:
  """:func:`lock_workdir` and :func:`prepare_workdir`, for a job of one or more processes.

  Process 0 holds the lock for the ``with`` block and prepares the workdir; the
  other processes touch nothing and learn its outcome
  (:func:`fedjax_mm.core.processes.broadcast`), so that every process resumes,
  or starts afresh, or stops, together. With one process this is exactly
  ``with lock_workdir(workdir): resumed = prepare_workdir(...)``. Every process
  of the job must call it.

  Args:
    workdir: the run's folder.
    config: as for :func:`prepare_workdir`.
    overwrite: as for :func:`prepare_workdir`.

  Yields:
    Whether the run resumes (:func:`prepare_workdir`'s result on process 0).

  Raises:
    WorkdirError: on process 0, from :func:`lock_workdir` or
      :func:`prepare_workdir`; on the other processes, when process 0 raised
      anything there (its error says why).
    TypeError: on process 0, ``config`` is not JSON-serialisable.
  """
  from fedjax_mm.core import processes  # Lazy: the rest of this module needs no jax.

  if not processes.is_primary():
    outcome = processes.broadcast(0)
    if outcome < 0:
      raise WorkdirError(f"--workdir {workdir}: process 0 could not claim it (see its error).")
    yield bool(outcome)
    return
  outcome = -1  # What the others hear if the lock or the preparation raises.
  with contextlib.ExitStack() as stack:
    try:
      stack.enter_context(lock_workdir(workdir))
      resumed = prepare_workdir(workdir, config, overwrite=overwrite)
      outcome = int(resumed)
    finally:
      processes.broadcast(outcome)
    yield resumed
