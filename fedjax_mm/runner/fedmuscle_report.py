"""FedMuscle's report: Table 1 (a column per method, Delta against local), bytes, FLOPs.

:func:`report` turns a run of :mod:`fedjax_mm.runner.fedmuscle` into its
``report.md`` sections, plots and ``results.json``: per user its model, task,
metric and one column per method beside the trivial baseline, each method's
Delta against local training (:func:`_delta`, users whose local metric is 0
left out), the bytes of every method's ledger, and the FLOPs table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from fedjax_mm import metrics
from fedjax_mm.core import ledger as ledger_lib
from fedjax_mm.runner import loop
from fedjax_mm.runner import report as report_lib
from fedjax_mm.runner.writers import metric_series

#: The report's names of the methods (FedMuscle's adds its loss).
LABELS = {
  "sage": "SAGE",
  "cofed": "CoFED",
  "feddf": "FedDF",
  "fedhenn": "FedHeNN",
  "fedrcl": "FedRCL",
  "simclr": "SimCLR (alone)",
  "pseudo_label": "Curriculum Labeling (alone)",
  "local": "local",
}


#: How the report's per-method ledger counts (see :func:`_baseline_bytes`).
BYTES_NOTE = (
  "FedMuscle: representations up, the partners' terms down (per CL batch). SAGE: the "
  "parameters a user averages within its task (its head; everything trained with an "
  "architecture partner) up and their average down, for users with a partner in their task. "
  "CoFED: int32 votes on the public set up (a class per head, -1 if not confident) and "
  "int32 pseudo-labels down. FedDF / FedRCL: "
  "trained parameters up and the fused ones down, for users that have a partner to average "
  "or distil with (the others send nothing). FedHeNN: one R x R kernel each way. SimCLR and "
  "Curriculum Labeling train each user alone: nothing."
)


def label(config, method: str) -> str:
  """A method's name in the report."""
  if method == "fedmuscle":
    return f"FedMuscle ({config.muscle.loss})"
  return LABELS.get(method, method)


def _delta(alg: Sequence[float], local: Sequence[float]) -> tuple[float, list[int]]:
  """Delta over the users whose local metric is nonzero, and the excluded users.

  A user whose locally trained model scores exactly 0 (e.g. a multi-label model
  that predicts no positive yet, micro-F1 = 0) has no relative gain; Delta is
  the mean over the others, and the report names the excluded users. With no
  user left Delta is NaN.
  """
  local = np.asarray(local, float)
  defined = local > 0
  if not defined.any():
    return math.nan, list(range(len(local)))
  value = metrics.delta(jnp.asarray(alg), jnp.asarray(local), where=jnp.asarray(defined))
  return float(value), [int(i) for i in np.flatnonzero(~defined)]


def _downlink_note(downlink: str) -> str:
  """What each user receives under the downlink that ran (the same loss either way)."""
  if downlink == "factored":
    return (
      "Downlink that ran: factored. Each user receives its M partners' own representations "
      "Z^m / tau and the pairwise terms -gamma Z^m Z^m'^T, from which its loss is computed "
      "exactly. The paper's server sends only the aggregate S^n and alpha^n (eq. 5): the "
      "factored downlink is far smaller but shows a user its partners' representations of "
      "the public batch, a privacy difference. The loss, and so training, is identical."
    )
  return (
    "Downlink that ran: paper. Each user receives the aggregated S^n (B^M x d) and alpha^n "
    "(B^M) of eq. 5, never a partner's own representations."
  )


def flops_table(config, methods, users, costs, deltas) -> str:
  """Per method: users' GFLOPs per round (sum and per user), the server's, and Delta."""
  giga = lambda x: f"{x / 1e9:.4g}"  # 4 significant digits: servers may do little
  rows = [
    [
      label(config, m),
      giga(sum(costs[m].users)),
      " / ".join(giga(x) for x in costs[m].users),
      giga(costs[m].server),
      report_lib.percent(deltas[m]) if m in deltas else "(reference)",
    ]
    for m in methods
  ]
  per_user = "per user (" + ", ".join(str(u.index + 1) for u in users) + ")"
  return report_lib.format_table(
    ["method", "users, GFLOPs/round", per_user, "server, GFLOPs/round", "Delta"], rows
  )


#: What the FLOPs table counts (fedjax_mm/algorithms/cost.py).
FLOPS_NOTE = (
  "XLA's cost analysis of each method's steps, compiled once at start-up on each user's "
  "model and multiplied by the steps a round runs (fedjax_mm/algorithms/cost.py): users' local "
  "steps, their CL steps (FedMuscle, SimCLR), unlabelled steps (SAGE) or public-set labelling "
  "(CoFED, Curriculum Labeling); the server's targets (FedMuscle), distillation (FedDF), "
  "kernel mean (FedHeNN), parameter averages (SAGE, FedDF, FedRCL), vote tally (CoFED). "
  "Transcendentals (exp, log) and evaluation are not counted."
)


def report(
  config,
  methods,
  users,
  groups,
  traffic,
  trivial,
  outcome: loop.Outcome,
  *,
  costs=None,
  data_note=None,
  probes=None,
) -> loop.Report:
  """Table 1 of the paper for this run: per user, every method vs local training, Delta, bytes.

  ``data_note`` (TFDS runs): the datasets and the examples each set got, in
  results.json ``"data"`` and a report section. ``probes`` (``config.probe.users``):
  ``{"initial": ..., "trivial": ...}``, the probed users' scores before training and
  without looking; each method's after the last round are in its evaluation.
  """
  final = {m: outcome.final[m]["users"] for m in methods}
  history = outcome.history
  fmt = report_lib.format_table
  others = [m for m in methods if m != "local"]
  single = len(others) == 1
  deltas = {m: _delta(final[m], final["local"])[0] for m in others}
  excluded = _delta(final[others[0]], final["local"])[1]  # depends on local training only
  rows = {
    label(config, m): {"users": [100 * final[m][u.index] for u in users], "delta": 100 * d}
    for m, d in [*deltas.items(), ("local", 0.0)]
  }
  metric_names = ", ".join(
    f"{u.name} {g.task.metric_name}" for u, g in zip(users, groups, strict=True)
  )
  sections_traffic, totals = None, None
  if "fedmuscle" in methods:
    ledger = outcome.ledgers["fedmuscle"]
    totals = {"up": int(ledger.total_up), "down": int(ledger.total_down)}
    mb = lambda n: ledger_lib.format_bytes(n)
    sections_traffic = fmt(
      ["per user and round", "bytes"],
      [
        ["up (Z^n)", mb(traffic["up"])],
        ["down, factored (Z^m/tau, -gamma G)", mb(traffic["down_factored"])],
        ["down, paper (S^n, alpha^n)", mb(traffic["down_paper"])],
        ["paper / factored", f"{traffic['down_paper'] / traffic['down_factored']:,.0f}x"],
        [
          f"all users, all rounds, up / down ({config.muscle.downlink})",
          f"{mb(totals['up'])} / {mb(totals['down'])}",
        ],
      ],
    )
  wall, start_round = outcome.wall_time_s, outcome.resumed_at
  counted = f"over {len(users) - len(excluded)} of {len(users)} users after {config.rounds} rounds"
  settings = f"(E={config.local_epochs}, d={config.rep_dim})"
  if "fedmuscle" in methods:
    settings = (
      f"(M={config.muscle.num_partners}, B={config.muscle.batch_size}, T={config.muscle.cl_epochs}, "
      f"E={config.local_epochs}, d={config.rep_dim}, loss={config.muscle.loss}, "
      f"downlink={config.muscle.downlink})"
    )
  if single:
    lead = f"Delta = {report_lib.percent(deltas[others[0]])}"
    if others[0] != "fedmuscle":
      lead = f"{label(config, others[0])}: {lead}"
  else:
    lead = "Delta = " + ", ".join(
      f"{report_lib.percent(deltas[m])} ({label(config, m)})" for m in others
    )
  summary = f"{lead} {counted} {settings}; wall time {wall:.0f} s" + (
    f" (resumed at round {start_round})" if start_round else ""
  )
  if excluded:
    names = ", ".join(users[i].name for i in excluded)
    summary += f". Left out of Delta: {names}, which scored 0 under local training"
  summary += f". Metrics (in %; trivial: majority class / every label present): {metric_names}"
  curve = lambda run, u: metric_series(
    history, f"{u.name}/{groups[u.index].task.metric_name}", run=run
  )
  series = {
    f"{u.name} ({u.encoder}/{u.task})": {
      ("FedMuscle" if m == "fedmuscle" else label(config, m)): curve(m, u) for m in methods
    }
    for u in users
  }
  result = {
    "methods": list(methods),
    "deltas": deltas,
    "delta_excluded_users": [users[i].name for i in excluded],
    **{m: final[m] for m in methods},
    "trivial": list(trivial),
    "rounds": config.rounds,
    "wall_time_s": wall,
  }
  if "fedmuscle" in methods:
    result |= {"delta": deltas["fedmuscle"], "traffic_per_round": traffic, "traffic_total": totals}
  baselines = {"trivial": {"users": [100 * t for t in trivial]}}
  if probes is not None:  # each probed user's representation: initial, then each method's
    result["probes"] = {
      "initial": probes["initial"],
      "trivial": probes["trivial"],
      **{m: outcome.final[m]["probes"] for m in methods},
    }
    for m in methods:
      rows[label(config, m)]["probes"] = outcome.final[m]["probes"]
    baselines |= {
      "initial model": {"probes": probes["initial"]},
      "trivial": baselines["trivial"] | {"probes": probes["trivial"]},
    }
  by_method = {
    m: {"up": int(outcome.ledgers[m].total_up), "down": int(outcome.ledgers[m].total_down)}
    for m in others
    if m in outcome.ledgers
  }
  if set(by_method) - {"fedmuscle"}:
    result["traffic_total_by_method"] = by_method
    bytes_table = report_lib.format_table(
      ["method", "all users, all rounds: up / down"],
      [
        [
          label(config, m),
          f"{ledger_lib.format_bytes(t['up'])} / {ledger_lib.format_bytes(t['down'])}",
        ]
        for m, t in by_method.items()
      ],
    )
  sections = []
  if data_note is not None:
    result["data"] = data_note
    data_rows = [
      [
        u.name,
        data_note["datasets"][u.task],
        data_note["train_sizes"][i],
        data_note["test_sizes"][i],
      ]
      for i, u in enumerate(users)
    ]
    data_rows.append(["public set", data_note["public"], data_note["public_size"], ""])
    sections.append(
      (
        f"Data (TFDS, data.limit={data_note['limit']}, images {data_note['image_size']} px)",
        fmt(["set", "dataset", "train examples", "test examples"], data_rows),
      )
    )
  if sections_traffic is not None:
    sections.append(
      ("Communication", sections_traffic + "\n\n" + _downlink_note(config.muscle.downlink))
    )
  if "traffic_total_by_method" in result:
    sections.append(("Communication of every method (ledgers)", bytes_table + "\n\n" + BYTES_NOTE))
  compute_table = None
  if costs is not None:
    result["flops_per_round"] = {m: costs[m].to_dict() for m in methods}
    compute_table = flops_table(config, methods, users, costs, deltas)
    sections.append(("Computation per round (FLOPs)", compute_table + "\n\n" + FLOPS_NOTE))
  title = (
    "FedMuscle vs local training"
    if list(methods) == ["fedmuscle", "local"]
    else (", ".join(label(config, m) for m in others) + " vs local training")
  )
  text = "\n\n".join(
    ([sections_traffic] if sections_traffic else [])
    + ([compute_table] if compute_table else [])
    + [summary]
  )
  return loop.Report(
    title=title,
    sections=[("Result", summary)],
    plots={
      "metrics.png": loop.Curves(series, "Test metric per round", "metric"),
      "delta.png": loop.Curves(
        {
          "Delta": {
            f"{label(config, m)} vs local": metric_series(history, "delta", run=m) for m in others
          }
        },
        "Delta per round",
        "Delta",
      ),
    },
    results=result,
    text=text,
    final=rows,
    baselines=baselines,
    tail=sections,
  )


def tables(config) -> list[report_lib.Table]:
  """Table 1 of the paper: a row per method, a column per user (its metric, %) and Delta
  against local training, beside the trivial predictor; over seeds FedMuscle minus every
  other method, paired by seed."""
  users = [f"user {i + 1} ({u['encoder']}/{u['task']})" for i, u in enumerate(config.users)]
  columns = [report_lib.Column(u, f"users.{i}", digits=2) for i, u in enumerate(users)]
  delta = report_lib.Column("Delta vs local (%)", "delta", signed=True)
  out = [
    report_lib.Table(
      "Per user (metric in %) and Delta against local training",
      [*columns, delta],
      headline="delta",
      label="method",
      baselines=("trivial",),
      reference=label(config, "fedmuscle"),
    )
  ]
  probed = [int(u) for u in config.get("probe", {}).get("users", ())]
  if probed:
    targets = tuple(config.probe.targets)
    out.append(
      report_lib.Table(
        f"Linear probes of the users' representations ({config.probe.train} labelled private "
        f"scenes, tested on {config.probe.test}; %), after the last round",
        [
          report_lib.Column(f"user {u} {t}", f"probes.user {u}.{t}", digits=1)
          for u in probed
          for t in targets
        ],
        label="method",
        baselines=("initial model", "trivial"),
        reference=label(config, "fedmuscle"),
      )
    )
  return out
