"""FedSCMR (Algorithm 1) and its baselines on one engine.

Li, Li and Shao (2024), "Federated learning for supervised cross-modal
retrieval". Every client holds labelled image-text feature pairs and a
:class:`~fedjax_mm.models.scmr.ScmrModel`; one round is

1. local training of every client (``E`` epochs, ``jax.vmap`` over clients by
   :func:`fedjax_mm.core.train_group`) on its local loss: FedSCMR's eq. (8)
   (:func:`fedjax_mm.losses.fedscmr_loss`) or DSCMR's objective
   (:func:`fedjax_mm.losses.dscmr_loss`);
2. per client, its mean training loss ``l^k_t`` and its retrieval mAP
   ``v^k_t`` on its own training pairs (mean of image-to-text and
   text-to-image mAP@N), the inputs of eqs. (11)-(12);
3. the server averages the common-subspace layer only (eq. 9; path
   ``"common"``) with weights from :mod:`fedjax_mm.server.fedscmr` and sends
   it back; every other layer (BaseNets, classifier, EnhanceNets) stays
   personal.

:class:`ScmrConfig` picks the system:

=================  ==========  =================================  ==============
system             loss        aggregation weights                paper
=================  ==========  =================================  ==============
DSCMR              dscmr       none (local training)              baseline
FedAvg             dscmr       ``n^k``                            baseline
FedProx            dscmr       ``n^k``, proximal term ``mu``      baseline
FedCMR             dscmr       data share + loss term             baseline
FedSCMR            fedscmr     eq. (13), ``gamma`` = 30           the method
FedSCMR -L_cs      fedscmr     eq. (13), ``alpha`` = 0            Tables 3-4
FedSCMR -L_ccs     fedscmr     eq. (13), ``beta`` = 0             Tables 3-4
FedSCMR -Phi       fedscmr     eq. (13), ``gamma`` = 0            Tables 3-4
=================  ==========  =================================  ==============

FedProx's proximal term (``core.with_proximal_term``) covers all of a
client's parameters, centred on its parameters at the start of the round
(the personal layers are thereby also kept near their previous values).

Client faults (:mod:`fedjax_mm.core.faults`, off by default), drawn per round
among the clients with data: a **straggler** takes only its drawn share of
local steps; with aggregation, a **dropped** client's round is lost (it keeps
its start-of-round parameters, gets weight 0 — eq. (13)'s softmax renormalises
over the others — and receives nothing), and a **Byzantine** client sends a
corrupted common-layer update (``W^k - W^k_start`` replaced by noise or
scaled) into the adaptive aggregation; its personal layers are never sent.
DSCMR (no aggregation) only sees stragglers.
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
    map_n: ``N`` of the per-round training mAP ``v^k_t``.
    shared: path components of the federated layers.
  """

  loss: str = "fedscmr"
  aggregation: str = "fedscmr"
  num_classes: int = 10
  alpha: float = 0.1
  beta: float = 0.1
  gamma: float = 30.0
  prox_mu: float = 0.0
  map_n: int = 50
  shared: tuple[str, ...] = (COMMON,)

  def validate(self) -> None:
    """Raises ``ValueError`` with a one-line message for an impossible setting."""
    if self.loss not in LOSSES:
      raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}.")
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}.")
    for name in ("alpha", "beta", "gamma", "prox_mu"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")
    if self.map_n < 1:
      raise ValueError(f"map_n must be >= 1, got {self.map_n}.")
    if self.num_classes < 2:
      raise ValueError(f"num_classes must be >= 2, got {self.num_classes}.")


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
  """Mean of image-to-text and text-to-image mAP@N of ONE client on its own pairs."""
  s_img, s_txt = embed_client(group, params, shared, arrays)
  labels = arrays["label"]
  kw = dict(n=n, query_where=mask, database_where=mask)
  i2t = metrics.map_at_n(s_img, s_txt, labels, labels, **kw)
  t2i = metrics.map_at_n(s_txt, s_img, labels, labels, **kw)
  return 0.5 * (i2t + t2i)


def aggregation_weights(
  config: ScmrConfig,
  num_samples: jax.Array,
  categories: jax.Array,
  client_losses: jax.Array,
  maps: jax.Array,
  where: jax.Array,
) -> jax.Array:
  """``[K]`` weights of the configured aggregation (0 for clients outside ``where``)."""
  if config.aggregation == "fedscmr":
    return weights_lib.fedscmr_weights(
      num_samples, categories, client_losses, maps, gamma=config.gamma, where=where
    )
  if config.aggregation == "fedcmr":
    return weights_lib.fedcmr_weights(num_samples, categories, client_losses, where=where)
  counts = jnp.where(where, num_samples, 0).astype(jnp.float32)
  return counts / jnp.maximum(jnp.sum(counts), 1)


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
    ``init(state, key) -> FederatedState`` and ``round(state, data) -> (state,
    stats)`` with per-client ``loss``, ``map``, ``weight`` ``[K]`` (``weight``
    is 0 everywhere without aggregation).
  """
  config.validate()
  select = server.path_contains(*config.shared)
  objective_fn = scmr_objective(config)

  def init(client_state: ClientState, key: jax.Array) -> FederatedState:
    return FederatedState(round=jnp.zeros((), jnp.int32), rng=key, groups=(client_state,))

  def round_fn(state: FederatedState, data: ClientData):
    (client_state,) = state.groups
    if reset_optimizer:
      client_state = client_state.replace(opt_state=jax.vmap(group.tx.init)(client_state.params))
    where = data.client_mask & (data.num_samples > 0)
    start, masks, budget = client_state.params, None, None
    if faults.enabled:
      fault_key = jax.random.fold_in(jax.random.fold_in(state.rng, state.round), faults_lib.SALT)
      masks = faults_lib.draw(fault_key, where, faults)
      budget = faults_lib.step_budget(
        masks.work, data.num_samples, num_epochs=group.local_epochs, batch_size=group.batch_size
      )
    client_state, stats = train_group(
      group,
      client_state,
      data,
      objective_fn=objective_fn,
      prox_mu=config.prox_mu,
      max_steps=budget,
    )
    maps = jax.vmap(functools.partial(retrieval_map, group, n=config.map_n), (0, None, 0, 0))(
      client_state.params, client_state.shared, data.arrays, data.sample_mask
    )
    categories = jax.vmap(
      functools.partial(weights_lib.num_categories, num_classes=config.num_classes)
    )(data.arrays["label"], data.sample_mask)
    weights = jnp.zeros(where.shape, jnp.float32)
    if config.aggregation != "none":
      sent = client_state.params
      if masks is not None:
        sent = faults_lib.send_updates(
          faults_lib.corruption_key(fault_key), start, sent, masks, faults, select=select
        )
        where = where & ~masks.dropped
      weights = aggregation_weights(
        config, data.num_samples, categories, stats["loss"], maps, where
      )
      params, _ = server.fedavg(sent, weights, receive=where, select=select)
      client_state = client_state.replace(params=params)
    out = {"loss": stats["loss"], "map": maps, "weight": weights}
    if masks is not None:
      out["fault_counts"] = masks.counts()
    return state.replace(round=state.round + 1, groups=(client_state,)), out

  return Algorithm(init=init, round=round_fn)


def evaluate_client(
  group: GroupDef, params, shared, arrays, mask, *, ns: tuple[int, ...]
) -> dict[str, jax.Array]:
  """mAP@N and NDCG@N, image-to-text and text-to-image, of ONE client on its test pairs.

  The query set is one modality of the client's test pairs and the database
  the other modality of the same pairs; relevance is a shared label.

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
