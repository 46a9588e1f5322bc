"""One job, several processes: who writes the files, and what every process reads.

A job started with ``jax.distributed.initialize()`` (``experiments/main.py
--distributed``) runs the same program in every process, one per host. The
rounds are collective: the runners spread each group's clients over the devices
of every process (:func:`fedjax_mm.core.job_mesh`), and every process holds
the same host data and makes the same calls. The host-side files of a run (lock,
``config.json``, metrics, reports, ``results.json``, printed tables, progress
bars) are written by **process 0 alone**, the *primary*. Orbax checkpoints stay
collective: every process calls save and restore, and Orbax itself writes each
array once (:mod:`fedjax_mm.core.checkpoint`).

Five helpers carry that rule, so that no other module asks for a process index:

* :func:`is_primary`: whether this process writes.
* :func:`broadcast`: the primary's answer (an int), on every process; used where
  only the primary can decide (is the workdir free? does the run resume?).
* :func:`sync`: a barrier, where the others must not go on before the primary has
  finished a write (a damaged checkpoint renamed, say).
* :func:`gather`: arrays split over (or replicated on) every process's devices,
  made readable by this one: a round's outputs, an evaluation's inputs.
* :func:`preempted`: whether the job has agreed to stop after this round, because
  one of its processes got a preemption notice (SIGTERM).

With one process (every run without ``--distributed``) :func:`is_primary` is True
and the other four return at once, without compiling anything.

Typical use::

  resumed = processes.broadcast(int(prepare()) if processes.is_primary() else 0)
  if processes.is_primary():
    write_report(...)
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

__all__ = ["broadcast", "gather", "is_primary", "preempted", "sync"]


def is_primary() -> bool:
  """Whether this process writes the run's host-side files: process 0 of the job."""
  return jax.process_index() == 0


def broadcast(value: int) -> int:
  """Process 0's ``value`` on every process (a collective: every process must call it).

  Args:
    value: an integer; only process 0's is used, the others' are ignored.

  Returns:
    Process 0's ``value``.
  """
  if jax.process_count() == 1:
    return int(value)
  return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def sync(name: str) -> None:
  """Blocks until every process has reached ``sync(name)`` (a collective).

  Args:
    name: the barrier's name, the same on every process; distinct barriers
      should have distinct names (it shows in errors of a process left behind).
  """
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def gather(tree: Any) -> Any:
  """``tree`` with every array this process cannot read whole made readable (a collective).

  A runner whose clients span the processes (:func:`fedjax_mm.core.job_mesh`)
  gets round outputs, evaluations and states back split over, or replicated on,
  every process's devices; each process must read them whole (the primary
  writes them, every process checks them for NaN/Inf alike) or evaluate them on
  its own devices. A leaf replicated over the processes becomes this process's
  copy (a ``jax.Array`` on one of its devices, nothing sent); a leaf split over
  them becomes a NumPy array of its global value (``process_allgather``). Every
  other leaf is returned as it is, so with one process ``gather`` changes
  nothing and costs nothing. Every process must call it on the same structure,
  in the same order.
  """
  if jax.process_count() == 1:
    return tree

  def read(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return x
    if x.is_fully_replicated:
      return x.addressable_data(0)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      data = multihost_utils.process_allgather(jax.random.key_data(x), tiled=True)
      return jax.random.wrap_key_data(np.asarray(data), impl=jax.random.key_impl(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  return jax.tree.map(read, tree)


def preempted(step: int) -> bool:
  """Whether every process of the job has agreed to stop after ``step``: a preemption.

  ``jax.distributed.initialize()`` installs JAX's preemption notifier, which takes
  SIGTERM (what Cloud TPU, GKE and SLURM send before they reclaim a host) in every
  process of a multi-process job: the process goes on, and the notice reaches the
  others through the coordination service. They agree on the step after the
  furthest one any of them has passed here (``reached_preemption_sync_point``), so
  all stop after the same round, with no collective left waiting. Orbax's
  ``CheckpointManager.save`` asks the same question with the same step numbers.

  The agreement holds only if every process calls this with consecutive steps
  (1, 2, 3, ...), each once or more: the sync point is one past the largest step
  any process has passed when the notice arrives, and each process must meet it
  exactly. A job resumed at round ``r`` therefore first passes ``1 .. r`` (a
  notice taken while it was starting sets the sync point at 1), then one step a
  round.

  Args:
    step: the number of rounds done (or passed, when catching up).

  Returns:
    True on every process at the same ``step`` once a notice has arrived; False
    before, with one process (its SIGTERM is ``experiments/main.py``'s), and with
    ``jax_enable_preemption_service`` off.
  """
  if jax.process_count() == 1 or not jax.config.jax_enable_preemption_service:
    return False
  return multihost_utils.reached_preemption_sync_point(step)
