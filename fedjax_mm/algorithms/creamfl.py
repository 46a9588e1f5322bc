r"""CreamFL: a larger server model learnt from heterogeneous uni- and multimodal clients.

Paper: ``creamfl.txt`` (Yu et al., 2023) — Sections 3-4, Algorithm 1, eqs. (1)-(7);
and FedMuscle's Appendix K (``fedmuscle_muscle_loss.txt``) for CreamFL + Muscle.

Three client groups share nothing but a public set of ``P`` image-caption pairs:
image-only clients (image classification), text-only clients (caption
classification) and multimodal clients (image-text retrieval), each with a
small encoder. The server's image and text encoders are larger. Every model
maps its modality to L2-normalised ``d``-dimensional representations. One round:

1. **server training**: the server trains one epoch on the public set with its
   retrieval loss (symmetric InfoNCE; the reference uses PCME);
2. a random fraction of the clients takes part (``num_selected`` of all);
3. the server computes its **global representations** ``I_glob``, ``T_glob``
   ``[P, d]`` of the public set and sends them to the selected clients;
4. each selected client trains ``E`` epochs on its **local objective**, eq.
   (3) (:func:`local_objective`): every local step adds to the loss of its
   private minibatch ``gamma`` times the **regulariser** on a public minibatch,
   the inter-modal contrast (eq. (1),
   :func:`fedjax_mm.losses.inter_modal_contrast`) plus the intra-modal
   contrast (eq. (2), :func:`fedjax_mm.losses.intra_modal_contrast`), whose
   negative is the client's own model at the START of the round;
5. each selected client sends its **local representations** of the public
   set, in the modalities it has;
6. the server **aggregates** them per modality: GCA (eqs. (4)-(6),
   :func:`fedjax_mm.server.gca.gca`), or the baselines' client weights;
7. the server **distils**: one epoch minimising the l2 distance between its
   representations and the aggregated ones (eq. (7),
   :func:`fedjax_mm.losses.representation_distance`).

**Where the round follows the authors' code, not Algorithm 1.** The reference
implementation (FLAIR-THU/CreamFL, ``src/algorithms/MMFL.py``, ``MMFL.train``)
trains the server on the public set FIRST and then computes the global
representations with the trained server; Algorithm 1 computes ``I_glob``,
``T_glob`` with ``w^t`` (line 3) and trains the server after the clients
(line 11). Steps 1 and 3 above take the code's order, so the clients, GCA
(eq. (4)) and the distillation all see the representations of the server
after its public epoch. Everything else follows the paper.

**Where the local step follows eq. (3), not the authors' code.** Algorithm 1,
line 17, takes gradient steps on eq. (3), the private loss plus ``gamma``
times the regulariser, so ``gamma`` sets the trade-off between the two
gradients in every step; that is what step 4 does (option "one objective per
local step"). The reference instead runs, after EACH private epoch, a separate
epoch over the public set minimising ``gamma * (inter + intra)``
(``ClientTrainer.tra``, ``MMClientTrainer.train_epoch``). Under its image and
text clients' SGD (momentum 0.9) ``gamma`` scales that pass's steps; under
adaptive optimisers (its multimodal clients' AdamP, our clients' AdamW) a
separate pass normalises the step and ``gamma`` barely matters. With one
objective, ``gamma = 0`` is exactly the private task alone and the
regulariser's gradient in the objective is linear in ``gamma`` under any
optimiser. The regulariser therefore runs in every one of the ``E`` epochs,
one public minibatch per private step, and by default each minibatch holds
``ceil(P / S)`` public samples (``S`` private steps per epoch), so that an
epoch draws about ``P`` public samples, as the reference's regulariser epoch
over the public set does (``CreamConfig.public_batch_size`` overrides it).

**Temperatures.** Eqs. (1) and (2) are printed without a temperature; the
reference divides both logits by 0.5 (``ClientTrainer.py``,
``MMClientTrainer.py``: ``logits /= 0.5``, ``torch.div(..., 0.5)``), hence
``inter_temperature = intra_temperature = 0.5``. GCA uses 1: eq. (4) as
printed and the reference's ``con_w`` aggregation (``MMFL.distill``; note that
its log-softmax keeps ``j = k`` in the denominator, which eq. (4) excludes;
:mod:`fedjax_mm.server.gca` follows eq. (4)). The server's and the multimodal
clients' retrieval InfoNCE temperature (0.1) is this library's choice: the
reference trains both with PCME (``criterion: pcme`` in ``coco.yaml`` /
``f30k.yaml``), whose learnt scale and shift have no InfoNCE counterpart.
CreamFL + Muscle uses FedMuscle's ``tau^(M+1) = 0.2``, ``tau^(M) = 0.15``
(FedMuscle, Implementation Details).

**CreamFL + Muscle** (FedMuscle App. K) replaces step 4's regulariser with the
Muscle loss of each local representation against the global representations of
BOTH modalities (``M = 2``, weighted by the same ``gamma``), and steps 6-7 with
the Muscle loss of the server's representations (anchors, one per modality)
against ``M`` local representation matrices drawn per batch among all those
received (all of them would make the ``B^(M+1)`` tensor intractable; FedMuscle
draws partners the same way).

The distillation baselines of Table 1 (FedMD, FedET, FedGEMS,
:mod:`fedjax_mm.algorithms.creamfl_baselines`) run the same round with step
4's regulariser replaced by local distillation (the l2 distance of each local
representation to the server's global one of the same modality, weighted by
the same ``gamma``) and step 6 by the mean, FedET's or FedGEMS's rule
(:mod:`fedjax_mm.server.kd_aggregate`); FedET's step 7 also carries its diversity
regulariser (``lambda`` KL to the ensemble of the clients outside the majority,
:func:`fedjax_mm.losses.fedet_diversity`).

Which variant runs is a runtime :class:`Variant` (the aggregation rule, picked
by ``jax.lax.switch``, and 0/1 weights of the regulariser terms and server
losses), so every federated row of CreamFL's Tables 1 and 3 shares ONE compiled
round; the regulariser sits under a ``jax.lax.cond`` in the local objective and
costs nothing for the reamFL rows. :func:`server_only` is the "local training"
row: step 1 alone.

Clients of a group are stacked ``[K, ...]`` and trained together by
:func:`fedjax_mm.core.train_group` (``vmap`` or a compiled loop, per backend) on
:func:`local_objective`, which closes
over each client's start-of-round parameters. Clients not selected are masked:
they take no step and weigh 0 in every aggregate.

**Token spaces.** The paper's server reads captions with BERT while its text and
multimodal clients run GRUs (Sec. 4.1, App. A.2): the towers read the same captions
through different tokenizers. Every text tower therefore reads the captions of its
own token space (:mod:`fedjax_mm.core.text`): :class:`ServerDef` and each
:class:`ClientGroup` carry a ``text_key`` (``caption``, or ``caption:<checkpoint>``),
and the public set (and each group's private data) holds the same captions once
per space read. Representations are of the same public samples whatever the space,
so steps 3-7 compare them as before; images and everything else are shared. A run
of one space (every tower on ``caption``) is exactly the single-tokenizer round.

Client faults (:mod:`fedjax_mm.core.faults`, off by default), drawn per round
among the selected clients: a **dropped** client trains but its local
representations never arrive (it is absent from step 6's aggregation and from
the server's Muscle partners); a **straggler** takes only its drawn share of
local steps (the regulariser rides on them); a **Byzantine** client sends
random unit vectors (or its representations scaled) for the public set — the
attack against which CreamFL argues that GCA, which scores each local
representation against the global ones, is more robust than the mean.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from fedjax_mm import losses, models
from fedjax_mm.algorithms.base import Algorithm
from fedjax_mm.core import faults as faults_lib
from fedjax_mm.core import optim
from fedjax_mm.core.client import (
  ClientData,
  ClientState,
  GroupDef,
  all_finite,
  apply_in_batches,
  client_uniform,
  finite_per_client,
  local_update,
  supervised_objective,
  train_group,
)
from fedjax_mm.core.sharding import replicate
from fedjax_mm.core.tasks import CAPTION_KEY, is_caption_key, masked_mean
from fedjax_mm.server import aggregate, gca, kd_aggregate

Array = jax.Array
PyTree = Any

MODALITIES = ("image", "text")
# "fedet", "fedgems" and the regulariser "kd" serve the baselines of
# :mod:`fedjax_mm.algorithms.creamfl_baselines` (FedMD, FedET, FedGEMS).
AGGREGATIONS = ("mean", "avg", "iot", "gca", "fedet", "fedgems")
REGULARISERS = ("none", "lcr", "muscle", "kd")
SERVER_OBJECTIVES = ("distill", "muscle")


def _other(modality: str) -> str:
  return "text" if modality == "image" else "image"


# ----------------------------------------------------------------------------
# Models


class DualEncoder(nnx.Module):
  """An image tower and a text tower, each encoder + projector to ``d``, L2-normalised.

  The multimodal clients' model (small encoders) and the server's (larger ones).

  Args:
    image_encoder: a name in :data:`fedjax_mm.models.ENCODERS` (image) or ``hf:<folder>``.
    text_encoder: a name in :data:`fedjax_mm.models.ENCODERS` (text) or ``hf:<folder>``
      (its captions must be in the checkpoint's tokens: :mod:`fedjax_mm.core.text`).
    rep_dim: ``d``.
    image_size: side of the square images.
    vocab_size: token ids of the text encoder.
    max_len: caption length.
    rngs: random streams.
    pretrained: optional collection of checkpoints (``"world-clip"``): each
      encoder starts from ``<pretrained>/<encoder name>``
      (:mod:`fedjax_mm.models.pretrained`); the projectors stay fresh.
  """

  def __init__(
    self,
    image_encoder: str,
    text_encoder: str,
    *,
    rep_dim: int,
    image_size: int,
    vocab_size: int,
    max_len: int,
    rngs: nnx.Rngs,
    pretrained: str | None = None,
  ):
    # build_encoder checks the modality (a ValueError naming the encoder).
    self.image_encoder = models.build_encoder(
      image_encoder, rngs=rngs, image_size=image_size, modality="image"
    )
    self.image_projector = nnx.Linear(self.image_encoder.features, rep_dim, rngs=rngs)
    self.text_encoder = models.build_encoder(
      text_encoder, rngs=rngs, vocab_size=vocab_size, max_len=max_len, modality="text"
    )
    self.text_projector = nnx.Linear(self.text_encoder.features, rep_dim, rngs=rngs)
    if pretrained:
      sizes = {"image_size": image_size, "vocab_size": vocab_size, "max_len": max_len}
      for name, encoder in ((image_encoder, self.image_encoder), (text_encoder, self.text_encoder)):
        if models.hf.is_hf(name):  # an hf: encoder is its own checkpoint
          continue
        keys = models.pretrained.size_keys(models.ENCODERS[name][0])
        expect = {"encoder": name, **{k: sizes[k] for k in keys if k in sizes}}
        models.pretrained.load_into(encoder, f"{pretrained}/{name}", expect=expect)

  def represent(self, x: Array, modality: str) -> Array:
    """``[b, d]`` representations of images ``[b, S, S, 3]`` or captions ``[b, L]``."""
    if modality == "image":
      pooled, _ = self.image_encoder(x)
      return models.l2_normalize(self.image_projector(pooled))
    pooled, _ = self.text_encoder(x)
    return models.l2_normalize(self.text_projector(pooled))


def represent(model: nnx.Module, modality: str, x: Array) -> Array:
  """Representations of ``x`` by a :class:`DualEncoder` or a single-modality ``UserModel``."""
  if isinstance(model, DualEncoder):
    return model.represent(x, modality)
  return model.represent(x)


@dataclasses.dataclass(frozen=True)
class RetrievalTask:
  """The multimodal clients' private task: image-caption retrieval (symmetric InfoNCE).

  Stands in for :class:`fedjax_mm.core.Task` in a :class:`GroupDef` (only
  ``modality`` and the objective below are used).
  """

  temperature: float = 0.1
  kind: str = "retrieval"
  modality: str = "multimodal"
  metric_name: str = "R@1"


def retrieval_objective(
  model: nnx.Module,
  batch: dict[str, Array],
  mask: Array,
  key: Array,
  temperature: float,
  text_key: str = CAPTION_KEY,
) -> Array:
  """Symmetric InfoNCE between images and one random caption each (masked mean).

  ``text_key``: the key of the captions the model's text tower reads (its token
  space: ``caption`` or ``caption:<checkpoint>``, :mod:`fedjax_mm.core.text`).
  """
  captions = batch[text_key]
  if captions.ndim == 3:  # [b, C, L]: pick one caption per sample
    choice = jax.random.randint(key, (captions.shape[0],), 0, captions.shape[1])
    captions = jnp.take_along_axis(captions, choice[:, None, None], axis=1)[:, 0]
  z_image = represent(model, "image", batch["image"])
  z_text = represent(model, "text", captions)
  per_sample = losses.symmetric_info_nce(z_image, z_text, temperature=temperature, where=mask)
  return masked_mean(per_sample, mask)


# ----------------------------------------------------------------------------
# Configuration, variants, state


@dataclasses.dataclass(frozen=True)
class CreamConfig:
  """Static hyperparameters of a CreamFL run.

  Attributes:
    num_selected: clients taking part per round (``max(p C, 1)`` of Alg. 1).
    batch_size: ``B``, public samples per step of the server (training,
      distillation).
    public_batch_size: public samples in each local step of a client (eq.
      (3)'s regulariser). ``None``: ``ceil(P / S)`` with ``S`` the group's
      private steps per epoch, so that one local epoch draws about ``P``
      public samples, as many as the reference's regulariser epoch over the
      whole public set (:func:`public_batch_size`).
    server_temperature: InfoNCE temperature of the server's retrieval loss
      (step 1) and of the multimodal clients' private task.
    lcr_weight: ``gamma`` of eq. (3), weight of the regulariser (LCR, or the
      clients' Muscle loss) in every local step (0.5 in the reference's
      README command, ``--interintra_weight 0.5``).
    inter_temperature: temperature of eq. (1) (0.5 in the reference).
    intra_temperature: temperature of eq. (2).
    gca_temperature: temperature of eq. (4) (1 is the paper's equation).
    distill_weight: a factor on the server's whole distillation objective (eq. (7),
      the server's Muscle loss and FedET's diversity term together; their relative
      weights are ``fedet_diversity_weight`` and the :class:`Variant`'s ``distill``
      / ``server_muscle``). Eq. (7) has no weight of its own. The distillation is an
      epoch of its own, and AdamW's step does not depend on a loss's scale (but
      through its epsilon), so the factor acts because the server's retrieval epoch
      (step 1) and its distillation epoch share one AdamW state: it sets the size of
      the distillation gradients against the retrieval ones in Adam's moments (as the
      authors' ``kd_weight`` does, one optimiser for both).
    iot_weight: multimodal clients' weight factor in reamFL+IoT (100).
    muscle_partners: ``M`` local matrices per batch in the server's Muscle loss.
    muscle_tau_full: Muscle ``tau^{(M+1)}``.
    muscle_tau_reduced: Muscle ``tau^{(M)}`` (``gamma = 1/tau_reduced - 1/tau_full``).
    gca_chunk_size: public samples per chunk of GCA and of FedET's and FedGEMS's
      rules (``None``: automatic, :func:`fedjax_mm.server.gca.default_chunk_size`).
    fedet_diversity_weight: ``lambda`` of FedET's diversity regulariser in the
      server's distillation (FedET row only, :class:`Variant` ``diversity``;
      0.05 as the FedET re-implementation the term follows,
      :mod:`fedjax_mm.server.kd_aggregate`).
  """

  num_selected: int = 6
  batch_size: int = 32
  server_temperature: float = 0.1
  lcr_weight: float = 0.5
  inter_temperature: float = 0.5
  intra_temperature: float = 0.5
  gca_temperature: float = 1.0
  distill_weight: float = 1.0
  iot_weight: float = 100.0
  muscle_partners: int = 3
  muscle_tau_full: float = 0.2
  muscle_tau_reduced: float = 0.15
  gca_chunk_size: int | None = None
  public_batch_size: int | None = None
  fedet_diversity_weight: float = 0.05

  @property
  def muscle_gamma(self) -> float:
    return 1.0 / self.muscle_tau_reduced - 1.0 / self.muscle_tau_full  # losses.muscle_gamma


@struct.dataclass
class Variant:
  """Which row of the tables runs: runtime switches and weights of one compiled round.

  Attributes:
    aggregation: ``int32`` index into :data:`AGGREGATIONS` (step 6).
    inter: weight (0 or 1) of the inter-modal term of LCR (eq. (1)).
    intra: weight (0 or 1) of the intra-modal term of LCR (eq. (2)).
    client_muscle: weight (0 or 1) of the clients' Muscle loss (App. K).
    distill: weight (0 or 1) of the l2 distillation (eq. (7)).
    server_muscle: weight (0 or 1) of the server's Muscle loss (App. K).
    local_kd: weight (0 or 1) of the clients' local distillation: the l2
      distance (eq. (7)'s) of each local representation to the server's
      global representation of the same modality (FedMD / FedET / FedGEMS,
      :mod:`fedjax_mm.algorithms.creamfl_baselines`).
    diversity: weight (0 or 1) of FedET's diversity regulariser in the server's
      distillation (times ``CreamConfig.fedet_diversity_weight``; the FedET row,
      :func:`fedjax_mm.losses.fedet_diversity`).
  """

  aggregation: Array
  inter: Array
  intra: Array
  client_muscle: Array
  distill: Array
  server_muscle: Array
  local_kd: Array
  diversity: Array

  @property
  def regularised(self) -> Array:
    """Whether the clients' local objective has a public-set regulariser (step 4)."""
    return (self.inter + self.intra + self.client_muscle + self.local_kd) > 0


def variant(
  aggregation: str = "gca",
  regulariser: str = "lcr",
  *,
  inter: bool = True,
  intra: bool = True,
  server: str = "distill",
  diversity: bool = False,
) -> Variant:
  """A :class:`Variant` from names (validated).

  Args:
    aggregation: one of :data:`AGGREGATIONS`.
    regulariser: one of :data:`REGULARISERS`.
    inter: with ``regulariser="lcr"``, include the inter-modal term.
    intra: with ``regulariser="lcr"``, include the intra-modal term.
    server: one of :data:`SERVER_OBJECTIVES`.
    diversity: add FedET's diversity regulariser to the server's distillation
      (only with ``aggregation="fedet"``, whose majority vote defines it).
  """
  for name, value, known in (
    ("aggregation", aggregation, AGGREGATIONS),
    ("regulariser", regulariser, REGULARISERS),
    ("server", server, SERVER_OBJECTIVES),
  ):
    if value not in known:
      raise ValueError(f"{name} must be one of {known}, got {value!r}.")
  if diversity and aggregation != "fedet":
    raise ValueError(f"diversity needs aggregation='fedet', got {aggregation!r}.")
  lcr = regulariser == "lcr"
  return Variant(
    aggregation=jnp.int32(AGGREGATIONS.index(aggregation)),
    inter=jnp.float32(lcr and inter),
    intra=jnp.float32(lcr and intra),
    client_muscle=jnp.float32(regulariser == "muscle"),
    distill=jnp.float32(server == "distill"),
    server_muscle=jnp.float32(server == "muscle"),
    local_kd=jnp.float32(regulariser == "kd"),
    diversity=jnp.float32(diversity),
  )


#: The rows of CreamFL's Tables 1 and 3 and FedMuscle's Table 3.
VARIANTS: dict[str, dict[str, Any]] = {
  "reamFL+Mean": dict(aggregation="mean", regulariser="none"),
  "reamFL+Avg": dict(aggregation="avg", regulariser="none"),
  "reamFL+IoT": dict(aggregation="iot", regulariser="none"),
  "reamFL+GCA": dict(aggregation="gca", regulariser="none"),
  "reamFL+GCA+LCR.inter": dict(aggregation="gca", regulariser="lcr", intra=False),
  "reamFL+GCA+LCR.intra": dict(aggregation="gca", regulariser="lcr", inter=False),
  "CreamFL": dict(aggregation="gca", regulariser="lcr"),
  "CreamFL+Muscle": dict(aggregation="mean", regulariser="muscle", server="muscle"),
}


@struct.dataclass
class CreamState:
  """State of one CreamFL run.

  Attributes:
    round: ``int32`` rounds completed.
    rng: root key of the run (client sampling, orders), folded with the round.
    server_params: the server's :class:`DualEncoder` parameters.
    server_opt: its optax state (one optimizer for steps 1 and 7).
    server_rng: key advanced by the server's passes over the public set.
    groups: per group, the stacked :class:`ClientState`.
  """

  round: Array
  rng: Array
  server_params: PyTree
  server_opt: PyTree
  server_rng: Array
  groups: tuple[ClientState, ...]

  def place(self, mesh) -> CreamState:
    server = replicate(
      (self.round, self.rng, self.server_params, self.server_opt, self.server_rng), mesh
    )
    return CreamState(*server, groups=tuple(g.place(mesh) for g in self.groups))


@dataclasses.dataclass(frozen=True)
class ServerDef:
  """Static description of the server: model graph, optimizer, the captions it reads.

  Attributes:
    graphdef: the server's :class:`DualEncoder` graph.
    tx: its optimizer (steps 1 and 7).
    text_key: the public set's key of the captions its text tower reads: ``caption``
      (the world's ids) or ``caption:<checkpoint>`` (a checkpoint tokenizer's ids;
      :func:`fedjax_mm.core.text.caption_key`).
    lr_factor: optional ``round -> factor`` (0-based round) scaling every server
      update of that round (:func:`fedjax_mm.core.optim.at_rate`: the learning rate's
      schedule for AdamW / AdamP), e.g. the authors' code's cosine annealing stepped
      once a round (:func:`fedjax_mm.core.optim.cosine_annealing`); ``None``: constant.
  """

  graphdef: nnx.GraphDef
  tx: optax.GradientTransformation
  text_key: str = CAPTION_KEY
  lr_factor: Callable[[Array], Array] | None = None

  def __post_init__(self):
    if not is_caption_key(self.text_key):
      raise ValueError(f"text_key must be a caption key, got {self.text_key!r}.")

  def merge(self, params: PyTree) -> nnx.Module:
    return nnx.merge(self.graphdef, params)

  def tx_at(self, round_index: Array) -> optax.GradientTransformation:
    """The optimizer of 0-based round ``round_index`` (``tx`` at its rate that round)."""
    if self.lr_factor is None:
      return self.tx
    return optim.at_rate(self.tx, self.lr_factor(round_index))


@dataclasses.dataclass(frozen=True)
class ClientGroup:
  """A group of clients and what it reads: the :class:`GroupDef` plus its modalities.

  Attributes:
    group: static group definition (its ``task`` is a ``core.Task`` for the
      uni-modal groups and a :class:`RetrievalTask` for the multimodal one).
    modalities: ``("image",)``, ``("text",)`` or ``("image", "text")``.
    text_key: the key of the captions its text tower reads, in its private data
      and in the public set (its token space; :class:`ServerDef`'s ``text_key``).
      A text-only group's ``core.Task`` must read the same key (``input_key``).
  """

  group: GroupDef
  modalities: tuple[str, ...]
  text_key: str = CAPTION_KEY

  def __post_init__(self):
    if not is_caption_key(self.text_key):
      raise ValueError(f"text_key must be a caption key, got {self.text_key!r}.")
    input_key = getattr(getattr(self.group, "task", None), "input_key", None)
    if self.modalities == ("text",) and input_key is not None and input_key != self.text_key:
      raise ValueError(
        f"a text group's task reads {input_key!r}, its text_key is {self.text_key!r}."
      )

  @property
  def multimodal(self) -> bool:
    return len(self.modalities) == 2


# ----------------------------------------------------------------------------
# Pieces of the round


def _public_inputs(
  public: dict[str, Array], modality: str, index: Array, text_key: str = CAPTION_KEY
) -> Array:
  """Inputs of public samples ``index``; text is each sample's first caption under ``text_key``.

  The public set holds the same captions once per token space the run's text towers
  read (``caption``, ``caption:<checkpoint>``); a tower reads those of its own space,
  so every tower represents the same public samples. Images are shared.
  """
  if modality == "image":
    return public["image"][index]
  return public[text_key][index, 0]


def public_representations(
  model: nnx.Module,
  modality: str,
  public: dict[str, Array],
  batch_size: int,
  text_key: str = CAPTION_KEY,
) -> Array:
  """``[P, d]`` representations of the public set (text: first caption of ``text_key``), in batches."""
  num_public = public["image"].shape[0]
  index = jnp.arange(num_public)
  return apply_in_batches(
    lambda idx: represent(model, modality, _public_inputs(public, modality, idx, text_key)),
    index,
    batch_size,
  )


def _private_objective(client: ClientGroup):
  """Builds the private-task objective of a group (``(group, shared) -> objective``)."""
  group = client.group
  if not client.multimodal:
    return supervised_objective

  def objective_fn(g, shared):
    def objective(params, batch, mask, key):
      model = g.merge(params, shared)
      loss = retrieval_objective(
        model, batch, mask, key, group.task.temperature, text_key=client.text_key
      )
      return loss, {}

    return objective

  return objective_fn


def regulariser_objective(
  client: ClientGroup,
  shared: PyTree,
  start_params: PyTree,
  public: dict[str, Array],
  global_reps: dict[str, Array],
  config: CreamConfig,
  var: Variant,
):
  """The regulariser of eq. (3) for ONE client, over a batch of public indices (no ``gamma``).

  ``sum_m [inter * mean eq.(1) + intra * mean eq.(2) + client_muscle * mean
  Muscle + local_kd * mean ||z_m - g_m||]`` over the client's modalities
  ``m``: LCR or, for CreamFL + Muscle, the Muscle loss of the local
  representation against the global representations of both modalities
  (``M = 2``), or, for the distillation baselines, the l2 distance of eq. (7)
  to the server's global representation ``g_m`` of the same sample and
  modality (the server-to-client transfer of FedMD / FedET / FedGEMS). The intra-modal negative is
  the representation by ``start_params``, the client's parameters at the START
  of the round (its model "of the last round", eq. (2)); it is a constant. The
  client's text tower reads the public captions of its own token space
  (``client.text_key``); the global representations it is compared with are the
  server's of the same samples, whatever space the server's text tower reads.
  :func:`local_objective` weighs this by ``gamma``.
  """
  group = client.group
  previous_model = group.merge(start_params, shared)

  def objective(params, batch, mask, key):
    del key
    model = group.merge(params, shared)
    index = batch["index"]
    others = jnp.stack([global_reps[m][index] for m in MODALITIES])  # [2, B, d]
    total, aux = 0.0, {}
    for m in client.modalities:
      x = _public_inputs(public, m, index, client.text_key)
      z = represent(model, m, x)
      previous = jax.lax.stop_gradient(represent(previous_model, m, x))
      l_inter = losses.inter_modal_contrast(
        z, global_reps[_other(m)], index, temperature=config.inter_temperature, where=mask
      )
      l_intra = losses.intra_modal_contrast(
        z, global_reps[m][index], previous, temperature=config.intra_temperature, where=mask
      )
      # Public batches have no padding rows; mask is all-or-nothing.
      l_muscle = losses.muscle_loss(
        z, others, tau=config.muscle_tau_full, gamma=config.muscle_gamma
      )
      aux[f"inter_{m}"] = masked_mean(l_inter, mask)
      aux[f"intra_{m}"] = masked_mean(l_intra, mask)
      aux[f"muscle_{m}"] = masked_mean(l_muscle, mask)
      l_kd = losses.representation_distance(z, global_reps[m][index], where=mask)
      aux[f"kd_{m}"] = masked_mean(l_kd, mask)
      total = (
        total
        + var.inter * aux[f"inter_{m}"]
        + var.intra * aux[f"intra_{m}"]
        + var.client_muscle * aux[f"muscle_{m}"]
        + var.local_kd * aux[f"kd_{m}"]
      )
    return total, aux

  return objective


#: Folded into a local step's key to draw its public minibatch (the private loss keeps the key).
_PUBLIC_STREAM = 0x9B11C


def public_batch(key: Array, num_public: int, batch_size: int) -> Array:
  """``int32 [B]`` distinct public indices drawn uniformly: the public minibatch of a local step.

  ``key`` is the step's key (the one its private loss receives); the draw uses
  a key folded out of it, so the private loss's own random draws are the same
  with and without a regulariser.
  """
  key = jax.random.fold_in(key, _PUBLIC_STREAM)
  return jax.random.choice(key, num_public, (batch_size,), replace=False).astype(jnp.int32)


def public_batch_size(config: CreamConfig, num_public: int, steps_per_epoch: int) -> int:
  """``B_p``: ``config.public_batch_size``, or ``ceil(P / S)`` (about ``P`` public samples an epoch)."""
  if config.public_batch_size is not None:
    return min(config.public_batch_size, num_public)
  return min(num_public, math.ceil(num_public / max(1, steps_per_epoch)))


def local_objective(
  client: ClientGroup,
  shared: PyTree,
  start_params: PyTree,
  public: dict[str, Array],
  global_reps: dict[str, Array],
  config: CreamConfig,
  var: Variant,
  b_public: int,
):
  r"""Eq. (3) for ONE client: its private loss plus ``gamma`` times the regulariser.

  One local step minimises

  .. math::
    \mathcal{L}_{local} = \frac{1}{b} \sum_{k \in \text{private batch}} \ell(x_k, y_k)
      + \gamma \cdot \frac{1}{B_p} \sum_{k \in \text{public batch}}
        (\ell^{inter}_k + \ell^{intra}_k)

  on the step's private minibatch and a public minibatch of ``B_p``
  samples drawn afresh (:func:`public_batch`), an unbiased estimate of eq.
  (3)'s gradient, as Algorithm 1, line 17 takes it. The public batch is drawn
  from a key folded out of the step's key, so the private loss sees exactly
  the keys it sees without a regulariser, and ``gamma = 0`` trains exactly as
  the private task alone. For variants without a regulariser (``reamFL``)
  the public term sits under a ``jax.lax.cond`` and costs nothing.

  Args:
    client: the client's group and modalities.
    shared: the group's untrained shared parameters.
    start_params: the client's parameters at the start of the round (eq.
      (2)'s negative).
    public: ``image [P, S, S, 3]`` and the captions ``[P, C, L]`` of every token
      space (the client reads ``client.text_key``'s).
    global_reps: ``{modality: [P, d]}``, the server's global representations.
    config: ``lcr_weight`` is ``gamma``.
    var: the variant (which regulariser terms run).
    b_public: ``B_p``, public samples per step (static; :func:`public_batch_size`).

  Returns:
    An objective ``(params, batch, mask, key) -> (loss, aux)`` for
    :func:`fedjax_mm.core.local_update`; ``aux`` holds the ``private`` loss
    and the unweighted ``regulariser``.
  """
  private = _private_objective(client)(client.group, shared)
  regulariser = regulariser_objective(
    client, shared, start_params, public, global_reps, config, var
  )
  num_public = public["image"].shape[0]

  def objective(params, batch, mask, key):
    loss, aux = private(params, batch, mask, key)

    def regularise(_):
      index = public_batch(key, num_public, b_public)
      value, _ = regulariser(params, {"index": index}, jnp.ones(index.shape, bool), key)
      return jnp.asarray(value, jnp.float32)

    value = jax.lax.cond(var.regularised, regularise, lambda _: jnp.zeros((), jnp.float32), None)
    return loss + config.lcr_weight * value, aux | {"private": loss, "regulariser": value}

  return objective


def _public_pass(objective, tx, params, opt_state, rng, num_public, batch_size, enabled):
  """One epoch of ``objective`` over the public indices (no step when not ``enabled``)."""
  index = jnp.arange(num_public)
  mask = jnp.broadcast_to(enabled, (num_public,))
  return local_update(
    objective,
    tx,
    params,
    opt_state,
    rng,
    {"index": index},
    mask,
    num_epochs=1,
    batch_size=batch_size,
  )


def server_retrieval_objective(server: ServerDef, public: dict[str, Array], temperature: float):
  """Step 1: the server's symmetric InfoNCE on public pairs (a random caption each, of
  ``server.text_key``)."""
  text_key = server.text_key

  def objective(params, batch, mask, key):
    model = server.merge(params)
    index = batch["index"]
    sub = {"image": public["image"][index], text_key: public[text_key][index]}
    return retrieval_objective(model, sub, mask, key, temperature, text_key=text_key), {}

  return objective


def draw_local_partners(
  key: Array, present: Array, num_partners: int, valid: Array | None = None
) -> Array:
  """``int32 [M]`` distinct indices among the ``present`` local matrices, uniformly.

  ``valid`` (``bool [R]``, the matrices of real clients) indexes the draw by rank
  among them (:func:`fedjax_mm.core.client_uniform`), so padding clients in the
  concatenation change no choice; None: by position.
  """
  u = jax.random.uniform(key, present.shape) if valid is None else client_uniform(key, valid)
  scores = jnp.where(present, u, -1.0)
  return jax.lax.top_k(scores, num_partners)[1]


def server_kd_objective(
  server: ServerDef,
  public: dict[str, Array],
  targets: dict[str, Array],
  has: dict[str, Array],
  local_reps: Array,
  present: Array,
  config: CreamConfig,
  var: Variant,
  *,
  diversity: dict[str, tuple[Array, Array]] | None = None,
  global_reps: dict[str, Array] | None = None,
  valid: Array | None = None,
):
  """Steps 6-7 on the server: eq. (7) and/or the server's Muscle loss (App. K).

  ``distill_weight * (distill * sum_m ||f_m - a_m||_2 + server_muscle * sum_m
  Muscle(f_m; M local matrices) [+ FedET's term])``: ``a_m`` are the aggregated
  representations (modalities nobody sent are skipped), and the ``M`` partners are
  drawn per batch among all local matrices received (``local_reps`` ``[R, P, d]``,
  both modalities). The FedET row (``var.diversity``) adds ``fedet_diversity_weight
  * sum_m mean_k KL(softmax(e_m,k . g_m'/tau) || softmax(f_m,k . g_m'/tau))``,
  FedET's diversity regulariser (:func:`fedjax_mm.losses.fedet_diversity`,
  :mod:`fedjax_mm.server.kd_aggregate`), under a ``jax.lax.cond`` so the other rows
  do not compute it.

  Args:
    diversity: per modality ``m``, ``(e_m [P, d], mask_m bool [P])``: FedET's
      diversity ensemble and the samples that have one
      (:func:`fedjax_mm.server.kd_aggregate.fedet_with_diversity`); ``None``
      leaves the term out of the program.
    global_reps: the global representations ``g`` of both modalities (this
      round's ``I_glob``, ``T_glob``; the softmaxes of modality ``m`` run over
      those of the other one ``m'``); needed with ``diversity``.
    valid: ``bool [R]``, the local matrices of real clients (padding clients
      excluded), for :func:`draw_local_partners`.
  """
  if diversity is not None and global_reps is None:
    raise ValueError("diversity needs global_reps.")

  def objective(params, batch, mask, key):
    model = server.merge(params)
    index = batch["index"]
    partners = draw_local_partners(key, present, config.muscle_partners, valid)
    others = local_reps[partners][:, index]  # [M, B, d]
    total = 0.0
    for m in MODALITIES:
      z = represent(model, m, _public_inputs(public, m, index, server.text_key))
      distance = losses.representation_distance(z, targets[m][index], where=mask)
      muscle = losses.muscle_loss(z, others, tau=config.muscle_tau_full, gamma=config.muscle_gamma)
      total = (
        total
        + var.distill * has[m] * masked_mean(distance, mask)
        + var.server_muscle * masked_mean(muscle, mask)
      )
      if diversity is not None:
        ensemble, has_ensemble = diversity[m]

        def regularise(_, z=z, ensemble=ensemble, has_ensemble=has_ensemble, m=m):
          kl = losses.fedet_diversity(
            z,
            ensemble[index],
            global_reps[_other(m)],
            temperature=config.gca_temperature,
            where=mask & has_ensemble[index],
          )
          return masked_mean(kl, mask).astype(z.dtype)

        def skip(_, z=z):
          return jnp.zeros((), z.dtype)

        value = jax.lax.cond(var.diversity > 0, regularise, skip, None)
        total = total + config.fedet_diversity_weight * value
    return config.distill_weight * total, {}

  return objective


def _split(flat: Array, sizes: Sequence[int]) -> list[Array]:
  out, start = [], 0
  for k in sizes:
    out.append(flat[start : start + k])
    start += k
  return out


def client_update(
  client: ClientGroup,
  state: ClientState,
  data: ClientData,
  active: Array,
  public: dict[str, Array],
  global_reps: dict[str, Array],
  var: Variant,
  config: CreamConfig,
  max_steps: Array | None = None,
) -> tuple[ClientState, Array]:
  """Step 4 for one group: ``E`` epochs of eq. (3), the clients batched by the engine.

  :func:`fedjax_mm.core.train_group` runs each client's
  :func:`fedjax_mm.core.local_update` of its
  :func:`local_objective` (private minibatch + ``gamma`` x regulariser on a
  public minibatch of :func:`public_batch_size`, every step), whose
  intra-modal negative is the client's model at the START of this call. Clients with ``active = False`` take no
  step; ``max_steps [K]`` (stragglers) caps the local steps, regulariser
  included (it rides on them).

  Returns:
    ``(state, local objective [K])``: the mean over the steps taken of eq. (3)
    (the private loss alone for variants without a regulariser).
  """
  group = client.group
  steps_per_epoch = math.ceil(data.sample_mask.shape[1] / group.batch_size)
  b_public = public_batch_size(config, public["image"].shape[0], steps_per_epoch)

  def objective(params):
    return local_objective(client, state.shared, params, public, global_reps, config, var, b_public)

  state, stats = train_group(
    group, state, data, active=active, max_steps=max_steps, client_objective=objective
  )
  return state, stats["loss"]


# ----------------------------------------------------------------------------
# The algorithm


def _server_retrieval_epoch(
  server: ServerDef, config: CreamConfig, state: CreamState, public: dict[str, Array]
) -> tuple[CreamState, Array]:
  """Step 1: one epoch of the server's retrieval loss on the public set; returns the mean loss."""
  objective = server_retrieval_objective(server, public, config.server_temperature)
  params, opt, rng, stats = _public_pass(
    objective,
    server.tx_at(state.round),
    state.server_params,
    state.server_opt,
    state.server_rng,
    public["image"].shape[0],
    config.batch_size,
    True,
  )
  return state.replace(server_params=params, server_opt=opt, server_rng=rng), stats["loss"]


def creamfl(
  clients: Sequence[ClientGroup],
  server: ServerDef,
  config: CreamConfig,
  *,
  faults: faults_lib.Faults = faults_lib.NONE,
) -> Algorithm:
  """CreamFL and its variants over a tuple of client groups, as an :class:`Algorithm`.

  ``init(server_params, client_states, key)`` and
  ``round(state, data, public, variant) -> (state, stats)`` where ``data`` is
  the per-group :class:`ClientData` (sample counts and client masks are read
  from it), ``public`` holds ``image [P, S, S, 3]`` and the captions ``[P, C, L]``
  of every token space read (``server.text_key`` and each group's ``text_key``:
  the same captions, tokenised for each text tower) and ``variant`` is a
  :class:`Variant`. ``stats`` holds the participation
  mask per group (``active``), the number of local matrices received per
  modality, losses, and finiteness flags of the server and of each client;
  with ``faults`` (default: none) also ``fault_counts`` and ``dropped`` per
  group.
  """
  clients = tuple(clients)

  def init(server_params: PyTree, states: Sequence[ClientState], key: Array) -> CreamState:
    return CreamState(
      round=jnp.zeros((), jnp.int32),
      rng=key,
      server_params=server_params,
      server_opt=server.tx.init(server_params),
      server_rng=jax.random.fold_in(key, 1),
      groups=tuple(states),
    )

  def aggregate_modality(local, present, counts, multimodal, global_same, global_other, var):
    """Step 6 for one modality: ``[C, P, d]`` -> ``[P, d]`` by the variant's rule.

    Returns ``(target [P, d], diversity [P, d], has_diversity bool [P])``: the
    last two are FedET's diversity ensemble (zeros / ``False`` for the other rules).
    """
    p = present.astype(local.dtype)
    n = counts.astype(local.dtype)
    factor = jnp.where(multimodal, config.iot_weight, 1.0).astype(local.dtype)
    tau, chunk = config.gca_temperature, config.gca_chunk_size
    none = (jnp.zeros(local.shape[1:], local.dtype), jnp.zeros(local.shape[1:2], bool))

    def fedet(_):
      target, _, ensemble, beta = kd_aggregate.fedet_with_diversity(
        local, global_other, present, temperature=tau, chunk_size=chunk
      )
      return target, ensemble, jnp.sum(beta, axis=0) > 0

    def fedgems(_):
      target, _ = kd_aggregate.fedgems(
        local, global_same, global_other, present, temperature=tau, chunk_size=chunk
      )
      return target, *none

    def gca_rule(_):
      target, _ = gca.gca(local, global_other, present, temperature=tau, chunk_size=chunk)
      return target, *none

    branches = (
      lambda _: (gca.client_weighted(local, p)[0], *none),
      lambda _: (gca.client_weighted(local, p * n)[0], *none),
      lambda _: (gca.client_weighted(local, p * n * factor)[0], *none),
      gca_rule,
      fedet,
      fedgems,
    )
    return jax.lax.switch(var.aggregation, branches, None)

  def round_fn(
    state: CreamState, data: Sequence[ClientData], public: dict[str, Array], var: Variant
  ):
    key = jax.random.fold_in(state.rng, state.round)
    num_public = public["image"].shape[0]
    stats = {}

    # 1. The server trains on the public set.
    state, stats["server_loss"] = _server_retrieval_epoch(server, config, state, public)
    server_model = server.merge(state.server_params)

    # 2. A random fraction of the clients takes part.
    valid = jnp.concatenate([d.client_mask for d in data])
    selected = aggregate.sample_clients(jax.random.fold_in(key, 0), valid, config.num_selected)
    sizes = [d.num_clients for d in data]
    active = _split(selected, sizes)
    stats["active"] = tuple(active)
    masks = None
    if faults.enabled:
      fault_key = jax.random.fold_in(key, faults_lib.SALT)
      masks = faults_lib.draw(fault_key, selected, faults, client_mask=valid)
      stats["fault_counts"] = masks.counts()
      stats["dropped"] = tuple(_split(masks.dropped, sizes))

    # 3. Global representations of the public set, sent to the selected clients.
    global_reps = {
      m: public_representations(server_model, m, public, config.batch_size, server.text_key)
      for m in MODALITIES
    }

    # 4-5. Local training on eq. (3), local representations of the public set.
    new_groups, local = [], {m: [] for m in MODALITIES}
    meta = {m: {"present": [], "counts": [], "multimodal": [], "valid": []} for m in MODALITIES}
    client_losses, offset = [], 0
    for client, cstate, d, act in zip(clients, state.groups, data, active, strict=True):
      budget = sent = None
      if masks is not None:
        k = d.num_clients
        budget = faults_lib.step_budget(
          masks.work[offset : offset + k],
          d.num_samples,
          num_epochs=client.group.local_epochs,
          batch_size=client.group.batch_size,
        )
        sent = act & ~masks.dropped[offset : offset + k]
        byzantine = masks.byzantine[offset : offset + k]
        offset += k
      cstate, local_loss = client_update(
        client, cstate, d, act, public, global_reps, var, config, max_steps=budget
      )
      client_losses.append(local_loss)
      new_groups.append(cstate)

      def reps(params, shared=cstate.shared, client=client):
        model = client.group.merge(params, shared)
        return {
          m: public_representations(model, m, public, config.batch_size, client.text_key)
          for m in client.modalities
        }

      group_reps = jax.vmap(reps)(cstate.params)  # {m: [K, P, d]}
      if masks is not None and faults.has_byzantine:
        group_reps = {
          m: faults_lib.corrupt_representations(
            jax.random.fold_in(faults_lib.corruption_key(fault_key, len(new_groups)), i),
            group_reps[m],
            byzantine,
            faults,
          )
          for i, m in enumerate(client.modalities)
        }
      for m in client.modalities:
        local[m].append(group_reps[m])
        meta[m]["present"].append(act if sent is None else sent)
        meta[m]["counts"].append(d.num_samples)
        meta[m]["multimodal"].append(jnp.full(act.shape, client.multimodal))
        meta[m]["valid"].append(d.client_mask)
    state = state.replace(groups=tuple(new_groups))
    stats["client_loss"] = tuple(client_losses)

    local = {m: jnp.concatenate(v) for m, v in local.items()}
    meta = {m: {k: jnp.concatenate(v) for k, v in mm.items()} for m, mm in meta.items()}
    has = {m: jnp.any(meta[m]["present"]).astype(jnp.float32) for m in MODALITIES}
    stats["received"] = {m: jnp.sum(meta[m]["present"]) for m in MODALITIES}

    # 6-7. Aggregation and distillation (or the server's Muscle loss).
    aggregated = {
      m: aggregate_modality(
        local[m],
        meta[m]["present"],
        meta[m]["counts"],
        meta[m]["multimodal"],
        global_reps[m],
        global_reps[_other(m)],
        var,
      )
      for m in MODALITIES
    }
    objective = server_kd_objective(
      server,
      public,
      {m: a[0] for m, a in aggregated.items()},
      has,
      jnp.concatenate([local[m] for m in MODALITIES]),
      jnp.concatenate([meta[m]["present"] for m in MODALITIES]),
      config,
      var,
      diversity={m: a[1:] for m, a in aggregated.items()},
      global_reps=global_reps,
      valid=jnp.concatenate([meta[m]["valid"] for m in MODALITIES]),
    )
    params, opt, rng, kd_stats = _public_pass(
      objective,
      server.tx_at(state.round),
      state.server_params,
      state.server_opt,
      state.server_rng,
      num_public,
      config.batch_size,
      True,
    )
    stats["kd_loss"] = kd_stats["loss"]
    state = state.replace(server_params=params, server_opt=opt, server_rng=rng)
    stats["server_finite"] = all_finite(state.server_params)
    stats["client_finite"] = tuple(finite_per_client(g.params) for g in state.groups)
    return state.replace(round=state.round + 1), stats

  return Algorithm(init=init, round=round_fn)


def server_only(server: ServerDef, config: CreamConfig) -> Algorithm:
  """ "Local training" of the server alone on the public set (step 1 every round).

  Same state type as :func:`creamfl` (the client groups ride along untouched),
  ``round(state, public) -> (state, stats)``.
  """

  def init(server_params: PyTree, states: Sequence[ClientState], key: Array) -> CreamState:
    return creamfl((), server, config).init(server_params, states, key)

  def round_fn(state: CreamState, public: dict[str, Array]):
    state, loss = _server_retrieval_epoch(server, config, state, public)
    state = state.replace(round=state.round + 1)
    return state, {"server_loss": loss, "server_finite": all_finite(state.server_params)}

  return Algorithm(init=init, round=round_fn)
