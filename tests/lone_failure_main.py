"""``python -m tests.lone_failure_main FLAGS``: ``experiments.main`` where one process fails alone.

The environment's ``LONE_FAILURE=P:R`` makes process ``P`` of a job fail in round
``R``, on its own: process 0 as a full disk fails the metric line it writes
(``OSError`` ENOSPC; only process 0 writes them), any other process with a
``RuntimeError`` before it saves the round's checkpoint. The other processes are
then inside the round's collectives (the save's), waiting on it.

``LATE_START=P:S`` makes process ``P`` sleep ``S`` seconds after its backend has
started, before the runner reads the config: the others meet a config error first,
while it is still starting.

``FULL_DISK=config.json`` or ``FULL_DISK=results.json`` makes process 0's write of
that file fail as a full disk: the first while it claims the workdir (the others
hear that it could not), the second after the last collective (the others have
finished). Without the variables the command runs as it is.
"""

import errno
import os
import runpy
import time

import jax

import fedjax_mm.runner
from fedjax_mm.core import processes
from fedjax_mm.runner import report, workdir, writers


def _patch(process: int, at_round: int) -> None:
  if process == 0:
    write = writers.MetricWriter.write

    def failing_write(self, step, scalars):
      if int(step) >= at_round:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
      return write(self, step, scalars)

    writers.MetricWriter.write = failing_write
    return
  preempted = processes.preempted

  def failing(step):  # Called once a round, before the round's checkpoint is saved.
    if jax.process_index() == process and step >= at_round:
      raise RuntimeError(f"lone_failure_main: process {process} fails in round {step}")
    return preempted(step)

  processes.preempted = failing


def _late(process: int, seconds: float) -> None:
  experiment_runner = fedjax_mm.runner.experiment_runner

  def late_runner(name):
    run = experiment_runner(name)

    def late_run(*args, **kwargs):
      if jax.process_index() == process:
        time.sleep(seconds)
      return run(*args, **kwargs)

    return late_run

  fedjax_mm.runner.experiment_runner = late_runner


def _full_disk(name: str) -> None:
  def full(path):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

  if name == "config.json":
    # Only process 0 writes it, as it claims the workdir.
    workdir._write_config = lambda folder, text: full(folder / name)
  elif name == "results.json":
    write_text = report.write_text

    def failing(path, text):
      if str(path).endswith(name):
        full(path)
      return write_text(path, text)

    report.write_text = failing
  else:
    raise ValueError(f"FULL_DISK={name}: config.json or results.json")


if __name__ == "__main__":
  if os.environ.get("LONE_FAILURE"):
    _patch(*map(int, os.environ["LONE_FAILURE"].split(":")))
  if os.environ.get("LATE_START"):
    process, seconds = os.environ["LATE_START"].split(":")
    _late(int(process), float(seconds))
  if os.environ.get("FULL_DISK"):
    _full_disk(os.environ["FULL_DISK"])
  runpy.run_module("experiments.main", run_name="__main__", alter_sys=True)
