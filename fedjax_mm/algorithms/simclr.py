r"""SimCLR, trained by each user alone: local training interleaved with self-supervised CL.

Paper: Chen, Kornblith, Norouzi and Hinton, "A Simple Framework for
Contrastive Learning of Visual Representations", ICML 2020 (arXiv
2002.05709), Algorithm 1 and eq. (1) (NT-Xent,
:func:`fedjax_mm.losses.nt_xent`). The FedMuscle paper (Sec. 6.1, Baselines) compares
with SimCLR, pseudo-labelling and local training, "where each user's model is
trained individually", SimCLR on the public data; read here as: every user
pre-trains its own representation on the public data, nothing is sent. One round here:

1. **Local update**: every user trains its whole model on its own task for
   ``E`` epochs (:func:`fedjax_mm.core.train_group`), as FedMuscle's line 5.
2. **CL epochs**: ``T`` passes over the public set in batches of ``B``, the
   same batches in the same order as FedMuscle's
   (:func:`fedjax_mm.algorithms.fedmuscle.public_epochs` from the same round
   key). Per batch every user draws two augmented views of each sample,
   encodes both with its representation model ``w^n`` and takes one step on
   the NT-Xent loss; its head is untouched (the CL optimizer is FedMuscle's,
   masked to the encoder and projector:
   :func:`fedjax_mm.algorithms.fedmuscle.cl_optimizer`, with its own state).

So SimCLR gets FedMuscle's budget exactly: the same local steps, the same
number of CL steps on the same public batches, the same trainable set (LoRA
adapters where the encoder has them, projector), and its only difference is
the contrastive signal: two views of the user's own encoder instead of
``M`` partners' encoders.

Augmentations, every choice (the world's images are ``32 x 32`` RGB scenes of
flat-coloured shapes, :mod:`fedjax_mm.data.world`):

* **Random resized crop** of a square whose side is a uniform fraction in
  ``[min_crop, 1]`` (0.8) of the image, resized back (bilinear). SimCLR crops
  down to 8% of the area; here an object's presence is a label (multi-label:
  every shape present; IC10/IC100: the largest object), and a crop that cuts
  an object out would change the labels the views are meant to share, so the
  crop keeps at least 64% of the area. The aspect ratio stays 1 (the shapes'
  aspect, e.g. circle vs ellipse, is what tells some classes apart).
* **Horizontal flip** with probability 1/2: every shape class is preserved by
  a mirror image, and no task reads the left/right region.
* **Gaussian pixel noise** (std ``noise``, 0.05), clipped to ``[0, 1]``: the
  world's own nuisance (it renders uniform pixel noise).
* **No colour distortion** (SimCLR's colour jitter and grayscale, its most
  important augmentation on ImageNet): colour is a label here (IC100 is
  shape x colour, TC the colour of the primary object), so invariance to it
  would teach the encoder to discard what two of the tasks are about.
* **Caption users** (Setup 2) take two of the sample's captions, drawn
  independently, as the two views; a public set with one caption per sample
  gives identical views.
* ``tau = 0.2``, FedMuscle's ``tau^{(M+1)}`` (SimCLR's own best values are
  0.1-0.5, depending on the batch size).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

from fedjax_mm import losses
from fedjax_mm.algorithms.base import Algorithm
from fedjax_mm.algorithms.fedmuscle import (
  FedMuscleState,
  cl_optimizer,
  public_epochs,
  representation_mask,
)
from fedjax_mm.core import faults as faults_lib
from fedjax_mm.core.client import ClientData, ClientState, GroupDef, train_group
from fedjax_mm.core.tasks import Task

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SimCLRConfig:
  """SimCLR's CL epochs (FedMuscle's budget: its ``B`` and ``T``).

  Attributes:
    batch_size: ``B``, public samples per CL step (``2B`` views).
    cl_epochs: ``T``, passes over the public set per round.
    tau: NT-Xent temperature.
    min_crop: smallest crop side, as a fraction of the image side.
    noise: standard deviation of the added pixel noise.
  """

  batch_size: int = 32
  cl_epochs: int = 1
  tau: float = 0.2
  min_crop: float = 0.8
  noise: float = 0.05


def augment(key: Array, image: Array, *, min_crop: float = 0.8, noise: float = 0.05) -> Array:
  """One random view of ONE image ``[S, S, C]`` in ``[0, 1]`` (module docstring)."""
  size = image.shape[0]
  k_side, k_y, k_x, k_flip, k_noise = jax.random.split(key, 5)
  side = size * jax.random.uniform(k_side, minval=min_crop, maxval=1.0)
  offset_y = jax.random.uniform(k_y) * (size - side)
  offset_x = jax.random.uniform(k_x) * (size - side)
  scale = size / side
  view = jax.image.scale_and_translate(
    image,
    image.shape,
    spatial_dims=(0, 1),
    scale=jnp.stack([scale, scale]),
    translation=jnp.stack([-offset_y * scale, -offset_x * scale]),
    method="linear",
    antialias=False,
  )
  view = jnp.where(jax.random.bernoulli(k_flip), view[:, ::-1], view)
  view = view + noise * jax.random.normal(k_noise, view.shape, view.dtype)
  return jnp.clip(view, 0.0, 1.0)


def views(task: Task, batch: dict[str, Array], key: Array, config: SimCLRConfig):
  """Two views ``[B, ...]`` of a public batch for a user of ``task``."""
  k1, k2 = jax.random.split(key)
  if task.modality == "text":  # two independently drawn captions of each sample
    return task.inputs(batch, k1), task.inputs(batch, k2)
  x = task.inputs(batch)
  one = lambda k: jax.vmap(
    lambda kk, im: augment(kk, im, min_crop=config.min_crop, noise=config.noise)
  )(jax.random.split(k, x.shape[0]), x)
  return one(k1), one(k2)


def simclr_loss(group: GroupDef, config: SimCLRConfig):
  """``(params, shared, batch, key) -> mean NT-Xent`` of one user on a public batch."""

  def loss(params, shared, batch, key):
    model = group.merge(params, shared)
    x1, x2 = views(group.task, batch, key, config)
    return losses.nt_xent(model.represent(x1), model.represent(x2), tau=config.tau).mean()

  return loss


def simclr(groups: Sequence[GroupDef], config: SimCLRConfig) -> Algorithm:
  """SimCLR (each user alone) over a tuple of groups, as an :class:`Algorithm`.

  ``round(state, data, public)`` returns each group's local-training stats
  and ``cl_loss`` ``[N]``: each user's mean NT-Xent over the round's CL steps
  (0 for padding clients). The state is FedMuscle's (its CL optimizer state
  per group); no user reads another's anything.
  """
  groups = tuple(groups)
  cl_txs = tuple(cl_optimizer(g.tx) for g in groups)
  loss_fns = tuple(simclr_loss(g, config) for g in groups)

  def init(states: Sequence[ClientState], key: Array) -> FedMuscleState:
    cl_opt = tuple(jax.vmap(tx.init)(s.params) for tx, s in zip(cl_txs, states, strict=True))
    return FedMuscleState(
      round=jnp.zeros((), jnp.int32), rng=key, groups=tuple(states), cl_opt_state=cl_opt
    )

  def cl_batch(carry, xs, data):
    states, opts = carry
    batch, key = xs
    new_states, new_opts, batch_losses = [], [], []
    for g, (tx, loss_fn, state, opt, d) in enumerate(
      zip(cl_txs, loss_fns, states, opts, data, strict=True)
    ):
      keys = jax.random.split(jax.random.fold_in(key, g), d.num_clients)  # each user its own draws
      loss, grads = jax.vmap(jax.value_and_grad(loss_fn), in_axes=(0, None, None, 0))(
        state.params, state.shared, batch, keys
      )
      grads = jax.tree.map(lambda x, m: x * m, grads, representation_mask(grads))
      updates, new_opt = jax.vmap(tx.update)(grads, opt, state.params)
      params = optax.apply_updates(state.params, updates)
      absent = ~d.client_mask  # padding clients keep their state exactly
      params = faults_lib.keep_where(absent, state.params, params)
      new_opt = faults_lib.keep_where(absent, opt, new_opt)
      new_states.append(state.replace(params=params))
      new_opts.append(new_opt)
      batch_losses.append(jnp.where(d.client_mask, loss, 0.0))
    return (tuple(new_states), tuple(new_opts)), jnp.concatenate(batch_losses)

  def round_fn(state: FedMuscleState, data: Sequence[ClientData], public: dict[str, Array]):
    key = jax.random.fold_in(state.rng, state.round)  # FedMuscle's round key: its batches
    new_groups, stats = [], {}
    for group, client_state, client_data in zip(groups, state.groups, data, strict=True):
      client_state, group_stats = train_group(group, client_state, client_data)
      new_groups.append(client_state)
      stats[group.name] = group_stats
    (new_groups, cl_opt_state), stats["cl_loss"] = public_epochs(
      lambda c, xs: cl_batch(c, xs, data),
      (tuple(new_groups), state.cl_opt_state),
      key,
      public,
      batch_size=config.batch_size,
      epochs=config.cl_epochs,
    )
    return state.replace(round=state.round + 1, groups=new_groups, cl_opt_state=cl_opt_state), stats

  return Algorithm(init=init, round=round_fn)
