"""Client groups: stacked state, vmapped local training and evaluation.

Users that share one model definition (encoder + head) form a *group*. A group
is held as pytrees whose every leaf has a leading client axis ``[K, ...]``:

* :class:`ClientState` — what training changes: the trainable parameters, the
  optax state and a typed PRNG key per client; plus ``shared``, parameters that
  every client of the group holds identically and nobody trains (the frozen
  base weights under LoRA), kept once, without a client axis.
* :class:`ClientData` — what it reads: each client's local arrays padded to a
  common size ``n`` with a sample mask, global user ids and a client mask
  (padding clients, added to fill the device mesh, have mask 0).

Client code is written for ONE client (:func:`local_update`,
:func:`evaluate_client`) and batched in exactly one place each
(:func:`train_group` through :func:`map_clients`: ``vmap``, or compiled chunks
of clients where that is faster, per backend; :func:`evaluate_group`:
``vmap``); nothing loops over clients in Python. The graph definition of the model (``nnx.split`` once at
:func:`init_group`) travels in a static :class:`GroupDef`; the model is
re-assembled with ``nnx.merge`` inside the traced functions.

Local training follows fedjax/FedAvg conventions. ``E`` epochs of a client with
``n_k`` valid samples take ``ceil(n_k / b)`` steps each; the scan runs the
group's maximum and masks the steps a client does not have, so small clients
are not over-trained. Each epoch visits a fresh random order of the client's own
samples drawn from the client's own key. Sample ``i``'s sort key is drawn from
``fold_in(epoch_key, i)`` and step ``s`` of epoch ``e`` uses
``fold_in(fold_in(key, e), s)``, so appending padding samples (or padding
clients) changes neither the order of the real samples nor any random draw.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from fedjax_mm.core.sharding import CLIENTS, replicate, shard_clients
from fedjax_mm.core.tasks import SAMPLE_WEIGHT_KEY, Task

Array = jax.Array
PyTree = Any
# objective(params, batch, batch_mask, key) -> (loss, aux dict of scalars)
Objective = Callable[[PyTree, dict[str, Array], Array, Array], tuple[Array, dict[str, Array]]]


@struct.dataclass
class ClientState:
  """Trainable state of a group of ``K`` clients.

  Attributes:
    params: trainable parameters (an ``nnx.State``), every leaf ``[K, ...]``.
    opt_state: optax state of ``params``, every leaf ``[K, ...]``.
    rng: ``[K]`` typed PRNG keys, advanced once per call of local training.
    shared: parameters held identically by all clients and not trained (the
      frozen base weights under LoRA; an empty state otherwise). No client axis.
  """

  params: PyTree
  opt_state: PyTree
  rng: Array
  shared: PyTree

  def place(self, mesh: Mesh) -> ClientState:
    """Splits the client axis over ``mesh``; replicates ``shared``."""
    clients = shard_clients((self.params, self.opt_state, self.rng), mesh)
    return ClientState(*clients, shared=replicate(self.shared, mesh))

  def pad(self, num_clients: int) -> ClientState:
    """The group with padding clients appended up to ``num_clients`` (see :meth:`ClientData.pad`).

    A padding client holds a copy of client 0's parameters and optimiser state
    (finite values of the right shapes) and its own key; the real clients'
    entries are unchanged, so a round that masks padding clients out computes
    for the real ones what the unpadded group computes.
    """
    extra = _extra_clients(self.rng.shape[0], num_clients)
    if not extra:
      return self
    copy = lambda x: jnp.concatenate([x, jnp.broadcast_to(x[:1], (extra,) + x.shape[1:])])
    keys = jax.random.split(jax.random.fold_in(self.rng[0], num_clients), extra)
    return ClientState(
      params=jax.tree.map(copy, self.params),
      opt_state=jax.tree.map(copy, self.opt_state),
      rng=jnp.concatenate([self.rng, keys]),
      shared=self.shared,
    )


def client_uniform(key: Array, client_mask: Array) -> Array:
  """``float32 [K]``: a ``U[0, 1)`` draw per client, indexed by its rank among the valid ones.

  The ``r``-th valid client gets entry ``r`` of ``uniform(key, [K])``, whose
  first entries do not depend on ``K`` (JAX's partitionable threefry), so
  padding clients, wherever they sit (after each of several groups, say), move
  no valid client's draw: a padded run draws what the unpadded one draws.
  Padding clients (:meth:`ClientData.pad`) get some valid client's value;
  callers mask them out. With every client valid it is ``uniform(key, [K])``
  itself.
  """
  client_mask = jnp.asarray(client_mask, bool)
  rank = jnp.maximum(jnp.cumsum(client_mask) - 1, 0)
  return jax.random.uniform(key, client_mask.shape)[rank]


def _extra_clients(num_clients: int, target: int) -> int:
  if target < num_clients:
    raise ValueError(f"cannot pad {num_clients} clients to {target}.")
  return target - num_clients


@struct.dataclass
class ClientData:
  """Local data of a group of ``K`` clients, padded to ``n`` samples each.

  Attributes:
    arrays: dict of ``[K, n, ...]`` arrays (``image``, ``caption``, labels, ...).
    sample_mask: ``bool [K, n]``, True for real samples.
    user_ids: ``int32 [K]`` global user ids, -1 for padding clients.
    client_mask: ``bool [K]``, True for real clients.
  """

  arrays: dict[str, Array]
  sample_mask: Array
  user_ids: Array
  client_mask: Array

  def place(self, mesh: Mesh) -> ClientData:
    """Splits the client axis of every array over ``mesh``."""
    return shard_clients(self, mesh)

  def pad(self, num_clients: int) -> ClientData:
    """The group with padding clients appended up to ``num_clients``.

    Padding clients hold zeros, no samples (``sample_mask`` False),
    ``client_mask`` False and user id -1, as
    :func:`fedjax_mm.data.pad_clients` pads the numpy arrays: with
    :func:`fedjax_mm.core.padded_size` they make a group split evenly over a
    mesh of any size.
    """
    extra = _extra_clients(self.num_clients, num_clients)
    if not extra:
      return self
    zeros = lambda x, fill=0: jnp.concatenate([x, jnp.full((extra,) + x.shape[1:], fill, x.dtype)])
    return ClientData(
      arrays={k: zeros(v) for k, v in self.arrays.items()},
      sample_mask=zeros(self.sample_mask),
      user_ids=zeros(self.user_ids, -1),
      client_mask=zeros(self.client_mask),
    )

  @property
  def num_clients(self) -> int:
    return self.sample_mask.shape[0]

  @property
  def num_samples(self) -> Array:
    """``int32 [K]`` real samples per client (0 for padding clients)."""
    return jnp.sum(self.sample_mask & self.client_mask[:, None], axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class GroupDef:
  """Static description of a group: model graph, optimiser and task.

  Hashable and array-free, so jitted round functions close over it.

  Attributes:
    name: display name (e.g. ``"vit_s/multilabel"``).
    graphdef: the ``nnx.GraphDef`` of the model, from ``nnx.split``.
    tx: optax transformation used by every client of the group.
    task: the group's supervised :class:`~fedjax_mm.core.tasks.Task`.
    local_epochs: ``E``, local epochs per round.
    batch_size: ``b``, local minibatch size.
    client_map: how :func:`train_group` runs the group's clients (see
      :func:`map_clients`): ``"auto"``, ``"vmap"``, ``"scan"`` or ``"map:<k>"``.
    compute_dtype: ``None`` (compute in the parameters' dtype) or the name of
      a floating dtype (``"bfloat16"``) that :func:`supervised_objective` runs
      the model's forward and backward pass in (:func:`cast_floating`).
  """

  name: str
  graphdef: nnx.GraphDef
  tx: optax.GradientTransformation
  task: Task
  local_epochs: int = 1
  batch_size: int = 32
  client_map: str = "auto"
  compute_dtype: str | None = None

  def merge(self, params: PyTree, shared: PyTree) -> nnx.Module:
    """The model of one client from its parameters (inside traced code)."""
    return nnx.merge(self.graphdef, params, shared)


def init_group(
  make_model: Callable[[nnx.Rngs], nnx.Module],
  *,
  name: str,
  tx: optax.GradientTransformation,
  task: Task,
  key: Array,
  num_clients: int,
  trainable: Any = nnx.Param,
  same_init: bool = False,
  local_epochs: int = 1,
  batch_size: int = 32,
  client_map: str = "auto",
  compute_dtype: str | None = None,
) -> tuple[GroupDef, ClientState]:
  """Builds a group's static definition and its stacked initial state.

  Args:
    make_model: ``rngs -> nnx.Module``, the architecture of every client.
    name: display name.
    tx: optimiser.
    task: the group's task.
    key: typed PRNG key of this group (derived from the run's root seed).
    num_clients: ``K`` (padding clients included).
    trainable: nnx filter of the trained parameters (e.g. LoRA adapters +
      projector + head); the rest is ``shared``, initialised once for the group.
    same_init: all clients start from identical parameters (FedAvg) instead
      of independently initialised ones (FedMuscle's heterogeneous users).
    local_epochs: ``E``.
    batch_size: ``b``.
    client_map: how local training runs the clients (:func:`map_clients`).
    compute_dtype: mixed precision (see :class:`GroupDef`); parameters and
      optimiser state stay in their own dtype.

  Returns:
    ``(GroupDef, ClientState)``.
  """
  if num_clients < 1:
    raise ValueError(f"a group needs at least one client, got {num_clients}.")
  parse_client_map(client_map)
  check_compute_dtype(compute_dtype)
  init_key, rng_key = jax.random.split(key)

  def split(k):
    return nnx.split(make_model(nnx.Rngs(k)), trainable, ...)

  graphdef, _, shared = split(init_key)
  client_keys = jax.random.split(init_key, num_clients)
  if same_init:
    client_keys = jnp.broadcast_to(init_key, (num_clients,))
  params = jax.vmap(lambda k: split(k)[1])(client_keys)
  opt_state = jax.vmap(tx.init)(params)
  state = ClientState(
    params=params, opt_state=opt_state, rng=jax.random.split(rng_key, num_clients), shared=shared
  )
  group = GroupDef(
    name=name,
    graphdef=graphdef,
    tx=tx,
    task=task,
    local_epochs=local_epochs,
    batch_size=batch_size,
    client_map=client_map,
    compute_dtype=compute_dtype,
  )
  return group, state


def init_jitted(make, key):
  """``(graphdef, params)`` of ``make(nnx.Rngs(key))``, initialised in one compiled call.

  Built eagerly, a model's initialisation dispatches (and on CPU compiles) one
  small computation per operation, seconds for a few layers; under ``jit`` it
  is one.
  """
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
  params = jax.jit(lambda k: nnx.split(make(nnx.Rngs(k)))[1])(key)
  return graphdef, params


def init_identical_group(
  make, *, tx, task, key, num_clients, local_epochs, batch_size, client_map="auto", name="scmr"
):
  """A group of ``num_clients`` identical models: :func:`fedjax_mm.core.init_group`
  with ``same_init=True`` (same key use, so the same parameters), jitted: FedSCMR's clients."""
  init_key, rng_key = jax.random.split(key)
  graphdef, params = init_jitted(make, init_key)
  stack = jax.jit(
    lambda p: jax.tree.map(lambda x: jnp.broadcast_to(x, (num_clients,) + x.shape), p)
  )
  params = stack(params)
  state = ClientState(
    params=params,
    opt_state=jax.jit(jax.vmap(tx.init))(params),
    rng=jax.random.split(rng_key, num_clients),
    shared=nnx.State({}),
  )
  group = GroupDef(
    name=name,
    graphdef=graphdef,
    tx=tx,
    task=task,
    local_epochs=local_epochs,
    batch_size=batch_size,
    client_map=client_map,
  )
  return group, state


def make_client_data(
  stacked: dict[str, np.ndarray],
  sample_mask: np.ndarray,
  *,
  user_ids: np.ndarray,
  client_mask: np.ndarray | None = None,
) -> ClientData:
  """Wraps stacked numpy arrays (see :func:`fedjax_mm.data.stack_clients`)."""
  num_clients = sample_mask.shape[0]
  if client_mask is None:
    client_mask = np.ones(num_clients, bool)
  user_ids = np.where(client_mask, np.asarray(user_ids), -1).astype(np.int32)
  return ClientData(
    arrays={k: jnp.asarray(v) for k, v in stacked.items()},
    sample_mask=jnp.asarray(sample_mask, bool) & jnp.asarray(client_mask, bool)[:, None],
    user_ids=jnp.asarray(user_ids),
    client_mask=jnp.asarray(client_mask, bool),
  )


COMPUTE_DTYPES = ("bfloat16", "float16", "float32")


def check_compute_dtype(compute_dtype: str | None) -> str | None:
  """``compute_dtype`` if it is None or one of :data:`COMPUTE_DTYPES`; ValueError otherwise."""
  if compute_dtype is not None and compute_dtype not in COMPUTE_DTYPES:
    raise ValueError(
      f"compute_dtype must be None or one of {COMPUTE_DTYPES}, got {compute_dtype!r}."
    )
  return compute_dtype


def cast_floating(tree: PyTree, dtype: Any) -> PyTree:
  """Every floating-point leaf of ``tree`` cast to ``dtype``; other leaves unchanged.

  The cast is differentiable: the gradient with respect to a float32 leaf
  comes back as float32 (the cotangent is cast back), so mixed precision keeps
  float32 master weights and optimiser state while the model runs in
  ``dtype``.
  """
  dtype = jnp.dtype(dtype)

  def cast(x):
    if isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating):
      return x.astype(dtype)
    return x

  return jax.tree.map(cast, tree)


def supervised_objective(group: GroupDef, shared: PyTree) -> Objective:
  """The task loss of one client as an :data:`Objective`.

  With ``group.compute_dtype`` set (mixed precision), the parameters, the
  shared weights and the floating inputs are cast to it for the model's
  forward and backward pass, and the outputs back to float32 before the task
  loss, so the loss, the gradients and the optimiser's update stay float32.
  Normalisation statistics then run in ``compute_dtype`` too (no layer is
  kept in float32); with bfloat16 a loss agrees with float32's to about 1%.
  A batch holding :data:`~fedjax_mm.core.tasks.SAMPLE_WEIGHT_KEY` weights each
  example's loss by it (:meth:`~fedjax_mm.core.tasks.Task.loss`).
  """
  dtype = group.compute_dtype

  def objective(params, batch, batch_mask, key):
    inputs = group.task.inputs(batch, key)
    weights = shared
    if dtype is not None:
      params, weights, inputs = cast_floating((params, shared, inputs), dtype)
    model = group.merge(params, weights)
    outputs = model(inputs)
    if dtype is not None:
      outputs = cast_floating(outputs, jnp.float32)
    targets = batch[group.task.target_key]
    if SAMPLE_WEIGHT_KEY in batch:
      return group.task.loss(outputs, targets, batch_mask, batch[SAMPLE_WEIGHT_KEY]), {}
    return group.task.loss(outputs, targets, batch_mask), {}

  return objective


def with_proximal_term(objective: Objective, center: PyTree, mu: float) -> Objective:
  """FedProx: adds ``mu / 2 * ||params - center||^2`` to an objective."""

  def proximal(params, batch, batch_mask, key):
    loss, aux = objective(params, batch, batch_mask, key)
    diff = jax.tree.map(lambda p, c: p - c, params, center)
    penalty = 0.5 * mu * sum(jnp.sum(jnp.square(d)) for d in jax.tree.leaves(diff))
    return loss + penalty, aux | {"proximal": penalty}

  return proximal


def _epoch_orders(key: Array, sample_mask: Array, num_epochs: int, padded: int) -> Array:
  """``[E, padded]`` sample orders: real samples first, in a fresh random order."""
  n = sample_mask.shape[0]

  def one_epoch(e):
    epoch_key = jax.random.fold_in(key, e)
    scores = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(epoch_key, i)))(jnp.arange(n))
    order = jnp.argsort(jnp.where(sample_mask, scores, 2.0), stable=True)
    return jnp.pad(order, (0, padded - n))

  return jax.vmap(one_epoch)(jnp.arange(num_epochs))


def local_update(
  objective: Objective,
  tx: optax.GradientTransformation,
  params: PyTree,
  opt_state: PyTree,
  rng: Array,
  arrays: dict[str, Array],
  sample_mask: Array,
  *,
  num_epochs: int,
  batch_size: int,
  max_steps: Array | None = None,
) -> tuple[PyTree, PyTree, Array, dict[str, Array]]:
  """Local training of ONE client: ``E`` epochs of minibatch steps.

  Args:
    objective: ``(params, batch, batch_mask, key) -> (loss, aux)``.
    tx: optax transformation.
    params: the client's trainable parameters.
    opt_state: its optimizer state.
    rng: its typed PRNG key.
    arrays: dict of ``[n, ...]`` local arrays.
    sample_mask: ``bool [n]``.
    num_epochs: ``E`` (static).
    batch_size: ``b`` (static).
    max_steps: optional ``int32`` scalar: the client stops after this many of
      its real steps (a straggler, :mod:`fedjax_mm.core.faults`); the later
      steps are masked like padding steps, so every random draw is unchanged.

  Returns:
    ``(params, opt_state, rng, stats)`` where ``stats`` holds ``loss`` (mean
    over the steps taken) and ``steps`` (number of steps taken).
  """
  n = sample_mask.shape[0]
  steps_per_epoch = max(1, math.ceil(n / batch_size))
  padded = steps_per_epoch * batch_size
  num_valid = jnp.sum(sample_mask)
  rng, key = jax.random.split(rng)
  order_key, step_key = jax.random.split(key)
  orders = _epoch_orders(order_key, sample_mask, num_epochs, padded).reshape(
    num_epochs, steps_per_epoch, batch_size
  )
  positions = jnp.arange(padded).reshape(steps_per_epoch, batch_size)

  def step(carry, xs):
    params, opt_state = carry
    epoch, index, idx = xs
    batch_mask = positions[index] < num_valid
    taken = jnp.any(batch_mask)
    if max_steps is not None:
      # Real steps come first in every epoch: ceil(n_k / b) of them.
      real_per_epoch = (num_valid + batch_size - 1) // batch_size
      taken = taken & (epoch * real_per_epoch + index < max_steps)
    batch = jax.tree.map(lambda x: x[idx], arrays)
    key = jax.random.fold_in(jax.random.fold_in(step_key, epoch), index)
    (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(params, batch, batch_mask, key)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(taken, a, b), new, old)
    return (keep(new_params, params), keep(new_opt_state, opt_state)), (loss * taken, taken)

  epochs = jnp.repeat(jnp.arange(num_epochs), steps_per_epoch)
  indices = jnp.tile(jnp.arange(steps_per_epoch), num_epochs)
  (params, opt_state), (losses, taken) = jax.lax.scan(
    step, (params, opt_state), (epochs, indices, orders.reshape(-1, batch_size))
  )
  steps = jnp.sum(taken)
  stats = {"loss": jnp.sum(losses) / jnp.maximum(steps, 1), "steps": steps}
  return params, opt_state, rng, stats


def parse_client_map(spec: str) -> tuple[str, int | None]:
  """``"auto" | "vmap" | "scan" | "map:<k>"`` -> ``(kind, k)``; ValueError otherwise."""
  if spec in ("auto", "vmap", "scan"):
    return spec, None
  kind, _, size = str(spec).partition(":")
  if kind == "map" and size.isdigit() and int(size) >= 1:
    return "map", int(size)
  raise ValueError(
    f"client_map must be 'auto', 'vmap', 'scan' or 'map:<k>' with k >= 1, got {spec!r}."
  )


def context_clients() -> int:
  """Devices along the ``clients`` axis of the mesh in context (1 if none).

  The mesh in context is the one ``jax.set_mesh`` (or
  :func:`fedjax_mm.core.jit_round`, while it traces a round) makes current. An
  axis already manual (inside a ``shard_map`` over it) counts as 1: its clients
  are this device's own.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if CLIENTS not in mesh.axis_names or CLIENTS in mesh.manual_axes:
    return 1
  return mesh.shape[CLIENTS]


def resolve_client_map(spec: str) -> str:
  """The form ``"auto"`` stands for on this process's backend.

  On accelerators, ``vmap``: one batched program keeps the device busy and the
  sharding intact. On the CPU, XLA:CPU runs a vmapped round of small
  convolutional clients below the rate of the same step run client after client
  (``experiments/benchmarks/engine_throughput.py`` measures every form and
  prints the choice: 0.5-0.8x the loop for ``vmap``, 1.0x for ``scan``), so
  ``"auto"`` runs them one after another in a compiled loop there (``"scan"``):
  on a single CPU device, and on a CPU mesh in context with a ``clients`` axis
  (:func:`map_clients` then runs one such loop per device). On several CPU
  devices with no mesh in context the client axis may still be sharded by the
  compiler's propagation, where a loop over it would run whole on every
  device, so ``"vmap"``.
  """
  kind, _ = parse_client_map(spec)
  if kind != "auto":
    return spec
  if jax.default_backend() != "cpu":
    return "vmap"
  if jax.device_count() == 1 or CLIENTS in jax.sharding.get_abstract_mesh().axis_names:
    return "scan"
  return "vmap"


def map_clients(fn: Callable[..., Any], args: tuple[Any, ...], spec: str = "auto") -> Any:
  """``fn`` (written for one client) over the leading client axis of ``args``.

  Every form computes the same per-client function on the same per-client
  inputs, so results agree up to float rounding (tested):

  * ``"vmap"``: ``jax.vmap(fn)``, one batched program for all K clients;
  * ``"scan"``: ``jax.lax.map``, one client after another in a compiled loop;
  * ``"map:<k>"``: ``jax.lax.map(..., batch_size=k)``, vmapped chunks of ``k``
    clients in a compiled loop (the remainder as one more vmapped chunk);
  * ``"auto"``: :func:`resolve_client_map`'s choice for this backend.

  With a mesh in context whose ``clients`` axis spans D > 1 devices
  (``jax.set_mesh``, or :func:`fedjax_mm.core.jit_round`), ``"scan"`` and
  ``"map:<k>"`` run as one loop per device: the clients split ``[D, K / D]``,
  the loop vmapped over the device axis, which the compiler partitions, so
  each device loops over its own K / D clients, at the same time as the others
  (K must be a multiple of D: pad with :meth:`ClientData.pad` /
  :meth:`ClientState.pad`, or :func:`fedjax_mm.data.pad_clients`). Without
  it, a compiled loop over a sharded client axis would run whole on every
  device.
  ``"vmap"`` is left to the compiler's sharding propagation, which keeps each
  device's clients on it.
  """
  kind, size = parse_client_map(resolve_client_map(spec))
  if kind == "vmap":
    return jax.vmap(fn)(*args)

  def loop(args):
    return jax.lax.map(lambda xs: fn(*xs), args, batch_size=size)

  devices = context_clients()
  if devices == 1:
    return loop(args)
  num_clients = jax.tree.leaves(args)[0].shape[0]
  if num_clients % devices:
    raise ValueError(
      f"{num_clients} clients do not split over the {devices} devices of the mesh's "
      f"{CLIENTS!r} axis; pad the group to a multiple (fedjax_mm.data.pad_clients)."
    )
  # One loop per device without a manual region: the clients, split [D, K / D], run
  # as a loop vmapped over the device axis, which the compiler partitions over the
  # devices (each runs its own K / D clients; the constraint pins what propagation
  # already chooses). A shard_map did the same as fast (engine_throughput --devices=2,
  # 1.10-1.13x the loop either way), but the arrays fn closes over (the server's
  # representations a CreamFL client reads by index) keep the enclosing automatic mesh
  # in their types, and a gather from them inside its manual region fails (JAX 0.10).
  split = jax.tree.map(lambda x: x.reshape((devices, -1) + x.shape[1:]), args)
  split = jax.lax.with_sharding_constraint(split, P(CLIENTS))
  out = jax.vmap(loop)(split)
  return jax.tree.map(lambda x: x.reshape((num_clients,) + x.shape[2:]), out)


def train_group(
  group: GroupDef,
  state: ClientState,
  data: ClientData,
  *,
  objective_fn: Callable[[GroupDef, PyTree], Objective] = supervised_objective,
  prox_mu: float = 0.0,
  active: Array | None = None,
  max_steps: Array | None = None,
  client_objective: Callable[[PyTree], Objective] | None = None,
) -> tuple[ClientState, dict[str, Array]]:
  """Local training of every client of a group, batched by :func:`map_clients`.

  Args:
    group: the group's static definition.
    state: stacked :class:`ClientState`.
    data: stacked :class:`ClientData`.
    objective_fn: builds a client objective from the group and its shared
      parameters (default: the supervised task loss).
    prox_mu: FedProx coefficient; the proximal centre is each client's
      parameters at the start of local training.
    active: optional ``bool [K]``: clients that train this round (sampled
      participants); inactive clients keep their state.
    max_steps: optional ``int32 [K]``: each client's step budget (stragglers,
      :func:`fedjax_mm.core.faults.step_budget`); None: every step.
    client_objective: optional ``params -> Objective`` built per client from
      its parameters at the start of local training (objectives that anchor
      to them, e.g. CreamFL's intra-modal negative); replaces ``objective_fn``
      and ``prox_mu``.

  Returns:
    ``(state, stats)`` with per-client ``loss`` and ``steps`` ``[K]``.
  """
  mask = data.sample_mask
  if active is not None:
    mask = mask & active[:, None]
  base = objective_fn(group, state.shared) if client_objective is None else None

  def one_client(params, opt_state, rng, arrays, sample_mask, budget):
    if client_objective is not None:
      objective = client_objective(params)
    else:
      objective = with_proximal_term(base, params, prox_mu) if prox_mu else base
    return local_update(
      objective,
      group.tx,
      params,
      opt_state,
      rng,
      arrays,
      sample_mask,
      num_epochs=group.local_epochs,
      batch_size=group.batch_size,
      max_steps=budget,
    )

  params, opt_state, rng, stats = map_clients(
    one_client,
    (state.params, state.opt_state, state.rng, data.arrays, mask, max_steps),
    group.client_map,
  )
  return state.replace(params=params, opt_state=opt_state, rng=rng), stats


def all_finite(tree: PyTree) -> Array:
  """Scalar ``bool``: every leaf of a pytree is finite (NaN/Inf guard of a server's state).

  The runners' one guard with :func:`finite_per_client`: whatever produced the
  non-finite value is named before the state is checkpointed.
  """
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def finite_per_client(stacked: PyTree) -> Array:
  """``bool [K]``: every leaf of each client's slice of a stacked pytree is finite.

  The NaN/Inf guard of the runners: a client whose update diverged is named
  before its state is checkpointed.
  """
  leaves = jax.tree.leaves(stacked)
  return jnp.stack([jnp.all(jnp.isfinite(x.reshape(x.shape[0], -1)), axis=1) for x in leaves]).all(
    0
  )


def apply_in_batches(fn: Callable[[PyTree], PyTree], x: PyTree, batch_size: int) -> PyTree:
  """``fn`` on ``x`` in minibatches of ``batch_size`` rows (bounded memory).

  ``x`` is an array ``[n, ...]`` or a pytree of them sharing ``n`` (e.g. a
  dict of images and captions); ``fn`` sees whole minibatches ``[b, ...]``
  (``jax.lax.map``'s own ``batch_size`` would vmap it over single examples),
  the last one padded, and may return any pytree of ``[b, ...]`` arrays.
  Equal to ``fn(x)`` for an ``fn`` that treats rows independently.
  """
  leaves = jax.tree.leaves(x)
  if not leaves:
    raise ValueError("apply_in_batches needs at least one array.")
  n = leaves[0].shape[0] if leaves[0].ndim else None
  if any(leaf.ndim == 0 or leaf.shape[0] != n for leaf in leaves):
    shapes = [leaf.shape for leaf in leaves]
    raise ValueError(f"apply_in_batches needs arrays of one leading size, got {shapes}.")
  b = max(1, min(batch_size, n))
  chunks = math.ceil(n / b)

  def split(a):
    padded = jnp.pad(a, [(0, chunks * b - n)] + [(0, 0)] * (a.ndim - 1))
    return padded.reshape((chunks, b) + a.shape[1:])

  out = jax.lax.map(fn, jax.tree.map(split, x))
  return jax.tree.map(lambda o: o.reshape((chunks * b,) + o.shape[2:])[:n], out)


def evaluate_client(
  group: GroupDef,
  params: PyTree,
  shared: PyTree,
  arrays: dict[str, Array],
  sample_mask: Array,
  *,
  batch_size: int = 128,
) -> dict[str, Array]:
  """Task loss and metric of ONE client on its (padded) evaluation set."""
  model = group.merge(params, shared)
  outputs = apply_in_batches(model, group.task.inputs(arrays), batch_size)
  targets = arrays[group.task.target_key]
  return {
    "loss": group.task.loss(outputs, targets, sample_mask),
    group.task.metric_name: group.task.metric(outputs, targets, sample_mask),
  }


def evaluate_group(
  group: GroupDef, state: ClientState, data: ClientData, *, batch_size: int = 128
) -> dict[str, Array]:
  """:func:`evaluate_client` for every client of a group: ``{name: [K]}``."""
  fn = functools.partial(evaluate_client, group, batch_size=batch_size)
  return jax.vmap(fn, in_axes=(0, None, 0, 0))(
    state.params, state.shared, data.arrays, data.sample_mask
  )
