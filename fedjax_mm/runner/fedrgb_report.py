"""FedRGB's tables: retrieval (average and worst client, OOD), distortion, downstream tasks.

What a run of :mod:`fedjax_mm.runner.fedrgb` prints and writes, and its summary
over seeds (:func:`summarize`, FedRGB - FedAvg paired by seed): the retrieval
table's columns (:data:`COLUMNS`) and chance row, the distortion matrices
(:func:`distortion_tables`), downstream accuracy and segmentation Dice per
labelled fraction beside the trivial baselines and the initial model.
"""

from __future__ import annotations

import numpy as np

from fedjax_mm.runner import report as report_lib
from fedjax_mm.runner.report import format_table

#: Downstream classification tasks (the paper's RSNA and COVIDx): name -> (classes, label).
#: "binary": does the scene hold a circle (shape 0, one of the five attributes, as RSNA's
#: pneumonia is one of MIMIC's findings); "three_way": how many objects, 1, 2 or 3 (COVIDx's
#: three classes).
DOWNSTREAM = {
  "binary": (2, lambda w: (np.asarray(w["multilabel"])[:, 0] > 0).astype(np.int32)),
  "three_way": (3, lambda w: np.asarray(w["num_objects"], np.int32) - 1),
}

#: The report's columns: (group, metric) of ``results.json``'s ``methods.<m>``.
COLUMNS = (
  ("mean", "gallery_t2i_R@1"),
  ("worst", "gallery_t2i_R@1"),
  ("mean", "gallery_t2i_R@5"),  # the paper's Recall@5: a text's batch of images
  ("worst", "gallery_t2i_R@5"),
  ("mean", "i2t_R@1"),
  ("worst", "i2t_R@1"),
  ("mean", "t2i_R@1"),
  ("worst", "t2i_R@1"),
  ("mean", "i2t_R@5"),
  ("mean", "t2i_R@5"),
  ("ood", "i2t_R@1"),
  ("ood", "t2i_R@1"),
)


def column_labels(gallery: int) -> list[str]:
  label = {
    "gallery_t2i_R@1": f"T2I@1 (batch {gallery})",
    "gallery_t2i_R@5": f"T2I@5 (batch {gallery})",
    "i2t_R@1": "I2T@1",
    "t2i_R@1": "T2I@1",
    "i2t_R@5": "I2T@5",
    "t2i_R@5": "T2I@5",
  }
  return ["Method"] + [f"{label[n]} {g}" for g, n in COLUMNS]


def chance_row(chance: dict[str, float]) -> list[str]:
  return (
    ["chance"]
    + [f"{chance['gallery_R@1']:.1f}"] * 2
    + [f"{chance['gallery_R@5']:.1f}"] * 2
    + [f"{chance['R@1']:.1f}"] * 4
    + [f"{chance['R@5']:.1f}"] * 2
    + [f"{chance['ood_R@1']:.1f}"] * 2
  )


def fraction_label(f: float) -> str:
  """``0.01 -> "1%"``."""
  return f"{100 * f:g}%"


def distortion_tables(final, methods, k: int) -> tuple[str, list[str]]:
  """The summary table (one row per method and retraining) and each matrix as a table."""
  header = ["Method", "retrain", "off-diagonal", "diagonal", "all", "paired cos", "unpaired cos"]
  rows, matrices = [], []
  for m in methods:
    for retrain, d in final[m].get("distortion", {}).items():
      sm = d["summary"]
      rows.append(
        [m, retrain]
        + [f"{sm[n]:.4f}" for n in ("off_diagonal", "diagonal", "all")]
        + [f"{d['paired_cosine']:.3f}", f"{d['unpaired_cosine']:.3f}"]
      )
      mat = np.asarray(d["matrix"])
      body = [[f"Retrain on C{i + 1}"] + [f"{v:.4f}" for v in mat[i]] for i in range(k)]
      body.append(["Avg"] + [f"{v:.4f}" for v in mat.mean(0)])
      cols = [f"{m} ({retrain})"] + [f"Test on C{j + 1}" for j in range(k)]
      matrices.append(format_table(cols, body))
  if not rows:
    return "", []
  rows.append(["no retraining", "-", "0.0000", "0.0000", "0.0000", "-", "-"])
  return format_table(header, rows), matrices


def downstream_table(final, methods, initial, majority, fractions) -> str:
  """Accuracy (%) per method, task and labelled fraction, beside the majority class."""
  labels = [fraction_label(f) for f in fractions]
  cols = [(task, f) for task in DOWNSTREAM for f in labels]
  header = ["Method"] + [f"{task} {f}" for task, f in cols]
  rows = [
    [m] + [f"{final[m]['downstream'][t][f]:.1f}" for t, f in cols]
    for m in methods
    if "downstream" in final[m]
  ]
  if not rows:
    return ""
  rows.append(["initial model"] + [f"{initial[t][f]:.1f}" for t, f in cols])
  rows.append(["majority class"] + [f"{majority[t]:.1f}" for t, _ in cols])
  return format_table(header, rows)


def segmentation_table(final, methods, initial, all_positive, fractions) -> str:
  """Dice (%) per method and labelled fraction, beside the initial model and all-positive."""
  labels = [fraction_label(f) for f in fractions]
  rows = [
    [m] + [f"{final[m]['segmentation'][f]:.1f}" for f in labels]
    for m in methods
    if "segmentation" in final[m]
  ]
  rows.append(["initial model"] + [f"{initial[f]:.1f}" for f in labels])
  rows.append(["all positive"] + [f"{all_positive:.1f}" for _ in labels])
  return format_table(["Method"] + [f"Dice {f}" for f in labels], rows)


def _seed_table(runs, methods, labels, value, initial, trivial) -> str:
  """Per-column ``value(final)`` as mean ± std over runs; FedRGB minus each row, paired by
  run; then the initial model's ``initial(run)`` and the ``trivial`` row ``(name, per run)``."""
  cell = report_lib.seed_cell
  rows = [[m] + [cell([v(r["methods"][m]) for r in runs]) for v in value] for m in methods]
  if "fedrgb" in methods:
    rows += [
      [f"fedrgb - {o} (paired)"]
      + [cell([v(r["methods"]["fedrgb"]) - v(r["methods"][o]) for r in runs]) for v in value]
      for o in methods
      if o != "fedrgb"
    ]
  rows.append(["initial model"] + [cell([b(r) for r in runs]) for b in initial])
  name, per_run = trivial
  rows.append([name] + [cell([t(r) for r in runs]) for t in per_run])
  return format_table(["Method", *labels], rows)


def summarize(workdirs) -> str:
  """The report's tables as mean ± sample std over runs (seeds); FedRGB minus each row, paired.

  Retrieval for every row; downstream accuracy and segmentation Dice for the rows every run
  has them for (the global models), beside the initial model and the trivial score.

  ``python -m experiments.summarize runs/fedrgb_s*``: the runs must share
  every config key but the seed (same methods, clients and test sizes).
  """
  runs, configs = report_lib.load_seed_runs(workdirs)
  methods = list(runs[0]["methods"])

  cell = report_lib.seed_cell
  value = lambda r, m, g, n: r["methods"][m][g][n]
  rows = [[m] + [cell([value(r, m, g, n) for r in runs]) for g, n in COLUMNS] for m in methods]
  if "fedrgb" in methods:
    for other in (m for m in methods if m != "fedrgb"):
      rows.append(
        [f"fedrgb - {other} (paired)"]
        + [
          cell([value(r, "fedrgb", g, n) - value(r, other, g, n) for r in runs]) for g, n in COLUMNS
        ]
      )
  rows.append(chance_row(runs[0]["chance"]))
  seeds = ", ".join(str(c["seed"]) for c in configs)
  table = format_table(column_labels(int(configs[0]["gallery"])), rows)
  text = f"FedRGB, mean ± std over seeds {seeds} (R@K, %):\n{table}"
  # Downstream accuracy and segmentation Dice, where every run has them.
  down = [m for m in methods if all("downstream" in r["methods"][m] for r in runs)]
  if down:
    first = runs[0]["methods"][down[0]]["downstream"]
    cols = [(t, f) for t in first for f in first[t]]
    table = _seed_table(
      runs,
      down,
      [f"{t} {f}" for t, f in cols],
      [lambda o, t=t, f=f: o["downstream"][t][f] for t, f in cols],
      [lambda r, t=t, f=f: r["downstream_initial"][t][f] for t, f in cols],
      ("majority class", [lambda r, t=t: r["downstream_majority"][t] for t, _ in cols]),
    )
    text += f"\n\nDownstream accuracy (%), mean ± std over seeds {seeds}:\n{table}"
  seg = [m for m in methods if all("segmentation" in r["methods"][m] for r in runs)]
  if seg:
    fracs = list(runs[0]["methods"][seg[0]]["segmentation"])
    table = _seed_table(
      runs,
      seg,
      [f"Dice {f}" for f in fracs],
      [lambda o, f=f: o["segmentation"][f] for f in fracs],
      [lambda r, f=f: r["segmentation_initial"][f] for f in fracs],
      ("all positive", [lambda r: r["segmentation_all_positive"] for _ in fracs]),
    )
    text += f"\n\nSegmentation Dice (%), mean ± std over seeds {seeds}:\n{table}"
  return text
