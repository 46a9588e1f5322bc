r"""Runs an experiment from a config file.

  python -m experiments.main --config=experiments/fedmuscle.py [--workdir=runs/fedmuscle] [--overwrite]

The loop lives in the library (``fedjax_mm.runner.loop``); this file only
parses flags and picks the experiment by the config file's name
(``fedjax_mm.runner.EXPERIMENTS``). A bad config or workdir is reported in one
line on stderr with exit status 2, before any compilation; so are a run that
produced NaN/Inf, a workdir whose checkpoints are all damaged, and a bad
combination of the flags below.

Several hosts: start the same command once per host with ``--distributed``,
which calls ``jax.distributed.initialize()`` before anything touches a device:
with no arguments (Cloud TPU, SLURM and other clusters JAX detects), or with
``--coordinator=HOST:PORT --num_processes=N --process_id=I`` passed through.
Process 0 writes the workdir; see ``fedjax_mm.runner.loop``.

Several devices: a config's ``devices=N`` spreads each group's clients over the
first N devices of each process (every runner but FedMuscle's), so a job of P
processes trains them on N * P devices, each process its share.
On a CPU, ``--cpu_devices=N`` first makes N XLA devices of it, so each runs its
share of the clients as its own compiled loop.
"""

import pathlib
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from fedjax_mm.core.checkpoint import CheckpointError
from fedjax_mm.runner import EXPERIMENTS, experiment_runner
from fedjax_mm.runner.errors import ConfigError, NonFiniteError
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


def main(argv):
  del argv
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
    jax.distributed.initialize(**distributed)
  if _CACHE.value:
    jax.config.update("jax_compilation_cache_dir", _CACHE.value)
  config_path = flags.FLAGS["config"].config_filename
  name = pathlib.Path(config_path.split(":")[0]).stem
  if name not in EXPERIMENTS:
    sys.exit(f"error: no runner for config {name!r}; known: {', '.join(EXPERIMENTS)}")
  run = experiment_runner(name)
  workdir = _WORKDIR.value or str(pathlib.Path("runs") / name)
  try:
    run(_CONFIG.value, workdir, overwrite=_OVERWRITE.value)
  except (ConfigError, WorkdirError, NonFiniteError, CheckpointError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
