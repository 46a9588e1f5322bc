r"""FedRGB (Algorithm 1): guided local training and a DRO-learnt teacher aligner.

FedRGB paper (``fedrgb.txt``), Sections 4.1-4.2, Algorithm 1, App. B; the
authors' code is BioMed-AI-Lab-U-Michgan/TMLR_FedDRA. Each method of :data:`METHODS` is an
:class:`~fedjax_mm.algorithms.base.Algorithm` (:func:`algorithm`, or
:attr:`FedRGB.algorithm`): ``init(key, encoder, aligner, num_clients, decoder=None)`` and
``round(state, arrays, mask) -> (state, metrics)``, :class:`FedRGB`'s methods. One round:

1. **DRO losses at the start of the round** (Algorithm 1 line 3): every client
   computes ``v_c = L_dro`` (in the configured form: App. B's by default, eq. (12)
   or eq. (6)) of the current teacher on one batch, with the learnable encoder copy
   equal to the global encoder (no distortion yet: the regulariser is 0, so ``v_c``
   is the teacher's ``L_CL`` on the global features, plus under App. B's form the
   global aligners' ``L_task`` there).
2. **DRO weights** (eq. (5), line 15): ``w <- Proj(w e^{gamma v} / sum, rho)``
   (:func:`fedjax_mm.server.dro_update`), used in this same round (line 23), as
   the paper says. ``dro_source="code"`` is the authors' code's variant instead:
   after stage 2, each client's ``L_dro`` of the averaged model (encoder ``f*``,
   the new teacher, no distortion) on a fixed 10% of its training split
   (:func:`dro_subset`) is kept in the state and gives the weights of the NEXT
   round (uniform in the first; tested).
3. **Stage 1** (eqs. (1)-(2)): each client trains its aligners (and, with
   ``train_encoders``, its encoders) on ``L_local = L_guide + alpha L_task``
   with the teacher aligners frozen, ``stage1_steps`` AdamW steps on batches
   drawn with replacement from its data (the paper's "50 batches per round").
4. **Aggregation weighted by w.** Adam(W) is invariant to the scale of the
   loss, so scaling client ``c``'s loss by ``w_c`` (Algorithm 1 line 23, and the
   authors' code) would leave the update unchanged. Here the server's average
   of the stage-1 encoders and aligners is weighted by ``w``
   (FedAvg's weighted mean, :func:`fedjax_mm.server.weighted_mean`): raising ``w_c`` moves the global model towards client
   ``c`` (tested).
5. **Stage 2** (eq. (6), lines 17-27): on each client, a learnable copy of the
   averaged encoder ``f*`` gives distorted features; the client's frozen
   stage-1 aligner ``g`` gives ``L_task``; the teacher ``g*`` (trained here, as
   the paper says; the code never trains it) gives calibrated representations
   regularised towards its output on the frozen ``f*``'s features (weight
   ``beta``) plus ``L_CL``. **Default: App. B** (``dro_form="appb"``): eq. (12)'s
   regulariser and ``L_CL`` (between the teacher's image and text outputs on the
   frozen ``f*``'s features) plus ``L_task`` of the client's frozen stage-1 aligner
   on the distorted features, as App. B's text feeds them; ``dro_form="eq12"`` is
   eq. (12) alone, ``"eq6"`` eq. (6). ``L_task`` is what distorts: it pulls the
   encoder copy towards the client's own (biased) alignment, and the regulariser
   then trains the teacher to give the same outputs on the distorted features as on
   the clean ones. Under eq. (12) alone the copy gets no gradient where it starts
   (the regulariser is at its minimum and ``L_CL`` reads the frozen ``f*``): with
   ``beta = 0`` it moves only by AdamW's weight decay (tested), and with ``beta > 0``
   by the regulariser's gradient of that drift, which Adam's normalisation turns into
   steps of full size. That is distortion by the optimiser, not by the client's
   alignment; the stage then trains the teacher on ``L_CL`` of undistorted
   features. Measured (world, 5 clients, 5 rounds, seed 0): with eq. (6) and line
   27 the global aligners collapse to chance (i2t R@1 0.0%, chance 1%), since eq.
   (6) never trains the teacher's image-text alignment (its ``L_CL`` pairs images
   with images, and ``L_task`` reaches only the encoder copy through the frozen
   local aligner) yet the teacher replaces the aligners; eq. (12) keeps the
   alignment (i2t R@1 23.8%, FedAvg 24.4%). The
   encoder copy is discarded after the stage (only the teacher is sent, as
   Table 9's stage-2 traffic implies).
6. **Server**: the teachers' average weighted by ``w`` becomes both the next
   teacher and the next round's global aligners (line 27).

Model choices (scaled from the paper's ViT-Base / BERT-base, with the authors'
code's 768-2048-128 heads):

* Encoders: the zoo's, optionally filled from the shipped World-CLIP weights.
* Align module: one pre-LN Transformer block (width = encoder features, 4
  heads) over the sequence ``[pooled; tokens]`` keeping the first output
  token, as the authors' code keeps the first token. Image tokens are the
  encoder's spatial map ``[H/4, W/4, c]`` flattened (patch tokens for the ViTs,
  spatial positions for the CNNs); the pooled feature is prepended as the
  first token for both modalities (the zoo's encoders have no CLS token).
  Text PAD tokens are masked as keys.
* Projection head: Linear -> GELU -> Linear to ``d`` and L2-normalised; no
  BatchNorm (the library's models hold no batch statistics).
* Encoders frozen in stage 1 by default (the code; the paper trains the whole
  model): ``train_encoders=True`` is the paper's. Stage 1 reaches the next round
  through stage 2: App. B's ``L_task`` reads the client's stage-1 aligner, whose
  alignment distorts the encoder copy that the teacher learns to be robust to
  (tested: the "->CL" guidance changes the round). **With frozen encoders and eq.
  (12) alone, stage 1 cannot change the result**: line 27 replaces the aligners by
  the teacher, eq. (12) does not read the local aligners, and the encoders do not
  move, so the local aligners trained in stage 1 reach nothing (tested: the "->CL"
  guidance gives bit for bit the round eq. (1) gives). In the authors' code stage
  1 counts because their teacher is the average of the stage-1 aligners
  (``teacher="average"``); in the paper's Algorithm 1 it also counts through the
  encoders it trains.
* Losses reduced by the mean over the batch (:mod:`fedjax_mm.losses.fedrgb`).
* Optimiser: AdamW (weight decay 0.05, the authors' code's; App. C names no
  optimiser), fresh state every stage and round (the code re-creates its
  optimiser per round).
* No extra round for the guidance: App. C runs "an extra communication" to
  obtain it; here round 1's stage 1 is guided by the initial aligner. The
  authors' code runs no round before the first either (``FedAvg_SLIA_HC.py``):
  its first round's guiding aligners are freshly initialised modules of their own
  (``SLIA_module.py``), set from the averaged aligners only after stage 1. With
  frozen encoders and eq. (12) alone stage 1 cannot change the result (above); with
  ``train_encoders`` the first round's guidance pulls towards that aligner.

``method="fedavg"`` is the baseline on the same backbone: stage 1 on
``L_task`` alone (no guidance), no stage 2, no DRO, aggregation weighted by
the clients' data sizes. Ablations (Sec. 5.4, Table 4): ``teacher="average"``
("->avg.alig.": no stage 2; the teacher is the stage-1 aligners' average, weighted
by ``w`` like the aligners, which the authors' code does in every run),
``guide="cl"`` ("->CL": :func:`fedjax_mm.losses.guide_contrastive_loss` instead of
eq. (1)), and ``rho=0`` (uniform DRO weights: ours). ``method="local"`` is the paper's "Local" row: every
client trains its own copy on ``L_task`` for ``stage1_steps`` steps a round and
nothing is communicated; its state holds the ``K`` models stacked.

``method="centralised"`` is the paper's upper bound, "the centralized pre-trained model
(Global)" (Sec. 5.2; Table 2's "Centralized"; App. C.3 swaps the two names: "centralized
training (Local), and decentralized training (Global)"): ONE model (same encoders,
aligners and ``L_task``; no guidance, no DRO, no teacher) trained on the union of the
clients' training pairs. Budget: the same number of samples seen and of AdamW steps as
FedAvg's round summed over clients, i.e. ``K * stage1_steps`` steps of ``batch_size``
pairs a round, drawn with replacement from the union (so each client's data counts in
proportion to its size, as FedAvg's data-size weights); the batch stays ``batch_size``,
so the contrastive loss sees as many negatives as a client's does. Optimiser state fresh
every round, as the federated rows'. Nothing is communicated.

``method="fedema"`` is the paper's adapted FedEMA (Zhuang et al., ICLR 2022; Sec. 5.1:
"we adapted FedMAE ..., FedEMA ..., and FedX ... for comparison"; "To enable uni-modal
self-supervised learning baselines to be applied to our setting, we employ the image-text
contrastive loss with the same hyperparameters to our method for fairness"). FedEMA's
contribution is its model update, :mod:`fedjax_mm.server.fedema`: at the start of each
round client ``k`` starts from ``mu W_k + (1 - mu) W_g`` with ``mu = min(lambda_k ||W_g -
W_k||, 1)`` and ``lambda_k = ema_tau / ||W_g - W_k||`` the first time its divergence is
positive (the authors' autoscaler, target 0.8 by default). Adaptations:

* **Local loss**: ``L_task`` (the image-text contrastive loss, tau 0.07) for
  ``stage1_steps`` AdamW steps, as FedAvg, in place of BYOL's; so there is no target
  network (BYOL's EMA target exists for its loss) and no predictor (FedEMA's
  divergence-aware predictor update has nothing to act on).
* **What is EMA-updated and measured**: the client's trained parameters, the aligners
  (+ the encoders with ``train_encoders``), the analogue of FedEMA's online network. The
  divergence is taken over the same parameters (FedEMA measures the encoder; here the
  encoders are frozen by default, and a divergence of frozen weights would be 0 and give
  FedAvg).
* **Divergence** as the paper writes it, ``||W_g^r - W_k^{r-1}||`` over the whole
  parameter vector (default); ``ema_divergence="code"`` is the authors' code's, the mean
  per-layer distance of the weight matrices between the start and end of the client's
  last local training (its conv weights). Measured (world, 5 clients, seed 0): the
  paper's measure locks ``mu`` at 1 from round 3 (the divergence to a global model the
  client no longer takes in only grows), so the clients then train on alone and the
  global model is the average of their drifting models.
* **Server**: FedAvg's data-size-weighted average of the clients' trained models (the
  global model that is evaluated); every client takes part in every round, so every
  client keeps its model of the last round (``RgbState.clients``, ``scaler``). Traffic as
  FedAvg's (Table 9 gives FedEMA FedAvg's communication).

``method="fedx"`` is the paper's adapted FedX (Han et al., "FedX: Unsupervised Federated
Learning with Cross Knowledge Distillation", ECCV 2022; code Sungwon-Han/FEDX). A client
keeps the global model it received frozen (``g``) and trains its copy (``z``) for
``stage1_steps`` AdamW steps on FedX's four terms, each of weight 1 (the code's sum;
``fedx_weight`` scales the last three, 0 leaves FedAvg's client), on FedAvg's batch of
``B`` pairs and a second batch of ``B`` anchor pairs drawn from its data (the code's
"random" loader), :meth:`FedRGB.fedx_objective`::

  L = L_task(z_I, z_T)                                         local contrastive
    + L_rel(z_I, z_T; A_z)                                     local relational
    + (NT-Xent(z_I, g_T) + NT-Xent(z_T, g_I)) / 2              global contrastive
    + (L_rel(z_I, g_I; A_g) + L_rel(z_T, g_T; A_g)) / 2        global relational

with ``A_z`` / ``A_g`` the local / global model's image AND text embeddings of the anchor
batch (``2B`` anchors), ``L_rel`` :func:`fedjax_mm.losses.relational_loss` (FedX's JS
loss) and NT-Xent :func:`fedjax_mm.losses.nt_xent`, both at FedX's temperatures
``fedx_tau = fedx_target_tau = 0.1`` (its code's ``--temperature``, ``--ts``, ``--tt``).
The server is FedAvg (data-size weights), traffic FedAvg's. Adaptations:

* **Views.** FedX's two augmented views of an image become the image and its caption
  (the two views the image-text contrastive loss already pairs; the runner has no
  augmentations), and FedX's local NT-Xent becomes ``L_task`` (tau 0.07), the paper's
  "image-text contrastive loss with the same hyperparameters".
* **No predictor.** FedX feeds its global terms from a predictor head on the local
  projection; Table 9 gives FedX FedAvg's parameter count, so none is added and the local
  embeddings enter the global terms directly.
* **Global contrastive**: FedX contrasts the local model's view 1 with the global model's
  view 2; here both crossings (local image / global text and local text / global image),
  averaged, as image and caption are not exchangeable the way two augmentations are.
* **Global relational**: FedX compares the local model's two views over the global
  model's anchors. Here each modality's local embedding is compared with the global
  model's embedding of the same item (``z_I`` with ``g_I``, ``z_T`` with ``g_T``) over
  the global model's anchors: the local image-text relation is already the local term,
  and this way the term distils the global model's relations themselves. It is 0 when
  local and global embeddings agree (at ``fedx_tau = fedx_target_tau``; tested).

``method="fedmae"`` is the paper's adapted FedMAE (Yan et al., "Label-efficient
self-supervised federated learning for tackling data heterogeneity in medical imaging",
IEEE TMI 2023: Fed-MAE, MAE pre-training (He et al., CVPR 2022) with FedAvg of the whole
masked autoencoder, encoder and decoder). A client trains on ``L_task`` of the clean
pairs plus ``mae_weight`` (1: the paper gives none) times MAE's loss,
:meth:`FedRGB.mae_objective`: a random ``mae_ratio = 0.75`` of each image's patches
(MAE's ratio; Fed-MAE's published retina script passes 0.6, settable as
``fedmae.mask_ratio``) is masked afresh every step, and the mean squared error of
normalised pixels over the masked patches (:func:`fedjax_mm.losses.masked_reconstruction_loss`,
MAE's ``norm_pix_loss``, which Fed-MAE's scripts set) is minimised. Adaptations:

* **Patches and masking.** Patches are ``p x p`` on the encoder's token grid (``p = 4``
  for every encoder of the zoo: the ViTs' patch size, the CNNs' stride to the spatial
  map, e.g. ``cnn_s`` in ``:smoke``). The zoo's encoders take no subset of tokens (and
  the CNNs have none), so the masked patches are zeroed in pixel space and the whole grid
  is encoded, where MAE drops them from its encoder; the decoder then replaces the masked
  positions by its mask token, so what it reads of a masked patch is only the context
  the visible ones give.
* **MAE's encoder** is the image tower up to the align module's Transformer block
  (:meth:`Aligner.encode`): with frozen encoders (the default) reconstruction trains the
  image aligner's block, which the contrastive loss trains too (with
  ``train_encoders`` the encoder as well).
* **Decoder** (:class:`MaeDecoder`): one Transformer block at the encoder's width and a
  linear pixel head (MAE's has 8 blocks of width 512; scaled to the model). It is
  averaged by FedAvg each round and sent with the model (``RgbState.decoder``; Table 9
  counts FedMAE's extra parameters in its traffic), never part of the evaluated model:
  retrieval, distortion and fine-tuning read the encoders and aligners only; the
  distortion study's "own" retraining trains it alongside, from the final one.
* ``L_task`` sees the unmasked images (the paper does not say whether its adaptation
  contrasts masked images).

**Client faults** (:mod:`fedjax_mm.core.faults`, off by default; ``FedRGB.faults``),
drawn per round among the clients with data (every client takes part in every round) from
``fold_in(round_key, SALT)``, for every federated method (FedRGB and its ablations, FedAvg,
FedEMA, FedX, FedMAE); Local and Centralised communicate nothing and run without them.

* A **straggler** takes ``floor(u * steps)`` of each stage's steps (stage 1, and FedRGB's
  stage 2, with the same drawn ``u``); the rest leave its parameters and optimiser state
  as they are (:meth:`FedRGB._train`; the batches are still drawn, so no draw moves).
* A **dropped** client drops after its DRO loss of the round (sent at the start, eq.
  (5)) has arrived: that loss still moves the DRO weights ``w``, but its stage-1 update
  and its stage-2 teacher never arrive, so the aggregations weigh it 0 and renormalise
  ``w`` over the others (``w`` itself is kept in the state: eq. (5)'s multiplicative
  step would otherwise keep a zero weight at 0 for good). Under ``dro_source="code"``
  its post-round loss never arrives and its last one is kept; under FedEMA its kept
  model, ``lambda_k`` and drift stay as they were. If every client drops, the global
  model stays as it was.
* A **Byzantine** client sends a corrupted update of what it sends (the aligners, the
  encoders if trained, FedMAE's decoder, and FedRGB's stage-2 teacher, each against
  the start of its stage: :func:`fedjax_mm.core.faults.send_updates`) and, under FedRGB,
  *reports the DRO loss that maximises its own weight* (:func:`byzantine_dro_reports`):
  eq. (5) up-weights the clients that report high losses, so an attacker that knows the
  rule takes as much weight as the chi-square ball allows, the adversarial case for DRO
  weighting (as FedSCMR's Byzantine clients report what maximises their adaptive weight).
  Its own stage-1 aligner, which only it reads in stage 2, stays honest.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from fedjax_mm import losses, models, server
from fedjax_mm.algorithms.base import Algorithm
from fedjax_mm.core import faults as faults_lib
from fedjax_mm.core.client import map_clients
from fedjax_mm.models import layers
from fedjax_mm.models import pretrained as pretrained_lib
from fedjax_mm.models.user_model import l2_normalize
from fedjax_mm.server import fedema

PyTree = Any
Array = jax.Array

METHODS = ("fedrgb", "fedavg", "local", "centralised", "fedema", "fedx", "fedmae")
#: What FedMAE's ``L_task`` reads: the clean images (MAE's loss beside it), or the masked
#: ones the decoder reads (so the masking enters the alignment).
MAE_CONTRASTS = ("clean", "masked")
#: Where the teacher comes from: trained in stage 2 (eq. (6) / (12)), or the ablation
#: "->avg.alig." (Sec. 5.4: "an align module that is simply averaged by local ones").
TEACHERS = ("dro", "average")
#: Where the DRO losses ``v`` come from: the paper's (one batch at the start of the round,
#: used in that round) or the authors' code's (the averaged model after stage 2 on a fixed
#: 10% of each client's split, used in the next round).
DRO_SOURCES = ("paper", "code")
#: FedEMA's divergence: the paper's ||W_g - W_k|| or the authors' code's last-training drift.
EMA_DIVERGENCES = ("paper", "code")
#: The share of each client's training split the code's DRO losses are computed on.
DRO_SUBSET = 0.1


class Encoders(nnx.Module):
  """Image and text encoders of the zoo, returning token sequences for the aligners."""

  def __init__(
    self,
    image_encoder: str,
    text_encoder: str,
    *,
    image_size: int,
    vocab_size: int,
    max_len: int,
    pretrained: bool,
    rngs: nnx.Rngs,
  ):
    self.image = models.build_encoder(image_encoder, rngs=rngs, image_size=image_size)
    self.text = models.build_encoder(
      text_encoder, rngs=rngs, vocab_size=vocab_size, max_len=max_len
    )
    if pretrained:
      pretrained_lib.load_into(
        self.image, f"world-clip/{image_encoder}", expect={"image_size": image_size}
      )
      pretrained_lib.load_into(self.text, f"world-clip/{text_encoder}", expect={"max_len": max_len})

  def image_tokens(self, images: Array) -> Array:
    """``[b, S, S, 3]`` -> ``[b, 1 + HW/16, c]``: the pooled feature, then the spatial map."""
    pooled, spatial = self.image(images)
    b = pooled.shape[0]
    return jnp.concatenate([pooled[:, None], spatial.reshape(b, -1, spatial.shape[-1])], 1)

  def __call__(self, images: Array, captions: Array):
    """``[b, S, S, 3], [b, L]`` -> image ``[b, 1 + HW/16, c]``, text ``[b, 1 + L, h]`` + mask."""
    return self.image_tokens(images), *self.text_tokens(captions)

  def text_tokens(self, captions: Array) -> tuple[Array, Array]:
    """``[b, L]`` -> text ``[b, 1 + L, h]`` (the pooled state first) and its mask."""
    pooled_t, tokens = self.text(captions)
    text_tokens = jnp.concatenate([pooled_t[:, None], tokens], 1)
    text_mask = jnp.concatenate([jnp.ones((captions.shape[0], 1), bool), captions != 0], 1)
    return text_tokens, text_mask


class Aligner(nnx.Module):
  """Align module + projection head: one Transformer block, first token, MLP, L2 norm."""

  def __init__(self, width: int, dim: int, *, rngs: nnx.Rngs):
    self.block = layers.TransformerBlock(width, 4 if width % 4 == 0 else 1, rngs=rngs)
    self.fc1 = nnx.Linear(width, 2 * width, rngs=rngs)
    self.fc2 = nnx.Linear(2 * width, dim, rngs=rngs)

  def encode(self, tokens: Array, mask: Array | None = None) -> Array:
    """The align module's output sequence ``[b, T, width]`` (FedMAE's decoder reads it)."""
    return self.block(tokens, mask)

  def __call__(self, tokens: Array, mask: Array | None = None) -> Array:
    first = self.encode(tokens, mask)[:, 0]
    return l2_normalize(self.fc2(jax.nn.gelu(self.fc1(first))))


class Aligners(nnx.Module):
  """The image and text aligners of one model (local, global or teacher)."""

  def __init__(self, image_width: int, text_width: int, dim: int, *, rngs: nnx.Rngs):
    self.image = Aligner(image_width, dim, rngs=rngs)
    self.text = Aligner(text_width, dim, rngs=rngs)


class MaeDecoder(nnx.Module):
  """FedMAE's decoder: mask tokens, positions, one Transformer block, a pixel head.

  Reads the image aligner's output sequence ``[b, 1 + P, width]`` (the pooled token,
  then one token per ``p x p`` patch), puts a learnt mask token at every masked patch
  (MAE's decoder input: the encoded visible tokens plus mask tokens), adds learnt
  positions, and predicts the ``p p 3`` pixels of every patch. Trained and averaged
  with the model, never part of the evaluated one.
  """

  def __init__(self, width: int, num_patches: int, patch_pixels: int, *, rngs: nnx.Rngs):
    self.mask_token = nnx.Param(jnp.zeros((width,), jnp.float32))
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (1 + num_patches, width)))
    self.block = layers.TransformerBlock(width, 4 if width % 4 == 0 else 1, rngs=rngs)
    self.head = nnx.Linear(width, patch_pixels, rngs=rngs)

  def __call__(self, tokens: Array, patch_mask: Array) -> Array:
    """``[b, 1 + P, width], bool [b, P]`` -> predicted pixels ``[b, P, p p 3]``."""
    patches = jnp.where(patch_mask[..., None], self.mask_token[...], tokens[:, 1:])
    x = jnp.concatenate([tokens[:, :1], patches], 1) + self.pos[...]
    return self.head(self.block(x)[:, 1:])


def random_patch_mask(key: Array, num_patches: int, ratio: float) -> Array:
  """``bool [P]`` with ``round(ratio P)`` masked patches drawn uniformly (MAE's shuffle)."""
  num_masked = int(round(ratio * num_patches))
  order = jnp.argsort(jax.random.uniform(key, (num_patches,)))
  return jnp.zeros((num_patches,), bool).at[order[:num_masked]].set(True)


def mask_images(images: Array, patch_mask: Array, patch: int) -> Array:
  """``[b, S, S, C]`` with the pixels of every masked ``p x p`` patch (``bool [b, P]``) zeroed."""
  b, size, _, c = images.shape
  g = size // patch
  m = patch_mask.reshape(b, g, 1, g, 1, 1)
  blocks = images.reshape(b, g, patch, g, patch, c)
  return jnp.where(m, 0.0, blocks).reshape(images.shape)


@dataclasses.dataclass(frozen=True)
class RgbConfig:
  """Static settings of one FedRGB / FedAvg run (App. C defaults, scaled)."""

  method: str = "fedrgb"
  alpha: float = 1.0
  beta: float = 2.0
  gamma: float = 1.0
  rho: float = 1.0
  tau: float = losses.fedrgb.TAU
  dro_form: str = "appb"
  dro_source: str = "paper"
  teacher: str = "dro"
  guide: str = "l2"
  train_encoders: bool = False
  stage1_steps: int = 20
  stage2_steps: int = 50
  batch_size: int = 32
  learning_rate: float = 1e-4
  weight_decay: float = 0.05
  client_map: str = "auto"
  ema_tau: float = fedema.AUTOSCALER_TARGET  # FedEMA's autoscaler target (its first mu)
  ema_divergence: str = "paper"  # FedEMA's divergence: "paper" | "code" (server.fedema)
  fedx_tau: float = losses.fedx.TAU  # FedX's contrastive and relational temperature
  fedx_target_tau: float = losses.fedx.TAU  # FedX's relational target temperature
  fedx_weight: float = 1.0  # FedX: L_task + fedx_weight (its three other terms); its code: 1
  mae_ratio: float = losses.fedmae.MASK_RATIO  # FedMAE's share of masked patches
  mae_weight: float = 1.0  # FedMAE: L_task + mae_weight L_rec
  # FedMAE's L_task reads the "clean" images or the "masked" ones (MAE_CONTRASTS).
  mae_contrast: str = "clean"

  def __post_init__(self):
    if self.method not in METHODS:
      raise ValueError(f"method must be one of {METHODS}, got {self.method!r}.")
    if self.dro_form not in losses.fedrgb.DRO_FORMS:
      raise ValueError(f"dro_form must be one of {losses.fedrgb.DRO_FORMS}, got {self.dro_form!r}.")
    if self.dro_source not in DRO_SOURCES:
      raise ValueError(f"dro_source must be one of {DRO_SOURCES}, got {self.dro_source!r}.")
    if self.teacher not in TEACHERS:
      raise ValueError(f"teacher must be one of {TEACHERS}, got {self.teacher!r}.")
    if self.guide not in losses.fedrgb.GUIDES:
      raise ValueError(f"guide must be one of {losses.fedrgb.GUIDES}, got {self.guide!r}.")
    if self.rho < 0 or self.gamma < 0:
      raise ValueError(f"rho and gamma must be >= 0, got rho={self.rho}, gamma={self.gamma}.")
    if not self.ema_tau > 0:
      raise ValueError(f"ema_tau must be > 0, got {self.ema_tau}.")
    if self.ema_divergence not in EMA_DIVERGENCES:
      raise ValueError(f"ema_divergence must be one of {EMA_DIVERGENCES}.")
    if not (self.fedx_tau > 0 and self.fedx_target_tau > 0):
      raise ValueError(
        f"fedx_tau and fedx_target_tau must be > 0, got {self.fedx_tau}, {self.fedx_target_tau}."
      )
    if not 0 < self.mae_ratio < 1:
      raise ValueError(f"mae_ratio must be in (0, 1), got {self.mae_ratio}.")
    if not self.mae_weight >= 0:
      raise ValueError(f"mae_weight must be >= 0, got {self.mae_weight}.")
    if self.mae_contrast not in MAE_CONTRASTS:
      raise ValueError(f"mae_contrast must be one of {MAE_CONTRASTS}, got {self.mae_contrast!r}.")
    if not self.fedx_weight >= 0:
      raise ValueError(f"fedx_weight must be >= 0, got {self.fedx_weight}.")


@struct.dataclass
class RgbState:
  """Server state: global encoders ``f``, aligners ``g``, teacher ``g*``, DRO weights ``w``.

  ``dro_losses`` ``[K]``: with ``dro_source="code"``, the losses the next round's weights
  are computed from (zeros before the first round, so its weights stay uniform); unused
  otherwise. FedEMA only (None otherwise): ``clients``, each client's trained parameters
  of the last round (``{"encoder", "aligner"}`` stacked ``[K, ...]``; the encoder ``{}``
  when frozen), ``scaler`` ``[K]``, each client's ``lambda_k`` (0 until set), and ``drift``
  ``[K]``, the code's divergence of each client's last training (``ema_divergence="code"``).
  FedMAE only: ``decoder``, the global MAE decoder (:class:`MaeDecoder`'s parameters).
  """

  round: Array
  rng: Array
  encoder: PyTree
  aligner: PyTree
  teacher: PyTree
  weights: Array
  dro_losses: Array
  clients: PyTree = None
  scaler: Array | None = None
  drift: Array | None = None
  decoder: PyTree = None


@dataclasses.dataclass(frozen=True)
class FedRGB:
  """Pure functions of one FedRGB / FedAvg run; ``round`` is jitted once by the caller.

  :attr:`algorithm` is :meth:`init` and :meth:`round` as the library's
  :class:`~fedjax_mm.algorithms.base.Algorithm`.
  """

  config: RgbConfig
  encoder_def: nnx.GraphDef
  aligner_def: nnx.GraphDef
  decoder_def: nnx.GraphDef | None = None  # FedMAE's decoder
  faults: faults_lib.Faults = faults_lib.NONE  # simulated client faults (module docstring)

  @property
  def algorithm(self) -> Algorithm:
    """``Algorithm(init, round)``: :meth:`init` and :meth:`round` of this run."""
    return Algorithm(init=self.init, round=self.round)

  @property
  def tx(self) -> optax.GradientTransformation:
    return optax.adamw(self.config.learning_rate, weight_decay=self.config.weight_decay)

  def features(self, encoder: PyTree, images: Array, captions: Array):
    return nnx.merge(self.encoder_def, encoder)(images, captions)

  def align(self, aligner: PyTree, feats) -> tuple[Array, Array]:
    image_tokens, text_tokens, text_mask = feats
    a = nnx.merge(self.aligner_def, aligner)
    return a.image(image_tokens), a.text(text_tokens, text_mask)

  def embed(self, encoder: PyTree, aligner: PyTree, images: Array, captions: Array):
    """``(z_I, z_T)`` ``[b, d]`` of one batch."""
    return self.align(aligner, self.features(encoder, images, captions))

  def embed_images(self, encoder: PyTree, aligner: PyTree, images: Array) -> Array:
    """``z_I`` ``[b, d]`` of images alone (the image tower: encoder, image aligner)."""
    tokens = nnx.merge(self.encoder_def, encoder).image_tokens(images)
    return nnx.merge(self.aligner_def, aligner).image(tokens)

  def image_map(self, encoder: PyTree, aligner: PyTree, images: Array) -> Array:
    """``[b, S, S, 3]`` -> ``[b, S/4, S/4, c]``: the image align module's output per position.

    The spatial tokens of :meth:`Aligner.encode` (the pooled token dropped) on the
    encoder's map, back on their grid: the last spatial stage of the image tower, which
    the segmentation decoder reads (:mod:`fedjax_mm.algorithms.fedrgb_eval`).
    """
    tokens = nnx.merge(self.encoder_def, encoder).image_tokens(images)
    seq = nnx.merge(self.aligner_def, aligner).image.encode(tokens)[:, 1:]
    b, n, c = seq.shape
    side = int(round(n**0.5))
    if side * side != n:
      raise ValueError(f"the image tokens ({n}) do not form a square grid.")
    return seq.reshape(b, side, side, c)

  # -- one client ------------------------------------------------------------

  def _train(
    self, loss_fn, params, key, arrays, mask, steps, *, draws=1, keyed=False, max_steps=None
  ):
    """``steps`` AdamW steps of ``loss_fn(params, batch)`` on batches drawn from ``mask``.

    ``draws``: batches drawn per step, concatenated (FedX's second batch of anchors); the
    first is the batch every method draws from the step's key;
    ``keyed``: ``loss_fn(params, batch, key)`` gets a fresh key each step (FedMAE's masks);
    ``max_steps``: a straggler's budget (``int32`` scalar, :mod:`fedjax_mm.core.faults`):
    the steps from it on leave the parameters and the optimiser state as they are (every
    batch is still drawn, so the draws do not change), and the mean loss is over the
    steps taken (0 if none).
    """
    tx = self.tx
    n = mask.shape[0]
    batch_size = self.config.batch_size
    probs = mask / jnp.maximum(jnp.sum(mask), 1)

    def step(carry, k):
      params, opt_state = carry
      # The first batch is drawn as every method draws it, so FedX's and FedMAE's clients
      # see FedAvg's batches; the anchors and the loss's key come from keys of their own.
      idx = jnp.concatenate(
        [
          jax.random.choice(k if d == 0 else jax.random.fold_in(k, d), n, (batch_size,), p=probs)
          for d in range(draws)
        ]
      )
      batch = jax.tree.map(lambda x: x[idx], arrays)
      args = (batch, jax.random.fold_in(k, draws)) if keyed else (batch,)
      loss, grads = jax.value_and_grad(loss_fn)(params, *args)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    keys = jax.random.split(key, steps)
    if max_steps is None:
      (params, _), loss = jax.lax.scan(step, (params, tx.init(params)), keys)
      return params, jnp.mean(loss)

    def budgeted(carry, x):
      i, k = x
      new, loss = step(carry, k)
      taken = i < max_steps
      return jax.tree.map(lambda a, b: jnp.where(taken, a, b), new, carry), (loss, taken)

    xs = (jnp.arange(steps), keys)
    (params, _), (loss, taken) = jax.lax.scan(budgeted, (params, tx.init(params)), xs)
    return params, jnp.sum(jnp.where(taken, loss, 0.0)) / jnp.maximum(jnp.sum(taken), 1)

  def stage1_client(
    self, encoder, aligner, teacher, key, arrays, mask, steps=None, *, decoder=None, max_steps=None
  ):
    """Stage 1 of ONE client: returns ``(encoder, aligner, mean loss)``.

    ``steps`` (default ``stage1_steps``) lets the distortion study
    (:mod:`fedjax_mm.algorithms.fedrgb_eval`) retrain for longer with the same update.
    FedX and FedMAE: :meth:`ssl_client` (FedMAE reads ``decoder``; its trained
    decoder is dropped here). ``max_steps``: a straggler's budget (:meth:`_train`).
    """
    cfg = self.config
    if cfg.method in ("fedx", "fedmae"):
      enc, al, _, loss = self.ssl_client(
        encoder, aligner, decoder, key, arrays, mask, steps, max_steps=max_steps
      )
      return enc, al, loss

    def loss_fn(params, batch):
      enc = params["encoder"] if cfg.train_encoders else jax.lax.stop_gradient(encoder)
      feats = self.features(enc, batch["images"], batch["captions"])
      z_i, z_t = self.align(params["aligner"], feats)
      if cfg.method != "fedrgb":
        return losses.task_loss(z_i, z_t, tau=cfg.tau).mean()
      t_i, t_t = jax.lax.stop_gradient(self.align(teacher, feats))
      return losses.local_loss(
        z_i, z_t, t_i, t_t, alpha=cfg.alpha, tau=cfg.tau, guide=cfg.guide
      ).mean()

    params = {"encoder": encoder if cfg.train_encoders else {}, "aligner": aligner}
    steps = cfg.stage1_steps if steps is None else steps
    params, loss = self._train(loss_fn, params, key, arrays, mask, steps, max_steps=max_steps)
    return (params["encoder"] if cfg.train_encoders else encoder), params["aligner"], loss

  def fedx_terms(self, params, start_encoder, start_aligner, batch) -> dict[str, Array]:
    """FedX's four terms (``[B]`` each, :func:`fedjax_mm.losses.fedx_terms`) of ``2B`` pairs.

    The first ``B`` pairs are the batch, the last ``B`` the anchors. ``params`` is
    ``{"encoder", "aligner"}`` (encoder ``{}`` when frozen); the global model is the
    frozen ``(start_encoder, start_aligner)`` the client received.
    """
    cfg = self.config
    enc = params["encoder"] if cfg.train_encoders else jax.lax.stop_gradient(start_encoder)
    b = cfg.batch_size
    z_i, z_t = self.embed(enc, params["aligner"], batch["images"], batch["captions"])
    g_i, g_t = jax.lax.stop_gradient(
      self.embed(start_encoder, start_aligner, batch["images"], batch["captions"])
    )
    return losses.fedx_terms(
      z_i[:b],
      z_t[:b],
      g_i[:b],
      g_t[:b],
      jnp.concatenate([z_i[b:], z_t[b:]]),
      jnp.concatenate([g_i[b:], g_t[b:]]),
      task_tau=cfg.tau,
      tau=cfg.fedx_tau,
      target_tau=cfg.fedx_target_tau,
    )

  def fedx_objective(self, params, start_encoder, start_aligner, batch):
    """FedX's client loss: the local contrastive term (``L_task``) + ``fedx_weight`` times the
    other three, batch means (the code's weights: 1)."""
    terms = self.fedx_terms(params, start_encoder, start_aligner, batch)
    task = terms.pop("local_contrastive").mean()
    return task + self.config.fedx_weight * sum(v.mean() for v in terms.values())

  def mae_terms(self, params, frozen_encoder, batch, key) -> tuple[Array, Array]:
    """FedMAE's ``(L_task, L_rec)`` batch means: ``L_task`` of the clean pairs (or, with
    ``mae_contrast="masked"``, of the masked images and their captions), and ``L_rec`` of
    the masked images."""
    cfg = self.config
    enc = params["encoder"] if cfg.train_encoders else jax.lax.stop_gradient(frozen_encoder)
    images = batch["images"]
    encoder = nnx.merge(self.encoder_def, enc)
    num_patches = jax.eval_shape(encoder.image_tokens, images[:1]).shape[1] - 1
    patch = images.shape[1] // int(round(num_patches**0.5))
    patch_mask = jax.vmap(lambda k: random_patch_mask(k, num_patches, cfg.mae_ratio))(
      jax.random.split(key, images.shape[0])
    )
    tokens = encoder.image_tokens(mask_images(images, patch_mask, patch))
    aligner = nnx.merge(self.aligner_def, params["aligner"])
    if cfg.mae_contrast == "masked":  # L_task reads the masked images (FLIP's way)
      z_i, z_t = aligner.image(tokens), aligner.text(*encoder.text_tokens(batch["captions"]))
    else:
      z_i, z_t = self.embed(enc, params["aligner"], images, batch["captions"])
    task = losses.task_loss(z_i, z_t, tau=cfg.tau).mean()
    sequence = aligner.image.encode(tokens)
    pred = nnx.merge(self.decoder_def, params["decoder"])(sequence, patch_mask)
    target = losses.patchify(images, patch)
    return task, losses.masked_reconstruction_loss(pred, target, patch_mask).mean()

  def mae_objective(self, params, frozen_encoder, batch, key):
    """FedMAE: ``L_task`` on the clean pairs + ``mae_weight`` MAE loss on masked images."""
    task, rec = self.mae_terms(params, frozen_encoder, batch, key)
    return task + self.config.mae_weight * rec

  def ssl_client(self, encoder, aligner, decoder, key, arrays, mask, steps=None, *, max_steps=None):
    """FedX / FedMAE client update: returns ``(encoder, aligner, decoder, mean loss)``."""
    cfg = self.config
    steps = cfg.stage1_steps if steps is None else steps
    params = {"encoder": encoder if cfg.train_encoders else {}, "aligner": aligner}
    train = functools.partial(self._train, max_steps=max_steps)
    if cfg.method == "fedx":
      loss_fn = lambda p, batch: self.fedx_objective(p, encoder, aligner, batch)
      params, loss = train(loss_fn, params, key, arrays, mask, steps, draws=2)
    else:
      params["decoder"] = decoder
      loss_fn = lambda p, batch, k: self.mae_objective(p, encoder, batch, k)
      params, loss = train(loss_fn, params, key, arrays, mask, steps, keyed=True)
    enc = params["encoder"] if cfg.train_encoders else encoder
    return enc, params["aligner"], params.get("decoder"), loss

  def dro_objective(self, copy, teacher, encoder, local_aligner, batch):
    """Mean ``L_dro`` (eq. (6) / (12)) of one batch."""
    cfg = self.config
    clean = jax.lax.stop_gradient(self.features(encoder, batch["images"], batch["captions"]))
    distorted = self.features(copy, batch["images"], batch["captions"])
    t_i, t_t = self.align(teacher, distorted)
    a_i, a_t = self.align(teacher, clean)
    l_i, l_t = self.align(jax.lax.stop_gradient(local_aligner), distorted)
    per_pair = losses.dro_loss(
      t_i, t_t, a_i, a_t, l_i, l_t, beta=cfg.beta, tau=cfg.tau, form=cfg.dro_form
    )
    return per_pair.mean()

  def stage2_client(self, encoder, local_aligner, teacher, key, arrays, mask, *, max_steps=None):
    """Stage 2 of ONE client: returns ``(teacher, mean L_dro)``; ``max_steps``: :meth:`_train`."""

    def loss_fn(params, batch):
      return self.dro_objective(params["copy"], params["teacher"], encoder, local_aligner, batch)

    params = {"copy": encoder, "teacher": teacher}
    steps = self.config.stage2_steps
    params, loss = self._train(loss_fn, params, key, arrays, mask, steps, max_steps=max_steps)
    return params["teacher"], loss

  # -- the round ---------------------------------------------------------------

  def _average(self, encs: PyTree, sent: PyTree, weights: Array) -> tuple[PyTree, PyTree]:
    """The server's ``(encoder, aligner)``: what arrived (``sent``) averaged by ``weights``.

    Frozen encoders are not sent (every client holds the global one, ``encs``).
    """
    encoder = server.weighted_mean(sent["encoder"] if self.config.train_encoders else encs, weights)
    return encoder, server.weighted_mean(sent["aligner"], weights)

  def init(
    self, key: Array, encoder: PyTree, aligner: PyTree, num_clients: int, decoder: PyTree = None
  ) -> RgbState:
    """The initial state; ``decoder``: FedMAE's initial decoder (required for it)."""
    if self.config.method == "fedmae" and (decoder is None or self.decoder_def is None):
      raise ValueError("fedmae needs a decoder (decoder_def and its parameters: build_decoder).")
    if self.config.method == "local":  # K private copies, stacked
      stack = lambda t: jax.tree.map(lambda x: jnp.stack([x] * num_clients), t)
      encoder, aligner = stack(encoder), stack(aligner)
    clients = scaler = drift = None
    if self.config.method == "fedema":  # every client starts from the global model
      trained = {"encoder": encoder if self.config.train_encoders else {}, "aligner": aligner}
      clients = jax.tree.map(lambda x: jnp.stack([x] * num_clients), trained)
      scaler = drift = jnp.zeros((num_clients,), jnp.float32)
    return RgbState(
      decoder=decoder if self.config.method == "fedmae" else None,
      clients=clients,
      scaler=scaler,
      drift=drift,
      round=jnp.zeros((), jnp.int32),
      rng=key,
      encoder=encoder,
      aligner=aligner,
      teacher=aligner,
      weights=jnp.full((num_clients,), 1.0 / num_clients, jnp.float32),
      dro_losses=jnp.zeros((num_clients,), jnp.float32),
    )

  def round(self, state: RgbState, arrays: dict[str, Array], mask: Array):
    """One round over all ``K`` clients: ``arrays`` ``[K, n, ...]``, ``mask`` ``bool [K, n]``.

    With :attr:`faults` on, the federated methods' metrics gain ``fault_counts`` and their
    ``weights`` are the aggregation weights that acted (0 for a dropped client).
    """
    cfg = self.config
    k = mask.shape[0]
    key = jax.random.fold_in(state.rng, state.round)
    k_v, k1, k2 = jax.random.split(key, 3)
    spec = cfg.client_map
    metrics = {}
    if cfg.method == "local":
      encs, aligns, loss1 = map_clients(
        lambda e, al, kk, a, m: self.stage1_client(e, al, al, kk, a, m),
        (state.encoder, state.aligner, jax.random.split(k1, k), arrays, mask),
        spec,
      )
      new = state.replace(round=state.round + 1, encoder=encs, aligner=aligns, teacher=aligns)
      return new, {"stage1_loss": loss1, "weights": state.weights}
    if cfg.method == "centralised":  # one model, the union of the clients' pairs
      union = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), arrays)
      steps = k * cfg.stage1_steps  # FedAvg's steps (and samples) summed over clients
      encoder, aligner, loss1 = self.stage1_client(
        state.encoder, state.aligner, state.teacher, k1, union, mask.reshape(-1), steps
      )
      weights = data_size_weights(mask)  # each client's share of the union
      new = state.replace(
        round=state.round + 1, encoder=encoder, aligner=aligner, teacher=aligner, weights=weights
      )
      return new, {"stage1_loss": loss1, "weights": weights}
    faults = _RoundFaults.draw(self.faults, key, mask)
    if cfg.method == "fedema":
      return self._fedema_round(state, arrays, mask, k1, faults)
    if cfg.method in ("fedx", "fedmae"):
      return self._ssl_round(state, arrays, mask, k1, faults)
    if cfg.method == "fedrgb" and cfg.dro_source == "code":  # last round's losses
      weights = server.dro_update(state.weights, state.dro_losses, gamma=cfg.gamma, rho=cfg.rho)
    elif cfg.method == "fedrgb":
      first = jax.vmap(
        lambda m, kk: jax.random.choice(kk, m.shape[0], (cfg.batch_size,), p=m / m.sum())
      )(mask.astype(jnp.float32), jax.random.split(k_v, k))
      batches = jax.tree.map(lambda x: jax.vmap(lambda xc, i: xc[i])(x, first), arrays)
      v = map_clients(
        lambda b: self.dro_objective(state.encoder, state.teacher, state.encoder, state.aligner, b),
        (batches,),
        spec,
      )
      # Sent at the start of the round, before any client drops out.
      v = faults.dro_reports(v, cfg.gamma)
      weights = server.dro_update(state.weights, v, gamma=cfg.gamma, rho=cfg.rho)
      metrics["dro_loss_start"] = v
    else:
      weights = data_size_weights(mask)
    start = {"encoder": state.encoder if cfg.train_encoders else {}, "aligner": state.aligner}
    budget = faults.budget(cfg.stage1_steps)
    encs, aligns, loss1 = map_clients(
      lambda kk, a, m, *b: self.stage1_client(
        state.encoder, state.aligner, state.teacher, kk, a, m, max_steps=faults.unpack(b)
      ),
      (jax.random.split(k1, k), arrays, mask, *budget),
      spec,
    )
    sent = faults.send(0, start, {"encoder": encs if cfg.train_encoders else {}, "aligner": aligns})
    received = faults.weights(weights)
    encoder, aligner = self._average(encs, sent, received)
    metrics["stage1_loss"] = loss1
    teacher = state.teacher
    if cfg.method == "fedrgb" and cfg.teacher == "average":  # "->avg.alig.": no stage 2
      teacher = aligner
    elif cfg.method == "fedrgb":
      budget = faults.budget(cfg.stage2_steps)
      teachers, loss2 = map_clients(
        lambda la, kk, a, m, *b: self.stage2_client(
          encoder, la, state.teacher, kk, a, m, max_steps=faults.unpack(b)
        ),
        (aligns, jax.random.split(k2, k), arrays, mask, *budget),
        spec,
      )
      teacher = server.weighted_mean(faults.send(1, state.teacher, teachers), received)
      aligner = teacher
      metrics["stage2_loss"] = loss2
    dro_losses = state.dro_losses
    if cfg.method == "fedrgb" and cfg.dro_source == "code":
      # The averaged model (no distortion: the copy is f* itself) on a fixed 10% of each
      # client's split; eq. (6) reads the client's stage-1 aligner.
      subset = jax.vmap(dro_subset)(mask)
      fixed = jax.tree.map(lambda x: jax.vmap(lambda xc, i: xc[i])(x, subset), arrays)
      dro_losses = map_clients(
        lambda la, b: self.dro_objective(encoder, teacher, encoder, la, b), (aligns, fixed), spec
      )
      # Sent after the round: a dropped client's never arrives (its last one is kept).
      dro_losses = faults.after_round(faults.dro_reports(dro_losses, cfg.gamma), state.dro_losses)
      metrics["dro_loss_next"] = dro_losses
    # If every client dropped, nothing arrived: the global model stays as it was.
    encoder, aligner, teacher = faults.if_any_arrived(
      (encoder, aligner, teacher), (state.encoder, state.aligner, state.teacher)
    )
    metrics["weights"] = received  # ``weights`` itself without faults
    metrics |= faults.counts()
    new = state.replace(
      round=state.round + 1,
      encoder=encoder,
      aligner=aligner,
      teacher=teacher,
      weights=weights,
      dro_losses=dro_losses,
    )
    return new, metrics

  def _fedema_round(self, state: RgbState, arrays, mask, key, faults: _RoundFaults):
    """FedEMA: each client starts from the EMA of the global and its own last model."""
    cfg = self.config
    k = mask.shape[0]
    trained = {"encoder": state.encoder if cfg.train_encoders else {}, "aligner": state.aligner}
    code = cfg.ema_divergence == "code"
    start, mu, scaler, div = jax.vmap(
      lambda local, lam, d: fedema.fedema_start(
        trained, local, lam, tau=cfg.ema_tau, div=d if code else None
      )
    )(state.clients, state.scaler, state.drift)

    def client(st, kk, a, m, *b):
      enc = st["encoder"] if cfg.train_encoders else state.encoder
      return self.stage1_client(
        enc, st["aligner"], state.teacher, kk, a, m, max_steps=faults.unpack(b)
      )

    budget = faults.budget(cfg.stage1_steps)
    encs, aligns, loss1 = map_clients(
      client, (start, jax.random.split(key, k), arrays, mask, *budget), cfg.client_map
    )
    clients = {"encoder": encs if cfg.train_encoders else {}, "aligner": aligns}
    sent = faults.send(0, start, clients, stacked=True)
    weights = faults.weights(data_size_weights(mask))  # FedAvg's aggregation
    encoder, aligner = self._average(encs, sent, weights)
    drift = jax.vmap(fedema.layer_divergence)(start, clients)  # this round's training
    # A dropped client's round is lost on its side too: its last model and scaler stay.
    clients, scaler, drift = faults.after_round(
      (clients, scaler, drift), (state.clients, state.scaler, state.drift)
    )
    encoder, aligner = faults.if_any_arrived((encoder, aligner), (state.encoder, state.aligner))
    new = state.replace(
      drift=drift,
      round=state.round + 1,
      encoder=encoder,
      aligner=aligner,
      teacher=aligner,
      weights=weights,
      clients=clients,
      scaler=scaler,
    )
    out = {"stage1_loss": loss1, "weights": weights, "ema_mu": mu, "divergence": div}
    return new, out | faults.counts()

  def _ssl_round(self, state: RgbState, arrays, mask, key, faults: _RoundFaults):
    """FedX / FedMAE: every client's update from the global model, then FedAvg."""
    cfg = self.config
    k = mask.shape[0]
    budget = faults.budget(cfg.stage1_steps)
    encs, aligns, decs, loss1 = map_clients(
      lambda kk, a, m, *b: self.ssl_client(
        state.encoder, state.aligner, state.decoder, kk, a, m, max_steps=faults.unpack(b)
      ),
      (jax.random.split(key, k), arrays, mask, *budget),
      cfg.client_map,
    )
    mae = cfg.method == "fedmae"
    start = {"encoder": state.encoder if cfg.train_encoders else {}, "aligner": state.aligner}
    trained = {"encoder": encs if cfg.train_encoders else {}, "aligner": aligns}
    if mae:
      start["decoder"], trained["decoder"] = state.decoder, decs
    sent = faults.send(0, start, trained)
    weights = faults.weights(data_size_weights(mask))
    encoder, aligner = self._average(encs, sent, weights)
    decoder = server.weighted_mean(sent["decoder"], weights) if mae else None
    encoder, aligner, decoder = faults.if_any_arrived(
      (encoder, aligner, decoder), (state.encoder, state.aligner, state.decoder)
    )
    new = state.replace(
      round=state.round + 1,
      encoder=encoder,
      aligner=aligner,
      teacher=aligner,
      weights=weights,
      decoder=decoder,
    )
    return new, {"stage1_loss": loss1, "weights": weights} | faults.counts()


#: A Byzantine client's DRO report exceeds the largest honest one by this over ``gamma``:
#: ``e^30 ~ 1e13``, so before the projection its weight dwarfs every honest client's.
DRO_SATURATION = 30.0


def byzantine_dro_reports(v: Array, byzantine: Array, gamma: float) -> Array:
  """The DRO losses the server receives when the ``byzantine [K]`` clients lie about theirs.

  Eq. (5) raises a client's weight with its reported loss, so a Byzantine client that
  knows the rule and the honest reports (the usual worst case) reports the largest honest
  loss plus ``DRO_SATURATION / gamma``: before the projection it then holds all but
  ``~e^-30`` of the mass (shared among the Byzantine clients), and after it the most
  weight that the chi-square ball of radius ``rho`` allows. With ``gamma = 0`` the
  weights do not read the reports, and they stay honest.
  """
  if gamma == 0:
    return v
  top = jnp.max(jnp.where(byzantine, -jnp.inf, v))
  top = jnp.where(jnp.isfinite(top), top, jnp.max(v))  # every client Byzantine
  return jnp.where(byzantine, top + DRO_SATURATION / gamma, v)


@dataclasses.dataclass(frozen=True)
class _RoundFaults:
  """One round's client faults (:mod:`fedjax_mm.core.faults`) as FedRGB's rounds read them.

  ``masks`` is None when faults are off: then every method is the identity on what it is
  given, so the fault-free round is the same program as before faults existed.
  """

  faults: faults_lib.Faults
  masks: faults_lib.FaultMasks | None = None
  key: Array | None = None
  active: Array | None = None  # bool [K]: the clients with data

  @classmethod
  def draw(cls, faults: faults_lib.Faults, round_key: Array, mask: Array) -> _RoundFaults:
    """Every client with data takes part in every round; the faults are drawn among them."""
    if not faults.enabled:
      return cls(faults)
    key = jax.random.fold_in(round_key, faults_lib.SALT)
    active = jnp.any(mask, axis=1)
    return cls(faults, faults_lib.draw(key, active, faults), key, active)

  def budget(self, steps: int) -> tuple[Array, ...]:
    """``(int32 [K],)``: each client's steps of a ``steps``-step stage; ``()`` without faults."""
    if self.masks is None:
      return ()
    return (jnp.floor(self.masks.work * steps).astype(jnp.int32),)

  @staticmethod
  def unpack(budget: tuple[Array, ...]) -> Array | None:
    return budget[0] if budget else None

  def send(self, index: int, start: PyTree, trained: PyTree, *, stacked: bool = False) -> PyTree:
    """What arrives of ``trained [K, ...]`` (from ``start``: ``[K, ...]`` if ``stacked``).

    A Byzantine client's update is corrupted, a dropped client's is lost (it holds
    ``start``; its weight is 0). ``index`` keeps the corruption keys of the stages apart.
    """
    if self.masks is None:
      return trained
    k = self.masks.dropped.shape[0]
    if not stacked:
      start = jax.tree.map(lambda x: jnp.broadcast_to(x, (k,) + x.shape), start)
    key = faults_lib.corruption_key(self.key, index)
    return faults_lib.send_updates(key, start, trained, self.masks, self.faults)

  def weights(self, weights: Array) -> Array:
    """Aggregation weights renormalised over the clients whose update arrived."""
    if self.masks is None:
      return weights
    w = jnp.where(self.masks.dropped, 0.0, weights)
    return w / jnp.where(jnp.sum(w) > 0, jnp.sum(w), 1.0)

  def dro_reports(self, v: Array, gamma: float) -> Array:
    """The DRO losses that arrive (:func:`byzantine_dro_reports`)."""
    if self.masks is None or not self.faults.has_byzantine:
      return v
    return byzantine_dro_reports(v, self.masks.byzantine, gamma)

  def after_round(self, new: PyTree, old: PyTree) -> PyTree:
    """Per client (leaves ``[K, ...]``): ``old`` for the dropped clients, else ``new``."""
    if self.masks is None:
      return new
    return faults_lib.keep_where(self.masks.dropped, old, new)

  def if_any_arrived(self, new: PyTree, old: PyTree) -> PyTree:
    """``new`` unless every client dropped (then nothing arrived and ``old`` stays)."""
    if self.masks is None:
      return new
    arrived = jnp.any(self.active & ~self.masks.dropped)
    return jax.tree.map(lambda n, o: jnp.where(arrived, n, o), new, old)

  def counts(self) -> dict[str, Any]:
    return {} if self.masks is None else {"fault_counts": self.masks.counts()}


def dro_subset(mask: Array) -> Array:
  """``int [m]``: the first ``m = max(2, round(DRO_SUBSET n))`` valid indices of ``bool [n]``.

  The code's fixed DRO split (at least two pairs: a contrastive loss of one pair is 0);
  a client holding fewer than ``m`` valid samples also gets padding indices (the
  runner's clients hold ``n`` each).
  """
  m = max(2, int(round(DRO_SUBSET * mask.shape[0])))
  return jnp.argsort(~mask, stable=True)[:m]


def data_size_weights(mask: Array) -> Array:
  """FedAvg's weights: each client's share of the samples, ``bool [K, n] -> [K]``."""
  sizes = jnp.sum(mask, axis=1).astype(jnp.float32)
  return sizes / jnp.sum(sizes)


def algorithm(
  config: RgbConfig,
  encoder_def: nnx.GraphDef,
  aligner_def: nnx.GraphDef,
  decoder_def: nnx.GraphDef | None = None,
  *,
  faults: faults_lib.Faults = faults_lib.NONE,
) -> Algorithm:
  """The method ``config.method`` as an :class:`~fedjax_mm.algorithms.base.Algorithm`.

  ``init(key, encoder, aligner, num_clients, decoder=None) -> RgbState`` and
  ``round(state, arrays, mask) -> (state, metrics)``: :meth:`FedRGB.init` and
  :meth:`FedRGB.round` (``decoder_def``: FedMAE's, :func:`build_decoder`; ``faults``: the
  simulated client faults, module docstring).
  """
  return FedRGB(config, encoder_def, aligner_def, decoder_def, faults=faults).algorithm


def stage_traffic(alg: FedRGB, state: RgbState) -> dict[str, int]:
  """Bytes one client sends per round in each stage (float32 parameters)."""
  size = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t))
  if alg.config.method == "local":  # stacked private models; nothing is sent
    full = size(state.encoder) + size(state.aligner)
    return {"stage1": 0, "stage2": 0, "full_model": full // state.weights.shape[0]}
  if alg.config.method == "centralised":  # one model on pooled data; no rounds of traffic
    return {"stage1": 0, "stage2": 0, "full_model": size(state.encoder) + size(state.aligner)}
  stage1 = size(state.aligner) + (size(state.encoder) if alg.config.train_encoders else 0)
  if alg.config.method == "fedmae":  # FedMAE averages its decoder too
    stage1 += size(state.decoder)
  trains_teacher = alg.config.method == "fedrgb" and alg.config.teacher == "dro"
  stage2 = size(state.teacher) if trains_teacher else 0
  return {
    "stage1": stage1,
    "stage2": stage2,
    "full_model": size(state.encoder) + size(state.aligner),
  }


def build(
  config: RgbConfig,
  *,
  image_encoder: str,
  text_encoder: str,
  image_size: int,
  vocab_size: int,
  max_len: int,
  dim: int,
  pretrained: bool,
  key: Array,
  num_clients: int,
) -> tuple[FedRGB, RgbState]:
  """The algorithm and its initial state (encoders from the World-CLIP weights if ``pretrained``)."""
  k_enc, k_al, k_state = jax.random.split(key, 3)
  enc = Encoders(
    image_encoder,
    text_encoder,
    image_size=image_size,
    vocab_size=vocab_size,
    max_len=max_len,
    pretrained=pretrained,
    rngs=nnx.Rngs(k_enc),
  )
  aligners = Aligners(enc.image.features, enc.text.features, dim, rngs=nnx.Rngs(k_al))
  enc_def, enc_params = nnx.split(enc, nnx.Param)
  al_def, al_params = nnx.split(aligners, nnx.Param)
  dec_def = dec_params = None
  if config.method == "fedmae":
    dec_def, dec_params = build_decoder(enc_def, enc_params, image_size, jax.random.fold_in(key, 7))
  alg = FedRGB(config, enc_def, al_def, dec_def)
  return alg, alg.init(k_state, enc_params, al_params, num_clients, dec_params)


def build_decoder(encoder_def, encoder_params, image_size: int, key: Array):
  """FedMAE's :class:`MaeDecoder` for these encoders: ``(graphdef, params)``.

  The patch size is the image size over the side of the encoder's token grid (4 for
  every encoder of the zoo: the ViTs' patches, the CNNs' stride).
  """
  encoder = nnx.merge(encoder_def, encoder_params)
  tokens = jax.eval_shape(encoder.image_tokens, jnp.zeros((1, image_size, image_size, 3)))
  num_patches, width = tokens.shape[1] - 1, tokens.shape[2]
  patch = image_size // int(round(num_patches**0.5))
  decoder = MaeDecoder(width, num_patches, patch * patch * 3, rngs=nnx.Rngs(key))
  return nnx.split(decoder, nnx.Param)
