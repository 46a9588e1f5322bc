"""Tests of fedjax_mm.runner.report: tables, number formats, report file, PNG plots."""

import json
import math
import struct
import sys

import numpy as np
import pytest

from fedjax_mm.runner import format_table, mean_std, percent, plot_curves, report, write_report

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path):
  """Checks the PNG signature and returns (width, height) from the IHDR chunk."""
  data = path.read_bytes()
  assert data[:8] == _PNG_MAGIC and data[12:16] == b"IHDR"
  return struct.unpack(">II", data[16:24])


def test_format_table_aligns_columns():
  table = format_table(
    ["method", "acc", "Delta", "bytes"],
    [["FedMuscle", 0.8123, "+16.9%", 1024], ["local", np.float32(0.7), "+0.0%", None]],
  )
  assert table.splitlines() == [
    "| method    |  acc | Delta  | bytes |",
    "| :-------- | ---: | :----- | ----: |",
    "| FedMuscle | 0.81 | +16.9% |  1024 |",
    "| local     | 0.70 | +0.0%  |       |",
  ]
  assert len({len(line) for line in table.splitlines()}) == 1  # Lines up on a terminal.


def test_format_table_values():
  table = format_table(
    ["a", "b"],
    [[float("nan"), "x|y"], [np.int64(3), True], [np.asarray(2.5), 1e-3]],
    floatfmt=".3f",
  )
  lines = table.splitlines()
  assert lines[2] == "|   nan | x\\|y  |"  # NaN printed, pipe escaped; column "a" numeric.
  assert lines[3] == "|     3 | True  |"  # Bools are text.
  assert lines[4] == "| 2.500 | 0.001 |"
  with pytest.raises(ValueError, match="row 0 has 1 cells"):
    format_table(["a", "b"], [[1]])
  assert format_table(["x"], []).splitlines() == ["| x   |", "| :-- |"]


def test_percent():
  assert percent(0.169) == "+16.9%"
  assert percent(-0.0304) == "-3.0%"
  assert percent(-0.0001) == "+0.0%"  # Never "-0.0%".
  assert percent(np.float32(0.5), digits=2) == "+50.00%"
  assert percent(float("nan")) == "nan%"


def test_mean_std_uses_the_sample_std():
  values = [0.15, 0.169, 0.19]
  expected_std = 100 * np.std(values, ddof=1)
  assert mean_std(values) == f"+{100 * np.mean(values):.1f} ± {expected_std:.1f}"
  assert mean_std(values) == "+17.0 ± 2.0"
  assert mean_std([0.0, 2.0], scale=1) == "+1.0 ± 1.4"  # ddof=1: sqrt(2), not 1.
  assert mean_std([-0.05, -0.07]) == "-6.0 ± 1.4"
  assert mean_std([0.169]) == "+16.9"
  with pytest.raises(ValueError):
    mean_std([])


def test_write_report(tmp_path):
  path = write_report(
    tmp_path / "sub" / "report.md",
    title="FedMuscle",
    sections=[("Results", format_table(["a"], [[1]])), ("Notes", "ok\n")],
  )
  assert path.read_text() == (
    "# FedMuscle\n\n## Results\n\n|   a |\n| --: |\n|   1 |\n\n## Notes\n\nok\n"
  )


def test_plot_curves_multi_panel(tmp_path):
  series = {
    f"user {u} (vit_b/multilabel)": {
      "FedMuscle": [(r, 0.1 * u + 0.01 * r) for r in range(20)],
      "local": [(r, 0.1 * u + 0.005 * r) for r in reversed(range(20))],
    }
    for u in range(1, 5)
  }
  series["user 7 (bert/text)"] = {"FedMuscle": [(0, 0.3), (1, math.nan), (2, 0.5)], "local": []}
  series["user 8 (empty)"] = {"local": []}
  path = plot_curves(
    tmp_path / "plots" / "users.png", series, title="per-user metric", ylabel="metric"
  )
  width, height = _png_size(path)
  assert (width, height) == (4 * 420, 2 * 320 + 40)  # 6 panels: 4 columns x 2 rows at dpi 100.
  assert path.stat().st_size > 20_000


def test_plot_curves_single_panel(tmp_path):
  path = plot_curves(
    tmp_path / "delta.png",
    {"Delta": {"FedMuscle": [(r, 0.02 * r) for r in range(10)]}},
    title="Delta over rounds",
    ylabel="Delta",
  )
  assert _png_size(path) == (420, 360)
  assert path.stat().st_size > 5_000
  with pytest.raises(ValueError):
    plot_curves(tmp_path / "none.png", {}, title="t", ylabel="y")


def test_plot_curves_leaves_pyplot_alone(tmp_path):
  pyplot_was_loaded = "matplotlib.pyplot" in sys.modules
  plot_curves(tmp_path / "a.png", {"p": {"l": [(0, 1.0)]}}, title="t", ylabel="y")
  if pyplot_was_loaded:
    assert not sys.modules["matplotlib.pyplot"].get_fignums()  # No figure left open.
  else:
    assert "matplotlib.pyplot" not in sys.modules


def test_load_seed_runs(tmp_path):
  def run(name, seed, lr=0.1, finished=True):
    w = tmp_path / name
    w.mkdir()
    (w / "config.json").write_text(json.dumps({"seed": seed, "lr": lr}))
    if finished:
      (w / "results.json").write_text(json.dumps({"value": seed}))
    return w

  a, b = run("a", 0), run("b", 1)
  results, configs = report.load_seed_runs([a, b])
  assert [r["value"] for r in results] == [0, 1] and [c["seed"] for c in configs] == [0, 1]
  c = run("c", 2, lr=0.2)
  with pytest.raises(report.SummaryError) as info:
    report.load_seed_runs([a, c])
  assert str(info.value) == (
    f"the runs differ in more than the seed ({a} and {c}: lr: 0.1 != 0.2); summarise them "
    "separately."
  )
  with pytest.raises(FileNotFoundError, match="has not finished"):
    report.load_seed_runs([a, run("d", 3, finished=False)])
  with pytest.raises(ValueError, match="no workdirs"):
    report.load_seed_runs([])


TABLE = report.Table(
  "Results",
  [report.Column("R@1", "g.R@1"), report.Column("gap", "gap", higher=False)],
  headline="g.R@1",
  baselines=("chance", "trivial"),
  reference="a",
)


def test_table_renders_one_run_with_its_baseline_rows():
  final = {"a": report.flatten({"g": {"R@1": 12.34}, "gap": 2}), "b": {"g.R@1": 10.0}}
  baselines = {"chance": {"g.R@1": 1.0}, "trivial": {"gap": 0.5}}
  assert TABLE.render(final, baselines) == (
    "| Method  |  R@1 | gap |\n"
    "| :------ | ---: | --: |\n"
    "| a       | 12.3 | 2.0 |\n"
    "| b       | 10.0 |     |\n"
    "| chance  |  1.0 |     |\n"
    "| trivial |      | 0.5 |"
  )
  assert TABLE._replace(min_rows=3).render(final, baselines) is None


def test_table_over_seeds_has_intervals_and_a_paired_row_with_its_verdict():
  from scipy import stats

  a, b = [10.0, 12.0, 14.0], [9.0, 10.0, 12.0]
  finals = [
    {"a": {"g.R@1": x, "gap": 1.0}, "b": {"g.R@1": y, "gap": 1.0}}
    for x, y in zip(a, b, strict=True)
  ]
  text = TABLE.render_seeds(finals, [{"chance": {"g.R@1": 1.0}}] * 3)
  rows = {
    r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in text.splitlines()
  }
  t = stats.t.ppf(0.975, 2)
  assert rows["a"][0] == f"12.0 ± {t * 2.0 / np.sqrt(3):.1f}"  # sd 2
  diff = np.array(a) - np.array(b)  # 1, 2, 2: mean 5/3, sd 0.577
  half = t * diff.std(ddof=1) / np.sqrt(3)
  m = diff.mean()
  assert rows["a - b (paired)"] == [
    f"{m:+.1f} [{m - half:+.1f}, {m + half:+.1f}]",
    "+0.0 [+0.0, +0.0]",
    "reproduced",
  ]
  assert rows["chance"][:2] == ["1.0 ± 0.0", ""]
  assert text.splitlines()[0].rstrip().endswith("| verdict (R@1) |")
