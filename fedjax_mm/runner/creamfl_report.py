"""CreamFL's tables: Table 1 (Recall@K per test size, R@1_sum), Table 2's VQA analogue, bytes.

The report of a run of :mod:`fedjax_mm.runner.creamfl` (:func:`report`), its
summary over seeds (:func:`summarize`), and what both read: the chance levels
of a random ranking (:func:`fedjax_mm.metrics.retrieval.chance_recall`), the test sizes' names and folds,
R@1_sum and RSUM. Nothing here builds data or models.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedjax_mm import data, metrics
from fedjax_mm.core import ledger as ledger_lib
from fedjax_mm.data import tfds as tfds_data
from fedjax_mm.runner import loop
from fedjax_mm.runner import report as report_lib

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
  out = {k: metrics.retrieval.chance_recall(n, c) for k, n in fold_images(config, num_test).items()}
  if config.test.private_size:
    out["private"] = metrics.retrieval.chance_recall(config.test.private_size, c)
  return out


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
  """How the VQA analogue was run (``qa``: the run's :class:`~fedjax_mm.algorithms.vqa.VqaData`)."""
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


def tables(config) -> list[report_lib.Table]:
  """The result tables: R@1_sum and RSUM with bytes per round, the six recalls per test size
  (and the private test's), Table 2's VQA analogue; each beside its chance or majority row.
  Over seeds CreamFL minus local training and FedAvg, paired by seed."""
  column, table = report_lib.Column, report_lib.Table
  recalls = lambda prefix: [column(k, f"{prefix}.{k}", digits=2) for k in RECALL_KEYS]
  chance = ("chance (random ranking)",)
  out = [
    table(
      "R@1_sum (public-distribution tests)",
      [
        column("R@1_sum", "r1_sum", digits=2),
        column("RSUM", "rsum", digits=2),
        column("vs local", "vs_local", digits=2, signed=True),
        column("bytes/round", "bytes_per_round", format=ledger_lib.format_bytes),
      ],
      label="method",
      baselines=chance,
      reference="CreamFL",
      against=(LOCAL, "FedAvg"),
    )
  ]
  for n in config.test.sizes:
    label = size_label(n)
    out.append(
      table(f"{label} test: Recall@K (%)", recalls(label), label="method", baselines=chance)
    )
  if config.test.private_size:
    out.append(
      table(
        f"Private distribution (shift 0, {config.test.private_size} images, full set; not in "
        "R@1_sum): Recall@K (%)",
        recalls("private"),
        label="method",
        baselines=chance,
      )
    )
  types = [column(t, f"vqa.per_type.{t}", digits=2) for t in data.vqa.QUESTION_TYPES]
  vqa = [column("accuracy", "vqa.accuracy", 2), column("blind", "vqa.blind_accuracy", 2)]
  vqa.append(column("vs blind", "vqa.vs_blind", digits=2, signed=True))
  out.append(
    table(
      "Table 2 analogue (VQA accuracy %)",
      vqa + types,
      label="method",
      baselines=("majority answer per type",),
      reference="CreamFL",
      against=(LOCAL, "FedAvg"),
    )
  )
  return out


def _vqa_note(config, p) -> str:
  """How Table 2's analogue was run (``p``: :func:`vqa_protocol`)."""
  return (
    f"Each row's server frozen after {config.rounds} rounds; a fusion head (hidden "
    f"{p['head']['hidden']}, {p['head']['steps']} Adam steps of {p['head']['batch_size']} "
    f"questions, lr {p['head']['learning_rate']}) on its {p['features']} features, trained on "
    f"{p['train_questions']} questions about {p['train_images']} scenes, tested on "
    f"{p['test_questions']} questions about {p['test_images']} other scenes at shift "
    f"{p['shift']}; top-1 exact-match accuracy over {p['answers']} answers. blind: the same "
    "head without the image (question only); vs blind: accuracy minus blind; majority: "
    "each type's most frequent training answer. Not VQA v2: template questions about "
    "the embedded world's scenes (fedjax_mm.data.vqa)."
  )


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
  """CreamFL's Table 1 (:func:`tables`: one table per test size, R@1_sum over all), plus
  bytes per round; Table 2's analogue when ``vqa_protocol`` (the VQA analogue ran) is given;
  what each set read when ``data_note`` (a TFDS run, :func:`tfds_note`) is given."""
  results, rounds = outcome.final, config.rounds
  sizes = tuple(config.test.sizes)
  num_test = None if data_note is None else data_note["test_images"]
  num_public = config.public.size if data_note is None else data_note["public_size"]
  chance = chance_levels(config, num_test)
  local_sum = r1_sum(results[LOCAL], sizes) if LOCAL in results else None
  traffic, final = {}, {}
  for m in methods:
    ledger = outcome.ledgers.get(m)  # None: the method sent nothing.
    up, down = (ledger.total_up, ledger.total_down) if ledger else (0, 0)
    traffic[m] = {"up_per_round": up / rounds, "down_per_round": down / rounds}
    total = r1_sum(results[m], sizes)
    final[m] = {
      "r1_sum": total,
      "rsum": rsum(results[m], sizes),
      "vs_local": None if local_sum is None else total - local_sum,
      "bytes_per_round": (up + down) / rounds,
      **{k: v for k, v in results[m].items() if k != "vqa"},
    }
    if vqa_protocol is not None:
      r = results[m]["vqa"]
      final[m]["vqa"] = {**r, "vs_blind": r["accuracy"] - r["blind_accuracy"]}
  baselines = {
    "chance (random ranking)": {"r1_sum": r1_sum(chance, sizes), "rsum": rsum(chance, sizes)}
    | chance,
  }
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
  sections = [("Result", description)]
  if data_note is not None:
    sections.append(_data_section(data_note))
  tail = [("Curves", "![R@1_sum](curves.png)")]
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
  if config.test.private_size:
    result["private_recall"] = {m: results[m]["private"] for m in methods}
  if data_note is not None:
    result["data"] = dict(data_note)
  if vqa_protocol is not None:
    first = results[methods[0]]["vqa"]
    tail.insert(0, ("Table 2 analogue: how it ran", _vqa_note(config, vqa_protocol)))
    baselines["majority answer per type"] = {
      "vqa": {"accuracy": first["majority_accuracy"], "per_type": first["majority_per_type"]}
    }
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
    text=description,
    final=final,
    baselines=baselines,
    tail=tail,
  )
