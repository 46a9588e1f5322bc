r"""Runs an experiment from a config file.

  python -m experiments.main --config=experiments/fedmuscle.py [--workdir=runs/fedmuscle] [--overwrite]

The loop lives in the library (``fedjax_mm.runner.loop``); this file only
parses flags and picks the experiment by the config file's name
(``fedjax_mm.runner.EXPERIMENTS``). A bad config or workdir is reported in one
line on stderr with exit status 2, before any compilation; so are a run that
produced NaN/Inf, a workdir whose checkpoints are all damaged, a bad
combination of the flags below, and a bad command line (:func:`parse_flags`:
an unknown flag, a ``--config.<key>`` the config lacks, with the nearest keys,
a value that does not parse, a config file that is missing or fails to load).
Ctrl-C and SIGTERM stop a run cleanly: the checkpoint being saved is finished,
a line says so on stderr, and the exit status is 128 + the signal's number
(130, 143); the same command then resumes. In a job of several processes, SIGTERM
(a preemption notice) or Ctrl-C to any of them stops all of them after the same
round, which is checkpointed; they exit 143 (a second Ctrl-C interrupts at once). A
process of such a job that stops alone, on an error only it met, leaves the job at
once, and the others stop within seconds on the closed connection (exit 1); a
refusal that every process meets (its config, its workdir, a checkpoint, a NaN),
or an error of process 0 after the others have finished, ends them together.
A write that fails for want of space (or a quota, a read-only or failing disk) is
one line too, with exit status 2: the checkpoints written so far are kept, and the
same command resumes from them.

Several hosts: start the same command once per host with ``--distributed``,
which calls ``jax.distributed.initialize()`` before anything touches a device:
with no arguments (Cloud TPU, SLURM and other clusters JAX detects), or with
``--coordinator=HOST:PORT --num_processes=N --process_id=I`` passed through; the
other processes wait up to ``--join_timeout`` seconds for process 0's coordinator.
Process 0 writes the workdir; see ``fedjax_mm.runner.loop``.

Several devices: a config's ``devices=N`` spreads each group's clients over the
first N devices of each process (every runner but FedMuscle's), so a job of P
processes trains them on N * P devices, each process its share.
On a CPU, ``--cpu_devices=N`` first makes N XLA devices of it, so each runs its
share of the clients as its own compiled loop.
"""

import difflib
import errno
import importlib.util
import os
import pathlib
import signal
import socket
import sys
import threading
import time
import traceback

import jax
from absl import app, flags, logging
from jax._src import distributed as jax_distributed  # The job's size, known before any backend.
from ml_collections import config_flags

from fedjax_mm.core.checkpoint import CheckpointError
from fedjax_mm.data.tfds import DatasetError
from fedjax_mm.models.hf import HfError
from fedjax_mm.models.pretrained import PretrainedError
from fedjax_mm.runner import EXPERIMENTS, experiment_runner
from fedjax_mm.runner.errors import ConfigError, NonFiniteError, Preempted
from fedjax_mm.runner.workdir import WorkdirError

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Experiment config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (default: runs/<config name>).")
_OVERWRITE = flags.DEFINE_bool(
  "overwrite", False, "Move an existing workdir with another config aside."
)
_CACHE = flags.DEFINE_string(
  "compilation_cache",
  str(pathlib.Path("~/.cache/fedjax_mm/xla").expanduser()),
  "Folder of JAX's persistent compilation cache, so reruns, resumes and other seeds "
  "skip compilation; empty to disable.",
)
_CPU_DEVICES = flags.DEFINE_integer(
  "cpu_devices",
  0,
  "XLA devices to make of this machine's CPU (jax_num_cpu_devices), so that a config's "
  "devices=N can spread the clients over N compiled loops, one per core; 0: JAX's default "
  "(one). No effect on GPUs and TPUs.",
  lower_bound=0,
)
_DISTRIBUTED = flags.DEFINE_bool(
  "distributed",
  False,
  "One process of a multi-host job: call jax.distributed.initialize() first (with the three "
  "flags below when given, else with no arguments: Cloud TPU, SLURM).",
)
_COORDINATOR = flags.DEFINE_string(
  "coordinator", None, "With --distributed: HOST:PORT of process 0's coordination service."
)
_NUM_PROCESSES = flags.DEFINE_integer(
  "num_processes", None, "With --distributed and --coordinator: processes in the job."
)
_PROCESS_ID = flags.DEFINE_integer(
  "process_id", None, "With --distributed and --coordinator: this process's index, 0 .. N-1."
)
_JOIN_TIMEOUT = flags.DEFINE_integer(
  "join_timeout",
  300,
  "With --distributed: seconds to wait for the job's processes to join "
  "(jax.distributed.initialize's initialization_timeout).",
  lower_bound=1,
)


def distributed_args(
  distributed: bool, coordinator: str | None, num_processes: int | None, process_id: int | None
) -> dict[str, object] | None:
  """The keyword arguments of ``jax.distributed.initialize``; None when not distributed.

  Raises:
    ValueError: a bad combination, in one line: the three flags without
      ``--distributed``, some of them without the others, a coordinator
      without a port, fewer than one process, or a process id outside
      ``0 .. num_processes - 1``.
  """
  given = {
    "coordinator": coordinator,
    "num_processes": num_processes,
    "process_id": process_id,
  }
  named = [f"--{k}" for k, v in given.items() if v is not None]
  if not distributed:
    if named:
      raise ValueError(f"{', '.join(named)} given without --distributed")
    return None
  if not named:
    return {}  # JAX finds the cluster itself (Cloud TPU, SLURM, ...).
  if len(named) < len(given):
    missing = [f"--{k}" for k, v in given.items() if v is None]
    raise ValueError(
      f"--distributed with {', '.join(named)} needs {', '.join(missing)} too "
      "(or none of the three, where JAX finds the cluster itself)"
    )
  host, _, port = coordinator.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"--coordinator={coordinator} must be HOST:PORT")
  if num_processes < 1:
    raise ValueError(f"--num_processes={num_processes} must be at least 1")
  if not 0 <= process_id < num_processes:
    raise ValueError(
      f"--process_id={process_id} must be in 0 .. {num_processes - 1} (--num_processes="
      f"{num_processes})"
    )
  return {
    "coordinator_address": coordinator,
    "num_processes": num_processes,
    "process_id": process_id,
  }


def _bad_override(argv: list[str], error: Exception) -> str:
  """Which ``--config...`` flag of ``argv`` raised ``error``, and why, in one line.

  ml_collections fails an override of a key the config lacks with a bare exception
  and no flag name, and a config file without ``get_config`` likewise. The file is
  loaded again here (the parser keeps none of it after the failure) to tell which,
  and to name the nearest keys where an override's path went wrong.
  """
  specs = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
  specs += [b for a, b in zip(argv, argv[1:], strict=False) if a in ("--config", "-config")]
  if not specs:
    return f"{type(error).__name__}: {error}"
  spec = specs[-1]
  filename, *variant = spec.split(":", 1)
  try:
    loader = importlib.util.spec_from_file_location("_fedjax_mm_config", filename)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    if not callable(getattr(module, "get_config", None)):
      return f"--config={spec}: {filename} defines no get_config(), so it is no config file"
    config = module.get_config(*variant)
  except Exception as e:  # noqa: BLE001 - reported, in one line, where it was raised
    frame = traceback.extract_tb(e.__traceback__)[-1]  # A SyntaxError names its own line.
    at = "" if isinstance(e, SyntaxError) else f" (at {frame.filename}:{frame.lineno})"
    return f"--config={spec}: {type(e).__name__}: {e}{at}"
  for arg in argv:
    if not arg.startswith("--config."):
      continue
    path = arg[len("--config.") :].split("=", 1)[0]
    node, walked = config, []
    for key in path.split("."):
      if not hasattr(node, "keys"):
        return f"{arg}: {'.'.join(walked)} is a {type(node).__name__}, it has no key {key!r}"
      if key not in node.keys():
        near = difflib.get_close_matches(key, list(node.keys()), n=3)
        where = f"{'.'.join(walked)} has" if walked else "the config has"
        hint = " or ".join(repr(".".join([*walked, k])) for k in near)
        return f"{arg}: {where} no key {key!r}" + (f"; did you mean {hint}?" if near else "")
      node = node[key]
      walked.append(key)
  return f"{type(error).__name__}: {error}"


_HELP_FLAGS = ("help", "helpshort", "helpfull", "helpxml", "?")


def _asks_for_help(args: list[str]) -> bool:
  """Whether a flag before any ``--`` is one of absl's help flags."""
  for arg in args:
    if arg == "--":
      return False
    if arg.startswith("-") and arg.lstrip("-").split("=")[0] in _HELP_FLAGS:
      return True
  return False


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, every error reported in one line on stderr with exit status 2.

  absl prints a bad flag value on several lines with exit status 1 (a config file
  that fails to load: with its traceback), and ml_collections lets an override of a
  key the config lacks, or a config file's own exception, escape bare; the runs' own
  errors are one ``error:`` line and status 2, so the command line's are too (a
  config file's exception with the file and line it was raised at). ``--help`` (and
  ``--helpfull``, ``--helpshort``, ``--helpxml``) prints the usage and exits 0, where
  absl exits 1: asking for help is no failure.
  """
  try:
    return flags.FLAGS(argv)
  except SystemExit as e:  # absl's --help and its kin print the usage, then exit 1.
    if e.code == 1 and _asks_for_help(argv[1:]):
      sys.exit(0)
    raise
  except flags.Error as e:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    message = " ".join(lines[:1] + lines[-1:]) if len(lines) > 1 else "".join(lines)
  except Exception as e:  # noqa: BLE001 - ml_collections: a --config.<key>=... where the
    message = _bad_override(argv, e)  # config has no <key>, or a config file that raised.
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


#: A write that failed for want of room or of a working disk, not for a bug.
_STORAGE_FIXES = {
  errno.ENOSPC: "free some space",
  errno.EDQUOT: "free some space or raise the quota",
  errno.EROFS: "make it writable again",
  errno.EIO: "check the disk",
}


def _storage_error(e: BaseException) -> OSError | None:
  """The first storage OSError (disk full, quota, read-only, I/O) that led to ``e``, if any.

  The first one is the cause: a failed checkpoint save or metric line is often
  followed, while the run unwinds, by the same error from closing the metric files
  or the checkpointer, and Python raises the last.
  """
  found, seen = None, set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in _STORAGE_FIXES:
      found = e
    e = e.__cause__ or e.__context__
  return found


def _storage_message(e: OSError, workdir: str) -> str:
  where = f" ({e.filename})" if e.filename else ""
  return (
    f"a write failed: {e.strerror}{where}. Every round checkpointed so far is kept in "
    f"{workdir}; {_STORAGE_FIXES[e.errno]}, then the same command resumes from the last of them."
  )


class Stopped(BaseException):  # noqa: N818 - a signal, like KeyboardInterrupt
  """SIGTERM, raised in the main thread as SIGINT raises ``KeyboardInterrupt``."""


def _raise_stopped(signum, frame):
  del frame
  raise Stopped(signum)


def _sigint_as_notice(signum, frame):
  """Ctrl-C in a process of a multi-process job: a preemption notice, as SIGTERM is.

  ``KeyboardInterrupt`` would stop this process alone, mid-round, and leave the
  others waiting on its collectives; sent on as SIGTERM, it reaches JAX's
  preemption notifier, and every process stops after the same round. A second
  Ctrl-C interrupts at once.
  """
  del signum, frame
  signal.signal(signal.SIGINT, signal.default_int_handler)
  os.kill(os.getpid(), signal.SIGTERM)


#: Where each process of a job posts, in JAX's coordination service, that it ends
#: through the shutdown barrier (a normal end, a refusal every process meets, a
#: preemption).
_AT_THE_BARRIER = "fedjax_mm/ends_at_the_barrier/"
#: How long process 0, stopping alone, waits for the others to post that they end there.
_MEET_S = 5.0


def _wait_for_the_coordinator(address: str, timeout: int) -> None:
  """Returns once something answers at process 0's ``address``; exits 2 after ``timeout`` s.

  JAX would wait as long for the coordination service, then abort the process
  with a page of C++ stack trace (a mistyped address, a closed port, process 0
  never started). Connecting first turns that into one line, and says what it
  waits for meanwhile.
  """
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout
  waiting = False
  while True:
    try:
      with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
        return
    except socket.gaierror as e:
      print(f"error: --coordinator={address}: no such host ({e.strerror}).", file=sys.stderr)
      sys.exit(2)
    except OSError:
      if time.monotonic() >= deadline:
        print(
          f"error: --coordinator={address}: nothing answered there in {timeout} s "
          "(--join_timeout); start process 0 of the job on that host, or check the address and "
          "that the port is open to this host.",
          file=sys.stderr,
        )
        sys.exit(2)
      if not waiting:
        print(
          f"waiting up to {timeout} s for process 0's coordinator at {address}",
          file=sys.stderr,
          flush=True,
        )
        waiting = True
      time.sleep(0.5)


def _not_joined(distributed: dict[str, object], timeout: int) -> None:
  """Ends a process whose job has not all joined, a second before JAX would abort it.

  ``jax.distributed.initialize`` waits ``--join_timeout`` seconds for every process
  to register with the coordinator, then aborts the process with a page of C++
  stack trace; this timer, started just before it, says why in one line instead.
  """
  size = distributed.get("num_processes")  # None where JAX finds the cluster itself.
  count = f"{size} " if size else ""
  print(
    f"error: --distributed: the job's {count}processes did not all join within {timeout} s "
    "(--join_timeout); start the missing ones with the same command and their own "
    "--process_id, or give them longer.",
    file=sys.stderr,
  )
  _leave_the_job(2)


def _leave_the_job(code: int) -> None:
  """Ends this process of a multi-process job now, without JAX's shutdown barrier.

  A process that stops alone (an error only it met, a second Ctrl-C) has already
  unwound: its checkpoint saves are finished, its files closed, the workdir's lock
  released. On a normal exit JAX's ``atexit`` would then wait at a barrier for the
  other processes, who wait on this one's collectives: each side timed out after
  about 5 minutes (``shutdown_timeout_seconds``) and every process aborted with a
  page of C++ stack trace. Leaving at once closes this process's connections, and
  the others' collectives and coordination service fail within seconds.
  """
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


class _Refused(SystemExit):
  """A refusal every process of a job meets at the same point, so they exit together.

  The config and the code are the same on every process, the devices each sees are
  the job's, and the decisions only process 0 can make (is the workdir free? is
  a checkpoint intact? did a round give NaN?) reach the others as one answer: a
  config, workdir, checkpoint or NaN error is raised by every process alike. Such
  an exit goes through JAX's shutdown barrier, where the processes meet and end
  together. Leaving at once instead (:func:`_leave_the_job`) could close the
  coordination service under a process still starting its backend, and JAX aborts
  a process that loses the service with a page of C++ stack trace.
  """


def _ends_at_the_barrier() -> None:
  """Posts that this process ends through JAX's shutdown barrier (see :func:`_stop_alone`)."""
  job = jax_distributed.global_state
  try:
    job.client.key_value_set(f"{_AT_THE_BARRIER}{job.process_id}", "1", allow_overwrite=True)
  except Exception:  # noqa: BLE001 - the service is gone: no process is left to tell.
    pass


def _stop_alone(code: int) -> None:
  """Ends a process of a job that stopped on an error the others may not share.

  If the others are in collectives, waiting on this process, it leaves at once
  (:func:`_leave_the_job`). But process 0 holds the job's coordination service,
  and JAX aborts every process still running when it goes (exit -6, a page of C++
  stack trace): one that finished and waits at the shutdown barrier (process 0
  failed to write the results after the last collective) or one that heard of
  process 0's error (a full disk while it claimed the workdir) and refuses too.
  Those post that they end at the barrier (:func:`_ends_at_the_barrier`), so
  process 0 waits up to ``_MEET_S`` seconds for every other process's post and, if
  all come, ends at the barrier with them. The others do not wait: their leaving
  never stops the service.
  """
  job = jax_distributed.global_state
  if job.process_id == 0 and _the_others_end_at_the_barrier(job):
    sys.exit(code)  # Through the barrier, where the others wait.
  _leave_the_job(code)


def _the_others_end_at_the_barrier(job) -> bool:
  """Whether every other process posts, within ``_MEET_S`` seconds, that it ends there."""
  others = {f"{_AT_THE_BARRIER}{p}" for p in range(1, job.num_processes)}
  deadline = time.monotonic() + _MEET_S
  try:
    while not others <= {key for key, _ in job.client.key_value_dir_get(_AT_THE_BARRIER)}:
      if time.monotonic() > deadline:
        return False
      time.sleep(0.05)
  except (Exception, KeyboardInterrupt):  # noqa: BLE001 - no answer, or Ctrl-C again: leave.
    return False
  return True


def main(argv):
  del argv
  try:
    _main()
  except _Refused:
    if _in_a_job():
      _ends_at_the_barrier()
    raise
  except SystemExit as e:  # A preemption (143) stops every process after one round together.
    if _in_a_job():
      if e.code in (None, 0, 128 + signal.SIGTERM):
        _ends_at_the_barrier()
      else:
        _stop_alone(e.code if isinstance(e.code, int) else 1)
    raise
  except BaseException:
    if not _in_a_job():
      raise
    traceback.print_exc()
    job = jax_distributed.global_state
    print(
      f"\nerror: process {job.process_id} of the job's {job.num_processes} stopped on "
      "the error above and leaves the job (if it is a closed connection, another process "
      "stopped first: its output says why); the same command resumes from the last "
      "checkpoint.",
      file=sys.stderr,
    )
    _stop_alone(1)
  else:
    if _in_a_job():
      _ends_at_the_barrier()


def _in_a_job() -> bool:
  """Whether this process is one of several, asked without starting a backend.

  ``jax.process_count()`` would start the backend if the error came before it had
  started, or retry one that failed to start, which is itself a collective step.
  """
  return jax.distributed.is_initialized() and jax_distributed.global_state.num_processes > 1


def _main():
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  try:
    distributed = distributed_args(
      _DISTRIBUTED.value, _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value
    )
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  if _CPU_DEVICES.value:  # Only before the first computation.
    jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
  if distributed is not None:  # Before anything touches a device, the cache config included.
    if distributed.get("process_id"):  # Not process 0, which starts the coordinator itself.
      _wait_for_the_coordinator(distributed["coordinator_address"], _JOIN_TIMEOUT.value)
    watchdog = threading.Timer(
      max(_JOIN_TIMEOUT.value - 1, 0.5), _not_joined, (distributed, _JOIN_TIMEOUT.value)
    )
    watchdog.daemon = True
    watchdog.start()
    try:
      jax.distributed.initialize(**distributed, initialization_timeout=_JOIN_TIMEOUT.value)
    except (ValueError, RuntimeError) as e:  # No cluster found, or the coordinator not met.
      hint = (
        ": no cluster was found (Cloud TPU, SLURM, ...); elsewhere pass --coordinator=HOST:PORT "
        "--num_processes=N --process_id=I"
        if not distributed
        else ""
      )
      print(f"error: --distributed: {str(e).strip().rstrip('.')}{hint}.", file=sys.stderr)
      sys.exit(2)
    finally:
      watchdog.cancel()
  if _CACHE.value:
    jax.config.update("jax_compilation_cache_dir", _CACHE.value)
  config_path = flags.FLAGS["config"].config_filename
  if not pathlib.Path(config_path.split(":")[0]).is_file():
    print(f"error: --config={config_path}: no such file", file=sys.stderr)
    raise _Refused(2)
  name = pathlib.Path(config_path.split(":")[0]).stem
  if name not in EXPERIMENTS:
    print(f"error: no runner for config {name!r}; known: {', '.join(EXPERIMENTS)}", file=sys.stderr)
    raise _Refused(2)
  run = experiment_runner(name)
  workdir = _WORKDIR.value or str(pathlib.Path("runs") / name)
  # SIGTERM (a scheduler's preemption, `kill`, `docker stop`) unwinds like Ctrl-C: the
  # checkpointer finishes the save in flight, the metric files are closed, the workdir's
  # lock is released; the default action would end the process at once. In a job of
  # several processes each would stop at its own point and could wait on the others'
  # collectives; there JAX's preemption notifier takes SIGTERM, and the loop stops every
  # process after the same round (processes.preempted), raising Preempted. Ctrl-C there
  # is sent on as SIGTERM, for the same reason.
  if jax.process_count() == 1:
    signal.signal(signal.SIGTERM, _raise_stopped)
  else:
    signal.signal(signal.SIGINT, _sigint_as_notice)
  try:
    run(_CONFIG.value, workdir, overwrite=_OVERWRITE.value)
  except (ConfigError, DatasetError, WorkdirError, NonFiniteError, CheckpointError) as e:
    print(f"error: {e}", file=sys.stderr)
    raise _Refused(2) from None
  except (HfError, PretrainedError) as e:  # A damaged checkpoint file: each host reads its own.
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except OSError as e:
    storage = _storage_error(e)
    if storage is None:
      raise
    print(f"\nerror: {_storage_message(storage, workdir)}", file=sys.stderr)
    sys.exit(2)
  except Preempted as e:
    print(
      f"\nstopped by SIGTERM or Ctrl-C to a process of the job: every process stopped after "
      f"{e.where}, which is checkpointed in {workdir}; the same command resumes from it",
      file=sys.stderr,
    )
    sys.exit(128 + signal.SIGTERM)
  except (KeyboardInterrupt, Stopped) as e:
    signum = e.args[0] if isinstance(e, Stopped) else signal.SIGINT
    print(
      f"\nstopped by {signal.Signals(signum).name}: every round checkpointed so far is kept in "
      f"{workdir}; the same command resumes from the last of them",
      file=sys.stderr,
    )
    sys.exit(128 + signum)


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main, flags_parser=parse_flags)
