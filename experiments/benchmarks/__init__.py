"""Benchmark scripts (``python -m experiments.benchmarks.<name>``) and what they share."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from absl import app, flags

from fedjax_mm import core


def engine_mesh(devices: int, clients: Sequence[int]) -> jax.sharding.Mesh:
  """The engine's ``clients`` mesh over the first ``devices`` devices.

  Call it before anything else touches JAX's backend: on the CPU it first makes
  ``devices`` XLA host devices (``jax_num_cpu_devices``), which only takes
  effect before the backend starts. Every client count must split evenly.

  Raises:
    app.UsageError: too few devices, or a client count that does not split.
  """
  if devices > 1:
    jax.config.update("jax_num_cpu_devices", devices)
  if jax.device_count() < devices:
    raise app.UsageError(f"--devices={devices}, but {jax.device_count()} are available.")
  uneven = [n for n in clients if n % devices]
  if uneven:
    raise app.UsageError(f"--clients {uneven} do not split over --devices={devices}.")
  return core.client_mesh(devices)


def auto_client_map(mesh: jax.sharding.Mesh) -> str:
  """What ``client_map="auto"`` runs on ``mesh`` (the mesh in context, as under ``jit_round``)."""
  with jax.set_mesh(mesh):
    return core.resolve_client_map("auto")


def define_counts(name: str, default: Sequence[str], help_text: str):
  """A comma-separated list flag of positive integers, checked when flags are parsed.

  ``--clients=8,64``; a bad entry (``--clients=8,abc``, ``0``) or none
  (``--clients=``) is absl's one-line flag error, not a traceback from the
  benchmark's first ``int()`` or a run that times nothing.
  """
  holder = flags.DEFINE_list(name, list(default), help_text)
  flags.register_validator(
    name,
    lambda values: bool(values) and all(v.isdigit() and int(v) > 0 for v in values),
    message=f"--{name} must be positive integers, comma-separated (e.g. {','.join(default)})",
  )
  return holder


def define_names(name: str, default: Sequence[str], known: Sequence[str], help_text: str):
  """A comma-separated list flag whose entries are each one of ``known``, checked at parsing."""
  holder = flags.DEFINE_list(name, list(default), f"{help_text} Known: {', '.join(known)}.")
  flags.register_validator(
    name,
    lambda values: bool(values) and all(v in known for v in values),
    message=f"--{name} must be one or more of {', '.join(known)}, comma-separated",
  )
  return holder
