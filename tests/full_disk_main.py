"""``python -m tests.full_disk_main FLAGS``: ``experiments.main`` on a disk that fills at round N.

The environment's ``FULL_DISK_AT_ROUND=N`` makes the checkpoint save of round N
fail as Orbax's write fails on a full disk (``OSError`` ENOSPC, naming the file),
and every later write of the metric files too, as they do when the disk stays
full: closing them while the run unwinds raises ENOSPC again, without a file
name, the last exception Python reports. Without the variable the command runs as
it is.
"""

import errno
import os
import runpy

from fedjax_mm.core import checkpoint
from fedjax_mm.runner import writers

_FULL = "full_disk_main: the disk is full"


def _full(filename=None):
  return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)


def _patch(at_round: int) -> None:
  save, close = checkpoint.Checkpointer.save, writers.MetricWriter.close

  def failing_save(self, step, *args, **kwargs):
    if int(step) >= at_round:
      os.environ[_FULL] = "1"
      raise _full(str(self.directory / f"{step}.orbax-checkpoint-tmp" / "state"))
    return save(self, step, *args, **kwargs)

  def failing_close(self):
    close(self)
    if os.environ.get(_FULL):
      raise _full()

  checkpoint.Checkpointer.save = failing_save
  writers.MetricWriter.close = failing_close


if __name__ == "__main__":
  if os.environ.get("FULL_DISK_AT_ROUND"):
    _patch(int(os.environ["FULL_DISK_AT_ROUND"]))
  runpy.run_module("experiments.main", run_name="__main__", alter_sys=True)
