"""Placing stacked client state on a ``clients`` device mesh.

One mesh axis, ``clients``, spans every device of every process. Stacked client
pytrees (leading ``[K, ...]`` axis) are split along it with
``NamedSharding(mesh, P("clients"))``; server state is replicated with ``P()``.
Because clients never interact inside a ``vmap``-ed step, XLA's sharding
propagation keeps client work local to each device and inserts collectives
only where a server transform reduces over the client axis (e.g. FedAvg's
weighted mean becomes an all-reduce).

The mesh uses ``AxisType.Auto`` (propagation by the compiler) rather than
explicit sharding-in-types: the client code is written for one client and
never names the axis, so nothing would be gained, and every op of the models
works unchanged.

The same code runs on 1 CPU, 8 fake CPU devices (tests), 8 GPUs, or several
hosts after ``jax.distributed.initialize()``: :func:`shard_clients` builds
global arrays from host data with ``jax.make_array_from_callback``, where each
process supplies the slices its own devices hold. Client counts are padded to a
multiple of the device count first (:func:`padded_size`, and
:func:`fedjax_mm.data.pad_clients` for the data) and padding clients carry mask 0.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

CLIENTS = "clients"


def client_mesh(num_devices: int | None = None) -> Mesh:
  """A 1-D mesh over the first ``num_devices`` devices (default: all)."""
  devices = jax.devices()
  num_devices = len(devices) if num_devices is None else num_devices
  if not 1 <= num_devices <= len(devices):
    raise ValueError(f"asked for {num_devices} devices, {len(devices)} are available.")
  return jax.make_mesh(
    (num_devices,), (CLIENTS,), axis_types=(AxisType.Auto,), devices=devices[:num_devices]
  )


def local_mesh(num_devices: int = 1) -> Mesh:
  """A ``clients`` mesh over this process's first ``num_devices`` devices.

  FedMuscle's runner places its users on ``local_mesh()``. With one process,
  ``local_mesh(n)`` is ``client_mesh(n)``. In a job of several processes
  (``jax.distributed``) each process gets its own: every process computes the
  whole run on its own devices, from the same seeds, so all hold the same arrays
  (process 0 writes the files, :mod:`fedjax_mm.core.processes`; the checkpoints
  store them once, :mod:`fedjax_mm.core.checkpoint`). The other runners use
  :func:`job_mesh`, which spreads the clients over every process.
  """
  devices = jax.local_devices()
  if not 1 <= num_devices <= len(devices):
    raise ValueError(
      f"asked for {num_devices} devices, this process has {len(devices)} ({devices[0].platform})."
    )
  return jax.make_mesh(
    (num_devices,), (CLIENTS,), axis_types=(AxisType.Auto,), devices=devices[:num_devices]
  )


def job_mesh(num_devices: int = 1) -> Mesh:
  """A ``clients`` mesh over the first ``num_devices`` devices of every process.

  The experiments' runners place their clients on it (``config.devices``, a count
  per process). With one process it is :func:`local_mesh`. In a job of several
  processes (``jax.distributed``) it spans ``num_devices * process_count``
  devices, process 0's first: each process holds, and trains, its share of every
  group's clients; what every process must read whole (a round's outputs, an
  evaluation) is gathered with :func:`fedjax_mm.core.processes.gather`.
  """
  local = local_mesh(num_devices)  # The same check, on this process's devices.
  if jax.process_count() == 1:
    return local
  devices = [
    d for p in range(jax.process_count()) for d in jax.local_devices(process_index=p)[:num_devices]
  ]
  if len(devices) != num_devices * jax.process_count():
    have = sorted({len(jax.local_devices(process_index=p)) for p in range(jax.process_count())})
    raise ValueError(f"asked for {num_devices} devices of every process; some have fewer ({have}).")
  return jax.make_mesh((len(devices),), (CLIENTS,), axis_types=(AxisType.Auto,), devices=devices)


def padded_size(num_clients: int, mesh: Mesh) -> int:
  """The smallest multiple of the mesh size that holds ``num_clients``."""
  size = mesh.shape[CLIENTS]
  return max(size, math.ceil(num_clients / size) * size)


def client_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(CLIENTS))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def _place(x: Any, sharding: NamedSharding) -> jax.Array:
  if isinstance(x, jax.ShapeDtypeStruct):  # An abstract state: the restore target of a checkpoint.
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  if isinstance(x, jax.core.Tracer):  # Under jax.eval_shape (a state's size): nothing to place.
    return x
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    data = _place(jax.random.key_data(x), sharding)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  if isinstance(x, jax.Array) and x.is_fully_addressable:
    return jax.device_put(x, sharding)
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_clients(tree: Any, mesh: Mesh) -> Any:
  """Splits every leaf's leading client axis over the mesh.

  Leaves may be arrays (placed) or ``jax.ShapeDtypeStruct`` (given the
  sharding, e.g. to restore a checkpoint of ``jax.eval_shape(init)``).
  """
  size = mesh.shape[CLIENTS]
  for leaf in jax.tree.leaves(tree):
    if leaf.shape[0] % size:
      raise ValueError(
        f"client axis {leaf.shape[0]} is not a multiple of {size} devices; pad first."
      )
  return jax.tree.map(lambda x: _place(x, client_sharding(mesh)), tree)


def replicate(tree: Any, mesh: Mesh) -> Any:
  """Places every leaf, whole, on every device of the mesh."""
  return jax.tree.map(lambda x: _place(x, replicated(mesh)), tree)


def shardings_of(tree: Any) -> Any:
  """The sharding of every leaf of a tree of placed arrays."""
  return jax.tree.map(lambda x: x.sharding, tree)


def jit_round(round_fn: Any, state: Any = None, *, donate: bool = True) -> Any:
  """Jits ``round_fn(state, *args) -> (state, metrics)`` keeping ``state``'s placement.

  Without this the compiler may return, say, FedAvg's broadcast parameters
  replicated instead of split over ``clients``, and the next round would start
  by re-sharding them. Metrics are left to the compiler. With ``state=None``
  the placement kept is that of the state of the first call (the runners,
  which build their states after their round functions).

  ``round_fn`` is traced with ``state``'s mesh in context, so that
  :func:`fedjax_mm.core.map_clients` runs a compiled loop over clients
  (``"scan"``, ``"map:<k>"``, and ``"auto"`` on the CPU) as one loop per device
  over that device's clients, instead of the whole loop on every device.
  """
  if state is None:
    jitted = None

    @functools.wraps(round_fn)
    def first_call(state, *args, **kwargs):
      nonlocal jitted
      if jitted is None:
        jitted = jit_round(round_fn, state, donate=donate)
      return jitted(state, *args, **kwargs)

    return first_call
  shardings = shardings_of(state)
  meshes = {s.mesh for s in jax.tree.leaves(shardings) if isinstance(s, NamedSharding)}
  if len(meshes) > 1:
    raise ValueError(f"state is placed on {len(meshes)} different meshes; place it on one.")

  traced = traced_in(next(iter(meshes)), round_fn) if meshes else round_fn
  return jax.jit(traced, out_shardings=(shardings, None), donate_argnums=(0,) if donate else ())


def traced_in(mesh: Mesh, fn: Any) -> Any:
  """``fn``, traced with ``mesh`` in context (a mesh the caller set wins).

  Under ``jax.jit``, :func:`fedjax_mm.core.map_clients` inside ``fn`` then runs
  a compiled loop over clients as one loop per device of the mesh's
  ``clients`` axis. :func:`jit_round` uses it; so do the runners whose state is
  replicated rather than split (RCSR, FedRGB).
  """

  @functools.wraps(fn)
  def traced(*args, **kwargs):
    if not jax.sharding.get_abstract_mesh().empty:
      return fn(*args, **kwargs)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args, **kwargs)

  return traced
