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

#: The retrieval table's columns: (group, metric) of ``results.json``'s ``methods.<m>``,
#: and the chance level each is compared with.
COLUMNS = (
  ("mean", "gallery_t2i_R@1", "gallery_R@1"),
  ("worst", "gallery_t2i_R@1", "gallery_R@1"),
  ("mean", "gallery_t2i_R@5", "gallery_R@5"),  # the paper's Recall@5: a text's batch of images
  ("worst", "gallery_t2i_R@5", "gallery_R@5"),
  ("mean", "i2t_R@1", "R@1"),
  ("worst", "i2t_R@1", "R@1"),
  ("mean", "t2i_R@1", "R@1"),
  ("worst", "t2i_R@1", "R@1"),
  ("mean", "i2t_R@5", "R@5"),
  ("mean", "t2i_R@5", "R@5"),
  ("ood", "i2t_R@1", "ood_R@1"),
  ("ood", "t2i_R@1", "ood_R@1"),
)


def tables(config) -> list[report_lib.Table]:
  """The result tables: retrieval beside chance, downstream accuracy beside the initial
  model and the majority class, segmentation Dice beside the initial model and all-positive;
  over seeds FedRGB minus every other row, paired by seed."""
  gallery, down, seg = int(config.gallery), config.downstream, config.segmentation
  label = {
    "gallery_t2i_R@1": f"T2I@1 (batch {gallery})",
    "gallery_t2i_R@5": f"T2I@5 (batch {gallery})",
    **{f"{d}_R@{k}": f"{d.upper()}@{k}" for d in ("i2t", "t2i") for k in (1, 5)},
  }
  column = report_lib.Column
  fractions = [fraction_label(float(f)) for f in down.fractions]
  on = f"a fraction of {down.train} labelled images, tested on {down.test}"
  return [
    report_lib.Table(
      "Retrieval (R@K, %)",
      [column(f"{label[n]} {g}", f"{g}.{n}") for g, n, _ in COLUMNS],
      reference="fedrgb",
    ),
    report_lib.Table(
      f"Downstream accuracy (%), fine-tuned for {down.steps} steps on {on}",
      [column(f"{t} {f}", f"downstream.{t}.{f}") for t in DOWNSTREAM for f in fractions],
      baselines=("initial model", "majority class"),
      reference="fedrgb",
    ),
    report_lib.Table(
      f"Segmentation Dice (%) of '{seg.target}', a decoder trained for {seg.steps} steps on "
      f"the frozen image tower with {on}",
      [column(f"Dice {f}", f"segmentation.{f}") for f in fractions],
      baselines=("initial model", "all positive"),
      reference="fedrgb",
    ),
  ]


def baselines(chance, initial, majority, seg_initial, all_positive, fractions) -> dict:
  """The tables' baseline rows by their column keys (None: that part did not run)."""
  labels = [fraction_label(f) for f in fractions]
  out = {"chance": {g: {} for g in ("mean", "worst", "ood")}}
  for g, n, c in COLUMNS:
    out["chance"][g][n] = chance[c]
  out["initial model"] = {"downstream": initial or {}, "segmentation": seg_initial or {}}
  out["majority class"] = {"downstream": {t: dict.fromkeys(labels, v) for t, v in majority.items()}}
  if seg_initial is not None:
    out["all positive"] = {"segmentation": dict.fromkeys(labels, all_positive)}
  return out


def fraction_label(f: float) -> str:
  """``0.01 -> "1%"``."""
  return f"{100 * f:g}%"


def sections(config, outcome) -> list[tuple[str, str]]:
  """The distortion section (:attr:`fedjax_mm.runner.loop.System.sections`), when it ran."""
  table, matrices = distortion_tables(outcome.final, list(outcome.final), int(config.num_clients))
  if not table:
    return []
  heading = (
    f"Distortion: drop in mean paired cosine after {config.distortion.steps} retraining steps "
    "on one client (Tables 6 / 11)"
  )
  return [(heading, "\n\n".join([table, *matrices]))]


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
