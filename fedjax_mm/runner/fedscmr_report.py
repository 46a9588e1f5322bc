"""FedSCMR's tables: the paper's Tables 1-4, the ranking, the aggregation weights, the report.

The end of a run of :mod:`fedjax_mm.runner.fedscmr` (:func:`report`: its
``report.md``, plots and ``results.json``) and the summary over seeds
(:func:`summarize`): Tables 1-2 (systems) and 3-4 (ablations) as mAP / NDCG
per client and ``N`` (:func:`tables`) under both test protocols
(:data:`PROTOCOLS`), each system's mean mAP ranked against chance
(:func:`ranking`), and FedSCMR's adaptive weights (:func:`weights_table`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedjax_mm.runner import loop
from fedjax_mm.runner import report as report_lib

#: System id -> name in the tables.
METHODS: dict[str, str] = {
  "dscmr": "DSCMR",
  "fedavg": "FedAvg",
  "fedprox": "FedProx",
  "fedavg_common": "FedAvg (common)",
  "fedprox_common": "FedProx (common)",
  "fedcmr": "FedCMR",
  "fedscmr": "FedSCMR",
  "fedscmr_no_lcs": "FedSCMR -L_cs",
  "fedscmr_no_lccs": "FedSCMR -L_ccs",
  "fedscmr_no_phi": "FedSCMR -Phi",
}


#: Rows of the paper's Tables 1-2 (with two of ours: FedAvg / FedProx of the common layer
#: only) and 3-4.
MAIN_TABLE = ("dscmr", "fedavg", "fedprox", "fedavg_common", "fedprox_common", "fedcmr", "fedscmr")


ABLATION_TABLE = ("fedscmr_no_lcs", "fedscmr_no_lccs", "fedscmr_no_phi", "fedscmr")


DIRECTIONS = (("img2txt", "Img2Txt"), ("txt2img", "Txt2Img"))


#: Test protocols: results.json key of the per-client metrics, and the name in the report.
PROTOCOLS = {
  "global": ("methods_global", "shared test (all classes)"),
  "own": ("methods", "own-class test"),
}


def _headline(client_metrics: Mapping[str, Mapping[str, float]], n: int) -> float:
  """Mean over clients and both directions of mAP@n."""
  return float(
    np.mean(
      [m[f"mAP@{n}/{d}"] for m in client_metrics.values() for d, _ in DIRECTIONS],
    )
  )


def tables(config) -> list[report_lib.Table]:
  """The result tables under both protocols: each system's mean mAP and NDCG ranked against
  chance (over seeds FedSCMR minus FedAvg and DSCMR, paired by seed), then the paper's
  Tables 1-2 (systems) and 3-4 (ablations): mAP / NDCG per task, ``N`` and client."""
  names, ns = [c["name"] for c in config.clients], [int(n) for n in config.ns]
  column, out = report_lib.Column, []
  cells = [column(f"N={n} {c}", f"{n}.{c}", digits=4) for n in ns for c in names]
  for protocol, (_, title) in PROTOCOLS.items():
    out.append(
      report_lib.Table(
        f"Ranking on the {title} (mean over clients, N and directions)",
        [
          column("mean mAP@N", f"{protocol}.mAP", digits=4),
          column("mean NDCG@N", f"{protocol}.NDCG", digits=4),
          column("mAP - DSCMR (paired)", f"{protocol}.vs_dscmr", digits=4, signed=True),
        ],
        baselines=("random ranking (chance)",),
        reference="FedSCMR",
        against=("FedAvg", "DSCMR"),
        sort=True,
      )
    )
  for protocol, (_, title) in PROTOCOLS.items():
    groups = [
      ((metric, task), f"{protocol}.{metric}/{direction}.")
      for metric in ("mAP", "NDCG")
      for direction, task in (*DIRECTIONS, ("average", "Average"))
    ]
    for rows, heading in (
      (
        MAIN_TABLE,
        f"Systems on the {title} (the paper's Tables 1-2, with FedAvg / FedProx (common))",
      ),
      (ABLATION_TABLE, f"Ablations on the {title} (as the paper's Tables 3-4)"),
    ):
      out.append(
        report_lib.Table(
          heading,
          cells,
          baselines=(),
          methods=[METHODS[m] for m in rows],
          groups=groups,
          group_headers=("Metric", "Task"),
          min_rows=2,
        )
      )
  return out


def _final(result) -> dict[str, dict]:
  """The tables' values (:attr:`fedjax_mm.runner.loop.Report.final`): per system and
  protocol the means, the paired difference to DSCMR, and each cell (``Average``: the mean
  of the two directions)."""
  out = {}
  for m in result["methods"]:
    out[METHODS[m]] = row = {}
    for protocol, (key, _) in PROTOCOLS.items():
      row[protocol] = block = {x: _mean_over_cells(result, m, x, key) for x in ("mAP", "NDCG")}
      if "dscmr" in result[key]:
        block["vs_dscmr"] = block["mAP"] - _mean_over_cells(result, "dscmr", "mAP", key)
      for metric in ("mAP", "NDCG"):
        for d, _ in (*DIRECTIONS, ("average", "")):
          block[f"{metric}/{d}"] = {
            str(n): {
              c: 0.5 * sum(cm[f"{metric}@{n}/{x}"] for x, _ in DIRECTIONS)
              if d == "average"
              else cm[f"{metric}@{n}/{d}"]
              for c, cm in result[key][m].items()
            }
            for n in result["ns"]
          }
  return out


def _mean_over_cells(result, method, metric, key: str = "methods") -> float:
  return float(
    np.mean(
      [
        result[key][method][c][f"{metric}@{n}/{d}"]
        for c in result["clients"]
        for n in result["ns"]
        for d, _ in DIRECTIONS
      ]
    )
  )


def weights_table(results: Sequence[Mapping[str, Any]], *, last: int | None = None) -> str:
  """Mean aggregation weight ``lambda^k`` of each client over the last rounds, per system.

  ``last`` rounds (default: the second half of the run) are averaged within
  each run, then ``mean ± std`` over runs. A flat row (every client near
  ``1 / K``) means the rule did not tell the clients apart; the data shares
  ``n^k / sum_j n^j`` (FedAvg's weights) are the reference. Empty string when
  no run recorded weights.
  """
  if not all("weights" in r for r in results):
    return ""
  names = results[0]["clients"]
  rows = []
  for m in METHODS:
    if not all(m in r["weights"] for r in results):
      continue
    row = [METHODS[m]]
    for c in names:
      values = []
      for r in results:
        series = r["weights"][m][c]
        k = last or max(1, len(series) // 2)
        values.append(float(np.mean(series[-k:])))
      row.append(f"{np.mean(values):.4f}")
    rows.append(row)
  if not rows:
    return ""
  return report_lib.format_table(["Method"] + [f"lambda {c}" for c in names], rows)


def _history(outcome: loop.Outcome, names, prefix: str, key: str) -> dict[str, dict[str, list]]:
  """method -> client -> ``[(round, value)]`` of ``{client}/{prefix}{key}``."""
  out = {m: {name: [] for name in names} for m in outcome.final}
  for record in sorted(outcome.history, key=lambda r: r["round"]):
    for name in names:
      value = record.get(f"{name}/{prefix}{key}")
      if value is not None and record["run"] in out:
        out[record["run"]][name].append((record["round"], float(value)))
  return out


def _mean_map_history(outcome, names, n, prefix):
  """method -> client -> ``[(round, mean of both directions' mAP@n)]``."""
  per_dir = [_history(outcome, names, prefix, f"mAP@{n}/{d}") for d, _ in DIRECTIONS]
  return {
    m: {
      name: [
        (r, 0.5 * (a + b)) for (r, a), (_, b) in zip(*(h[m][name] for h in per_dir), strict=True)
      ]
      for name in names
    }
    for m in outcome.final
  }


def _summary(result, key: str) -> dict[str, dict[str, float]]:
  """method -> ``{"mAP", "NDCG"}`` means over clients, ``N`` and directions."""
  return {
    m: {metric: _mean_over_cells(result, m, metric, key) for metric in ("mAP", "NDCG")}
    for m in result[key]
  }


def report(
  config, names, classes, ns, chance, outcome: loop.Outcome, aggregates: Sequence[str] = ()
) -> loop.Report:
  """Rankings and the paper's Tables 1-4 under both protocols, curves, ``results.json``.

  ``aggregates``: the methods that aggregate (whose weights the report plots).

  The per-round aggregation weights and validation mAPs come from the run's
  ``metrics.jsonl`` lines, so a run resumed after its last round reports them too.
  """
  n = ns[-1]
  aggregating = [m for m in outcome.final if m in aggregates]
  weight_history = _history(outcome, names, "", "weight")
  val_history = _history(outcome, names, "", "val_map")
  result = {
    "clients": names,
    "classes": {name: [int(c) for c in cs] for name, cs in zip(names, classes, strict=True)},
    "methods": {m: e["own"] for m, e in outcome.final.items()},
    "methods_global": {m: e["global"] for m, e in outcome.final.items()},
    "ns": list(ns),
  }
  result |= {
    "global_test": _summary(result, "methods_global"),
    "own_test": _summary(result, "methods"),
    "chance": chance,
    "weights": {m: {c: [w for _, w in weight_history[m][c]] for c in names} for m in aggregating},
    "last_weights": {m: [weight_history[m][c][-1][1] for c in names] for m in aggregating},
    "val_map": {m: {c: [v for _, v in val_history[m][c]] for c in names} for m in outcome.final},
    "sizes": {
      "train": [int(c["train_size"]) for c in config.clients],
      "val": int(config.val_size),
      "test": int(config.test_size),
      "global_test": int(config.global_test_size),
    },
    "rounds": config.rounds,
    "seed": config.seed,
    "wall_time_s": outcome.wall_time_s,
  }
  counts = ", ".join(f"{name}: {len(result['classes'][name])}" for name in names)
  summary = (
    f"{len(names)} clients (classes {counts}; train sizes "
    f"{', '.join(str(c['train_size']) for c in config.clients)}; {config.val_size} validation "
    f"and {config.test_size} own-class test pairs each; a shared test set of "
    f"{config.global_test_size} pairs over every class) after {config.rounds} rounds of "
    f"E={config.local_epochs} local epochs; seed {config.seed}; wall time "
    f"{outcome.wall_time_s:.0f} s"
    + (f" (resumed at round {outcome.resumed_at})" if outcome.resumed_at else "")
  )
  weights = weights_table([result])
  tail = (
    []
    if not weights
    else [("Aggregation weights lambda (mean over the second half of the rounds)", weights)]
  )
  plots = {}
  for file, prefix, title in (
    ("global.png", "global/", "shared test set, all classes"),
    ("metrics.png", "", "own-class test"),
  ):
    history = _mean_map_history(outcome, names, n, prefix)
    series = {f"client {c}": {METHODS[m]: history[m][c] for m in history} for c in names}
    plots[file] = loop.Curves(
      series, f"Test mAP@{n} per round ({title}; mean of img2txt and txt2img)", f"mAP@{n}"
    )
  figures = ["![mAP on the shared test set](global.png)", "![mAP per own-class test](metrics.png)"]
  if aggregating:
    series = {METHODS[m]: {f"client {c}": weight_history[m][c] for c in names} for m in aggregating}
    plots["lambda.png"] = loop.Curves(series, "Aggregation weight lambda^k per round", "lambda")
    figures.append("![aggregation weights](lambda.png)")
  return loop.Report(
    title="FedSCMR and its baselines",
    sections=[("Setup", summary)],
    plots=plots,
    results=result,
    text="\n\n".join([summary] + [f"{h}\n\n{b}" for h, b in tail]),
    final=_final(result),
    baselines={
      "random ranking (chance)": {"global": chance["global_test"], "own": chance["own_test"]}
    },
    tail=[*tail, ("Curves", "\n\n".join(figures))],
  )
