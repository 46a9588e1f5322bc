r"""FedDF: parameter averaging, then ensemble distillation on the public set.

Paper: Lin, Kong, Stich and Jaggi, "Ensemble Distillation for Robust Model
Fusion in Federated Learning", NeurIPS 2020 (arXiv 2006.07242), Algorithm 1
(and Algorithm 3 for heterogeneous architectures). One round:

1. every client trains locally on its own data (lines 3-5);
2. **fusion** (line 7): the server averages the received models of each
   architecture ("prototype") ``x_g = sum_k n_k x_k / sum_k n_k``;
3. **ensemble distillation** (lines 8-10): each fused model is trained on
   unlabelled server data ``d`` (here: the public set) to match the softmax of
   the *average of the logits* of all received client models, by
   ``KL(sigma(mean_k f(x_k, d)) || sigma(f(x_g, d)))``
   (:func:`fedjax_mm.losses.ensemble_distillation`), with Adam;
4. the clients of each architecture receive its distilled model.

FedMuscle's Table 1 runs FedDF on users with different tasks and models; the
paper's remark (Sec. 2: "knowledge can only be transferred among models with
the same logit size (i.e., models associated with the same task)") fixes the
adaptation. Every choice made here:

* **Averaging** only among users of the same task *and* the same encoder
  architecture (``architectures[g]`` equal, checked to have identical
  parameter trees): a "prototype" of FedDF is a (task, architecture) pair.
  Under LoRA only the trained parameters (adapters, projector, head) are
  averaged; the frozen base weights are identical by construction.
  Weights ``n_k`` (training samples), as FedAvg.
* **Distillation** only among users of the same task: the teacher ensemble of
  a task is the uniform mean of the logits of its present users' models after
  local training (before fusion, as Algorithm 1), and every prototype of that
  task is distilled toward it. Tasks that differ never meet: no logit, no
  parameter crosses a task boundary (tested).
* **A user with no partner** (the only user of its task, like the paper's
  IC10 user) just trains locally: its round is local training, bit for bit.
* The distillation target keeps each task's output distribution: softmax over
  classes, per-label sigmoids for multi-label users, per-pixel softmax for
  segmentation (:mod:`fedjax_mm.losses.feddf`); temperature 1 (the paper's).
* **Budget**: ``distill_epochs`` passes over the public set in batches of
  ``batch_size``, the same batches in the same order as FedMuscle's CL epochs
  (:func:`fedjax_mm.algorithms.fedmuscle.public_epochs` from the same round
  key), so the comparison is paired; the paper instead runs a fixed number of
  Adam steps with early stopping on a held-out set, which the users here do
  not have. The distillation optimizer is the group's own (AdamW at the
  experiment's rate), freshly initialised every round on the server; each
  user's task optimizer state stays its own.
* Caption inputs pick one caption per sample with the batch's key, as in
  FedMuscle.

What crosses the wire per round: each user with a partner uploads its
trained parameters and downloads its prototype's distilled ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import optax

from fedjax_mm import losses, server
from fedjax_mm.algorithms.base import (
  Algorithm,
  FederatedState,
  check_same_shapes,
  classes_of,
  task_classes,
)
from fedjax_mm.algorithms.fedmuscle import public_epochs
from fedjax_mm.core.client import ClientData, ClientState, GroupDef, train_group

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class FedDFConfig:
  """FedDF's server distillation.

  Attributes:
    batch_size: public samples per distillation step (FedMuscle's ``B``).
    distill_epochs: passes over the public set per round.
    temperature: ``T`` of both softmaxes (1 in the paper).
  """

  batch_size: int = 32
  distill_epochs: int = 1
  temperature: float = 1.0


def _logits(group: GroupDef, params, shared, x: Array) -> Array:
  """Task outputs ``[K, b, ...]`` of every client of a group on the same inputs."""
  return jax.vmap(lambda p: group.merge(p, shared)(x))(params)


def feddf(
  groups: Sequence[GroupDef],
  config: FedDFConfig,
  *,
  architectures: Sequence[Hashable],
) -> Algorithm:
  """FedDF over a tuple of groups, as an :class:`Algorithm`.

  ``round(state, data, public)`` takes the per-group :class:`ClientData` and
  the public set (dict of ``[P, ...]`` arrays). Its stats hold each group's
  local-training stats and ``distill_loss`` ``[N]`` (the mean distillation
  loss of each user's prototype this round; 0 for users without a partner).

  Args:
    groups: the users' groups.
    config: distillation hyperparameters.
    architectures: per group, a hashable naming its model architecture (e.g.
      the encoder name and LoRA rank); groups with the same task and
      architecture are averaged together.
  """
  groups = tuple(groups)
  tasks = task_classes(groups)
  fusion = classes_of(zip(tasks, architectures, strict=True))
  members = {t: [g for g, tg in enumerate(tasks) if tg == t] for t in dict.fromkeys(tasks)}

  def init(states: Sequence[ClientState], key: Array) -> FederatedState:
    check_same_shapes(states, fusion)
    return FederatedState(round=jnp.zeros((), jnp.int32), rng=key, groups=tuple(states))

  def round_fn(state: FederatedState, data: Sequence[ClientData], public: dict[str, Array]):
    key = jax.random.fold_in(state.rng, state.round)
    trained, stats = [], {}
    for group, client_state, client_data in zip(groups, state.groups, data, strict=True):
      client_state, group_stats = train_group(group, client_state, client_data)
      trained.append(client_state)
      stats[group.name] = group_stats

    teachers = tuple(s.params for s in trained)
    present = [d.client_mask for d in data]
    fused = server.average_within_classes(
      teachers, [d.num_samples * d.client_mask for d in data], fusion
    )
    # Tasks with a single client slot have no partner at all: nothing to distil (static).
    distilled = [t for t, gs in members.items() if sum(data[g].num_clients for g in gs) >= 2]
    students = [g for t in distilled for g in members[t]]
    params = {g: fused[g] for g in students}
    opts = {g: jax.vmap(groups[g].tx.init)(fused[g]) for g in students}
    shared = [s.shared for s in trained]

    def step(carry, xs):
      params, opts = carry
      batch, batch_key = xs
      batch_losses = {}
      for t in distilled:
        inputs = {
          g: groups[g].task.inputs(batch, jax.random.fold_in(batch_key, 1)) for g in members[t]
        }
        # The ensemble: uniform mean of the present users' logits (teachers are fixed).
        total = sum(
          jnp.einsum(
            "k,k...->...",
            present[g].astype(jnp.float32),
            _logits(groups[g], teachers[g], shared[g], inputs[g]),
          )
          for g in members[t]
        )
        count = sum(jnp.sum(present[g]) for g in members[t])
        ensemble = jax.lax.stop_gradient(total / jnp.maximum(count, 1))
        for g in members[t]:
          group = groups[g]

          def loss_fn(p, group=group, x=inputs[g], sh=shared[g], ensemble=ensemble):
            out = group.merge(p, sh)(x)
            return losses.ensemble_distillation(
              out, ensemble, kind=group.task.kind, temperature=config.temperature
            ).mean()

          loss, grads = jax.vmap(jax.value_and_grad(loss_fn))(params[g])
          updates, new_opt = jax.vmap(group.tx.update)(grads, opts[g], params[g])
          params[g] = optax.apply_updates(params[g], updates)
          opts[g] = new_opt
          batch_losses[g] = loss
      return (params, opts), batch_losses

    (params, opts), epoch_loss = public_epochs(
      step,
      (params, opts),
      key,
      public,
      batch_size=config.batch_size,
      epochs=config.distill_epochs if students else 0,
    )

    new_groups, distill_loss = [], []
    for g, (client_state, d) in enumerate(zip(trained, data, strict=True)):
      new_params, loss = fused[g], jnp.zeros(d.num_clients)
      if g in params:
        t = tasks[g]
        # A task left with fewer than two present users has no ensemble to learn from.
        partnered = sum(jnp.sum(present[h]) for h in members[t]) >= 2
        receive = partnered & d.client_mask
        new_params = jax.tree.map(
          lambda n, f, receive=receive: jnp.where(
            receive.reshape((-1,) + (1,) * (n.ndim - 1)), n, f
          ),
          params[g],
          fused[g],
        )
        if epoch_loss is not None:
          loss = jnp.where(receive, epoch_loss[g], 0.0)
      new_groups.append(client_state.replace(params=new_params))
      distill_loss.append(loss)
    stats["distill_loss"] = jnp.concatenate(distill_loss)
    return state.replace(round=state.round + 1, groups=tuple(new_groups)), stats

  return Algorithm(init=init, round=round_fn)
