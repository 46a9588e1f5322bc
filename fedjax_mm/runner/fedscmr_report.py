"""FedSCMR's tables: the paper's Tables 1-4, the ranking, the aggregation weights, the report.

The end of a run of :mod:`fedjax_mm.runner.fedscmr` (:func:`report`: its
``report.md``, plots and ``results.json``) and the summary over seeds
(:func:`summarize`): Tables 1-2 (systems) and 3-4 (ablations) as mAP / NDCG
per client and ``N`` (:func:`tables`) under both test protocols
(:data:`PROTOCOLS`), each system's mean mAP ranked against chance
(:func:`ranking`), and FedSCMR's adaptive weights (:func:`weights_table`).
"""

from __future__ import annotations

import pathlib
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


def _cell(values: Sequence[float], *, signed: bool = False) -> str:
  fmt = "+.4f" if signed else ".4f"
  if len(values) == 1:
    return f"{values[0]:{fmt}}"
  return f"{np.mean(values):{fmt}} ± {np.std(values, ddof=1):.4f}"


def _value(result, key, method, client, metric, direction, n) -> float:
  cm = result[key][method][client]
  if direction == "average":
    return 0.5 * (cm[f"{metric}@{n}/img2txt"] + cm[f"{metric}@{n}/txt2img"])
  return cm[f"{metric}@{n}/{direction}"]


def _protocols(results: Sequence[Mapping[str, Any]]) -> list[str]:
  """The protocols every run holds, shared test first (runs older than it have only own)."""
  return [p for p, (key, _) in PROTOCOLS.items() if all(key in r for r in results)]


def tables(results: Sequence[Mapping[str, Any]], *, protocol: str = "own") -> dict[str, str]:
  """The paper's Tables 1-2 (systems) and 3-4 (ablations) from one or more runs.

  Rows: metric (mAP, NDCG) x task (Img2Txt, Txt2Img, Average) x system;
  columns: ``N`` x client. A cell is one run's value, or ``mean ± std`` (sample
  standard deviation) over several runs (seeds); ``Average`` is the mean of
  the two directions within each run. Systems missing from the runs are left
  out.

  Args:
    results: ``results.json`` contents of runs with the same clients and ``ns``.
    protocol: ``"own"`` (each client's own-class test pairs) or ``"global"``
      (the shared test set over every class); see :data:`PROTOCOLS`.

  Returns:
    ``{"main": table, "ablation": table}`` (markdown; an entry is absent when
    none of its systems ran).
  """
  key = PROTOCOLS[protocol][0]
  first = results[0]
  names, ns = first["clients"], first["ns"]
  headers = ["Metric", "Task", "Method"] + [f"N={n} {c}" for n in ns for c in names]
  out = {}
  for table, rows_of in (("main", MAIN_TABLE), ("ablation", ABLATION_TABLE)):
    present = [m for m in rows_of if all(m in r[key] for r in results)]
    if present in ([], ["fedscmr"]):
      continue
    rows = []
    for metric in ("mAP", "NDCG"):
      for direction, title in DIRECTIONS + (("average", "Average"),):
        for m in present:
          row = [metric, title, METHODS[m]]
          for n in ns:
            for c in names:
              row.append(_cell([_value(r, key, m, c, metric, direction, n) for r in results]))
          rows.append(row)
    out[table] = report_lib.format_table(headers, rows)
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


def ranking(
  results: Sequence[Mapping[str, Any]], *, protocol: str = "own", baseline: str = "dscmr"
) -> str:
  """One row per system: mAP and NDCG averaged over clients, ``N`` and directions.

  ``mean ± std`` over runs; systems sorted by mean average mAP, best first. The
  last column is the **paired** difference in mean mAP to ``baseline`` (each
  run minus the baseline of the same run, then mean ± std), which removes the
  run-to-run variation the systems share (same data, same initial models).
  When the runs hold it, a last row gives the chance level: a random ranking
  of the same test pairs (:func:`chance_level`).
  """
  key = PROTOCOLS[protocol][0]
  rows = []
  for m in METHODS:
    if not all(m in r[key] for r in results):
      continue
    maps = [_mean_over_cells(r, m, "mAP", key) for r in results]
    ndcgs = [_mean_over_cells(r, m, "NDCG", key) for r in results]
    row = [METHODS[m], _cell(maps), _cell(ndcgs)]
    if all(baseline in r[key] for r in results):
      diffs = [
        x - _mean_over_cells(r, baseline, "mAP", key) for x, r in zip(maps, results, strict=True)
      ]
      row.append(_cell(diffs, signed=True))
    rows.append((np.mean(maps), row))
  rows.sort(key=lambda x: -x[0])
  rows = [row for _, row in rows]
  headers = ["Method", "mean mAP@N", "mean NDCG@N"]
  if rows and len(rows[0]) == 4:
    headers.append(f"mAP - {METHODS[baseline]} (paired)")
  chance_key = {"own": "own_test", "global": "global_test"}[protocol]
  if rows and all(chance_key in r.get("chance", {}) for r in results):
    chance = [r["chance"][chance_key] for r in results]
    row = ["random ranking (chance)", _cell([c["mAP"] for c in chance])]
    row.append(_cell([c["NDCG"] for c in chance]))
    rows.append(row + [""] * (len(headers) - len(row)))
  return report_lib.format_table(headers, rows)


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
      row.append(_cell(values))
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
  sections = [("Setup", summary)]
  for protocol, (_, title) in PROTOCOLS.items():
    sections.append(
      (
        f"Ranking on the {title} (mean over clients, N and directions)",
        ranking([result], protocol=protocol),
      )
    )
  weights = weights_table([result])
  if weights:
    sections.append(
      ("Aggregation weights lambda (mean over the second half of the rounds)", weights)
    )
  for protocol, (_, title) in PROTOCOLS.items():
    t = tables([result], protocol=protocol)
    if "main" in t:
      sections.append(
        (
          f"Systems on the {title} (the paper's Tables 1-2, with FedAvg / FedProx (common))",
          t["main"],
        )
      )
    if "ablation" in t:
      sections.append((f"Ablations on the {title} (as the paper's Tables 3-4)", t["ablation"]))
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
    sections=[*sections, ("Curves", "\n\n".join(figures))],
    plots=plots,
    results=result,
    text="\n\n".join(f"{h}\n\n{b}" for h, b in sections),
  )


def summarize(workdirs: Sequence[str | pathlib.Path]) -> str:
  """Mean ± std over the ``results.json`` of several runs (seeds): rankings and tables.

  Rankings under both protocols (with the chance level), the mean aggregation
  weights, then Tables 1-4 under both protocols. The runs must share every config
  key but the seed (:func:`fedjax_mm.runner.report.load_seed_runs`).
  """
  results, _ = report_lib.load_seed_runs(workdirs)
  seeds = ", ".join(str(r.get("seed")) for r in results)
  parts = [f"{len(results)} runs (seeds {seeds}); cells are mean ± std over runs."]
  protocols = _protocols(results)
  for protocol in protocols:
    parts += [f"Ranking on the {PROTOCOLS[protocol][1]}:", ranking(results, protocol=protocol)]
  weights = weights_table(results)
  if weights:
    parts += ["Aggregation weights lambda (mean over the second half of the rounds):", weights]
  for protocol in protocols:
    t = tables(results, protocol=protocol)
    for k in ("main", "ablation"):
      if k in t:
        parts += [f"Tables ({k}) on the {PROTOCOLS[protocol][1]}:", t[k]]
  return "\n\n".join(parts)
