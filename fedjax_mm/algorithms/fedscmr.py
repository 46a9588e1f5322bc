"""FedSCMR (Algorithm 1) and its baselines on one engine.

Li, Li and Shao (2024), "Federated learning for supervised cross-modal
retrieval". Every client holds labelled image-text feature pairs (training
pairs and a held-out validation part) and a
:class:`~fedjax_mm.models.scmr.ScmrModel`; one round is

1. local training of every client (``E`` epochs, ``jax.vmap`` over clients by
   :func:`fedjax_mm.core.train_group`) on its local loss: FedSCMR's eq. (8)
   (:func:`fedjax_mm.losses.fedscmr_loss`) or DSCMR's objective
   (:func:`fedjax_mm.losses.dscmr_loss`);
2. per client, what it reports to the server: its local loss ``l^k_t`` (mean
   over the round's steps) and its retrieval mAP ``v^k_t`` (mean of
   image-to-text and text-to-image mAP@N) on its *validation* pairs, never
   its training pairs: on those the mAP saturates near 1 and eq. (12) goes
   flat;
3. the server averages the federated layers with the system's weights
   (:mod:`fedjax_mm.server.fedscmr`) and sends the result back: the
   common-subspace layer only (eq. 9; path ``"common"``), every other layer
   (BaseNets, classifier, EnhanceNets) staying personal, or, for the
   paper's FedAvg / FedProx baselines ("DSCMR are trained on each client, and
   FedAvg (FedProx) is used for model aggregation", Section 5.3), the whole
   model.

:class:`ScmrConfig` picks the system:

=================  ==========  ======================================  ===========  ==========
system             loss        aggregation weights                     federated    paper
=================  ==========  ======================================  ===========  ==========
DSCMR              dscmr       none (local training)                   nothing      baseline
FedAvg             dscmr       ``n^k``                                 whole model  baseline
FedProx            dscmr       ``n^k``, proximal term ``mu``           whole model  baseline
FedAvg (common)    dscmr       ``n^k``                                 ``common``   --
FedProx (common)   dscmr       ``n^k``, proximal term ``mu``           ``common``   --
FedCMR             dscmr       FedCMR's code (below)                   ``common``   baseline
FedSCMR            fedscmr     eq. (13), ``gamma`` = 30                ``common``   the method
FedSCMR -L_cs      fedscmr     eq. (13), ``alpha`` = 0                 ``common``   Tables 3-4
FedSCMR -L_ccs     fedscmr     eq. (13), ``beta`` = 0                  ``common``   Tables 3-4
FedSCMR -Phi       fedscmr     eq. (13), ``gamma`` = 0                 ``common``   Tables 3-4
=================  ==========  ======================================  ===========  ==========

FedCMR runs its authors' code's round (github.com/hasakiXie123/FedCMR,
``train.py``): each round every client's training pairs are split at random
into 80% and 20% (``ScmrConfig.split``); ``E`` epochs on the 80% come before
aggregation, with the loss summed over those steps as ``L^k``; the server
aggregates the common layer with
:func:`~fedjax_mm.server.fedscmr.fedcmr_weights`; each client steps back from
the aggregate by half its own update of the round (``ScmrConfig.correction``,
:func:`~fedjax_mm.server.fedscmr.fedcmr_correction`); then ``E`` epochs on
the remaining 20%. The code splits lists of minibatches of 10 pairs; here the
pairs themselves are split.

FedProx's proximal term (``core.with_proximal_term``) covers all of a
client's parameters, centred on its parameters at the start of the round
(the global model under whole-model FedProx; with the common layer only, the
personal layers are also kept near their previous values).

Client faults (:mod:`fedjax_mm.core.faults`, off by default), drawn per round
among the clients with data: a **straggler** takes only its drawn share of
local steps (of each pass, for FedCMR); with aggregation, a **dropped**
client's round is lost (it keeps its start-of-round parameters, gets weight 0
-- the weights renormalise over the others -- receives nothing and, under
FedCMR, skips the pass after aggregation), and a **Byzantine** client sends a
corrupted update of the federated layers (``W^k - W^k_start`` replaced by
noise or scaled; its personal layers are never sent) and *reports the
values that maximise its own weight*: local loss 0 and validation mAP 1
(:func:`byzantine_reports`). Both maximise its softmax logit under eq. (13)
and FedCMR's rule (and lower the others' loss terms through the mean), so an
attacker that knows the weighting rule takes as much of the aggregate as the
rule allows: the adversarial case for adaptive weighting. ``n^k`` and ``c^k``
stay honest (the server is taken to know them from registration); FedAvg's
weights read nothing a client reports. DSCMR (no aggregation) only sees
stragglers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from fedjax_mm import losses, metrics, server
from fedjax_mm.algorithms.base import Algorithm, FederatedState
from fedjax_mm.core import faults as faults_lib
from fedjax_mm.core.client import ClientData, ClientState, GroupDef, train_group
from fedjax_mm.models.scmr import COMMON
from fedjax_mm.server import fedscmr as weights_lib

LOSSES = ("fedscmr", "dscmr")
AGGREGATIONS = ("none", "fedavg", "fedcmr", "fedscmr")
#: ``"common"``: the common-subspace layer only (eq. 9); ``"all"``: the whole model.
FEDERATED = ("common", "all")
#: Folded into a round's key for the split of local training (disjoint from faults.SALT).
SPLIT_SALT = 0x5B17


@dataclasses.dataclass(frozen=True)
class ScmrConfig:
  """Static hyperparameters of one system (hashable: jitted rounds close over it).

  Attributes:
    loss: ``"fedscmr"`` (eq. 8) or ``"dscmr"``.
    aggregation: ``"none"``, ``"fedavg"``, ``"fedcmr"`` or ``"fedscmr"``.
    num_classes: number of label classes ``c``.
    alpha: weight of ``L_cs`` (fedscmr) or of ``l_csd`` (dscmr).
    beta: weight of ``L_ccs`` (fedscmr) or of the invariance term (dscmr).
    gamma: weight of the mAP term in eq. (13).
    prox_mu: FedProx's proximal coefficient (0 = none).
    map_n: ``N`` of the per-round validation mAP ``v^k_t``.
    federated: which parameters the server averages, ``"common"`` or
      ``"all"`` (see :data:`FEDERATED`).
    split: fraction of each client's training pairs trained on before
      aggregation (drawn anew each round); the rest is trained on after it.
      1 (default): one pass over everything, before aggregation; FedCMR: 0.8.
    correction: after aggregation each client sets its federated layers to
      ``W - correction * (W^k - W^k_start)`` (FedCMR: 0.5; 0: none).
  """

  loss: str = "fedscmr"
  aggregation: str = "fedscmr"
  num_classes: int = 10
  alpha: float = 0.1
  beta: float = 0.1
  gamma: float = 30.0
  prox_mu: float = 0.0
  map_n: int = 50
  federated: str = "common"
  split: float = 1.0
  correction: float = 0.0

  def validate(self) -> None:
    """Raises ``ValueError`` with a one-line message for an impossible setting."""
    if self.loss not in LOSSES:
      raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}.")
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}.")
    if self.federated not in FEDERATED:
      raise ValueError(f"federated must be one of {FEDERATED}, got {self.federated!r}.")
    for name in ("alpha", "beta", "gamma", "prox_mu", "correction"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")
    if not 0 < self.split <= 1:
      raise ValueError(f"split must be in (0, 1], got {self.split}.")
    if self.map_n < 1:
      raise ValueError(f"map_n must be >= 1, got {self.map_n}.")
    if self.num_classes < 2:
      raise ValueError(f"num_classes must be >= 2, got {self.num_classes}.")

  @property
  def select(self):
    """Path predicate of the federated parameters (``None``: all of them)."""
    return None if self.federated == "all" else server.path_contains(COMMON)


def scmr_objective(config: ScmrConfig):
  """``objective_fn(group, shared)`` for :func:`fedjax_mm.core.train_group`.

  The batch holds ``image [b, d_img]``, ``text [b, d_txt]`` and ``label [b]``.
  """

  def objective_fn(group: GroupDef, shared):
    def objective(params, batch, batch_mask, key):
      del key  # The model is deterministic.
      out = group.merge(params, shared)(batch["image"], batch["text"])
      labels = jax.nn.one_hot(batch["label"], config.num_classes)
      if config.loss == "fedscmr":
        terms = losses.fedscmr_terms(
          out["s_img"],
          out["s_txt"],
          out["e_img"],
          out["e_txt"],
          out["p_img"],
          out["p_txt"],
          labels,
          where=batch_mask,
        )
        loss = config.alpha * terms["cs"] + config.beta * terms["ccs"] + terms["imd"]
        return loss, terms
      loss = losses.dscmr_loss(
        out["s_img"],
        out["s_txt"],
        out["p_img"],
        out["p_txt"],
        labels,
        alpha=config.alpha,
        beta=config.beta,
        where=batch_mask,
      )
      return loss, {}

    return objective

  return objective_fn


def embed_client(group: GroupDef, params, shared, arrays) -> tuple[jax.Array, jax.Array]:
  """``S`` features of ONE client's pairs: ``(S_V [n, d], S_T [n, d])``."""
  return group.merge(params, shared).embed(arrays["image"], arrays["text"])


def retrieval_map(group: GroupDef, params, shared, arrays, mask, *, n: int) -> jax.Array:
  """Mean of image-to-text and text-to-image mAP@N of ONE client on the pairs ``arrays``.

  The query set is one modality of the pairs and the database the other.
  """
  s_img, s_txt = embed_client(group, params, shared, arrays)
  labels = arrays["label"]
  kw = dict(n=n, query_where=mask, database_where=mask)
  i2t = metrics.map_at_n(s_img, s_txt, labels, labels, **kw)
  t2i = metrics.map_at_n(s_txt, s_img, labels, labels, **kw)
  return 0.5 * (i2t + t2i)


def split_samples(key: jax.Array, mask: jax.Array, fraction: float) -> tuple[jax.Array, jax.Array]:
  """ONE client's valid samples split at random into ``ceil(fraction * n)`` and the rest.

  Sample ``i``'s score is drawn from ``fold_in(key, i)``, so padding samples
  change nothing.

  Args:
    key: this client's key for the round.
    mask: ``bool [n]`` valid samples.
    fraction: share of the first part, in ``(0, 1]`` (static).

  Returns:
    ``(first, second)``: disjoint ``bool [n]`` masks whose union is ``mask``.
  """
  n = mask.shape[0]
  scores = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i)))(jnp.arange(n))
  rank = jnp.argsort(jnp.argsort(jnp.where(mask, scores, 2.0), stable=True), stable=True)
  # The tolerance keeps float32 rounding (0.8 * 360 = 288.00001) from adding a sample.
  count = jnp.ceil(fraction * jnp.sum(mask) - 1e-3)
  first = mask & (rank < count)
  return first, mask & ~first


def byzantine_reports(
  losses: jax.Array, maps: jax.Array, byzantine: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """What the clients report to the adaptive weights: Byzantine ones lie.

  A Byzantine client reports loss 0 and mAP 1, the values that maximise its
  weight under eq. (13) (``Psi`` and ``Phi`` both increase as its loss falls
  and its mAP rises, and a lower mean loss lowers the others' ``Psi``) and
  under FedCMR's rule. Honest clients report their own values.

  Args:
    losses: ``[K]`` honest local losses.
    maps: ``[K]`` honest validation mAPs.
    byzantine: ``bool [K]``.

  Returns:
    ``(losses, maps)`` as reported, ``[K]`` each.
  """
  return jnp.where(byzantine, 0.0, losses), jnp.where(byzantine, 1.0, maps)


def aggregation_weights(
  config: ScmrConfig,
  num_samples: jax.Array,
  categories: jax.Array,
  client_losses: jax.Array,
  maps: jax.Array,
  where: jax.Array,
) -> jax.Array:
  """``[K]`` weights of the configured aggregation (0 for clients outside ``where``).

  ``client_losses`` are what the rule reads: mean losses for eq. (13),
  losses summed over the round's steps for FedCMR's rule.
  """
  if config.aggregation == "fedscmr":
    return weights_lib.fedscmr_weights(
      num_samples, categories, client_losses, maps, gamma=config.gamma, where=where
    )
  if config.aggregation == "fedcmr":
    return weights_lib.fedcmr_weights(num_samples, categories, client_losses, where=where)
  counts = jnp.where(where, num_samples, 0).astype(jnp.float32)
  return counts / jnp.maximum(jnp.sum(counts), 1)


def _on_selected(select, fn, tree, *others):
  """``fn`` on the selected leaves of ``tree`` (and the matching leaves of ``others``)."""

  def one(path, x, *xs):
    return x if select is not None and not select(path) else fn(x, *xs)

  return jax.tree_util.tree_map_with_path(one, tree, *others)


def fedscmr(
  group: GroupDef,
  config: ScmrConfig,
  *,
  reset_optimizer: bool = True,
  faults: faults_lib.Faults = faults_lib.NONE,
) -> Algorithm:
  """One system of the table above as an :class:`Algorithm` over one client group.

  Args:
    group: the clients' static definition (an :class:`ScmrModel`).
    config: the system.
    reset_optimizer: re-initialise each client's optimizer state every round.
    faults: simulated client faults (default: none); with faults the stats
      gain ``fault_counts``.

  Returns:
    ``init(state, key) -> FederatedState`` and ``round(state, train, val) ->
    (state, stats)``, ``train`` and ``val`` the clients' training and
    validation :class:`~fedjax_mm.core.client.ClientData`. ``stats`` holds per
    client ``[K]``: ``loss`` (mean training loss before aggregation), ``map``
    (validation mAP ``v^k_t``) and ``weight`` (0 everywhere without
    aggregation).
  """
  config.validate()
  select = config.select
  objective_fn = scmr_objective(config)

  def init(client_state: ClientState, key: jax.Array) -> FederatedState:
    return FederatedState(round=jnp.zeros((), jnp.int32), rng=key, groups=(client_state,))

  def budget_of(masks, data):
    if masks is None:
      return None
    return faults_lib.step_budget(
      masks.work, data.num_samples, num_epochs=group.local_epochs, batch_size=group.batch_size
    )

  def round_fn(state: FederatedState, data: ClientData, val: ClientData):
    (client_state,) = state.groups
    if reset_optimizer:
      client_state = client_state.replace(opt_state=jax.vmap(group.tx.init)(client_state.params))
    where = data.client_mask & (data.num_samples > 0)
    start, masks = client_state.params, None
    round_key = jax.random.fold_in(state.rng, state.round)
    if faults.enabled:
      fault_key = jax.random.fold_in(round_key, faults_lib.SALT)
      masks = faults_lib.draw(fault_key, where, faults)
    before, after = data, None
    if config.split < 1:
      split_key = jax.random.fold_in(round_key, SPLIT_SALT)
      keys = jax.vmap(lambda k: jax.random.fold_in(split_key, k))(jnp.arange(data.num_clients))
      first, second = jax.vmap(split_samples, (0, 0, None))(keys, data.sample_mask, config.split)
      before, after = data.replace(sample_mask=first), data.replace(sample_mask=second)
    client_state, stats = train_group(
      group,
      client_state,
      before,
      objective_fn=objective_fn,
      prox_mu=config.prox_mu,
      max_steps=budget_of(masks, before),
    )
    maps = jax.vmap(functools.partial(retrieval_map, group, n=config.map_n), (0, None, 0, 0))(
      client_state.params, client_state.shared, val.arrays, val.sample_mask
    )
    categories = jax.vmap(
      functools.partial(weights_lib.num_categories, num_classes=config.num_classes)
    )(data.arrays["label"], data.sample_mask)
    weights = jnp.zeros(where.shape, jnp.float32)
    if config.aggregation != "none":
      trained = sent = client_state.params
      # FedCMR's rule reads the loss summed over the round's local steps.
      reported = stats["loss"] * stats["steps"] if config.aggregation == "fedcmr" else stats["loss"]
      reported_maps = maps
      if masks is not None:
        sent = faults_lib.send_updates(
          faults_lib.corruption_key(fault_key), start, sent, masks, faults, select=select
        )
        where = where & ~masks.dropped
        if faults.has_byzantine:
          reported, reported_maps = byzantine_reports(reported, maps, masks.byzantine)
      weights = aggregation_weights(
        config, data.num_samples, categories, reported, reported_maps, where
      )
      params, _ = server.fedavg(sent, weights, receive=where, select=select)
      if config.correction:
        params = _on_selected(
          select,
          functools.partial(weights_lib.fedcmr_correction, scale=config.correction, where=where),
          params,
          trained,
          start,
        )
      client_state = client_state.replace(params=params)
    if after is not None:
      # Dropped clients lost their round: they skip the pass after aggregation too.
      client_state, _ = train_group(
        group,
        client_state,
        after,
        objective_fn=objective_fn,
        prox_mu=config.prox_mu,
        active=where,
        max_steps=budget_of(masks, after),
      )
    out = {"loss": stats["loss"], "map": maps, "weight": weights}
    if masks is not None:
      out["fault_counts"] = masks.counts()
    return state.replace(round=state.round + 1, groups=(client_state,)), out

  return Algorithm(init=init, round=round_fn)


def evaluate_client(
  group: GroupDef, params, shared, arrays, mask, *, ns: tuple[int, ...]
) -> dict[str, jax.Array]:
  """mAP@N and NDCG@N, image-to-text and text-to-image, of ONE client on test pairs.

  The query set is one modality of the test pairs and the database the other
  modality of the same pairs; relevance is a shared label.

  Returns:
    ``{"mAP@N/img2txt", "mAP@N/txt2img", "NDCG@N/img2txt", ...}`` scalars for
    every ``N`` in ``ns``.
  """
  s_img, s_txt = embed_client(group, params, shared, arrays)
  labels = arrays["label"]
  out = {}
  for n in ns:
    for metric, fn in (("mAP", metrics.map_at_n), ("NDCG", metrics.ndcg_at_n)):
      kw = dict(n=n, query_where=mask, database_where=mask)
      out[f"{metric}@{n}/img2txt"] = fn(s_img, s_txt, labels, labels, **kw)
      out[f"{metric}@{n}/txt2img"] = fn(s_txt, s_img, labels, labels, **kw)
  return out


def evaluate_group(
  group: GroupDef, state: ClientState, data: ClientData, *, ns: tuple[int, ...]
) -> dict[str, jax.Array]:
  """:func:`evaluate_client` for every client: ``{name: [K]}``."""
  fn = functools.partial(evaluate_client, group, ns=ns)
  return jax.vmap(fn, (0, None, 0, 0))(state.params, state.shared, data.arrays, data.sample_mask)


def evaluate_shared(
  group: GroupDef, state: ClientState, arrays, mask, *, ns: tuple[int, ...]
) -> dict[str, jax.Array]:
  """:func:`evaluate_client` of every client on ONE test set (``arrays`` ``[n, ...]``): ``{name: [K]}``."""
  fn = functools.partial(evaluate_client, group, ns=ns)
  return jax.vmap(fn, (0, None, None, None))(state.params, state.shared, arrays, mask)
