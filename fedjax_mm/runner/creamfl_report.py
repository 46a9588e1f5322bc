"""CreamFL's tables: Table 1 (Recall@K per test size, R@1_sum), Table 2's VQA analogue, bytes.

The report of a run of :mod:`fedjax_mm.runner.creamfl` (:func:`report`), its
summary over seeds (:func:`summarize`), and what both read: the chance levels
of a random ranking (:func:`chance_recall`), the test sizes' names and folds,
R@1_sum and RSUM. Nothing here builds data or models.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedjax_mm import data
from fedjax_mm.core import ledger as ledger_lib
from fedjax_mm.data import tfds as tfds_data
from fedjax_mm.runner import loop
from fedjax_mm.runner import report as report_lib
from fedjax_mm.runner.errors import SummaryError

LOCAL = "local"


#: Client group -> (modalities, private task: kind, input key, target key, outputs, head).
GROUPS = {
  "image": (("image",), ("classification", "image", "label10", 10, "mlp")),
  "text": (("text",), ("classification", "caption", "caption_label", data.NUM_COLORS, "linear")),
  "multimodal": (("image", "text"), None),
}


RECALL_KEYS = ("i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10")


def size_label(size: int) -> str:
  """A test set's name by its number of images: ``1000 -> "1K"``, ``5000 -> "5K"``, ``250 -> "250"``."""
  return f"{size // 1000}K" if size % 1000 == 0 else str(size)


def r1_sum(recall: Mapping[str, Mapping[str, float]], sizes: Sequence[int]) -> float:
  """CreamFL's ``R@1_sum``: i2t R@1 + t2i R@1 on each test size (4 numbers for 1K and 5K).

  Args:
    recall: ``{size label: {"i2t_R@1": ..., "t2i_R@1": ..., ...}}`` (percentages).
    sizes: the test sizes (``config.test.sizes``).
  """
  return sum(recall[size_label(n)][k] for n in sizes for k in ("i2t_R@1", "t2i_R@1"))


def rsum(recall: Mapping[str, Mapping[str, float]], sizes: Sequence[int]) -> float:
  """All six recalls summed over the test sizes."""
  return sum(recall[size_label(n)][k] for n in sizes for k in RECALL_KEYS)


def chance_recall(
  num_images: int, captions_per_image: int, ks: Sequence[int] = (1, 5, 10)
) -> dict[str, float]:
  """Recall@K (%) of a uniformly random ranking on ``num_images`` images x ``C`` captions.

  t2i: one correct image among ``N``, ``min(K / N, 1)``. i2t: ``C`` correct
  captions among ``C N``, found unless all ``K`` top candidates are wrong,
  ``1 - prod_{j<K} (C N - C - j) / (C N - j)`` (about ``K / N`` too).
  """
  n, c = num_images, captions_per_image
  out = {}
  for k in ks:
    miss = 1.0
    for j in range(min(k, c * n)):
      miss *= max(c * n - c - j, 0) / (c * n - j)
    out[f"i2t_R@{k}"] = 100.0 * (1.0 - miss)
  for k in ks:
    out[f"t2i_R@{k}"] = 100.0 * min(k / n, 1.0)
  return out


def fold_images(config, num_test: int | None = None) -> dict[str, int]:
  """Images per fold of each test size: ``s`` itself, or ``N / folds`` when ``N < max(sizes)``."""
  sizes = tuple(config.test.sizes)
  num = max(sizes) if num_test is None else num_test
  return {size_label(n): num // (max(sizes) // n) for n in sizes}


def chance_levels(config, num_test: int | None = None) -> dict[str, dict[str, float]]:
  """Chance recall of every table: per test size (its fold size) and the private test.

  ``num_test``: the test images read (:func:`num_test_images`; None: ``max(test.sizes)``).
  """
  c = data.WorldConfig().captions_per_image
  out = {k: chance_recall(n, c) for k, n in fold_images(config, num_test).items()}
  if config.test.private_size:
    out["private"] = chance_recall(config.test.private_size, c)
  return out


def _recall_table(rows: Sequence[Sequence[Any]], chance: Mapping[str, float]) -> str:
  """``method | six recalls`` rows and a last row at chance."""
  rows = [*rows, ["chance (random ranking)", *(chance[k] for k in RECALL_KEYS)]]
  return report_lib.format_table(["method", *RECALL_KEYS], rows)


def protocol_of(config, num_test: int | None = None) -> dict[str, Any]:
  sizes = list(config.test.sizes)
  out = {
    "test_sizes": sizes,
    "test_images": max(sizes) if num_test is None else num_test,
    "folds": {size_label(n): max(sizes) // n for n in sizes},
    "captions_per_image": data.WorldConfig().captions_per_image,
    "shift": config.test.shift,
    "public_shift": config.public.shift,
    "private_size": config.test.private_size,
    "r1_sum": " + ".join(f"{d}_R@1({size_label(n)})" for n in sizes for d in ("i2t", "t2i")),
  }
  if num_test is not None and num_test < max(sizes):  # data.limit scaled the protocols down
    out["fold_images"] = fold_images(config, num_test)
  return out


def vqa_protocol(config, qa) -> dict[str, Any]:
  """How the VQA analogue was run (``qa``: the run's :class:`~fedjax_mm.runner.creamfl.VqaData`)."""
  test_types = np.bincount(np.asarray(qa.test["type"]), minlength=data.vqa.NUM_TYPES)
  return {
    "train_images": config.vqa.train_images,
    "test_images": config.vqa.test_images,
    "train_questions": int(qa.train["answer"].shape[0]),
    "test_questions": int(qa.test["answer"].shape[0]),
    "test_questions_per_type": dict(zip(data.vqa.QUESTION_TYPES, test_types.tolist(), strict=True)),
    "shift": config.test.shift,
    "answers": data.vqa.NUM_ANSWERS,
    "templates": dict(data.vqa.TEMPLATES),
    "features": config.vqa.features,
    "head": {k: config.vqa[k] for k in ("hidden", "steps", "batch_size", "learning_rate")},
  }


def _vqa_table(methods, results) -> str:
  """Table 2's analogue: each row's accuracy, its blind head's, and per question type."""
  types = data.vqa.QUESTION_TYPES
  rows = []
  for m in methods:
    r = results[m]["vqa"]
    gain = r["accuracy"] - r["blind_accuracy"]
    rows.append(
      [m, r["accuracy"], r["blind_accuracy"], f"{gain:+.2f}", *(r["per_type"][t] for t in types)]
    )
  majority = results[methods[0]]["vqa"]
  rows.append(
    [
      "majority answer per type",
      majority["majority_accuracy"],
      None,
      "",
      *(majority["majority_per_type"][t] for t in types),
    ]
  )
  return report_lib.format_table(["method", "accuracy", "blind", "vs blind", *types], rows)


def _describe_tests(config, data_note: Mapping[str, Any] | None = None) -> str:
  """The retrieval tests in words: images, captions, where they come from, folds."""
  sizes = tuple(config.test.sizes)
  num = max(sizes) if data_note is None else data_note["test_images"]
  c = data.WorldConfig().captions_per_image
  per_fold = fold_images(config, num)
  parts = [
    f"{size_label(n)} = mean over {max(sizes) // n} folds of {per_fold[size_label(n)]} images"
    if n < max(sizes)
    else f"{size_label(n)} = all {num} images"
    for n in sizes
  ]
  if data_note is not None:
    lead = (
      f"{num} test images x {c} captions of {data_note['datasets']['test']} (the public "
      "set's dataset)"
    )
  else:
    where = (
      "the public set's distribution"
      if config.test.shift == config.public.shift
      else "NOT the public set's distribution"
    )
    lead = f"{num} held-out test images x {c} captions at shift {config.test.shift} ({where})"
  return f"{lead}; " + "; ".join(parts)


def tfds_note(config, train_data, public, test) -> dict[str, Any]:
  """What a TFDS run read: datasets and splits, each client's examples, public and test sizes."""
  block = config.data
  names = {**{g: block.clients[g] for g in GROUPS}, "public": block.public, "test": block.public}
  splits = {k: tfds_data.READERS[v].splits[0] for k, v in names.items()}
  splits["test"] = tfds_data.READERS[block.public].splits[1]
  num_test = int(test["public"]["image"].shape[0])
  return {
    "source": "tfds",
    "datasets": names,
    "splits": splits,
    "limit": block.limit,
    "image_size": config.image_size,
    "train_sizes": {
      g: [int(n) for n in np.asarray(d.num_samples)]
      for g, d in zip(GROUPS, train_data, strict=True)
    },
    "public_size": int(public["image"].shape[0]),
    "test_images": num_test,
    "fold_images": fold_images(config, num_test),
  }


def _data_section(note: Mapping[str, Any]) -> tuple[str, str]:
  """The report's section: one row per set, the dataset and split it read, its examples."""
  rows = [
    [f"{g} clients ({len(sizes)})", f"{note['datasets'][g]} ({note['splits'][g]})", sizes]
    for g, sizes in note["train_sizes"].items()
  ]
  rows = [[name, where, " / ".join(map(str, sizes))] for name, where, sizes in rows]
  for key, size in (("public", note["public_size"]), ("test", note["test_images"])):
    what = "public set" if key == "public" else "test set (images, 5 captions each)"
    rows.append([what, f"{note['datasets'][key]} ({note['splits'][key]})", str(size)])
  table = report_lib.format_table(["set", "dataset (split)", "examples"], rows)
  return (
    f"Data (TFDS, data.limit={note['limit']}, images {note['image_size']} px)",
    table + "\n\nClients' examples per client (a Dirichlet split of the group's pool).",
  )


def report(
  config,
  methods,
  outcome: loop.Outcome,
  vqa_protocol: Mapping[str, Any] | None = None,
  data_note: Mapping[str, Any] | None = None,
) -> loop.Report:
  """CreamFL's Table 1 (one table per test size, R@1_sum over all), plus bytes per round;
  Table 2's analogue when ``vqa_protocol`` (the VQA analogue ran) is given; what each
  set read when ``data_note`` (a TFDS run, :func:`tfds_note`) is given."""
  results, rounds = outcome.final, config.rounds
  sizes = tuple(config.test.sizes)
  num_test = None if data_note is None else data_note["test_images"]
  num_public = config.public.size if data_note is None else data_note["public_size"]
  chance = chance_levels(config, num_test)
  fmt = report_lib.format_table
  local_sum = r1_sum(results[LOCAL], sizes) if LOCAL in results else None
  summary_rows, traffic = [], {}
  for m in methods:
    ledger = outcome.ledgers.get(m)  # None: the method sent nothing.
    up, down = (ledger.total_up, ledger.total_down) if ledger else (0, 0)
    traffic[m] = {"up_per_round": up / rounds, "down_per_round": down / rounds}
    total = r1_sum(results[m], sizes)
    gain = "" if local_sum is None else f"{total - local_sum:+.2f}"
    summary_rows.append(
      [m, total, rsum(results[m], sizes), gain, ledger_lib.format_bytes((up + down) / rounds)]
    )
  chance_sum = r1_sum(chance, sizes)
  summary_rows.append(["chance (random ranking)", chance_sum, rsum(chance, sizes), "", ""])
  summary = fmt(["method", "R@1_sum", "RSUM", "vs local", "bytes/round"], summary_rows)
  tables = {
    size_label(n): _recall_table(
      [[m, *(results[m][size_label(n)][k] for k in RECALL_KEYS)] for m in methods],
      chance[size_label(n)],
    )
    for n in sizes
  }
  private = None
  if config.test.private_size:
    private = _recall_table(
      [[m, *(results[m]["private"][k] for k in RECALL_KEYS)] for m in methods], chance["private"]
    )
  wall, start_round = outcome.wall_time_s, outcome.resumed_at
  protocol = protocol_of(config, num_test)
  description = (
    f"Server ({config.server.image_encoder} + {config.server.text_encoder}) after {rounds} rounds; "
    f"Recall@K (%) on {_describe_tests(config, data_note)}. R@1_sum = {protocol['r1_sum']} (CreamFL's "
    f"Table 1; RSUM adds all {6 * len(sizes)} recalls). "
    f"{sum(config.clients[g].num for g in GROUPS)} clients, "
    f"{config.creamfl.num_selected} per round, P={num_public}, d={config.rep_dim}, "
    f"gamma={config.creamfl.lcr_weight}, seed {config.seed}; wall time {wall:.0f} s"
    + (f" (resumed at round {start_round})" if start_round else "")
  )
  history = {
    m: [
      (record["round"], record[f"{m}/R@1_sum"])
      for record in outcome.history
      if f"{m}/R@1_sum" in record
    ]
    for m in methods
  }
  sections = [("Result", description), ("R@1_sum (public-distribution tests)", summary)]
  for n in sizes:
    label = size_label(n)
    sections.append((f"{label} test: Recall@K (%)", tables[label]))
  if data_note is not None:
    sections.append(_data_section(data_note))
  if private is not None:
    sections.append(
      (
        f"Private distribution (shift 0, {config.test.private_size} images, full set; not in "
        "R@1_sum): Recall@K (%)",
        private,
      )
    )
  vqa_text = None
  if vqa_protocol is not None:
    p = vqa_protocol
    vqa_text = _vqa_table(methods, results)
    sections.append(
      (
        "Table 2 analogue (VQA accuracy %)",
        vqa_text
        + "\n\n"
        + (
          f"Each row's server frozen after {rounds} rounds; a fusion head (hidden {p['head']['hidden']}, "
          f"{p['head']['steps']} Adam steps of {p['head']['batch_size']} questions, lr "
          f"{p['head']['learning_rate']}) on its {p['features']} features, trained on "
          f"{p['train_questions']} questions about {p['train_images']} scenes, tested on "
          f"{p['test_questions']} questions about {p['test_images']} other scenes at shift "
          f"{p['shift']}; top-1 exact-match accuracy over {p['answers']} answers. blind: the same "
          "head without the image (question only); vs blind: accuracy minus blind; majority: "
          "each type's most frequent training answer. Not VQA v2: template questions about "
          "the embedded world's scenes (fedjax_mm.data.vqa)."
        ),
      )
    )
  sections.append(("Curves", "![R@1_sum](curves.png)"))
  result = {
    "protocol": protocol,
    "recall": {m: {size_label(n): results[m][size_label(n)] for n in sizes} for m in methods},
    "r1_sum": {m: r1_sum(results[m], sizes) for m in methods},
    "rsum": {m: rsum(results[m], sizes) for m in methods},
    "chance": chance,
    "traffic": traffic,
    "gamma": config.creamfl.lcr_weight,
    "rounds": rounds,
    "seed": config.seed,
    "wall_time_s": wall,
  }
  if private is not None:
    result["private_recall"] = {m: results[m]["private"] for m in methods}
  if data_note is not None:
    result["data"] = dict(data_note)
  if vqa_protocol is not None:
    first = results[methods[0]]["vqa"]
    result["vqa"] = {
      "protocol": dict(vqa_protocol),
      "majority": {k: first[f"majority_{k}"] for k in ("accuracy", "per_type")},
      "methods": {
        m: {
          k: results[m]["vqa"][k]
          for k in ("accuracy", "per_type", "blind_accuracy", "blind_per_type")
        }
        for m in methods
      },
    }
  parts = [summary] + [f"{size_label(n)} test:\n{tables[size_label(n)]}" for n in sizes]
  if vqa_text is not None:
    parts.append(f"VQA (Table 2 analogue), accuracy %:\n{vqa_text}")
  text = "\n\n".join(parts + [description])
  return loop.Report(
    title="CreamFL and its variants: server image-text retrieval",
    sections=sections,
    plots={
      "curves.png": loop.Curves(
        {"server R@1_sum": history},
        "Server retrieval on the public-distribution test",
        "R@1_sum (%)",
      )
    },
    results=result,
    text=text,
  )


def summarize(workdirs) -> str:
  """Mean ± sample std over runs (seeds) of the final tables, from their ``results.json``.

  The runs must share every config key but the seed
  (:func:`fedjax_mm.runner.report.load_seed_runs`).
  """
  runs, _ = report_lib.load_seed_runs(workdirs)
  for w, r in zip(workdirs, runs, strict=True):
    if "protocol" not in r:
      raise SummaryError(
        f"{w}: results.json predates the public-distribution 1K/5K protocol; run it again."
      )
  sizes = runs[0]["protocol"]["test_sizes"]
  if any(r["protocol"]["test_sizes"] != sizes for r in runs):
    raise SummaryError("the runs were evaluated on different test sizes.")
  methods = [m for m in runs[0]["recall"] if all(m in r["recall"] for r in runs)]

  cell = functools.partial(report_lib.seed_cell, digits=2)
  chance = runs[0]["chance"]
  local = [r["r1_sum"][LOCAL] for r in runs] if LOCAL in methods else None
  rows = []
  for m in methods:
    row = [m, cell([r["r1_sum"][m] for r in runs]), cell([r["rsum"][m] for r in runs])]
    if local is not None:
      row.append(cell([r["r1_sum"][m] - lo for r, lo in zip(runs, local, strict=True)]))
    rows.append(row)
  rows.append(
    ["chance (random ranking)", f"{r1_sum(chance, sizes):.2f}", f"{rsum(chance, sizes):.2f}"]
    + ([""] if local is not None else [])
  )
  headers = ["method", "R@1_sum", "RSUM"] + (["vs local"] if local is not None else [])
  parts = [report_lib.format_table(headers, rows)]
  for n in sizes:
    label = size_label(n)
    rows = [
      [m] + [cell([r["recall"][m][label][k] for r in runs]) for k in RECALL_KEYS] for m in methods
    ]
    rows.append(["chance (random ranking)", *(f"{chance[label][k]:.2f}" for k in RECALL_KEYS)])
    parts.append(f"{label} test:\n" + report_lib.format_table(["method", *RECALL_KEYS], rows))
  if all("vqa" in r for r in runs):  # Table 2's analogue (runs from before it have none)
    types = data.vqa.QUESTION_TYPES
    rows = []
    for m in methods:
      blocks = [r["vqa"]["methods"][m] for r in runs]
      rows.append(
        [m, cell([b["accuracy"] for b in blocks]), cell([b["blind_accuracy"] for b in blocks])]
        + [cell([b["per_type"][t] for b in blocks]) for t in types]
      )
    majority = [r["vqa"]["majority"] for r in runs]
    rows.append(
      ["majority answer per type", cell([b["accuracy"] for b in majority]), ""]
      + [cell([b["per_type"][t] for b in majority]) for t in types]
    )
    table = report_lib.format_table(["method", "accuracy", "blind", *types], rows)
    parts.append("VQA (Table 2 analogue), accuracy %:\n" + table)
  seeds = ", ".join(str(r["seed"]) for r in runs)
  protocol = runs[0]["protocol"]
  note = runs[0].get("data")  # a TFDS run: its test set is a dataset's split, not a shift
  where = (
    f"at shift {protocol['shift']}"
    if note is None
    else f"of {note['datasets']['test']} ({note['splits']['test']} split)"
  )
  return "\n\n".join(parts) + (
    f"\n\nmean ± std (sample, ddof=1) over {len(runs)} runs (seeds {seeds}), Recall@K in %; "
    f"{protocol['test_images']} test images {where}; "
    f"R@1_sum = {protocol['r1_sum']}."
  )
