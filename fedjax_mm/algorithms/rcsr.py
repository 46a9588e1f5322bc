r"""RCSR and RCSR-p (Algorithm 1, eqs. 2-13) and their FedAvg / FedProx baselines.

Paper: ``../shared/papers/rcsr.txt``. Pure losses live in
:mod:`fedjax_mm.losses.rcsr` (eqs. 2-5), server transforms in
:mod:`fedjax_mm.server.rcsr` (eqs. 6-11, 13); this module is the model and the
round. Each method is the library's :class:`~fedjax_mm.algorithms.base.Algorithm`,
``algorithm(spec, name) -> Algorithm(init, round)``: :func:`init` with the method's
:class:`Method` stored in the state, and ``round(state, data)``, :func:`round_step` with
the method's static switches (:func:`round_flags`) bound and its traced ones read from
``state.method`` (:class:`RcsrRound`).

**Model.** Frozen image and text encoders (the library's ViT / text Transformer,
optionally filled with the shipped World-CLIP weights, as the paper freezes CLIP
ViT-B/32), a bottleneck adapter ``x + W_up ReLU(W_down LN(x))`` after every block of
both encoders (Houlsby-style, sequential; the paper gives only the dimension 64, we
scale it), ``W_down ~ N(0, 0.01)``, ``W_up ~ N(0, 0.01)`` (Sec. 5.1: "adapters
initialised N(0, 0.01)"), and a 2-layer ReLU MLP head per modality (``N(0, 0.02)``
kernels) to L2-normalised ``d``-dim embeddings. Only adapters and heads are trained
and sent (``global`` parameters); the encoders stay in ``frozen``; RCSR-p's residual
adapter ``A_k(z) = W2 GELU(W1 z)`` (eq. 12; ``W2 ~ N(0, 1e-4)``, "near zero") is the
client's ``personal`` state.

**Clients in one program.** Every client holds both arrays (the missing modality
zeroed); its modality mask ``m_k`` picks the loss (eq. 5) and **masks the update**
of the missing tower after AdamW (decoupled weight decay would otherwise move
parameters with zero gradient), so an image-only client's text adapters and head
come back bit-identical. The round gathers the ``floor(C N)`` sampled clients,
trains them with :func:`fedjax_mm.core.client.map_clients` over
:func:`fedjax_mm.core.client.local_update`, and scatters the personal state back.

**Methods as numbers.** FedAvg, FedProx, pFedMMA, RCSR, RCSR-p and the ablations of
Table 5 and Sec. C.4 differ only in the traced scalars of :class:`Method`
(prototype-proximal and parameter-proximal weights, FedProx mu, router on, q on,
personalisation on, fixed ``s_k``, zero or placeholder fill of the missing slot,
pFedMMA's client-adapter scale), so they all run the same compiled round. MOON
(Li, He & Song, CVPR 2021; RCSR's Sec. 5.1: temperature 0.5, weight 1) adds
:func:`fedjax_mm.losses.rcsr.moon_loss` between a client's embeddings and those of the
global model and of the client's previous local model (adapters + heads, kept per client
in the state), on every modality the client holds; it needs those two extra forward
passes, so it is a static switch of :func:`round_step` (its own compile), and it
aggregates as FedAvg. A client never sampled before uses the initial model as its
previous one. MFCPL, FedMEKT and CreamFL (below) are static switches too (``mfcpl=True``,
``mekt=True``, ``cream=True``: their own compiles), so the other methods' programs are unchanged.
FedAvg / FedProx single-modality clients use L_anchor to the EMA prototypes (Sec.
5.1), which therefore are kept for them too; their aggregation weights are
``|D_k| / sum |D_j|``.

**Personalised baselines (Table 1).** All on the same frozen encoders, adapters and
heads, single-modality clients on L_anchor, the EMA prototypes kept as for FedAvg.

* **FedPer** (Arivazhagan et al., 2019; RCSR's Sec. 5.1: "adapters/projection heads as
  personalized layers, not aggregated"). On this model every trained part is an adapter
  or a head, so *all* of them are personal: a sampled client starts from its own adapters
  + heads (``state.previous``, the initial model until first sampled), trains them as
  FedAvg's clients do and keeps them; the server aggregates nothing and ``state.params``
  never moves. It is a static switch of :func:`round_step` (``fedper=True``: the clients'
  starting points are mapped, not closed over). Nothing but the prototype report goes
  up, and only the EMA prototypes come down (:func:`traffic_bytes`). Declared: a client's
  own score uses its own model; FedPer's *global* score is the mean over the N clients
  of their own models' scores on the shared test set (there is no shared model).
* **pFedMMA** (Ghiasvand, Alizadeh & Pedarsani, 2025, arXiv:2507.05394; Sec. 5.1:
  "shared + client-specific components, scale 0.5"). pFedMMA's multi-modal adapter keeps
  its modality-specific down / up projections on the client and shares (and exchanges)
  only a cross-modal projection between them. RCSR's model has towers of different widths
  and the shared bottleneck adapters every baseline uses, so we declare this mapping:
  the shared component is the bottleneck adapter after each block plus the heads
  (aggregated by FedAvg), and the client-specific component is a second bottleneck
  adapter of the same shape after each block of each tower (``client_image_adapters``,
  ``client_text_adapters``; modality-specific like pFedMMA's local projections), added in
  parallel at scale 0.5 on the same input: ``h + A(h) + 0.5 A_k(h)``. It is ``personal``
  state (never sent, never aggregated, checkpointed), trains with the shared parts at the
  same learning rate (pFedMMA trains both jointly), its missing tower's update masked like
  the shared one; its prototypes and its clients' scores use ``A_k``, its global score the
  shared model alone (as RCSR-p's). For every other method the scale is 0 and the branch
  adds exact zeros.
* **FedMEKT** (Le et al., "FedMEKT: Distillation-based embedding knowledge transfer for
  multimodal federated learning", Neural Networks 183, 2025, arXiv:2307.13214; Sec. 5.1:
  "embedding knowledge transfer via KL divergence, temperature 3.0"). FedMEKT's server
  and clients exchange embeddings of a small multimodal proxy set and distil towards
  them with :func:`fedjax_mm.losses.fedmekt.embedding_distillation` (``T^2 KL`` of the
  softmax over an embedding's coordinates at T = 3, the authors' ``KL_Loss``).
  Adaptations (declared): (i) the proxy set is a seeded slice of the world's pairs held
  by no client and outside the global test set (RCSR's experiment has no public set;
  :mod:`fedjax_mm.runner.rcsr`), caption 0 per image; (ii) the adapters + heads are
  still averaged by FedAvg, as every Table 1 row shares this model and Sec. 6 puts
  FedMEKT's traffic *above* FedAvg's (109%): parameters + embeddings; FedMEKT's own
  server-side distillation of a global encoder (its upstream transfer) is therefore
  replaced by averaging: the server's "knowledge" is the plain mean (the authors'
  ``1 / k``) of the sampled clients' proxy embeddings per modality, over the clients
  that hold it (:func:`fedjax_mm.server.rcsr.embedding_average`); (iii) downstream, each
  client adds ``mekt_mu`` x the KL of its embeddings of the proxy set towards that
  average (the mean over its held modalities), at every local step over the whole proxy
  set; the round-1 target is the initial model's embeddings; (iv) the distilled vectors
  are the L2-normalised ``d``-dim embeddings every method shares (FedMEKT distils
  unnormalised encoder outputs), so at T = 3 the term is weak: for small differences
  its gradient is ``~ (z - t) / d``; (v) one weight ``mekt_mu`` (default 1.0; FedMEKT's
  code weights its two layers 0.1 and 0.04) and no classifier stage (retrieval has
  none). Table 1 lists FedMEKT among the personalised rows, yet it has no personal
  state: it is scored with the shared model, like FedAvg.
* **MFCPL** (Le et al., "Cross-Modal Prototype based Multimodal Federated Learning under
  Severely Missing Modality", Information Fusion 122, 2025, arXiv:2401.13898; Sec. 5.1:
  "10 prototypes per modality, CMPC + CMPR + CMA losses"). The terms are reconstructed
  in :mod:`fedjax_mm.losses.mfcpl` (only the paper's abstract and the components' roles
  were reachable, not its equations); adaptations (declared): (i) the classes are the
  K-Means pseudo-labels of the non-IID split (the world's retrieval clients have no
  labels), so ``C = kmeans_k`` prototypes per modality (10 by default, as Sec. 5.1);
  the labels are an oracle for an image-only client (they come from its images'
  captions, which it does not hold); (ii) a client reports, after training, the
  normalised per-class mean of its embeddings of each held modality and the class
  counts; the server takes the count-weighted mean per (modality, class), re-normalised
  (FedProto's rule; :func:`fedjax_mm.server.rcsr.class_prototype_average`), a class no
  sampled client reported keeping its previous prototype; the round-1 prototypes come
  from the initial model over every client; (iii) the client loss is eq. (5)'s (L_NCE
  or L_anchor) plus ``mfcpl_mu`` (default 1.0) x [mean over held modalities of CMPC +
  CMPR, plus CMA for paired clients], CMPC at tau = 0.07 (the model's contrastive
  temperature); (iv) adapters + heads are averaged by FedAvg.
* **CreamFL** (Yu et al., "Multimodal Federated Learning via Contrastive Representation
  Ensemble", ICLR 2023, ``../shared/papers/creamfl.txt``; the library's own CreamFL is
  :mod:`fedjax_mm.algorithms.creamfl`). RCSR says only: "CreamFL (representation-level
  ensemble distillation with contrastive regularization, EMA decay 0.9)" (Sec. 5.1),
  "All baselines share the same frozen CLIP + adapter + projection head architecture",
  and puts its traffic at 103% of FedAvg's (Table 4), i.e. parameters *and*
  representations. Reused from the library: the local regulariser, eq. (1)'s inter-modal
  and eq. (2)'s intra-modal contrast (:mod:`fedjax_mm.losses.creamfl`, temperature 0.5
  as the reference code), and GCA, eqs. (4)-(6) (:func:`fedjax_mm.server.gca.gca`,
  temperature 1). Adaptations (declared): (i) the public set is FedMEKT's proxy set
  (``public_size`` pairs held by no client, outside the global test set); (ii) the
  **server model** is RCSR's model itself: the server averages the clients' adapters +
  heads by FedAvg (every Table 1 row shares this model, and the 103% counts parameters),
  and keeps the **global representations** ``g [2, P, d]`` of the public set
  (``RcsrState.public_embeddings``), which start as the initial model's (Alg. 1 l. 3:
  ``f_s(P; w^0)``); (iii) **"EMA decay 0.9" is the EMA of the global representations**:
  each round the server aggregates the sampled clients' representations per modality by
  GCA (scored against ``g`` of the other modality) into ``a_v`` and sets ``g_v <- 0.9
  g_v + 0.1 a_v`` (:func:`fedjax_mm.server.rcsr.representation_ema`). This replaces
  CreamFL's eq. (7), whose server distils its own model into ``a`` and sends that
  model's representations: with the representations themselves as the distilled
  parameters, one step of size 0.1 on ``1/2 ||g - a||^2`` *is* that EMA, and RCSR's own
  EMA of global prototypes has the same momentum (Table 3: "EMA momentum mu 0.9"; C.5:
  "EMA: mu=0.9 for global prototypes"); RCSR's text names no other quantity it could
  apply to (no row averages the FedAvg'd model over rounds). In round 1 ``g`` equals the
  start-of-round model's representations, so eq. (2) has no gradient until ``g`` moves. (iv) **Single-modality clients** regularise and report only the modality
  they hold (CreamFL's uni-modal clients do the same), their unsent rows are zeroed and
  they are absent from that modality's GCA exactly as unsampled clients are
  (``present = m_k[v]``); their missing tower's update is masked as in every method;
  they still receive both modalities' ``g`` (eq. (1) needs the other's). A modality no
  sampled client holds leaves its ``g_v`` as it was. (v) The local loss is eq. (5)'s
  (L_NCE or L_anchor, Sec. 5.1) plus ``cream_mu`` (CreamFL's gamma, 0.5 as the
  reference's ``--interintra_weight``) x the regulariser (:func:`cream_terms`: inter +
  intra, each the mean over the public set, summed over held modalities as the
  library's ``regulariser_objective``), taken at every local step over the whole
  public set (as FedMEKT here; the library draws ``~P / S`` public samples a step).
  (vi) Eq. (2)'s negative, the client's model at the start of the round, is the global
  model for every client (all start from it), so it is computed once per round.

* **Learnable placeholder** (Sec. C.4): the missing slot of ``s_k`` holds a learnt
  ``[2, d]`` vector shared by all clients (C.4: "learnable placeholders are shared across
  clients"), trained with the router by the same Adam step on L_R after warm-up. Filled
  slots are masked out of the router's attention and of L_pc, so its gradient comes
  through eq. (9)'s ``d_k``; gamma_k uses its value at the start of the round. It starts
  as a random unit vector per modality, and, like the zero fill, it changes the router's
  input only (the EMA update always uses the EMA fill).

**Client faults** (:mod:`fedjax_mm.core.faults`; :func:`round_step`'s static ``faults``,
off by default, and off the round is the fault-free program, bit for bit). They are drawn
each round among the ``floor(C N)`` sampled clients, for every method of this module,
from ``fold_in(fold_in(rng, t), SALT)`` (the round's key, which the sampling splits, so
no draw of the fault-free round changes):

* a **straggler** takes only its drawn share of its ``E ceil(n_k / b)`` local steps (the
  rest are masked as padding steps are); it reports the mean loss of the steps it took
  (0 if none: the engine's convention) and its prototypes after them.
* a **dropped** client's round is lost after training has started: nothing it would send
  arrives (update, ``s_k``, MFCPL's, FedMEKT's or CreamFL's reports). Its weight is 0 and
  everything renormalises over the survivors: the data-size weights, the router's softmax
  (its slots get no attention, and L_R reads only the survivors), eq. (11)'s fused
  weights, the EMA prototypes, MFCPL's class-prototype average, FedMEKT's average and
  CreamFL's GCA; the q game reads only the survivors' losses (a dropped client's ``q``
  gets no factor, then ``q`` is renormalised as usual). The round is lost on its side
  too: its personal adapters, its previous local model (MOON, FedPer) and its last
  ``w^R`` stay as they were. If every sampled client drops, the server's state (adapters
  + heads, EMA prototypes, last global update, router and its optimiser, placeholder, q
  game, class prototypes, public-set embeddings) stays as it was; the round counter
  still advances.
* a **Byzantine** survivor sends a corrupted update of the adapters + heads (``Delta_k``
  replaced by noise or scaled: :func:`fedjax_mm.core.faults.send_updates`), which the
  aggregate and gamma_k's geometry both read (FedPer aggregates nothing: there only its
  reports matter), and corrupted representations (:func:`_byzantine_reports`): its
  prototypes in the modalities it holds (a missing slot still holds the server's EMA
  prototype), MFCPL's class prototypes (the counts stay honest) and FedMEKT's or
  CreamFL's public-set embeddings of its modalities. Its reported loss ``l_k`` stays
  honest (declared): the router is learnt, so no closed-form report maximises the weight
  it gives (as loss 0 and mAP 1 do under FedSCMR's eq. (13)), and an inflated loss
  against the q game is another attack, not simulated. What it keeps is what it
  trained: its personal adapters (RCSR-p, pFedMMA; never sent) and its own local model
  (MOON's and FedPer's ``previous``).

Choices where the paper is silent (declared):

* Local optimiser: AdamW (lr, weight decay 0.01), reset at every round (clients keep
  no optimiser state between rounds); the round's learning rate follows a cosine
  schedule over the rounds with a linear warm-up of ``lr_warmup`` rounds, constant
  within a round.
* Captions: one of the world's captions per image, drawn per step (train); caption 0
  at evaluation.
* RCSR-p: the personal step is taken *simultaneously* with each shared step (its
  gradient at the same point, the shared embeddings under stop-gradient), with its
  own AdamW at 0.1 x lr; ``z~`` is re-normalised before L_NCE / L_anchor; the same
  ``A_k`` is applied to image and text embeddings; ``s_k`` (eq. 13) uses the
  client's w^R from the last round it was sampled in (unsampled clients keep their
  last value; the initial value is 1/floor(C N)); personalisation starts at round
  ``personal_start`` (T_p).
* The reported loss ``l_k`` is the mean local training loss of the round; the
  reported prototypes are computed after training over all the client's samples;
  gamma_k as :func:`fedjax_mm.server.rcsr.geometry`.
* Router optimiser: Adam at the router lr (1e-3), one step per round after warm-up
  (t > T_w); before that ``w^R = |D_k| / sum |D_j|`` and the router is untouched.
* Global prototypes start as the mean of the frozen initial model's normalised
  embeddings of every client's available modality (the server has no data; this is
  the first round's clients' prototype report, computed once at init).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from fedjax_mm import metrics
from fedjax_mm.algorithms.base import Algorithm
from fedjax_mm.core import faults as faults_lib
from fedjax_mm.core.client import apply_in_batches, local_update, map_clients
from fedjax_mm.losses import creamfl as CF
from fedjax_mm.losses import fedmekt as F
from fedjax_mm.losses import mfcpl as M
from fedjax_mm.losses import rcsr as L
from fedjax_mm.server import rcsr as S

Array = jax.Array
PyTree = Any

GLOBAL = nnx.Any(
  nnx.PathContains("image_adapters"),
  nnx.PathContains("text_adapters"),
  nnx.PathContains("image_head"),
  nnx.PathContains("text_head"),
)
PERSONAL = nnx.Any(
  nnx.PathContains("personal"),
  nnx.PathContains("client_image_adapters"),
  nnx.PathContains("client_text_adapters"),
)


class BottleneckAdapter(nnx.Module):
  """``x + W_up ReLU(W_down LN(x))`` on ``[..., w]`` tokens."""

  def __init__(self, width: int, dim: int, *, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.01)
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.down = nnx.Linear(width, dim, kernel_init=init, rngs=rngs)
    self.up = nnx.Linear(dim, width, kernel_init=init, rngs=rngs)

  def residual(self, x: Array) -> Array:
    """``W_up ReLU(W_down LN(x))`` (the branch added to ``x``)."""
    return self.up(jax.nn.relu(self.down(self.norm(x))))

  def __call__(self, x: Array) -> Array:
    return x + self.residual(x)


class Head(nnx.Module):
  """2-layer ReLU MLP projection ``w -> hidden -> d`` (``N(0, 0.02)`` kernels)."""

  def __init__(self, width: int, hidden: int, dim: int, *, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    self.fc1 = nnx.Linear(width, hidden, kernel_init=init, rngs=rngs)
    self.fc2 = nnx.Linear(hidden, dim, kernel_init=init, rngs=rngs)

  def __call__(self, x: Array) -> Array:
    return self.fc2(jax.nn.relu(self.fc1(x)))


class Personal(nnx.Module):
  """RCSR-p's residual adapter ``A_k(z) = W2 GELU(W1 z)`` (eq. 12, no biases), ``W2`` near zero."""

  def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
    w1_init, w2_init = nnx.initializers.normal(0.02), nnx.initializers.normal(1e-4)
    self.w1 = nnx.Linear(dim, hidden, use_bias=False, kernel_init=w1_init, rngs=rngs)
    self.w2 = nnx.Linear(hidden, dim, use_bias=False, kernel_init=w2_init, rngs=rngs)

  def __call__(self, z: Array) -> Array:
    return self.w2(jax.nn.gelu(self.w1(z)))


class RcsrModel(nnx.Module):
  """Frozen dual encoder + per-block adapters + heads (+ the personal adapter)."""

  def __init__(
    self,
    image_encoder: nnx.Module,
    text_encoder: nnx.Module,
    *,
    adapter_dim: int,
    head_hidden: int,
    dim: int,
    personal_hidden: int,
    rngs: nnx.Rngs,
  ):
    self.image_encoder = image_encoder
    self.text_encoder = text_encoder
    wi, wt = image_encoder.features, text_encoder.features
    self.image_adapters = nnx.List(
      [BottleneckAdapter(wi, adapter_dim, rngs=rngs) for _ in image_encoder.blocks]
    )
    self.text_adapters = nnx.List(
      [BottleneckAdapter(wt, adapter_dim, rngs=rngs) for _ in text_encoder.blocks]
    )
    self.image_head = Head(wi, head_hidden, dim, rngs=rngs)
    self.text_head = Head(wt, head_hidden, dim, rngs=rngs)
    self.personal = Personal(dim, personal_hidden, rngs=rngs)
    # pFedMMA's client-specific adapters (made last, so the parts above draw the same
    # initial values as before they existed).
    self.client_image_adapters = nnx.List(
      [BottleneckAdapter(wi, adapter_dim, rngs=rngs) for _ in image_encoder.blocks]
    )
    self.client_text_adapters = nnx.List(
      [BottleneckAdapter(wt, adapter_dim, rngs=rngs) for _ in text_encoder.blocks]
    )

  @staticmethod
  def _adapt(shared, client, h: Array, client_scale: Array | None) -> Array:
    """After one block: ``h + A(h)``, plus pFedMMA's ``client_scale A_k(h)`` when given."""
    out = shared(h)
    if client_scale is None:
      return out
    return out + client_scale * client.residual(h)

  def embed_image(self, x: Array, client_scale: Array | None = None) -> Array:
    """``[b, S, S, C] -> [b, d]`` normalised (the ViT's forward with adapters)."""
    enc = self.image_encoder
    tokens = enc.embed_tokens(x)
    adapters = zip(enc.blocks, self.image_adapters, self.client_image_adapters, strict=True)
    for block, adapter, client in adapters:
      tokens = self._adapt(adapter, client, block(tokens), client_scale)
    pooled = enc.norm(tokens).mean(axis=1)
    return L.normalize(self.image_head(pooled))

  def embed_text(self, x: Array, client_scale: Array | None = None) -> Array:
    """``[b, L] int -> [b, d]`` normalised (the text Transformer's forward with adapters)."""
    enc = self.text_encoder
    mask = x != 0
    h = enc.embed(x) + enc.pos[: x.shape[1]]
    adapters = zip(enc.blocks, self.text_adapters, self.client_text_adapters, strict=True)
    for block, adapter, client in adapters:
      h = self._adapt(adapter, client, block(h, mask), client_scale)
    h = enc.norm(h) * mask[..., None]
    pooled = (h * mask[..., None]).sum(1) / jnp.maximum(mask.sum(1), 1)[:, None]
    return L.normalize(self.text_head(pooled))

  def personalise(self, z: Array, strength: Array) -> Array:
    """Eq. (12), re-normalised: ``normalize(z + s_k A_k(z))``."""
    return L.normalize(z + strength * self.personal(z))


@dataclasses.dataclass(frozen=True)
class RcsrDef:
  """Static side of the system (hashable; closed over by the jitted round)."""

  graphdef: Any
  num_clients: int
  per_round: int  # floor(C N)
  rounds: int
  dim: int = 32
  batch_size: int = 32
  local_epochs: int = 1
  lr: float = 1e-4
  weight_decay: float = 0.01
  lr_warmup: int = 5
  temperature: float = L.TAU_NCE
  lambda_anc: float = 1.0
  router_lr: float = 1e-3
  router_heads: int = 4
  router_width: int = 128
  router_layers: int = 2
  betas: tuple[float, float] = (1.0, 1.0)
  beta_4: float = 0.2
  beta_5: float = 0.3
  warmup_rounds: int = 20  # T_w
  eta_q: float = 0.1
  fair_momentum: float = 0.9
  proto_momentum: float = 0.9  # mu
  lambda_p: float = 0.3
  personal_start: int = 0  # T_p
  personal_lr_ratio: float = 0.1  # Sec. 4.5: the personal adapters train at 0.1 x lr
  client_map: str = "auto"
  eval_batch: int = 256
  num_classes: int = 10  # MFCPL's prototypes per modality (the K-Means pseudo-labels)
  mfcpl_temperature: float = L.TAU_NCE  # CMPC's tau
  mekt_temperature: float = F.TEMPERATURE  # FedMEKT's KL temperature (3.0)
  cream_temperature: float = 0.5  # CreamFL's eqs. (1)-(2) (the reference's 0.5)
  cream_gca_temperature: float = 1.0  # CreamFL's eq. (4) as printed
  cream_decay: float = 0.9  # the EMA of the global representations (RCSR's Sec. 5.1)

  def merge(self, global_params, personal, frozen) -> RcsrModel:
    return nnx.merge(self.graphdef, global_params, personal, frozen)


@struct.dataclass
class Method:
  """Traced switches that make one compiled round serve every method."""

  lambda_a: Array  # eq. (4) prototype-proximal weight (Table 3's lambda_align); 0 for baselines
  lambda_s: Array  # eq. (4) parameter-proximal weight; 0 for baselines
  prox_mu: Array  # FedProx's mu (the term is mu / 2 ||theta_k - theta||^2)
  router: Array  # bool: learnt w^R after warm-up (RCSR)
  fair: Array  # bool: the q game (RCSR)
  fair_centred: Array  # bool: the q game's centred step (ours; server.rcsr.fair_update)
  personal: Array  # bool: RCSR-p's personal adapters
  fixed_strength: Array  # bool: s_k = lambda_p for every client instead of eq. (13)
  zero_fill: Array  # bool: the missing prototype slot of s_k is 0, not the EMA prototype
  moon_mu: Array  # MOON's model-contrastive weight (needs round_step(moon=True)); 0 otherwise
  placeholder_fill: Array  # bool: the missing slot of s_k is the learnt placeholder (C.4)
  client_scale: Array  # pFedMMA's scale on the client-specific adapters; 0 otherwise
  fedper: Array  # bool: adapters + heads personal (needs round_step(fedper=True))
  mfcpl_mu: Array  # MFCPL's weight on CMPC + CMPR + CMA (needs round_step(mfcpl=True))
  mekt_mu: Array  # FedMEKT's weight on the proxy-set KL (needs round_step(mekt=True))
  cream_mu: Array  # CreamFL's gamma on inter + intra contrast (needs round_step(cream=True))


# name -> the switches it turns on. The last five are Table 5's and Sec. C.4's ablations:
# "w/o minimax game" (no q: w = w^R), "w/o client align" (eq. (4)'s two regularisers off,
# lambda_a = lambda_s = 0: L_align is what Sec. 5.6 calls the client alignment loss),
# "FedAvg + per-client adapter" (RCSR-p's adapters on FedAvg; s_k from the initial w^R
# = 1 / floor(C N), since FedAvg has no router), "RCSR-p (fixed lambda)" (s_k = lambda_p)
# and the zero-padding and learnable-placeholder fills of the missing slot (C.4).
_SWITCHES: dict[str, tuple[str, ...]] = {
  "fedavg": (),
  "fedprox": ("prox",),
  "rcsr": ("align", "router", "fair"),
  "rcsr_p": ("align", "router", "fair", "personal"),
  "rcsr_no_minimax": ("align", "router"),
  "rcsr_no_align": ("router", "fair"),
  "fedavg_personal": ("personal",),
  "rcsr_p_fixed": ("align", "router", "fair", "personal", "fixed_strength"),
  "rcsr_zero_fill": ("align", "router", "fair", "zero_fill"),
  "moon": ("moon",),
  "fedper": ("fedper",),
  "pfedmma": ("mma",),
  "rcsr_placeholder_fill": ("align", "router", "fair", "placeholder"),
  # Ours, not the paper's: the q game rewards a loss above the sampled clients' mean
  # rather than being sampled (server.rcsr.fair_update's centred step).
  "rcsr_centred_q": ("align", "router", "fair", "fair_centred"),
  "mfcpl": ("mfcpl",),
  "fedmekt": ("mekt",),
  "creamfl": ("cream",),
}
# Methods whose round needs the clients' previous local models (a separate compile).
NEEDS_PREVIOUS = ("moon",)
# Methods whose clients start from their own adapters + heads (a separate compile).
PERSONAL_MODELS = ("fedper",)
# MFCPL's class prototypes and FedMEKT's proxy-set distillation (a compile each).
CLASS_PROTOTYPES = ("mfcpl",)
PROXY_EMBEDDINGS = ("fedmekt",)
# CreamFL's public-set representations, GCA and their EMA (a compile).
PUBLIC_REPRESENTATIONS = ("creamfl",)
METHODS = tuple(_SWITCHES)
PFEDMMA_SCALE = 0.5  # RCSR's Sec. 5.1: "shared + client-specific components, scale 0.5"


def round_flags(name: str) -> dict[str, bool]:
  """The static keyword arguments of :func:`round_step` that method ``name`` needs."""
  return {
    "moon": name in NEEDS_PREVIOUS,
    "fedper": name in PERSONAL_MODELS,
    "mfcpl": name in CLASS_PROTOTYPES,
    "mekt": name in PROXY_EMBEDDINGS,
    "cream": name in PUBLIC_REPRESENTATIONS,
  }


def method(
  name: str,
  *,
  lambda_a: float = 0.1,
  lambda_s: float = 0.01,
  mu: float = 0.1,
  moon_mu: float = 1.0,
  mfcpl_mu: float = 1.0,
  mekt_mu: float = 1.0,
  cream_mu: float = 0.5,
) -> Method:
  """The :class:`Method` of one of :data:`METHODS`."""
  if name not in _SWITCHES:
    raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)}.")
  on = _SWITCHES[name]
  f = lambda x: jnp.asarray(x, jnp.float32)
  b = lambda key: jnp.asarray(key in on, bool)
  align = "align" in on
  return Method(
    lambda_a=f(lambda_a if align else 0.0),
    lambda_s=f(lambda_s if align else 0.0),
    prox_mu=f(mu if "prox" in on else 0.0),
    router=b("router"),
    fair=b("fair"),
    fair_centred=b("fair_centred"),
    personal=b("personal"),
    fixed_strength=b("fixed_strength"),
    zero_fill=b("zero_fill"),
    moon_mu=f(moon_mu if "moon" in on else 0.0),
    placeholder_fill=b("placeholder"),
    client_scale=f(PFEDMMA_SCALE if "mma" in on else 0.0),
    fedper=b("fedper"),
    mfcpl_mu=f(mfcpl_mu if "mfcpl" in on else 0.0),
    mekt_mu=f(mekt_mu if "mekt" in on else 0.0),
    cream_mu=f(cream_mu if "cream" in on else 0.0),
  )


def strength(spec: RcsrDef, meth: Method, last_wr: Array) -> Array:
  """RCSR-p's ``s_k``: eq. (13) of the client's last ``w^R``, or ``lambda_p`` when fixed."""
  adaptive = S.personal_strength(last_wr, lambda_p=spec.lambda_p)
  return jnp.where(meth.fixed_strength, jnp.asarray(spec.lambda_p, adaptive.dtype), adaptive)


@struct.dataclass
class RcsrState:
  """Everything that persists across rounds (checkpointed by the loop)."""

  round: Array
  rng: Array
  params: PyTree  # global adapters + heads
  personal: PyTree  # [N, ...] RCSR-p adapters (never aggregated, never sent)
  router: PyTree
  router_opt: PyTree
  fair: S.FairState  # q over all N clients + group running means
  prototypes: Array  # [2, d] EMA prototypes (pbar_I, pbar_T)
  prev_update: Array  # [P] last global update (gamma_k's entry 2)
  last_wr: Array  # [N] each client's last w^R (eq. 13's input)
  previous: PyTree  # [N, ...] each client's last local adapters + heads (MOON's z_prev,
  # FedPer's personal model)
  placeholder: Array  # [2, d] C.4's learnable placeholder of a missing prototype slot
  class_prototypes: Array  # [2, C, d] MFCPL's global per-class prototypes (0: no class yet)
  public_embeddings: Array  # [2, P, d] FedMEKT's average of the clients' proxy embeddings;
  # CreamFL's global representations of the public set (the EMA of GCA's aggregates)
  method: Method  # the run's switches (evaluation applies its personal adapters / s_k)


def token_dim(dim: int) -> int:
  return dim + 2 + 4 + 2 + 1


def build_model(
  image_encoder, text_encoder, *, adapter_dim, head_hidden, dim, personal_hidden, key
):
  """The model and its three parts: ``(graphdef, global, personal, frozen)``."""
  model = RcsrModel(
    image_encoder,
    text_encoder,
    adapter_dim=adapter_dim,
    head_hidden=head_hidden,
    dim=dim,
    personal_hidden=personal_hidden,
    rngs=nnx.Rngs(key),
  )
  return nnx.split(model, GLOBAL, PERSONAL, ...)


def _tower_flags(params: PyTree, modality: Array) -> PyTree:
  """Per leaf: 1 where the client holds the leaf's tower, else 0."""

  def flag(path, _):
    name = jax.tree_util.keystr(path)
    on = modality[0] if "image_" in name else modality[1]
    return on.astype(jnp.float32)

  return jax.tree_util.tree_map_with_path(flag, params)


def _is_client_adapter(path) -> bool:
  return "client_" in jax.tree_util.keystr(path)


def masked_tx(
  shared_tx: optax.GradientTransformation,
  personal_tx: optax.GradientTransformation,
  modality: Array,
  personal_on: Array,
  client_tx: optax.GradientTransformation | None = None,
  client_on: Array | bool = False,
) -> optax.GradientTransformation:
  """AdamW on ``{"global", "personal"}`` with the *update* masked per tower / switch.

  In ``personal``, RCSR-p's adapter steps with ``personal_tx`` where ``personal_on``;
  pFedMMA's client-specific adapters step with ``client_tx`` (default ``shared_tx``)
  where ``client_on``, masked per tower like the shared ones; nothing else moves.
  """
  client_tx = shared_tx if client_tx is None else client_tx

  def init(params):
    p = params["personal"]
    return shared_tx.init(params["global"]), personal_tx.init(p), client_tx.init(p)

  def update(grads, state, params):
    ug, sg = shared_tx.update(grads["global"], state[0], params["global"])
    up, sp = personal_tx.update(grads["personal"], state[1], params["personal"])
    uc, sc = client_tx.update(grads["personal"], state[2], params["personal"])
    flags = _tower_flags(ug, modality)
    # jnp.where, not a product: a NaN / Inf update of the missing tower stays out too.
    ug = jax.tree.map(lambda u, f: jnp.where(f > 0, u, 0.0), ug, flags)
    client_flags = _tower_flags(uc, modality)

    def pick(path, u_p, u_c, f):
      if _is_client_adapter(path):
        return jnp.where(client_on & (f > 0), u_c, 0.0)
      return jnp.where(personal_on, u_p, 0.0)

    up = jax.tree_util.tree_map_with_path(pick, up, uc, client_flags)
    return {"global": ug, "personal": up}, (sg, sp, sc)

  return optax.GradientTransformation(init, update)


def round_lr(spec: RcsrDef, t: Array) -> Array:
  """Cosine annealing over the rounds after a linear warm-up of ``lr_warmup`` rounds."""
  t = t.astype(jnp.float32)
  warm = jnp.minimum(1.0, (t + 1) / max(spec.lr_warmup, 1))
  cos = 0.5 * (1 + jnp.cos(jnp.pi * t / max(spec.rounds, 1)))
  return spec.lr * warm * cos


def _held_mean(modality: Array, image_term: Array, text_term: Array) -> Array:
  """The mean of two per-modality terms over the modalities the client holds."""
  held = modality.astype(image_term.dtype)
  total = jnp.where(modality[0], image_term, 0.0) + jnp.where(modality[1], text_term, 0.0)
  return total / jnp.maximum(held.sum(), 1.0)


def mfcpl_terms(spec, z_i, z_t, labels, mask, modality, class_prototypes):
  """MFCPL's ``CMPC + CMPR`` (mean over held modalities) ``+ CMA`` (paired) for one batch."""
  count = jnp.maximum(mask.sum(), 1).astype(z_i.dtype)
  complete = M.complete_prototypes(class_prototypes)

  def per_modality(z, other):
    cmpc = M.prototype_contrastive(
      z, labels, other, temperature=spec.mfcpl_temperature, where=mask
    ).sum()
    cmpr = M.prototype_regularization(z, labels, complete, where=mask).sum()
    return (cmpc + cmpr) / count

  specific = _held_mean(
    modality,
    per_modality(z_i, class_prototypes[1]),
    per_modality(z_t, class_prototypes[0]),
  )
  cma = M.cross_modal_alignment(z_i, z_t, where=mask).sum() / count
  return specific + jnp.where(modality[0] & modality[1], cma, 0.0)


def cream_terms(spec, z_i, z_t, global_reps, start_reps, modality):
  """CreamFL's regulariser (eq. (3) without gamma) on the whole public set, ONE client.

  Per held modality ``v`` (``o`` the other), the mean over the ``P`` public samples of
  the inter-modal contrast of ``z_v`` against every global representation of ``o`` (eq.
  (1)) plus the intra-modal contrast to the global representation of ``v``, the
  client's start-of-round representation the negative (eq. (2)); summed over the held
  modalities, as the library's CreamFL sums over a client's modalities.

  Args:
    spec: static settings (``cream_temperature``).
    z_i, z_t: ``[P, d]`` the client's current representations of the public set.
    global_reps: ``[2, P, d]`` the server's global representations (constants).
    start_reps: ``[2, P, d]`` the client's model's at the start of the round (constants).
    modality: ``bool [2]`` the client's modality mask.
  """
  g = jax.lax.stop_gradient(global_reps)
  p = jax.lax.stop_gradient(start_reps)
  index = jnp.arange(z_i.shape[0])
  tau = spec.cream_temperature

  def per_modality(z, v):
    inter = CF.inter_modal_contrast(z, g[1 - v], index, temperature=tau).mean()
    intra = CF.intra_modal_contrast(z, g[v], p[v], temperature=tau).mean()
    return inter + intra

  return jnp.where(modality[0], per_modality(z_i, 0), 0.0) + jnp.where(
    modality[1], per_modality(z_t, 1), 0.0
  )


def client_objective(
  spec,
  frozen,
  global_start,
  modality,
  prototypes,
  strength,
  meth,
  previous=None,
  *,
  class_prototypes=None,
  public=None,
  public_targets=None,
  cream_reps=None,
):
  """Eq. (5) (+ FedProx, + RCSR-p's personal loss, + MOON's) for ONE client as an Objective.

  ``previous`` (the client's last local adapters + heads) turns on MOON's
  model-contrastive term, weighted by ``meth.moon_mu``, on every modality the client
  holds (the mean over them); the global and previous models are frozen for it.
  pFedMMA's client-specific adapters enter every forward at ``meth.client_scale`` (0
  for every other method). ``class_prototypes`` (``[2, C, d]``, with ``batch["label"]``)
  turns on MFCPL's terms (:func:`mfcpl_terms`, weight ``meth.mfcpl_mu``); ``public``
  (the proxy set: ``image [P, S, S, C]``, ``caption [P, L]``) and ``public_targets``
  (``[2, P, d]``) turn on FedMEKT's distillation of the client's proxy embeddings
  towards the targets (weight ``meth.mekt_mu``), both over the modalities it holds.
  ``public`` with ``cream_reps`` (``(global [2, P, d], start [2, P, d])``: the server's
  global representations and the client's start-of-round model's, a constant) turns on
  CreamFL's regulariser instead: :func:`cream_terms`, weight ``meth.cream_mu``.
  """
  cs = meth.client_scale

  def moon_term(params, x_image, text, mask, z_i, z_t):
    frozen_model = lambda p: spec.merge(p, params["personal"], frozen)
    g = frozen_model(jax.lax.stop_gradient(global_start))
    q = frozen_model(jax.lax.stop_gradient(previous))
    per = lambda z, zg, zq: L.moon_loss(z, zg, zq, where=mask).sum() / jnp.maximum(mask.sum(), 1)
    m_i = per(z_i, g.embed_image(x_image, cs), q.embed_image(x_image, cs))
    m_t = per(z_t, g.embed_text(text, cs), q.embed_text(text, cs))
    held = modality.astype(m_i.dtype)
    return (held[0] * m_i + held[1] * m_t) / jnp.maximum(held.sum(), 1.0)

  def objective(params, batch, mask, key):
    model = spec.merge(params["global"], params["personal"], frozen)
    caps = batch["caption"]
    pick = jax.random.randint(key, (caps.shape[0],), 0, caps.shape[1])
    text = jnp.take_along_axis(caps, pick[:, None, None], axis=1)[:, 0]
    z_i = model.embed_image(batch["image"], cs)
    z_t = model.embed_text(text, cs)
    prox = L.parameter_proximal(params["global"], global_start)
    loss, terms = L.rcsr_client_loss(
      z_i,
      z_t,
      modality=modality,
      global_prototypes=prototypes,
      prox=prox,
      where=mask,
      temperature=spec.temperature,
      lambda_a=meth.lambda_a,
      lambda_s=meth.lambda_s,
      lambda_anc=spec.lambda_anc,
    )
    loss = loss + 0.5 * meth.prox_mu * prox
    if previous is not None:
      loss = loss + meth.moon_mu * moon_term(params, batch["image"], text, mask, z_i, z_t)
    if class_prototypes is not None:
      terms = mfcpl_terms(spec, z_i, z_t, batch["label"], mask, modality, class_prototypes)
      loss = loss + meth.mfcpl_mu * terms
    if public is not None and cream_reps is not None:
      z_pi = model.embed_image(public["image"], cs)
      z_pt = model.embed_text(public["caption"], cs)
      reg = cream_terms(spec, z_pi, z_pt, *cream_reps, modality)
      loss = loss + meth.cream_mu * reg
    elif public is not None:
      kd = lambda z, t: F.embedding_distillation(z, t, temperature=spec.mekt_temperature).mean()
      kd_i = kd(model.embed_image(public["image"], cs), public_targets[0])
      kd_t = kd(model.embed_text(public["caption"], cs), public_targets[1])
      loss = loss + meth.mekt_mu * _held_mean(modality, kd_i, kd_t)
    # RCSR-p (eq. 12): personal features from the shared ones under stop-gradient.
    pz_i = model.personalise(jax.lax.stop_gradient(z_i), strength)
    pz_t = model.personalise(jax.lax.stop_gradient(z_t), strength)
    p_loss, _ = L.rcsr_client_loss(
      pz_i,
      pz_t,
      modality=modality,
      global_prototypes=prototypes,
      prox=jnp.zeros(()),
      where=mask,
      temperature=spec.temperature,
      lambda_a=0.0,
      lambda_s=0.0,
      lambda_anc=spec.lambda_anc,
    )
    p_loss = jnp.where(meth.personal, p_loss, 0.0)
    # The value is the shared loss (the l_k a client reports); the gradient includes the
    # personal loss's, which reaches only the personal adapter. The parentheses keep the
    # value *exactly* the shared loss ((loss + p) - p is not, in float32), so RCSR-p's q
    # game and global model are RCSR's bit for bit.
    return loss + (p_loss - jax.lax.stop_gradient(p_loss)), {"personal_loss": p_loss}

  return objective


def client_update(
  spec: RcsrDef,
  frozen: PyTree,
  meth: Method,
  global_params: PyTree,
  prototypes: Array,
  lr: Array,
  personal_on: Array,
  personal: PyTree,
  rng: Array,
  arrays: dict[str, Array],
  sample_mask: Array,
  modality: Array,
  strength: Array,
  previous: PyTree | None = None,
  *,
  class_prototypes: Array | None = None,
  public: dict[str, Array] | None = None,
  public_targets: Array | None = None,
  cream_reps: tuple[Array, Array] | None = None,
  max_steps: Array | None = None,
) -> tuple[PyTree, PyTree, dict[str, Array]]:
  """Local training of ONE client; returns ``(new global params, new personal, stats)``.

  ``previous``: the client's last local adapters + heads, for MOON (else None).
  ``class_prototypes``: MFCPL's global ``[2, C, d]`` (``arrays`` then hold ``label``);
  ``public`` + ``public_targets``: FedMEKT's proxy set and the server's average of its
  embeddings; ``public`` + ``cream_reps``: CreamFL's public set, global and
  start-of-round representations (see :func:`client_objective`). ``max_steps``: an
  ``int32`` scalar, a straggler's budget of real local steps
  (:func:`fedjax_mm.core.client.local_update`; None: all of them). ``stats`` hold
  ``loss`` (the mean over the steps taken) and ``steps`` (their number).
  """
  shared_tx = optax.adamw(lr, weight_decay=spec.weight_decay)
  personal_tx = optax.adamw(spec.personal_lr_ratio * lr, weight_decay=spec.weight_decay)
  tx = masked_tx(
    shared_tx,
    personal_tx,
    modality,
    personal_on & meth.personal,
    client_on=meth.client_scale > 0,
  )
  obj = client_objective(
    spec,
    frozen,
    global_params,
    modality,
    prototypes,
    strength,
    meth,
    previous,
    class_prototypes=class_prototypes,
    public=public,
    public_targets=public_targets,
    cream_reps=cream_reps,
  )
  params = {"global": global_params, "personal": personal}
  params, _, _, stats = local_update(
    obj,
    tx,
    params,
    tx.init(params),
    rng,
    arrays,
    sample_mask,
    num_epochs=spec.local_epochs,
    batch_size=spec.batch_size,
    max_steps=max_steps,
  )
  return params["global"], params["personal"], stats


def client_embeddings(spec, frozen, params, personal, images, captions, client_scale=None):
  """``(z_I [n, d], z_T [n, d])`` of ``images [n, S, S, C]`` and ``captions [n, L]``."""
  model = spec.merge(params, personal, frozen)
  embed_i = lambda x: model.embed_image(x, client_scale)
  embed_t = lambda x: model.embed_text(x, client_scale)
  z_i = apply_in_batches(embed_i, images, spec.eval_batch)
  z_t = apply_in_batches(embed_t, captions, spec.eval_batch)
  return z_i, z_t


def recall(z_i: Array, z_t: Array, ks=(1, 5, 10)) -> dict[str, Array]:
  """R@K of pairs ``(z_i[j], z_t[j])``: both directions, in percent.

  A query's rank is the number of candidates strictly more similar than its own
  pair (:func:`fedjax_mm.metrics.image_text_recall` with one caption per image,
  which forms the similarities ``chunk_size`` queries at a time, never all
  ``n x n`` of them).
  """
  out = metrics.image_text_recall(z_i, z_t, jnp.arange(z_i.shape[0]), ks=ks)
  for k in ks:
    out[f"R@{k}"] = (out[f"i2t_R@{k}"] + out[f"t2i_R@{k}"]) / 2
  return out


def evaluate(spec: RcsrDef, s, test, g, frozen, *, ks=(1, 5, 10)):
  """Every client's R@K on its own test pairs (``test``, stacked), with its personal part
  where the method has one, and the shared model's on the global test pairs ``g``.

  Returns ``(own, global)``: :func:`recall` per client (and ``personal_shift``, the mean
  distance the personal adapter moves an embedding), and of the shared model (FedPer,
  which has none: the mean over the clients' own models). Jit it with ``spec`` bound.
  """
  cs = s.method.client_scale

  def embeddings(params, personal, pairs, client_scale=None):
    # spec.eval_batch pairs at a time: the whole set at once held every layer's activations.
    return client_embeddings(
      spec, frozen, params, personal, pairs["image"], pairs["caption"], client_scale
    )

  def own_params(previous):
    # FedPer's clients are scored with their own adapters + heads.
    return jax.tree.map(lambda p, q: jnp.where(s.method.fedper, q, p), s.params, previous)

  def client(personal, previous, arrays, wr):
    params = own_params(previous)
    model = spec.merge(params, personal, frozen)
    z_i, z_t = embeddings(params, personal, arrays, cs)
    s_k = strength(spec, s.method, wr)
    p_i, p_t = model.personalise(z_i, s_k), model.personalise(z_t, s_k)
    # How far the personal adapter moves the embeddings: mean ||z~ - z|| (unit vectors).
    shift = (
      jnp.linalg.norm(p_i - z_i, axis=-1).mean() + jnp.linalg.norm(p_t - z_t, axis=-1).mean()
    ) / 2
    z_i = jnp.where(s.method.personal, p_i, z_i)
    z_t = jnp.where(s.method.personal, p_t, z_t)
    return recall(z_i, z_t, ks) | {"personal_shift": jnp.where(s.method.personal, shift, 0.0)}

  own = jax.vmap(client)(s.personal, s.previous, test, s.last_wr)

  def shared():
    # The shared model alone (RCSR-p's and pFedMMA's client parts off).
    return recall(*embeddings(s.params, jax.tree.map(lambda x: x[0], s.personal), g), ks)

  def mean_of_clients():
    # FedPer has no shared model: the mean over the N clients' own models.
    def one(previous):
      return recall(*embeddings(previous, jax.tree.map(lambda x: x[0], s.personal), g), ks)

    return jax.tree.map(lambda x: x.mean(0), jax.lax.map(one, s.previous))

  return own, jax.lax.cond(s.method.fedper, mean_of_clients, shared)


def _reported(z_i, z_t, sample_mask, modality, prototypes):
  local = jnp.stack([L.prototype(z_i, where=sample_mask), L.prototype(z_t, where=sample_mask)])
  return jnp.where(modality[:, None], local, prototypes)


def _class_report(spec, z_i, z_t, labels, sample_mask, modality):
  """MFCPL's upload: ``([2, C, d] per-class prototypes, [2, C] counts)``, 0 where not held."""
  p_i, n_i = M.class_prototypes(z_i, labels, spec.num_classes, where=sample_mask)
  p_t, n_t = M.class_prototypes(z_t, labels, spec.num_classes, where=sample_mask)
  counts = jnp.stack([n_i, n_t]) * modality[:, None].astype(n_i.dtype)
  return jnp.stack([p_i, p_t]), counts


def _flat(tree: PyTree) -> Array:
  return jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(tree)])


def init(
  spec: RcsrDef,
  global_params: PyTree,
  personal: PyTree,
  frozen: PyTree,
  arrays: dict[str, Array],
  sample_mask: Array,
  modality: Array,
  key: Array,
  meth: Method | None = None,
  *,
  public: dict[str, Array] | None = None,
) -> RcsrState:
  """Initial state: stacked personal adapters, router, q = 1/N, initial prototypes.

  ``meth`` (default FedAvg's) is stored for evaluation and for :class:`RcsrRound`,
  which runs it; :func:`round_step` takes the method it runs as its own argument. Like the EMA prototypes, MFCPL's class
  prototypes (when ``arrays`` hold ``label``) start from the frozen initial model over
  every client's held modalities, aggregated as a round would; FedMEKT's proxy targets
  (when ``public`` is given) start as the initial model's embeddings of the proxy set.
  """
  n = spec.num_clients
  k_router, k_rng = jax.random.split(key)
  zeros = jnp.zeros((2, spec.dim))

  def report(a, m, mod):
    z_i, z_t = client_embeddings(
      spec, frozen, global_params, personal, a["image"], a["caption"][:, 0]
    )
    out = _reported(z_i, z_t, m, mod, zeros)
    if "label" in a:
      return out, _class_report(spec, z_i, z_t, a["label"], m, mod)
    return out, None

  fill, classes = jax.vmap(report)(arrays, sample_mask, modality)
  held = modality.astype(jnp.float32)
  protos = L.normalize(jnp.einsum("kv,kvd->vd", held, fill))
  class_protos = jnp.zeros((2, spec.num_classes, spec.dim))
  if classes is not None:
    class_protos = S.class_prototype_average(*classes, class_protos, jnp.ones((n,), bool))
  public_emb = jnp.zeros((2, 1, spec.dim))
  if public is not None:
    public_emb = jnp.stack(
      client_embeddings(spec, frozen, global_params, personal, public["image"], public["caption"])
    )
  router = S.init_router(
    k_router,
    token_dim(protos.shape[-1]),
    width=spec.router_width,
    layers=spec.router_layers,
  )
  # C.4's placeholder starts as a random unit vector per modality (zeros would start it
  # as the zero-fill ablation, where normalize has no useful gradient).
  placeholder = L.normalize(jax.random.normal(jax.random.fold_in(key, 1), (2, spec.dim)))
  return RcsrState(
    round=jnp.zeros((), jnp.int32),
    rng=k_rng,
    params=global_params,
    personal=jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), personal),
    router=router,
    router_opt=optax.adam(spec.router_lr).init({"router": router, "placeholder": placeholder}),
    fair=S.fair_init(n),
    prototypes=protos,
    prev_update=jnp.zeros_like(_flat(global_params)),
    # float32, not weakly typed: a restored checkpoint is float32, and the resumed run's
    # round would then be another program (compiled again, not found in the cache).
    last_wr=jnp.full((n,), 1.0 / spec.per_round, jnp.float32),
    previous=jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), global_params),
    placeholder=placeholder,
    class_prototypes=class_protos,
    public_embeddings=public_emb,
    method=method("fedavg") if meth is None else meth,
  )


def round_step(
  spec: RcsrDef,
  frozen: PyTree,
  meth: Method,
  state: RcsrState,
  arrays: dict[str, Array],
  sample_mask: Array,
  modality: Array,
  *,
  moon: bool = False,
  fedper: bool = False,
  mfcpl: bool = False,
  mekt: bool = False,
  cream: bool = False,
  public: dict[str, Array] | None = None,
  faults: faults_lib.Faults = faults_lib.NONE,
) -> tuple[RcsrState, dict[str, Array]]:
  """One round of Algorithm 1 for every method (its switches in ``meth``).

  Args:
    spec: static settings.
    frozen: the frozen encoders' parameters (not sent).
    meth: the method's :class:`Method`.
    state: :class:`RcsrState`.
    arrays: ``image [N, n, S, S, C]``, ``caption [N, n, C, L]`` (missing modality zeroed).
    sample_mask: ``bool [N, n]``.
    modality: ``bool [N, 2]`` client modality masks.
    moon: static; give the clients their previous local models (MOON's term, weighted
      by ``meth.moon_mu``) and keep the new ones. Off, ``state.previous`` is untouched.
    fedper: static; FedPer: every sampled client starts from its own adapters + heads
      (``state.previous``) and keeps what it trains there; ``state.params`` (the server's
      model) is left as it is, since nothing is aggregated.
    mfcpl: static; MFCPL: the clients train with ``state.class_prototypes`` (``arrays``
      must hold ``label [N, n]``) and report per-class prototypes and counts, which the
      server averages (:func:`fedjax_mm.server.rcsr.class_prototype_average`).
    mekt: static; FedMEKT: the clients distil their embeddings of ``public`` towards
      ``state.public_embeddings`` and report their own, which the server averages
      (:func:`fedjax_mm.server.rcsr.embedding_average`).
    cream: static; CreamFL: the clients regularise towards ``state.public_embeddings``
      (the global representations of ``public``) and report their own of the modalities
      they hold, which the server aggregates by GCA and folds into the global ones by
      an EMA (:func:`fedjax_mm.server.rcsr.representation_ema`).
    public: FedMEKT's proxy set / CreamFL's public set, ``image [P, S, S, C]``,
      ``caption [P, L]``.
    faults: static; the simulated client faults among the round's sampled clients
      (module docstring, "Client faults"). Off (the default), the round is the
      fault-free program.

  Returns:
    ``(state, metrics)``: metrics hold per-client ``[N]`` values (NaN where unsampled)
    and scalars; with faults on, also ``fault_counts`` (``int32`` scalars ``dropped``,
    ``stragglers``, ``byzantine``), ``dropped`` (``bool [N]``, the sampled clients that
    dropped out) and ``steps`` (``[N]``, the local steps each sampled client took).
  """
  n, m = spec.num_clients, spec.per_round
  t = state.round  # rounds completed; this is round t + 1 of Algorithm 1
  rng, k_sample, k_clients = jax.random.split(jax.random.fold_in(state.rng, t), 3)
  # Line 3: sample floor(C N) clients.
  scores = jax.random.uniform(k_sample, (n,))
  idx = jnp.sort(jax.lax.top_k(scores, m)[1])
  where = jnp.zeros((n,), bool).at[idx].set(True)
  take = lambda x: x[idx]
  c_arrays = jax.tree.map(take, arrays)
  c_mask, c_mod = sample_mask[idx], modality[idx]
  c_personal = jax.tree.map(take, state.personal)
  s_k = strength(spec, meth, state.last_wr[idx])
  lr = round_lr(spec, t)
  personal_on = t >= spec.personal_start
  # Lines 5-8: local training of the sampled clients, one compiled map.
  keys = jax.random.split(k_clients, m)
  mapped = (c_personal, keys, c_arrays, c_mask, c_mod, s_k)
  if moon:
    mapped += (jax.tree.map(take, state.previous),)
  if (mekt or cream) and public is None:
    raise ValueError("round_step(mekt=True / cream=True) needs public={image, caption}.")
  if mekt and cream:
    raise ValueError("round_step: mekt and cream are different methods.")
  extra = {}
  if mfcpl:
    extra["class_prototypes"] = state.class_prototypes
  if mekt:
    extra |= {"public": public, "public_targets": state.public_embeddings}
  if cream:
    # Eq. (2)'s negative: the client's model at the start of the round, which is the
    # global model for every client (they all start from it), so computed once.
    own = jax.tree.map(lambda x: x[0], state.personal)  # not read: no client scale
    start_reps = jnp.stack(
      client_embeddings(spec, frozen, state.params, own, public["image"], public["caption"])
    )
    extra |= {"public": public, "cream_reps": (state.public_embeddings, start_reps)}
  if fedper:
    # Each client's own adapters + heads are its starting point (mapped, not closed over).
    start = jax.tree.map(take, state.previous)

    def update(own, *rest, **kw):
      return client_update(
        spec, frozen, meth, own, state.prototypes, lr, personal_on, *rest, **extra, **kw
      )

    mapped = (start,) + mapped
  else:
    update = functools.partial(
      client_update,
      spec,
      frozen,
      meth,
      state.params,
      state.prototypes,
      lr,
      personal_on,
      **extra,
    )
    start = state.params
  train, masks = update, None
  if faults.enabled:
    # The fault key: fold_in(state.rng, t) is the key split above, so no draw of the
    # fault-free round changes. Masks are over the sampled clients, in idx's order.
    fault_key = jax.random.fold_in(jax.random.fold_in(state.rng, t), faults_lib.SALT)
    masks = faults_lib.draw(fault_key, jnp.ones((m,), bool), faults)
    budget = faults_lib.step_budget(
      masks.work, c_mask.sum(1), num_epochs=spec.local_epochs, batch_size=spec.batch_size
    )
    train = lambda *args: update(*args[:-1], max_steps=args[-1])
    mapped += (budget,)
  new_global, new_personal, stats = map_clients(train, mapped, spec.client_map)

  reports = _client_reports(
    spec,
    frozen,
    meth,
    state.prototypes,
    (new_global, new_personal, c_arrays, c_mask, c_mod),
    mfcpl=mfcpl,
    mekt=mekt,
    cream=cream,
    public=public,
  )
  # What the server receives: the trained adapters + heads, or, with faults, the
  # dropped clients' start (weight 0 below) and the Byzantine clients' corrupted updates;
  # ``arrived``: the sampled clients whose reports reach it (all of them without faults).
  received, arrived = new_global, jnp.ones((m,), bool)
  if masks is not None:
    arrived = ~masks.dropped
    starts = start if fedper else jax.tree.map(lambda x: jnp.broadcast_to(x, (m,) + x.shape), start)
    received = faults_lib.send_updates(
      faults_lib.corruption_key(fault_key), starts, new_global, masks, faults
    )
    if faults.has_byzantine:
      reports = _byzantine_reports(reports, c_mod, masks.byzantine, fault_key, faults)
  protos = reports["prototypes"]
  if fedper:
    deltas = jax.vmap(lambda p, p0: _flat(p) - _flat(p0))(received, start)
  else:
    deltas = jax.vmap(lambda p: _flat(p) - _flat(state.params))(received)
  # s_k's prototypes (eq. 6): the missing slot holds the EMA prototype, 0 or the learnt
  # placeholder (C.4 ablations); the EMA update below always uses the EMA fill, so the
  # ablations touch the router only.
  missing = ~c_mod[..., None]

  def fill(placeholder):
    out = jnp.where(meth.zero_fill & missing, 0.0, protos)
    return jnp.where(meth.placeholder_fill & missing, placeholder[None], out)

  gamma = jax.vmap(lambda d, pk, md: S.geometry(d, state.prev_update, pk, state.prototypes, md))(
    deltas, fill(state.placeholder), c_mod
  )
  loss = stats["loss"]
  # Lines 10-13: router after warm-up (RCSR), data-size weights otherwise.
  sizes = c_mask.sum(1)
  w_data = S.data_weights(sizes, arrived)
  routed = meth.router & (t >= spec.warmup_rounds)
  if masks is not None:
    # With nobody to weigh, the router's softmax is over an empty set (NaN gradients):
    # it, its optimiser and the placeholder stay as they were.
    any_arrived = jnp.any(arrived)
    routed = routed & any_arrived

  (router, placeholder, router_opt), r_loss, w_router = _router_step(
    spec, state, fill, gamma, c_mod, loss, arrived, routed, meth.placeholder_fill
  )
  w_r = jnp.where(routed, w_router, w_data)
  # Line 15: the q game over all N clients (RCSR), eq. (11) fused weights.
  full = lambda x: jnp.zeros((n,), x.dtype).at[idx].set(x)
  group = S.client_group(modality)
  reported = where if masks is None else jnp.zeros((n,), bool).at[idx].set(arrived)
  fair, _ = S.fair_update(
    state.fair,
    full(loss),
    group,
    reported,
    eta_q=spec.eta_q,
    momentum=spec.fair_momentum,
    centred=meth.fair_centred,
  )
  play = meth.fair
  if masks is not None:
    # With no loss reported, q / sum(q) would still move q's last bits: no game.
    play = play & any_arrived
  fair = jax.tree.map(lambda new, old: jnp.where(play, new, old), fair, state.fair)
  q = jnp.where(meth.fair, fair.q[idx], jnp.ones((m,)))
  w = S.fused_weights(w_r, q, arrived)
  # Lines 16-17: global update and EMA prototypes.
  step = jnp.einsum("k,kp->p", w, deltas)
  if fedper:
    params = state.params  # nothing is aggregated
  else:
    # With every client dropped w = 0, so params = g + 0 = g exactly.
    params = jax.tree.map(
      lambda g, new: g + jnp.einsum("k,k...->...", w, new - g), state.params, received
    )
  prototypes = S.ema_prototypes(state.prototypes, protos, w, mu=spec.proto_momentum)
  prev_update = step
  if masks is not None:
    # w = 0 would pull the prototypes towards 0 by mu, and a round that moved nothing
    # would erase the last global update gamma_k compares with.
    prototypes = jnp.where(any_arrived, prototypes, state.prototypes)
    prev_update = jnp.where(any_arrived, step, state.prev_update)
  class_prototypes = state.class_prototypes
  if mfcpl:
    class_prototypes = S.class_prototype_average(*reports["classes"], class_prototypes, arrived)
  public_embeddings = state.public_embeddings
  if mekt:
    public_embeddings = S.embedding_average(reports["public"], c_mod, public_embeddings, arrived)
  if cream:
    public_embeddings, _ = S.representation_ema(
      reports["public"],
      c_mod,
      public_embeddings,
      arrived,
      decay=spec.cream_decay,
      temperature=spec.cream_gca_temperature,
    )
  kept, local = routed, new_global
  if masks is not None:
    # A dropped client's round is lost on its side too: it keeps its personal state, its
    # previous local model and its last w^R. (A Byzantine one keeps what it trained.)
    new_personal = faults_lib.keep_where(masks.dropped, c_personal, new_personal)
    kept = routed & arrived
    if moon or fedper:
      local = faults_lib.keep_where(masks.dropped, jax.tree.map(take, state.previous), local)
  personal = jax.tree.map(lambda all_, new: all_.at[idx].set(new), state.personal, new_personal)
  last_wr = state.last_wr.at[idx].set(jnp.where(kept, w_router, state.last_wr[idx]))
  previous = state.previous
  if moon or fedper:
    previous = jax.tree.map(lambda all_, new: all_.at[idx].set(new), previous, local)
  new_state = RcsrState(
    round=t + 1,
    rng=state.rng,
    params=params,
    personal=personal,
    router=router,
    router_opt=router_opt,
    fair=fair,
    prototypes=prototypes,
    prev_update=prev_update,
    last_wr=last_wr,
    previous=previous,
    placeholder=placeholder,
    class_prototypes=class_prototypes,
    public_embeddings=public_embeddings,
    method=state.method,
  )
  nan = lambda x: jnp.full((n,), jnp.nan).at[idx].set(x)
  del rng
  metrics = {
    "loss": nan(loss),
    "weight": nan(w),
    "router_loss": r_loss,
    "lr": lr,
    "sampled": where,
  }
  if masks is not None:
    metrics |= {
      "fault_counts": masks.counts(),
      "dropped": jnp.zeros((n,), bool).at[idx].set(masks.dropped),
      "steps": nan(stats["steps"]),
    }
  return new_state, metrics


@dataclasses.dataclass(frozen=True)
class RcsrRound:
  """:func:`round_step` with the static switches bound and the method read from the state.

  ``round(state, data) -> (state, metrics)``, ``data`` a dict of ``frozen``, ``train``
  (:func:`round_step`'s ``arrays``), ``mask``, ``modality`` and, for FedMEKT and CreamFL,
  ``public`` (other keys are ignored). The traced :class:`Method` is ``state.method``
  (:func:`init` stores it), an input of the program, not a constant: rounds are compared
  and hashed by value, so methods with the same static switches (all but MOON, FedPer,
  MFCPL, FedMEKT and CreamFL) share one compile when the round is a static argument of
  ``jax.jit``.
  """

  spec: RcsrDef
  moon: bool = False
  fedper: bool = False
  mfcpl: bool = False
  mekt: bool = False
  cream: bool = False
  faults: faults_lib.Faults = faults_lib.NONE

  def __call__(self, state: RcsrState, data: dict[str, Any]) -> tuple[RcsrState, dict[str, Array]]:
    return round_step(
      self.spec,
      data["frozen"],
      state.method,
      state,
      data["train"],
      data["mask"],
      data["modality"],
      moon=self.moon,
      fedper=self.fedper,
      mfcpl=self.mfcpl,
      mekt=self.mekt,
      cream=self.cream,
      public=data.get("public"),
      faults=self.faults,
    )


def algorithm(
  spec: RcsrDef,
  name: str,
  meth: Method | None = None,
  *,
  faults: faults_lib.Faults = faults_lib.NONE,
) -> Algorithm:
  """Method ``name`` of :data:`METHODS` as an :class:`~fedjax_mm.algorithms.base.Algorithm`.

  Args:
    spec: static settings.
    name: the method; it sets the static switches of the round (:func:`round_flags`).
    meth: its traced switches and weights (default ``method(name)``).
    faults: static; the simulated client faults (module docstring, "Client faults").

  Returns:
    ``init(global_params, personal, frozen, arrays, sample_mask, modality, key, *,
    public=None) -> RcsrState``: :func:`init` with ``meth`` stored in ``state.method``;
    ``round(state, data) -> (state, metrics)``: :class:`RcsrRound`, which runs
    :func:`round_step` with the method of ``state.method``.
  """
  meth = method(name) if meth is None else meth

  def init_fn(global_params, personal, frozen, arrays, sample_mask, modality, key, *, public=None):
    return init(
      spec, global_params, personal, frozen, arrays, sample_mask, modality, key, meth, public=public
    )

  return Algorithm(init=init_fn, round=RcsrRound(spec, **round_flags(name), faults=faults))


def _client_reports(
  spec: RcsrDef,
  frozen: PyTree,
  meth: Method,
  prototypes: Array,
  clients: tuple[PyTree, PyTree, dict[str, Array], Array, Array],
  *,
  mfcpl: bool,
  mekt: bool,
  cream: bool,
  public: dict[str, Array] | None,
) -> dict[str, Any]:
  """What the ``[m]`` sampled clients report after training (one vmap over them).

  ``clients``: their trained ``(global params, personal, arrays, sample_mask, modality)``.
  Returns ``prototypes`` (eq. (6)'s ``[m, 2, d]``; the missing slot holds ``prototypes``,
  the server's EMA), with ``mfcpl`` MFCPL's ``classes`` (:func:`_class_report`), with
  ``mekt`` / ``cream`` the ``public`` set's embeddings ``[m, 2, P, d]`` (CreamFL's zero
  where the client does not hold the modality: it sends nothing for it).
  """

  def report(p, q, a, mk, md):
    z_i, z_t = client_embeddings(
      spec, frozen, p, q, a["image"], a["caption"][:, 0], meth.client_scale
    )
    out = {"prototypes": _reported(z_i, z_t, mk, md, prototypes)}
    if mfcpl:
      out["classes"] = _class_report(spec, z_i, z_t, a["label"], mk, md)
    if mekt or cream:
      out["public"] = jnp.stack(
        client_embeddings(spec, frozen, p, q, public["image"], public["caption"], meth.client_scale)
      )
    if cream:
      # A single-modality client sends nothing for the modality it does not hold.
      out["public"] = jnp.where(md[:, None, None], out["public"], 0.0)
    return out

  return jax.vmap(report)(*clients)


def _router_step(
  spec: RcsrDef,
  state: RcsrState,
  fill,
  gamma: Array,
  modality: Array,
  loss: Array,
  arrived: Array,
  routed: Array,
  placeholder_on: Array,
) -> tuple[tuple[PyTree, Array, PyTree], Array, Array]:
  """Lines 10-11: one Adam step of the router (and C.4's placeholder) on L_R.

  ``fill(placeholder)``: the sampled clients' ``s_k`` prototypes with the missing slot
  filled; ``gamma``, ``modality``, ``loss``, ``arrived``: theirs (``[m, ...]``). The step
  is kept where ``routed`` (the placeholder's also needs ``placeholder_on``); elsewhere
  the router, its optimiser and the placeholder stay as in ``state``.

  Returns:
    ``((router, placeholder, router_opt), L_R, w^R [m])``.
  """

  def router_objective(trained):
    # The placeholder reaches L_R through eq. (9)'s d_k (filled slots are masked out of
    # the attention and of L_pc); gamma_k uses its value at the start of the round.
    return S.router_loss(
      trained["router"],
      fill(trained["placeholder"]),
      gamma,
      modality,
      loss,
      arrived,
      state.prototypes,
      heads=spec.router_heads,
      betas=spec.betas,
      beta_4=spec.beta_4,
      beta_5=spec.beta_5,
    )

  trained = {"router": state.router, "placeholder": state.placeholder}
  (r_loss, w_router), r_grads = jax.value_and_grad(router_objective, has_aux=True)(trained)
  r_updates, r_opt = optax.adam(spec.router_lr).update(r_grads, state.router_opt, trained)
  stepped = optax.apply_updates(trained, r_updates)
  router = jax.tree.map(
    lambda new, old: jnp.where(routed, new, old), stepped["router"], state.router
  )
  placeholder = jnp.where(routed & placeholder_on, stepped["placeholder"], state.placeholder)
  router_opt = jax.tree.map(lambda new, old: jnp.where(routed, new, old), r_opt, state.router_opt)
  return (router, placeholder, router_opt), r_loss, w_router


def _byzantine_reports(
  reports: dict[str, Any], modality: Array, byzantine: Array, fault_key: Array, faults
) -> dict[str, Any]:
  """The reports the server receives from the round's ``[m]`` sampled clients.

  A Byzantine client's reported representations are corrupted
  (:func:`fedjax_mm.core.faults.corrupt_representations`, one corruption key each):
  its prototypes (``[2, d]``), MFCPL's class prototypes (``[2, C, d]``; the counts stay
  honest, like ``|D_k|``) and the public-set embeddings of FedMEKT / CreamFL
  (``[2, P, d]``), each in the modalities it holds only: a missing prototype slot holds
  the server's own EMA prototype, and nothing is sent for a missing modality.
  """
  held = lambda x: modality.reshape(modality.shape + (1,) * (x.ndim - 2))

  def corrupt(x, index):
    key = faults_lib.corruption_key(fault_key, index)
    bad = faults_lib.corrupt_representations(key, x, byzantine, faults)
    return jnp.where(held(x), bad, x)

  out = dict(reports)
  out["prototypes"] = corrupt(reports["prototypes"], 1)
  if "classes" in reports:
    class_protos, counts = reports["classes"]
    out["classes"] = (corrupt(class_protos, 2), counts)
  if "public" in reports:
    out["public"] = corrupt(reports["public"], 3)
  return out


def sent_bytes(global_params: PyTree) -> int:
  """Bytes of the shared adapters + heads (one client's model upload, or the broadcast)."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(global_params))


def traffic_bytes(
  name: str,
  global_params: PyTree,
  dim: int,
  *,
  held: int = 2,
  num_classes: int = 0,
  public_size: int = 0,
) -> tuple[int, int]:
  """``(up, down)`` bytes of one sampled client holding ``held`` modalities in one round.

  Up: the adapters + heads (none for FedPer, whose adapters + heads never leave the
  client; pFedMMA's client-specific adapters and RCSR-p's never do either), the
  prototype report ``[2, d]`` float32 (every method keeps the EMA prototypes that
  single-modality clients anchor to) and, for the router's methods, the rest of
  ``s_k``: ``gamma_k`` (4), ``m_k`` (2) and ``l_k`` (1) as float32. MFCPL adds its
  per-class prototypes and counts of each held modality (``held x C x (d + 1)``
  float32), FedMEKT and CreamFL their public-set representations of each held modality
  (``held x P x d`` float32). Down: the adapters + heads (none for FedPer), the EMA
  prototypes, and MFCPL's global class prototypes (``2 x C x d``), FedMEKT's averaged
  proxy embeddings or CreamFL's global representations (``2 x P x d``).
  """
  on = _SWITCHES[name]
  model = 0 if "fedper" in on else sent_bytes(global_params)
  protos = 2 * dim * 4
  stats = 7 * 4 if "router" in on else 0
  up, down = model + protos + stats, model + protos
  if "mfcpl" in on:
    up += held * num_classes * (dim + 1) * 4
    down += 2 * num_classes * dim * 4
  if "mekt" in on or "cream" in on:
    up += held * public_size * dim * 4
    down += 2 * public_size * dim * 4
  return up, down
