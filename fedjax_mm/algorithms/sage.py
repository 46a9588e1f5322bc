r"""SAGE: federated semi-supervised learning with confidence-corrected pseudo-labels, per task.

Paper: Liu, Shang, Zhang, Lu, Gong, Xue and Wang, "Mind the Gap: Confidence
Discrepancy Can Guide Federated Semi-Supervised Learning Across
Pseudo-Mismatch", CVPR 2025 (arXiv 2503.13227); the authors' code
(github.com/Jay-Codeman/SAGE, ``SAGE.py``) fixes what the paper leaves open.
SAGE is FedAvg over clients that hold a few labelled and many unlabelled
samples. One round:

1. every client starts from the global model ``G`` (kept frozen) and trains
   a local copy, each step on ``L_x + lambda_u L_u``: cross-entropy on a
   labelled batch, and on an unlabelled batch the KL from the pseudo-targets
   to the prediction on a strong view. The pseudo-targets come from both
   models' predictions on the weak view: a sample counts if either is
   confident (``>= 0.95``, CPG), and where the local model is confident its
   one-hot label is blended with the global one by ``lambda = exp(-kappa
   |c_l - c_g|)`` (CDSC; :func:`fedjax_mm.losses.sage_targets`,
   :func:`fedjax_mm.losses.sage_unlabeled_loss`);
2. the server averages the local models, weighted by each client's labelled
   plus unlabelled count, into the next ``G``.

FedMuscle's Table 1 runs SAGE on users with different tasks and models.
Every adaptation:

* **A SAGE federation per task**: only users of the same task (the same label
  set) average anything; tasks never meet (tested). Within a task, users
  average **the parts they share architecturally**: all trained parameters
  (LoRA adapters, projector, head) among users of the same architecture
  (``architectures[g]``, FedDF's prototypes), and the task head (``d ->
  hidden -> C``, the same shape for every user of a task) among all of them,
  LG-FedAvg's split (Liang et al. 2020: local representations, a global head).
  A task whose users' heads differ in shape (segmentation heads read the
  encoder's own feature map) averages within architectures only. So a user's
  global model ``G`` is its own encoder and projector with its task's head
  (and, with an architecture partner, the fused whole model).
* **A user alone in its task** (the default IC10 user) runs SAGE with one
  client, which is what the method does alone: its ``G`` is its own model at
  the round's start, the local model its trained copy, and the average of one
  client is itself (exactly). It sends nothing.
* **The unlabelled data is the public set**, the same for every user (SAGE's
  clients hold their own unlabelled shards); the averaging weights ``n_k +
  P`` follow the code's labelled-plus-unlabelled count.
* **Budget, in two phases whose objectives sum to SAGE's**: the labelled term
  is the round's ``E`` local epochs on the user's own data (every method's
  local update, :func:`fedjax_mm.core.train_group`); the unlabelled term
  ``lambda_u L_u`` then runs for ``T`` passes over the public set in
  FedMuscle's batches of ``B`` (:func:`fedjax_mm.algorithms.fedmuscle.public_epochs`
  from the same round key: the same batches in the same order, paired). SAGE
  pairs each unlabelled batch with a labelled one in one step (``mu = 2``
  unlabelled per labelled sample, ``|U| / B`` steps an epoch); here every
  method takes the same labelled steps and SAGE's extra public steps are
  FedMuscle's count. The whole model trains in both phases (SAGE's).
* **Optimizers**: the experiment's AdamW for both phases (the code: SGD at
  0.1), each phase with its own state, kept across rounds (the public
  phase's as FedMuscle's CL optimizer state, in ``cl_opt_state``): the local
  phase's momentum would otherwise carry its last labelled gradient through
  the public steps. A public step in which no pseudo-label counts (``m = 0``
  for the whole batch: ``L_u`` is 0) is not taken: AdamW would still move the
  model by momentum and weight decay. So a user alone in its task whose
  pseudo-labels never pass the threshold trains exactly as local training
  does (tested).
* **The local model's weak-view prediction** comes from the current local
  parameters at each public step (the code's detached ``logits_u_w``); the
  global model's from ``G``, the round's starting parameters.
* **Views**: weak = the public image as it is; strong = SimCLR's
  label-preserving view (:func:`fedjax_mm.algorithms.simclr.augment`: crop
  of at least 80% side, flip, pixel noise; no colour change, colour being a
  label here), where the code uses RandAugment. Segmentation users: pixel
  noise only (a crop or flip would move the pixels their targets label).
  Caption users: the first caption (weak) and a random one (strong).
* **Task kinds**: multi-label users run the rule per label, segmentation
  users per pixel (:mod:`fedjax_mm.losses.sage`).
* Constants as the code: ``tau = 0.95``, ``T = 1``, ``lambda_u = 1``,
  ``kappa = ln 2 / 0.05``.
* Padding clients take no step (both phases), weigh 0, receive nothing and
  keep their state exactly.

What crosses the wire per round: a user with a partner in its task uploads
the parameters it averages (its head; everything trained if it has an
architecture partner) and downloads their average (:func:`averaged_leaves`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import optax

from fedjax_mm import losses, server
from fedjax_mm.algorithms import simclr
from fedjax_mm.algorithms.base import Algorithm, check_same_shapes, classes_of, task_classes
from fedjax_mm.algorithms.fedmuscle import FedMuscleState, public_epochs
from fedjax_mm.core import faults as faults_lib
from fedjax_mm.core.client import ClientData, ClientState, GroupDef, train_group
from fedjax_mm.core.tasks import Task

Array = jax.Array

#: The head's parameters (``UserModel.head``): what every user of a task shares in shape.
is_head = server.path_contains("head")


@dataclasses.dataclass(frozen=True)
class SageConfig:
  """SAGE's unlabelled term and its public steps (FedMuscle's ``B`` and ``T``).

  Attributes:
    batch_size: ``B``, public samples per unlabelled step.
    epochs: ``T``, passes over the public set per round.
    threshold: ``tau``, the confidence a pseudo-label needs (0.95).
    half_gap: the confidence gap at which ``lambda = 1/2`` (0.05, so
      ``kappa = ln 2 / 0.05``).
    weight: ``lambda_u``, the unlabelled loss's weight (1).
    temperature: ``T`` of the pseudo-labelling softmax (1).
    min_crop: strong view's smallest crop side (SimCLR's view).
    noise: strong view's pixel noise.
  """

  batch_size: int = 32
  epochs: int = 1
  threshold: float = 0.95
  half_gap: float = 0.05
  weight: float = 1.0
  temperature: float = 1.0
  min_crop: float = 0.8
  noise: float = 0.05

  @property
  def kappa(self) -> float:
    return math.log(2.0) / self.half_gap


def _head_spec(params) -> dict[str, tuple[tuple[int, ...], object]]:
  """``{path: (shape without the client axis, dtype)}`` of the head leaves of a stacked pytree."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  return {jax.tree_util.keystr(p): (tuple(x.shape[1:]), x.dtype) for p, x in leaves if is_head(p)}


def averaged_leaves(
  params: Sequence, tasks: Sequence[Hashable], architectures: Sequence[Hashable]
) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
  """Per group: ``(architecture partners, head partners)``, the groups it averages with.

  ``params`` are the groups' stacked parameters (shapes only are read). A
  group's architecture partners are the groups of its task and architecture
  (itself included); its head partners those of its task when every group of
  the task has a head of identical paths and shapes, else its architecture
  partners. Static: computed from shapes at trace time.
  """
  archs = classes_of(zip(tasks, architectures, strict=True))
  heads = [_head_spec(p) for p in params]
  out = []
  for g in range(len(params)):
    same_arch = tuple(h for h in range(len(params)) if archs[h] == archs[g])
    task = tuple(h for h in range(len(params)) if tasks[h] == tasks[g])
    same_head = all(heads[h] == heads[g] for h in task)
    out.append((same_arch, task if same_head else same_arch))
  return tuple(out)


def fuse(params, weights, receive, partners) -> list:
  """The server's step: each group's parameters after averaging within its task.

  Args:
    params: per group, stacked trained parameters ``[K_g, ...]``.
    weights: per group, ``[K_g]`` averaging weights (0 for padding clients).
    receive: per group, ``bool [K_g]``: clients that take the averages.
    partners: :func:`averaged_leaves` of these groups.

  Returns:
    per group, the parameters: heads averaged over the head partners, every
    other trained leaf over the architecture partners.
  """
  architectures, tasks = [p[0] for p in partners], [p[1] for p in partners]
  whole = server.average_within_classes(params, weights, architectures, receive=receive)
  heads = server.average_within_classes(params, weights, tasks, receive=receive, select=is_head)
  return [
    jax.tree_util.tree_map_with_path(lambda path, w, h: h if is_head(path) else w, w_g, h_g)
    for w_g, h_g in zip(whole, heads, strict=True)
  ]


def strong_view(task: Task, batch: dict[str, Array], key: Array, config: SageConfig) -> Array:
  """SAGE's strong view of a public batch for a user of ``task`` (module docstring)."""
  if task.modality == "text":
    return task.inputs(batch, key)
  x = task.inputs(batch)
  if task.kind == "segmentation":  # per-pixel targets: the view must keep every pixel in place
    noisy = x + config.noise * jax.random.normal(key, x.shape, x.dtype)
    return jnp.clip(noisy, 0.0, 1.0)
  return jax.vmap(
    lambda k, im: simclr.augment(k, im, min_crop=config.min_crop, noise=config.noise)
  )(jax.random.split(key, x.shape[0]), x)


def unlabeled_objective(group: GroupDef, config: SageConfig):
  """``(params, global_params, shared, batch, key) -> (lambda_u L_u, counted share)`` of one user."""
  kind = group.task.kind

  def objective(params, global_params, shared, batch, key):
    local, global_ = group.merge(params, shared), group.merge(global_params, shared)
    weak = group.task.inputs(batch)
    targets, mask = losses.sage_targets(
      local(weak),
      global_(weak),
      kind=kind,
      threshold=config.threshold,
      kappa=config.kappa,
      temperature=config.temperature,
    )
    strong = local(strong_view(group.task, batch, key, config))
    loss = losses.sage_unlabeled_loss(strong, targets, mask, kind=kind).mean()
    return config.weight * loss, mask.mean()

  return objective


def sage(
  groups: Sequence[GroupDef],
  config: SageConfig,
  *,
  architectures: Sequence[Hashable],
) -> Algorithm:
  """SAGE, one federation per task, over a tuple of groups, as an :class:`Algorithm`.

  ``round(state, data, public)`` returns each group's local-training stats,
  ``pseudo_loss`` ``[N]`` (each user's mean ``lambda_u L_u`` over the public
  steps) and ``kept`` ``[N]`` (the mean share of public samples, or labels,
  whose pseudo-label counted); 0 for padding clients.

  Args:
    groups: the users' groups.
    config: the unlabelled term's settings.
    architectures: per group, a hashable naming its model architecture;
      groups with the same task and architecture average every trained
      parameter, groups of one task their heads.
  """
  groups = tuple(groups)
  tasks = task_classes(groups)
  fusion = classes_of(zip(tasks, architectures, strict=True))
  objectives = tuple(unlabeled_objective(g, config) for g in groups)

  def init(states: Sequence[ClientState], key: Array) -> FedMuscleState:
    check_same_shapes(states, fusion)
    ssl_opt = tuple(jax.vmap(g.tx.init)(s.params) for g, s in zip(groups, states, strict=True))
    return FedMuscleState(
      round=jnp.zeros((), jnp.int32), rng=key, groups=tuple(states), cl_opt_state=ssl_opt
    )

  def public_step(carry, xs, starts, data):
    states, opts = carry
    batch, key = xs
    new_states, new_opts, batch_losses, batch_kept = [], [], [], []
    for g, (group, objective, state, opt, start, d) in enumerate(
      zip(groups, objectives, states, opts, starts, data, strict=True)
    ):
      keys = jax.random.split(jax.random.fold_in(key, g), d.num_clients)  # each user its own views
      (loss, kept), grads = jax.vmap(
        jax.value_and_grad(objective, has_aux=True), in_axes=(0, 0, None, None, 0)
      )(state.params, start, state.shared, batch, keys)
      updates, new_opt = jax.vmap(group.tx.update)(grads, opt, state.params)
      params = optax.apply_updates(state.params, updates)
      # Padding clients, and users none of whose pseudo-labels count, keep their state exactly.
      skip = ~d.client_mask | (kept == 0)
      params = faults_lib.keep_where(skip, state.params, params)
      new_opt = faults_lib.keep_where(skip, opt, new_opt)
      new_states.append(state.replace(params=params))
      new_opts.append(new_opt)
      batch_losses.append(jnp.where(d.client_mask, loss, 0.0))
      batch_kept.append(jnp.where(d.client_mask, kept, 0.0))
    carry = (tuple(new_states), tuple(new_opts))
    return carry, (jnp.concatenate(batch_losses), jnp.concatenate(batch_kept))

  def round_fn(state: FedMuscleState, data: Sequence[ClientData], public: dict[str, Array]):
    key = jax.random.fold_in(state.rng, state.round)  # FedMuscle's round key: its batches
    starts = tuple(s.params for s in state.groups)  # each user's global model G, frozen
    trained, stats = [], {}
    for group, client_state, client_data in zip(groups, state.groups, data, strict=True):
      client_state, group_stats = train_group(group, client_state, client_data)
      trained.append(client_state)
      stats[group.name] = group_stats
    (trained, ssl_opt), out = public_epochs(
      lambda c, xs: public_step(c, xs, starts, data),
      (tuple(trained), state.cl_opt_state),
      key,
      public,
      batch_size=config.batch_size,
      epochs=config.epochs,
    )
    num = sum(d.num_clients for d in data)
    stats["pseudo_loss"], stats["kept"] = out if out is not None else (jnp.zeros(num),) * 2

    num_public = jax.tree.leaves(public)[0].shape[0]
    params = [s.params for s in trained]
    weights = [(d.num_samples + num_public) * d.client_mask for d in data]
    receive = [d.client_mask for d in data]
    fused = fuse(params, weights, receive, averaged_leaves(params, tasks, architectures))
    new_groups = tuple(s.replace(params=p) for s, p in zip(trained, fused, strict=True))
    return state.replace(round=state.round + 1, groups=new_groups, cl_opt_state=ssl_opt), stats

  return Algorithm(init=init, round=round_fn)
