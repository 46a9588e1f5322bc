r"""CreamFL's Table 1 distillation baselines on CreamFL's engine: FedMD, FedET, FedGEMS.

Paper: ``creamfl.txt`` (Yu et al., 2023), Section 4.1 "Baselines": "All
uni-modal algorithms are extended to multimodal scenarios by operating on each
modality separately, e.g., FedGEMS performs per-modality local distillation and
entropy-based selective aggregation. [...] For FedMD, we add the same large
server model as CreamFL for comparing the server performance, keeping its
averaging aggregation and local distillation unchanged." Section 4.3 / Fig. 4:
these baselines "transmit representations on public data and have the same
communication cost with CreamFL".

Each row below is a :class:`fedjax_mm.algorithms.creamfl.Variant` of
:func:`fedjax_mm.algorithms.creamfl.creamfl`'s round, so it runs with the
same clients, data, seeds, server initialisation and compiled round as the
CreamFL rows; per round and modality the clients send their ``[P, d]``
public representations and receive the server's ``I_glob``, ``T_glob``
(CreamFL's bytes, counted in each row's ledger). What changes, per method:

* step 4, the clients' regulariser: ``regulariser="kd"``, **local
  distillation**: every local step adds ``gamma`` (``lcr_weight``, the
  weight of CreamFL's regulariser) times the l2 distance (eq. (7)'s) between
  the client's representation of a public minibatch and the server's global
  representation of the same samples in the same modality, instead of LCR's
  contrast. The target is the server's representation: it is what reaches the
  clients in this engine, and it has just been distilled from the previous
  round's aggregate (the consensus) and trained on the public set.
* step 6, the aggregation of the clients' representations per modality.
* step 7: the server distils its large model into the aggregate (eq. (7)),
  FedET adding its diversity regulariser.

**FedMD** (Li & Wang, "FedMD: Heterogenous Federated Learning via Model
Distillation", NeurIPS 2019 workshop, arXiv 1910.03581): the consensus is the
plain mean of the clients' outputs on the public set ("averaging
aggregation"), and each client "digests" the consensus on the public set and
then "revisits" its private data. Here: aggregation ``"mean"`` (uniform over the
clients present, reamFL+Mean's) and ``regulariser="kd"``. **FedMD differs from
reamFL+Mean ONLY in the clients' local distillation**; and from FedMD itself
in that (a) the digest and revisit steps are one objective per local step
(private loss + ``gamma`` x distillation, as CreamFL's eq. (3) takes LCR), (b)
the clients distil toward the server's representation (the consensus as the
large server has learnt it, per Section 4.1's added server) rather than toward
the raw mean, and (c) the outputs are representations, not class scores.

**FedET** (Cho et al., "Heterogeneous Ensemble Knowledge Transfer for Training
Large Models in Federated Learning", IJCAI 2022, arXiv 2204.12703): a large
server model distilled from the clients' ensemble, weighted by confidence (the
variance of each client's output) among the clients agreeing with the
majority vote, a diversity regulariser that distils the clients outside the
consensus into the server too, and server-to-client transfer. Here: aggregation
``"fedet"`` (:func:`fedjax_mm.server.kd_aggregate.fedet`: the output of a client
on sample ``k`` is its softmax over the public set of similarities to the
server's other modality, GCA's eq. (4) scores), the same local distillation,
and ``diversity=True``: the server's distillation adds
``CreamConfig.fedet_diversity_weight`` (``lambda = 0.05``) times the KL from the
softmax of the non-majority clients' variance-weighted ensemble to the
server's own softmax over the same public set
(:func:`fedjax_mm.server.kd_aggregate.fedet_with_diversity`,
:func:`fedjax_mm.losses.fedet_diversity`; the source of the term's form and of
``lambda``, and what was adapted, are in :mod:`fedjax_mm.server.kd_aggregate`).

**FedGEMS** (Cheng et al., "FedGEMS: Federated Learning of Larger Server Models
via Selective Knowledge Fusion", arXiv 2110.11027, 2021): the server keeps its
own knowledge where it is right and fuses the correct clients' outputs,
weighted by low entropy, where it is wrong; per-modality local distillation
from the server. Here: aggregation ``"fedgems"``
(:func:`fedjax_mm.server.kd_aggregate.fedgems`: "right" = retrieves the
sample's pair among the other modality's global representations; the entropy
of the same softmax) and the same local distillation.

**FedAvg / FedIoT** (Table 1's "model homogeneous" rows: parameter averaging of
client models the size of the server, public data handed to the multimodal
clients, FedIoT weighting multimodal clients 100x) send parameters, not
representations, and have their own round:
:mod:`fedjax_mm.algorithms.creamfl_fedavg` (reamFL+Avg / reamFL+IoT are their
representation-distillation versions).
"""

from __future__ import annotations

from typing import Any

#: The rows, as keyword arguments of :func:`fedjax_mm.algorithms.creamfl.variant`.
BASELINES: dict[str, dict[str, Any]] = {
  "FedMD": dict(aggregation="mean", regulariser="kd"),
  "FedET": dict(aggregation="fedet", regulariser="kd", diversity=True),
  "FedGEMS": dict(aggregation="fedgems", regulariser="kd"),
}
