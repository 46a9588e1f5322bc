r"""FedMuscle: federated multi-task learning by aligning representation spaces.

Paper: ``fedmuscle_muscle_loss.txt`` — Algorithm 1, Section 5, eqs. (3) and (5).

Users with different models and tasks share nothing but a public data set. One
round (Algorithm 1, lines 4-14):

1. **Local update** (line 5): every user trains its whole model
   ``theta^n = {w^n, phi^n}`` for ``E`` epochs on its own task
   (:func:`fedjax_mm.core.train_group`).
2. **CL epochs** (lines 6-13): ``T`` passes over the public set in batches of
   ``B``. For each batch:

   * every user encodes the batch with its representation model ``w^n``
     (images or captions, whichever its task reads) and sends
     ``Z^n`` ``[B, d]`` (uplink);
   * the server draws, for each user, ``M`` partners uniformly among the
     *other* users present (fresh for every batch, from the run's key: Sec. 5
     says "in each communication round and CL epoch" and Algorithm 1 line 10
     leaves it open; a draw per batch is our reading) and
     computes each user's targets from the partners' matrices — all users at
     once, ``vmap``-ped (:func:`fedjax_mm.losses.muscle_server_targets`, or the
     paper's ``S^n, alpha^n`` with ``downlink="paper"``);
   * each user minimises its contrastive loss (eq. (5)) and updates ``w^n``
     only; its head ``phi^n`` is untouched (its gradient is zero and the CL
     optimizer is masked to the representation parameters).

Forward once: the representation a user sends is the one it differentiates
through. Each group's encoder runs once per batch under ``jax.vjp`` and the
pullback is applied to the cotangent ``dL/dZ^n`` that the user computes from
the server's answer; the encoder is never run a second time.

Users with the same architecture and task may share a group (one ``vmap``);
heterogeneous users are separate groups, and the round is one traced function
over the tuple of groups. Padding clients send nothing, are never chosen as
partners, and receive no update.

The contrastive loss is selectable (the paper's Figure 2 / Table 4):
``muscle`` (eq. (3)), ``pairwise`` (sum of InfoNCE, Sec. 4.1) or ``gramian``
(App. J).

Client faults (:mod:`fedjax_mm.core.faults`, off by default), drawn once per
round over all users: a **dropped** user takes no part in the round (its
local task update is lost — it takes no step — and in the CL epochs it sends
nothing, is never a partner and gets no update); a **straggler** takes only
its drawn share of local task steps; a **Byzantine** user sends corrupted
``Z^n`` (random unit vectors, or scaled) in every CL batch — what crosses the
wire, so its partners' losses see it — and ignores the server's answer (no CL
update of its own).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from fedjax_mm import losses
from fedjax_mm.algorithms.base import Algorithm
from fedjax_mm.core import faults as faults_lib
from fedjax_mm.core.client import ClientData, ClientState, GroupDef, train_group
from fedjax_mm.core.sharding import replicate, shard_clients
from fedjax_mm.server import aggregate

Array = jax.Array
PyTree = Any

LOSSES = ("muscle", "pairwise", "gramian")
DOWNLINKS = ("factored", "paper")


@dataclasses.dataclass(frozen=True)
class MuscleConfig:
  """Hyperparameters of the CL epochs (paper defaults, Section 6).

  Attributes:
    num_partners: ``M``, partners drawn per user and batch (``M < N``).
    batch_size: ``B``, public samples per batch.
    cl_epochs: ``T``, passes over the public set per round.
    tau_full: ``tau^{(M+1)}``, anchor-partner temperature.
    tau_reduced: ``tau^{(M)}``; ``gamma = 1/tau_reduced - 1/tau_full > 0``.
    loss: ``"muscle"``, ``"pairwise"`` or ``"gramian"``.
    downlink: ``"factored"`` (``Z^m / tau`` and ``-gamma G``) or ``"paper"``
      (``S^n`` ``[B^M, d]`` and ``alpha^n`` ``[B^M]``); same loss, same models.
    chunk_size: anchors per chunk of the Muscle log-sum-exp (None: automatic).
  """

  num_partners: int = 3
  batch_size: int = 32
  cl_epochs: int = 1
  tau_full: float = 0.2
  tau_reduced: float = 0.15
  loss: str = "muscle"
  downlink: str = "factored"
  chunk_size: int | None = None

  @property
  def gamma(self) -> float:
    return 1.0 / self.tau_reduced - 1.0 / self.tau_full

  def validate(self, num_users: int) -> None:
    """Raises ``ValueError`` with a one-line message for an impossible config."""
    if self.loss not in LOSSES:
      raise ValueError(f"muscle.loss must be one of {LOSSES}, got {self.loss!r}.")
    if self.downlink not in DOWNLINKS:
      raise ValueError(f"muscle.downlink must be one of {DOWNLINKS}, got {self.downlink!r}.")
    if not 1 <= self.num_partners < num_users:
      raise ValueError(
        f"muscle.num_partners (M={self.num_partners}) must be between 1 and the number of users - 1 ({num_users - 1})."
      )
    if self.batch_size < 2:
      raise ValueError(f"muscle.batch_size (B={self.batch_size}) must be at least 2.")
    if self.cl_epochs < 0:
      raise ValueError(f"muscle.cl_epochs (T={self.cl_epochs}) must be >= 0.")
    if self.tau_full <= 0 or self.tau_reduced <= 0:
      raise ValueError("muscle.tau_full and muscle.tau_reduced must be positive.")
    if self.loss == "muscle" and not self.tau_reduced < self.tau_full:
      raise ValueError(
        f"muscle.tau_reduced ({self.tau_reduced}) must be < muscle.tau_full ({self.tau_full}) so that gamma > 0 (paper App. C)."
      )


@struct.dataclass
class FedMuscleState:
  """State of a FedMuscle run.

  Attributes:
    round: ``int32`` scalar, rounds completed.
    rng: server key (partner draws, public-set order).
    groups: per group, the stacked task-training state.
    cl_opt_state: per group, the stacked optimizer state of the CL updates
      (masked to the representation parameters).
  """

  round: Array
  rng: Array
  groups: tuple[ClientState, ...]
  cl_opt_state: tuple[PyTree, ...]

  def place(self, mesh) -> FedMuscleState:
    return FedMuscleState(
      *replicate((self.round, self.rng), mesh),
      groups=tuple(g.place(mesh) for g in self.groups),
      cl_opt_state=tuple(shard_clients(o, mesh) for o in self.cl_opt_state),
    )


def is_representation(path: tuple[Any, ...]) -> bool:
  """True for parameters of the representation model ``w^n`` (encoder + projector)."""
  return aggregate.path_contains("encoder", "projector")(path)


def representation_mask(params: PyTree) -> PyTree:
  """Boolean pytree: which leaves of ``params`` belong to ``w^n``."""
  return jax.tree_util.tree_map_with_path(lambda path, _: is_representation(path), params)


def cl_optimizer(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """The group's optimizer restricted to the representation parameters.

  Head gradients are zeroed before this transform and ``optax.masked`` passes
  them through unchanged, so the head never moves in CL epochs (not even by
  AdamW's weight decay).
  """
  return optax.masked(tx, representation_mask)


def draw_partners(key: Array, present: Array, num_partners: int) -> Array:
  """``int32 [N, M]``: for each user, ``M`` distinct other present users, uniformly.

  Args:
    key: PRNG key of this batch.
    present: ``bool [N]`` users taking part (padding clients are absent).
    num_partners: ``M`` (static).

  Returns:
    Partner indices into the user axis. Rows of absent users are arbitrary.
  """
  n = present.shape[0]
  scores = jax.random.uniform(key, (n, n))
  allowed = present[None, :] & ~jnp.eye(n, dtype=bool)
  return jax.lax.top_k(jnp.where(allowed, scores, -1.0), num_partners)[1]


def _flatten_users(per_group: Sequence[Array]) -> Array:
  return jnp.concatenate(list(per_group), axis=0)


def server_targets(config: MuscleConfig, others: Array) -> PyTree:
  """What the server computes for ONE user from its partners' ``Z^m`` ``[M, B, d]``.

  The Muscle loss's server half (``muscle_server_targets``, or the paper's
  ``S^n, alpha^n``); the partners' matrices themselves for ``pairwise`` and
  ``gramian``, whose whole loss is the user's.
  """
  tau, gamma = config.tau_full, config.gamma
  if config.loss == "muscle" and config.downlink == "factored":
    return losses.muscle_server_targets(others, tau=tau, gamma=gamma)
  if config.loss == "muscle":
    return losses.muscle_paper_targets(others, tau=tau, gamma=gamma)
  return others


def user_loss(config: MuscleConfig) -> Callable[[Array, PyTree], Array]:
  """``(Z^n [B, d], targets) -> mean loss``: the user's half of its contrastive loss."""
  tau = config.tau_full
  if config.loss == "muscle" and config.downlink == "factored":
    # tau and gamma are static config: the client may contract in the exp domain.
    logit_range = losses.muscle_logit_range(tau, config.gamma, config.num_partners)
    return lambda z_n, t: losses.muscle_client_loss(
      z_n, t, chunk_size=config.chunk_size, logit_range=logit_range
    ).mean()
  if config.loss == "muscle":
    return lambda z_n, t: losses.muscle_loss_from_paper_targets(z_n, *t).mean()
  if config.loss == "pairwise":
    return lambda z_n, o: losses.pairwise_info_nce(z_n, o, tau=tau).mean()
  return lambda z_n, o: losses.gramian_loss(z_n, o, tau=tau).mean()


def user_gradients(config: MuscleConfig, z: Array, partners: Array) -> tuple[Array, Array]:
  """Server targets and each user's loss gradient w.r.t. its own ``Z^n``.

  Args:
    config: CL hyperparameters.
    z: ``[N, B, d]`` every user's representation matrix.
    partners: ``int32 [N, M]`` partner indices.

  Returns:
    ``(loss [N], dL/dZ [N, B, d])``. Targets are constants for the user: its
    gradient flows only into its own representation.
  """
  others = jax.lax.stop_gradient(z[partners])  # [N, M, B, d]: what the server combines.
  targets = jax.vmap(functools.partial(server_targets, config))(others)
  return jax.vmap(jax.value_and_grad(user_loss(config)))(z, targets)


def downlink_shapes(config: MuscleConfig, dim: int) -> PyTree:
  """Abstract shapes of what the server sends ONE user per batch (for the ledger)."""
  others = jax.ShapeDtypeStruct((config.num_partners, config.batch_size, dim), jnp.float32)
  if config.loss != "muscle":
    return others
  if config.downlink == "paper":
    return jax.eval_shape(lambda o: losses.muscle_paper_targets(o, tau=1.0, gamma=1.0), others)
  return jax.eval_shape(lambda o: losses.muscle_server_targets(o, tau=1.0, gamma=1.0), others)


def _encode(group: GroupDef, fn, state: ClientState, inputs: Array):
  """``Z`` ``[K, B, d]`` of every client of a group, and the pullback to its params."""

  def per_client(params):
    return jax.vmap(lambda p: fn(group, p, state.shared, inputs))(params)

  return jax.vjp(per_client, state.params)  # Forward once: keep the pullback.


def public_batches(key: Array, public: dict[str, Array], batch_size: int):
  """One epoch of the public set in a fresh order: ``[num_batches, B, ...]`` + keys.

  Full batches only: the ``num_public % B`` samples left over in this order are not
  used this epoch (8 of the paper's 5000 at B = 32), as a drop-last loader would.
  """
  num_public = jax.tree.leaves(public)[0].shape[0]
  num_batches = num_public // batch_size
  order = jax.random.permutation(key, num_public)[: num_batches * batch_size].reshape(
    num_batches, batch_size
  )
  batches = jax.tree.map(lambda x: x[order], public)
  keys = jax.random.split(jax.random.fold_in(key, 1), num_batches)
  return batches, keys


def public_epochs(
  step, carry, key: Array, public: dict[str, Array], *, batch_size: int, epochs: int
):
  """``epochs`` passes of a scanned ``step(carry, (batch, key))`` over the public set.

  Epoch ``e`` takes :func:`public_batches` of ``fold_in(key, e)``, so every method
  that calls this with the round's key (FedMuscle's CL epochs, SimCLR's, FedDF's
  distillation) sees the same batches in the same order. Returns the final carry
  and the mean over epochs of each epoch's mean output over its batches (``None``
  when ``epochs`` is 0).
  """
  per_epoch = []
  for epoch in range(epochs):
    batches, keys = public_batches(jax.random.fold_in(key, epoch), public, batch_size)
    carry, out = jax.lax.scan(step, carry, (batches, keys))
    per_epoch.append(jax.tree.map(lambda x: x.mean(0), out))
  if not per_epoch:
    return carry, None
  return carry, jax.tree.map(lambda *xs: jnp.mean(jnp.stack(xs), 0), *per_epoch)


def fedmuscle(
  groups: Sequence[GroupDef],
  config: MuscleConfig,
  *,
  represent_fns: Sequence[Callable[[GroupDef, PyTree, PyTree, Array], Array]] | None = None,
  faults: faults_lib.Faults = faults_lib.NONE,
) -> Algorithm:
  """FedMuscle over a tuple of groups, as an :class:`Algorithm`.

  ``round(state, data, public)`` takes the per-group :class:`ClientData` and
  the public set ``public`` (dict of ``[P, ...]`` arrays with the modalities
  the users read). It returns per-group task-training stats and the mean CL
  loss per user.

  Args:
    groups: the users' groups.
    config: CL hyperparameters.
    represent_fns: optional per-group ``(group, params, shared, inputs) -> Z``
      (default: ``model.represent``).
    faults: simulated client faults (default: none); with faults ``stats``
      gains ``fault_counts`` (dropped / stragglers / Byzantine users).
  """
  groups = tuple(groups)
  cl_txs = tuple(cl_optimizer(g.tx) for g in groups)

  def represent(group, params, shared, inputs):
    return group.merge(params, shared).represent(inputs)

  represent_fns = tuple(represent_fns or (represent,) * len(groups))

  def init(states: Sequence[ClientState], key: Array) -> FedMuscleState:
    cl_opt = tuple(jax.vmap(tx.init)(s.params) for tx, s in zip(cl_txs, states, strict=True))
    return FedMuscleState(
      round=jnp.zeros((), jnp.int32), rng=key, groups=tuple(states), cl_opt_state=cl_opt
    )

  def cl_batch(carry, xs, data, masks=None):
    states, cl_opts = carry
    batch, key = xs
    zs, pullbacks = [], []
    for group, fn, state in zip(groups, represent_fns, states, strict=True):
      z, pullback = _encode(group, fn, state, group.task.inputs(batch, jax.random.fold_in(key, 1)))
      zs.append(z)
      pullbacks.append(pullback)
    present = _flatten_users([d.client_mask for d in data])
    z = _flatten_users(zs)
    receives = present
    if masks is not None:
      present = present & ~masks.dropped
      receives = present & ~masks.byzantine
      if faults.has_byzantine:
        z = faults_lib.corrupt_representations(
          jax.random.fold_in(key, 2), z, masks.byzantine, faults
        )
    partners = draw_partners(jax.random.fold_in(key, 0), present, config.num_partners)
    if masks is not None:
      # With users dropped, fewer than M others may be present: such a user sits out the batch.
      full = jnp.all(present[partners], axis=1)
      present, receives = present & full, receives & full
    loss, dz = user_gradients(config, z, partners)

    new_states, new_opts, offset = [], [], 0
    for tx, state, cl_opt, pullback, d in zip(
      cl_txs, states, cl_opts, pullbacks, data, strict=True
    ):
      k = d.num_clients
      cot = dz[offset : offset + k] * receives[offset : offset + k, None, None]
      offset += k
      (grads,) = pullback(cot)
      grads = jax.tree.map(lambda g, m: g * m, grads, representation_mask(grads))
      updates, new_opt = jax.vmap(tx.update)(grads, cl_opt, state.params)
      params = optax.apply_updates(state.params, updates)
      if masks is not None:
        # A zero gradient still moves AdamW (momentum, weight decay): users that take no
        # part in this batch keep their parameters and CL optimizer state exactly.
        skip = ~receives[offset - k : offset]
        params = faults_lib.keep_where(skip, state.params, params)
        new_opt = faults_lib.keep_where(skip, cl_opt, new_opt)
      new_states.append(state.replace(params=params))
      new_opts.append(new_opt)
    return (tuple(new_states), tuple(new_opts)), jnp.where(present, loss, 0.0)

  def round_fn(state: FedMuscleState, data: Sequence[ClientData], public: dict[str, Array]):
    key = jax.random.fold_in(state.rng, state.round)
    new_groups, stats = [], {}
    masks = None
    if faults.enabled:
      users = _flatten_users([d.client_mask for d in data])
      masks = faults_lib.draw(jax.random.fold_in(key, faults_lib.SALT), users, faults)
      stats["fault_counts"] = masks.counts()
    offset = 0
    for group, client_state, client_data in zip(groups, state.groups, data, strict=True):
      if masks is None:
        client_state, group_stats = train_group(group, client_state, client_data)
      else:
        k = client_data.num_clients
        budget = faults_lib.step_budget(
          masks.work[offset : offset + k],
          client_data.num_samples,
          num_epochs=group.local_epochs,
          batch_size=group.batch_size,
        )
        client_state, group_stats = train_group(
          group,
          client_state,
          client_data,
          active=client_data.client_mask & ~masks.dropped[offset : offset + k],
          max_steps=budget,
        )
        offset += k
      new_groups.append(client_state)
      stats[group.name] = group_stats

    (new_groups, cl_opt_state), stats["cl_loss"] = public_epochs(
      functools.partial(cl_batch, data=data, masks=masks),
      (tuple(new_groups), state.cl_opt_state),
      key,
      public,
      batch_size=config.batch_size,
      epochs=config.cl_epochs,
    )
    new_state = state.replace(round=state.round + 1, groups=new_groups, cl_opt_state=cl_opt_state)
    return new_state, stats

  return Algorithm(init=init, round=round_fn)
