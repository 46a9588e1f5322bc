"""Computation and bytes per round of each FedMuscle-experiment method: users and server apart.

The FedMuscle paper's point about cost: Muscle moves work to the server (the
partners' terms ``Z^m / tau`` and ``-gamma G`` are the server's), while the
Gramian loss leaves everything to the user, ``(M+1)^3`` times more per pair.
:func:`method_costs` measures it for the run's own users, from XLA's cost
analysis of lowered-and-compiled functions (:func:`fedjax_mm.core.cost.flops`),
once at start-up, without training anything; :func:`method_bytes` gives what each
baseline's users send and receive per round.

XLA counts a loop's body once (see :mod:`fedjax_mm.core.cost`), so no round
is compiled whole: each method's round is split into the steps it repeats,
each step compiled alone on one user (client 0 of its group), and the counts
are multiplied by the number of times the round runs them:

* **every method's user**: ``E * ceil(n / b)`` local steps (forward, backward,
  optimizer update of the method's own objective: the task loss; FedRCL's
  with its relaxed contrastive term; FedHeNN's with its CKA term on the
  alignment set), padded steps included (the engine computes them and masks
  the update);
* **FedMuscle's user**, per public batch (``T * floor(P / B)`` of them): encode
  the batch, its loss and gradient w.r.t. ``Z^n`` from the server's targets,
  the pullback and the CL update. Its **server**, per batch: the partner draw
  and every user's targets (``Z^m / tau`` and ``-gamma G``; the paper
  downlink's ``S^n, alpha^n``; nothing but a gather for ``pairwise`` and
  ``gramian``). The Muscle log-sum-exp is counted unchunked (``chunk_size =
  B``): a chunked one runs under ``lax.map`` and would count one chunk.
* **SAGE's user**: its local steps, then per public batch (FedMuscle's
  count, ``T * floor(P / B)``) the unlabelled step: the local and the
  global model on the weak view, the local model's forward and backward on
  the strong view, the optimizer update. Its **server** averages each task's
  heads and each architecture class's parameters, once (0 when every user is
  alone in its task).
* **CoFED's user** labels the public set once (``ceil(P / label_batch_size)``
  forward passes and its votes) and takes ``E * ceil((n + P) / b)`` local
  steps over its own and the public samples (the count of a round that keeps
  them all, as Curriculum Labeling's). Its **server** tallies the votes and
  assigns every user its pseudo-labels, once.
* **FedDF's server**, per public batch (``distill_epochs * floor(P / B)``):
  each partnered user's teacher logits and its prototype's distillation step;
  plus the fusion average, once.
* **FedHeNN's user** also computes its alignment-set kernel once; its server
  averages the ``N`` kernels.
* **FedRCL's server** averages parameters within each (task, architecture)
  class.
* **SimCLR's user** (alone), per public batch (FedMuscle's count): two
  augmented views, both encoded, NT-Xent, its gradient and the CL update.
* **Curriculum Labeling's user** (alone) labels the whole public set once
  (``ceil(P / label_batch_size)`` forward passes) and takes
  ``E * ceil((n + P) / b)`` local steps: its epochs run over its own and the
  public samples, padded where pseudo-labels are not kept (the engine
  computes those steps and masks them; the count is the final stage's, 100%).
* **Local training**, SimCLR and Curriculum Labeling have no server.

Not counted: evaluation, the random draws of the engine's batch orders, the
per-round diagnostics (FedHeNN's reported CKA distances), and every
transcendental (``exp``/``log``; XLA reports them apart).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_mm import losses, server
from fedjax_mm.algorithms import (
  cofed,
  feddf,
  fedhenn,
  fedmuscle,
  fedrcl,
  pseudo_label,
  sage,
  simclr,
)
from fedjax_mm.algorithms.base import classes_of, task_classes
from fedjax_mm.core.client import ClientData, ClientState, GroupDef, supervised_objective
from fedjax_mm.core.cost import flops
from fedjax_mm.core.ledger import tree_bytes
from fedjax_mm.server import cofed as cofed_server

PyTree = Any


@dataclasses.dataclass(frozen=True)
class MethodCost:
  """FLOPs of one round of a method.

  Attributes:
    users: per user, what its own device computes in a round.
    server: what the server computes in a round (0 when it computes nothing).
  """

  users: tuple[float, ...]
  server: float

  def to_dict(self) -> dict[str, Any]:
    return {"users": list(self.users), "users_total": sum(self.users), "server": self.server}


def _client0(tree: PyTree) -> PyTree:
  return jax.tree.map(lambda x: x[0], tree)


def _local_batch(group: GroupDef, data: ClientData) -> tuple[dict[str, jax.Array], jax.Array]:
  arrays = {k: v[0, : group.batch_size] for k, v in data.arrays.items()}
  return arrays, jnp.ones(group.batch_size, bool)


def local_steps(group: GroupDef, data: ClientData) -> int:
  """Steps of one round of local training (padded steps included, as the engine runs them)."""
  return group.local_epochs * max(1, math.ceil(data.sample_mask.shape[1] / group.batch_size))


def step_flops(
  group: GroupDef, state: ClientState, data: ClientData, make_objective, *args: Any
) -> float:
  """FLOPs of one local step of client 0 of a group.

  ``make_objective(shared, *args)`` builds the step's objective; the frozen
  ``shared`` parameters and ``args`` are arguments of the compiled function,
  never constants, so XLA cannot fold any of the work away.
  """
  batch, mask = _local_batch(group, data)

  def step(params, opt_state, shared, args, batch, mask, key):
    objective = make_objective(shared, *args)
    (_, _), grads = jax.value_and_grad(objective, has_aux=True)(params, batch, mask, key)
    updates, opt_state = group.tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params, opt = _client0(state.params), _client0(state.opt_state)
  return flops(step, params, opt, state.shared, args, batch, mask, jax.random.key(0))


def _muscle(
  mc: fedmuscle.MuscleConfig, groups, states, public, num_batches
) -> tuple[list[float], float]:
  mc = dataclasses.replace(mc, chunk_size=mc.batch_size)  # no lax.map: count every anchor
  batch = jax.tree.map(lambda x: x[: mc.batch_size], public)
  user_loss = fedmuscle.user_loss(mc)
  users = []
  for group, state in zip(groups, states, strict=True):
    params = _client0(state.params)
    tx = fedmuscle.cl_optimizer(group.tx)
    x = group.task.inputs(batch, jax.random.key(0))

    def cl_step(params, cl_opt, shared, x, targets, group=group, tx=tx):
      z, pullback = jax.vjp(lambda p: group.merge(p, shared).represent(x), params)
      _, dz = jax.value_and_grad(user_loss)(z, targets)
      (grads,) = pullback(dz)
      grads = jax.tree.map(lambda g, m: g * m, grads, fedmuscle.representation_mask(grads))
      updates, cl_opt = tx.update(grads, cl_opt, params)
      return optax.apply_updates(params, updates), cl_opt

    z = jax.eval_shape(lambda p, g=group, s=state.shared, x=x: g.merge(p, s).represent(x), params)
    others = jax.ShapeDtypeStruct((mc.num_partners, *z.shape), z.dtype)
    targets = jax.eval_shape(functools.partial(fedmuscle.server_targets, mc), others)
    users.append(num_batches * flops(cl_step, params, tx.init(params), state.shared, x, targets))
  n = len(groups)

  def server_batch(z, key):
    partners = fedmuscle.draw_partners(key, jnp.ones(n, bool), mc.num_partners)
    return jax.vmap(functools.partial(fedmuscle.server_targets, mc))(z[partners])

  z_all = jax.ShapeDtypeStruct((n, mc.batch_size, z.shape[-1]), z.dtype)
  return users, num_batches * flops(server_batch, z_all, jax.random.key(0))


def _average_flops(states: Sequence[ClientState], fusion: Sequence[int]) -> float:
  """The server's parameter average within classes (0 when every user is alone in its class)."""
  if len(set(fusion)) == len(fusion):
    return 0.0
  params = [s.params for s in states]
  weights = [jnp.ones(jax.tree.leaves(p)[0].shape[0]) for p in params]
  return flops(lambda p, w: server.average_within_classes(p, w, fusion), params, weights)


def _feddf_server(config, groups, states, public, fusion, num_batches) -> float:
  tasks = task_classes(groups)
  batch = jax.tree.map(lambda x: x[: config.batch_size], public)
  total = 0.0
  for g, (group, state) in enumerate(zip(groups, states, strict=True)):
    if tasks.count(tasks[g]) < 2:  # alone in its task: nothing to distil
      continue
    x = group.task.inputs(batch, jax.random.key(0))
    params = _client0(state.params)
    logits = lambda p, shared, x, group=group: group.merge(p, shared)(x)
    ensemble = jax.eval_shape(logits, params, state.shared, x)

    def student_step(p, opt, shared, x, ensemble, group=group, logits=logits):
      loss = lambda p: losses.ensemble_distillation(
        logits(p, shared, x), ensemble, kind=group.task.kind, temperature=config.temperature
      ).mean()
      updates, opt = group.tx.update(jax.grad(loss)(p), opt, p)
      return optax.apply_updates(p, updates), opt

    per_batch = flops(logits, params, state.shared, x)  # its teacher logits
    per_batch += flops(student_step, params, group.tx.init(params), state.shared, x, ensemble)
    total += num_batches * per_batch
  return total + _average_flops(states, fusion)


def method_costs(
  config,
  methods: Sequence[str],
  groups: Sequence[GroupDef],
  states: Sequence[ClientState],
  train_data: Sequence[ClientData],
  public: dict[str, jax.Array],
  *,
  architectures: Sequence[Hashable],
  extra: dict[str, Callable[[], MethodCost]] | None = None,
) -> dict[str, MethodCost]:
  """FLOPs per round of every method, users and server apart (module docstring).

  Args:
    config: the experiment's config (``muscle``, ``baselines``).
    methods: the methods to count, in report order.
    groups, states, train_data: one group per user (its client 0 is counted).
    public: the public set.
    architectures: per user, the architecture key FedDF and FedRCL average by.
    extra: ``{method: () -> MethodCost}`` for methods counted elsewhere.
  """
  mc = fedmuscle.MuscleConfig(**config.muscle.to_dict())
  block = config.get("baselines") or {}
  kw = lambda name: dict(block[name].to_dict()) if name in block else {}
  fusion = classes_of(zip(task_classes(groups), architectures, strict=True))
  num_public = jax.tree.leaves(public)[0].shape[0]
  steps = [local_steps(g, d) for g, d in zip(groups, train_data, strict=True)]

  def per_user_steps(objective_fn):
    return [
      n * step_flops(g, s, d, functools.partial(objective_fn, g))
      for n, g, s, d in zip(steps, groups, states, train_data, strict=True)
    ]

  supervised = functools.cache(lambda: per_user_steps(supervised_objective))
  out = {}
  for m in methods:
    if m == "local":
      out[m] = MethodCost(tuple(supervised()), 0.0)
    elif m == "fedmuscle":
      cl, srv = _muscle(mc, groups, states, public, mc.cl_epochs * (num_public // mc.batch_size))
      out[m] = MethodCost(tuple(a + b for a, b in zip(supervised(), cl, strict=True)), srv)
    elif m == "sage":
      cfg = sage.SageConfig(batch_size=mc.batch_size, epochs=mc.cl_epochs, **kw("sage"))
      batches = cfg.epochs * (num_public // cfg.batch_size)
      ssl = _sage_users(cfg, groups, states, public, batches)
      tasks = task_classes(groups)
      out[m] = MethodCost(
        tuple(a + b for a, b in zip(supervised(), ssl, strict=True)),
        _sage_server(states, train_data, tasks, architectures, num_public),
      )
    elif m == "cofed":
      cfg = cofed.CoFEDConfig(**kw("cofed"))
      out[m] = _cofed(cfg, groups, states, train_data, public)
    elif m == "feddf":
      cfg = feddf.FedDFConfig(batch_size=mc.batch_size, **kw("feddf"))
      batches = cfg.distill_epochs * (num_public // cfg.batch_size)
      out[m] = MethodCost(
        tuple(supervised()), _feddf_server(cfg, groups, states, public, fusion, batches)
      )
    elif m == "fedrcl":
      cfg = fedrcl.FedRCLConfig(**kw("fedrcl"))
      users = per_user_steps(functools.partial(fedrcl.rcl_objective, cfg))
      out[m] = MethodCost(tuple(users), _average_flops(states, fusion))
    elif m == "fedhenn":
      out[m] = _fedhenn(fedhenn.FedHeNNConfig(**kw("fedhenn")), groups, states, train_data, public)
    elif m == "simclr":
      cfg = simclr.SimCLRConfig(batch_size=mc.batch_size, cl_epochs=mc.cl_epochs, **kw("simclr"))
      cl = _simclr(cfg, groups, states, public, cfg.cl_epochs * (num_public // cfg.batch_size))
      out[m] = MethodCost(tuple(a + b for a, b in zip(supervised(), cl, strict=True)), 0.0)
    elif m == "pseudo_label":
      cfg = pseudo_label.PseudoLabelConfig(num_rounds=config.rounds, **kw("pseudo_label"))
      out[m] = MethodCost(tuple(_pseudo_label(cfg, groups, states, train_data, public)), 0.0)
    elif extra and m in extra:
      out[m] = extra[m]()
    else:
      raise ValueError(f"no FLOPs count for method {m!r}.")
  return out


def _fedhenn(config, groups, states, train_data, public) -> MethodCost:
  rad = jax.tree.map(lambda x: x[: config.rad_size], public)
  target = jax.ShapeDtypeStruct((config.rad_size, config.rad_size), jnp.float32)
  users = []
  for group, state, data in zip(groups, states, train_data, strict=True):
    x = group.task.inputs(rad)
    params = _client0(state.params)
    kernel = lambda p, shared, x, group=group: losses.linear_kernel(
      group.merge(p, shared).represent(x)
    )
    objective = lambda shared, x, target, group=group: fedhenn.proximal_objective(
      config, group, shared, x=x, target=target
    )
    step = step_flops(group, state, data, objective, x, target)
    users.append(flops(kernel, params, state.shared, x) + local_steps(group, data) * step)
  kernels = jax.ShapeDtypeStruct((len(groups), config.rad_size, config.rad_size), jnp.float32)
  present = jax.ShapeDtypeStruct((len(groups),), jnp.bool_)
  return MethodCost(tuple(users), flops(server.weighted_mean, kernels, present))


def _simclr(config, groups, states, public, num_batches) -> list[float]:
  batch = jax.tree.map(lambda x: x[: config.batch_size], public)
  users = []
  for group, state in zip(groups, states, strict=True):
    tx = fedmuscle.cl_optimizer(group.tx)
    loss = simclr.simclr_loss(group, config)

    def cl_step(params, cl_opt, shared, batch, key, tx=tx, loss=loss):
      grads = jax.grad(loss)(params, shared, batch, key)
      grads = jax.tree.map(lambda g, m: g * m, grads, fedmuscle.representation_mask(grads))
      updates, cl_opt = tx.update(grads, cl_opt, params)
      return optax.apply_updates(params, updates), cl_opt

    params = _client0(state.params)
    args = (params, tx.init(params), state.shared, batch, jax.random.key(0))
    users.append(num_batches * flops(cl_step, *args))
  return users


def _sage_users(config, groups, states, public, num_batches) -> list[float]:
  batch = jax.tree.map(lambda x: x[: config.batch_size], public)
  users = []
  for group, state in zip(groups, states, strict=True):
    objective = sage.unlabeled_objective(group, config)

    def ssl_step(params, start, opt, shared, batch, key, group=group, objective=objective):
      grads, _ = jax.grad(objective, has_aux=True)(params, start, shared, batch, key)
      updates, opt = group.tx.update(grads, opt, params)
      return optax.apply_updates(params, updates), opt

    params = _client0(state.params)
    args = (params, params, _client0(state.opt_state), state.shared, batch, jax.random.key(0))
    users.append(num_batches * flops(ssl_step, *args))
  return users


def _sage_server(states, train_data, tasks, architectures, num_public) -> float:
  params = [s.params for s in states]
  partners = sage.averaged_leaves(params, tasks, architectures)
  if all(len(set(a + h)) == 1 for a, h in partners):  # every user alone in its task
    return 0.0
  weights = [d.num_samples + num_public for d in train_data]
  receive = [d.client_mask for d in train_data]
  return flops(lambda p, w, r: sage.fuse(p, w, r, partners), params, weights, receive)


def _cofed(config, groups, states, train_data, public) -> MethodCost:
  num_public = jax.tree.leaves(public)[0].shape[0]
  label_batch = min(config.label_batch_size, num_public)
  implies = jnp.asarray(cofed.world_implications())
  users, votes, statements = [], [], []
  for group, state, data in zip(groups, states, train_data, strict=True):
    st = cofed.world_statements(group.task)
    params = _client0(state.params)
    n = data.sample_mask.shape[1]
    if st is not None:
      x = group.task.inputs(jax.tree.map(lambda v: v[:label_batch], public))
      forward = lambda p, shared, x, group=group: cofed_server.confident_votes(
        cofed.head_probs(group.task, group.merge(p, shared)(x)), margin=config.margin
      )
      labelling = math.ceil(num_public / label_batch) * flops(forward, params, state.shared, x)
      votes.append(jax.ShapeDtypeStruct((num_public, st.shape[0]), jnp.int32))
      statements.append(jnp.asarray(st))
      n += num_public
    else:  # takes no part: local training
      labelling = 0.0
    steps = group.local_epochs * max(1, math.ceil(n / group.batch_size))
    users.append(labelling + steps * step_flops(group, state, data, _supervised(group)))
  if not votes:
    return MethodCost(tuple(users), 0.0)

  def server_step(votes):
    asserts = [
      cofed_server.asserted(v, st, implies) for v, st in zip(votes, statements, strict=True)
    ]
    can = jnp.stack([cofed_server.expressible(st, implies) for st in statements])
    kept, _ = cofed_server.consensus(
      jnp.stack(asserts), can, jnp.ones(len(votes)), threshold=config.threshold
    )
    return [cofed_server.assign(kept, st) for st in statements]

  return MethodCost(tuple(users), flops(server_step, votes))


def _pseudo_label(config, groups, states, train_data, public) -> list[float]:
  num_public = jax.tree.leaves(public)[0].shape[0]
  label_batch = min(config.label_batch_size, num_public)
  users = []
  for group, state, data in zip(groups, states, train_data, strict=True):
    x = group.task.inputs(jax.tree.map(lambda v: v[:label_batch], public))
    params = _client0(state.params)
    forward = lambda p, shared, x, group=group: pseudo_label.pseudo_labels(
      group.task, group.merge(p, shared)(x)
    )
    labelling = math.ceil(num_public / label_batch) * flops(forward, params, state.shared, x)
    n = data.sample_mask.shape[1] + num_public
    steps = group.local_epochs * max(1, math.ceil(n / group.batch_size))
    users.append(labelling + steps * step_flops(group, state, data, _supervised(group)))
  return users


def _supervised(group: GroupDef):
  return functools.partial(supervised_objective, group)


def method_bytes(
  methods, states, tasks, archs, statements, *, rad_size: int, num_public: int
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Bytes each user sends and receives per round under each baseline: ``{m: (up, down)}``.

    ``states``: each user's (a group of one); ``tasks`` / ``archs``: each user's task and
    architecture; ``statements``: each user's CoFED statements
    (:func:`fedjax_mm.algorithms.cofed.world_statements`); ``rad_size``: FedHeNN's alignment
    set; ``num_public``: the public set's size.

  Bytes each user sends and receives per round under each baseline: ``{m: (up, down)}``.

    * SAGE: a user with another user of its task uploads the parameters it
      averages (its head; every trained parameter when it also has an
      architecture partner) and downloads their average; a user alone in its
      task sends nothing.
    * CoFED: every voting user uploads ``int32 [P, H]`` votes and downloads
      ``int32 [P, H]`` pseudo-labels (``H`` = 1, or the labels of a multi-label
      user); segmentation users take no part.
    * FedDF: a user with a partner (another user of its task) uploads its trained
      parameters and downloads its prototype's distilled ones; a user alone in its
      task sends nothing.
    * FedRCL: a user with another user of its task and architecture uploads and
      downloads its parameters; a user alone in its class sends nothing (its
      average would be itself).
    * FedHeNN: every user uploads its ``[R, R]`` float32 kernel of the alignment
      set and downloads the server's ``K_bar``, of the same size.
  """
  params = np.array([tree_bytes(s.params) for s in states], np.int64)  # K = 1 each
  partner = np.array([tasks.count(t) > 1 for t in tasks])
  same_class = list(zip(tasks, archs, strict=True))
  classmate = np.array([same_class.count(c) > 1 for c in same_class])
  kernel = np.full(len(tasks), 4 * rad_size * rad_size, np.int64)
  votes = np.array([tree_bytes(cofed.messages(s, num_public)[:1]) for s in statements], np.int64)
  shared = _sage_bytes(states, tasks, archs)
  out = {
    "sage": (shared, shared),
    "cofed": (votes, votes),
    "feddf": (params * partner, params * partner),
    "fedrcl": (params * classmate, params * classmate),
    "fedhenn": (kernel, kernel),
    # Each user alone: nothing crosses the wire (a ledger of zeros, not a missing one).
    "simclr": (np.zeros(len(tasks), np.int64),) * 2,
    "pseudo_label": (np.zeros(len(tasks), np.int64),) * 2,
  }
  return {m: v for m, v in out.items() if m in methods}


def _sage_bytes(states, tasks, archs) -> np.ndarray:
  """Per user, the bytes of the parameters SAGE averages (each way); 0 for a user alone in its task."""
  partners = sage.averaged_leaves([s.params for s in states], tasks, archs)
  out = []
  for s, (arch, head) in zip(states, partners, strict=True):
    whole = len(arch) > 1  # an architecture partner: every trained parameter
    sent = jax.tree_util.tree_map_with_path(
      lambda path, x, whole=whole: x if whole or sage.is_head(path) else None, s.params
    )
    out.append(tree_bytes(sent) if len(set(arch + head)) > 1 else 0)
  return np.array(out, np.int64)
