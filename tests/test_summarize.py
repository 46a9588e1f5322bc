"""experiments.summarize groups runs by config (seed aside) and averages over seeds."""

import json

import numpy as np
import pytest

from experiments import summarize


def _run(path, seed, loss, delta, users):
  path.mkdir()
  config = {"seed": seed, "rounds": 3, "muscle": {"loss": loss, "num_partners": 2}}
  (path / "config.json").write_text(json.dumps(config))
  (path / "results.json").write_text(json.dumps({"delta": delta, "fedmuscle": users}))
  return path


def test_groups_by_config_without_seed_and_reports_mean_and_sample_std(tmp_path):
  dirs = [
    _run(tmp_path / "a0", 0, "muscle", 0.10, [0.5, 0.6]),
    _run(tmp_path / "a1", 1, "muscle", 0.20, [0.7, 0.6]),
    _run(tmp_path / "b0", 0, "pairwise", -0.05, [0.4, 0.2]),
  ]
  table = summarize.summarize(dirs, ["delta", "fedmuscle.0"], scale=100, digits=2)
  lines = table.splitlines()
  muscle = next(line for line in lines if '"muscle"' in line)
  pairwise = next(line for line in lines if '"pairwise"' in line)
  std = np.std([10.0, 20.0], ddof=1)
  assert "muscle.loss" in muscle and "0,1" in muscle
  assert f"+15.00 ± {std:.2f}" in muscle and "+60.00 ± 14.14" in muscle
  assert "-5.00" in pairwise and "±" not in pairwise
  assert len([line for line in lines if line.startswith("| muscle")]) == 2


def test_unfinished_run_is_a_clear_error(tmp_path):
  path = tmp_path / "run"
  path.mkdir()
  (path / "config.json").write_text("{}")
  with pytest.raises(FileNotFoundError, match="has no results.json"):
    summarize.summarize([path], ["delta"], scale=100, digits=1)


def test_the_command_refuses_every_unfinished_workdir_in_one_line(tmp_path, capsys):
  # A mean over fewer seeds than were given would pass unnoticed.
  done = _run(tmp_path / "done", 0, "muscle", 0.1, [0.5])
  stopped = tmp_path / "stopped"
  (stopped / "checkpoints" / "3").mkdir(parents=True)
  (stopped / "checkpoints" / "4.orbax-checkpoint-tmp-1").mkdir()  # never finalised
  (stopped / "config.json").write_text(json.dumps({"seed": 1, "rounds": 10}))
  fresh = tmp_path / "fresh"
  fresh.mkdir()
  (fresh / "config.json").write_text(json.dumps({"seed": 2, "rounds": 10}))
  assert summarize.unfinished([done]) == []
  with pytest.raises(SystemExit) as e:
    summarize.main(["summarize", str(done), str(stopped), str(fresh), str(tmp_path / "x"), str(tmp_path)])  # fmt: skip
  assert e.value.code == 2
  out, err = capsys.readouterr()
  assert out == "" and err == (
    f"error: cannot summarise {stopped} (unfinished: checkpointed at round 3 of 10); {fresh} "
    f"(unfinished: no round checkpointed); {tmp_path / 'x'} (no such folder); {tmp_path} (no "
    "config.json: not a run's workdir). Finish a run with the command that started it (it "
    "resumes), or leave it out.\n"
  )


def _results_only(path, results):
  path.mkdir()
  (path / "config.json").write_text(json.dumps({"seed": 0}))
  (path / "results.json").write_text(json.dumps(results))
  return path


def test_a_run_the_table_does_not_fit_is_one_line_naming_what_it_is(tmp_path, capsys):
  """A key the run lacks, a run that names no system, runs of different systems: one line."""
  fedscmr = _results_only(tmp_path / "fedscmr", {"system": "fedscmr", "ns": [5], "rounds": 2})
  rcsr = _results_only(tmp_path / "rcsr", {"system": "rcsr", "methods": {}})
  muscle = _run(tmp_path / "muscle", 0, "muscle", 0.1, [0.5, 0.7])
  cases = [
    (
      ["--keys=delta", fedscmr],
      f"error: {fedscmr}/results.json has no number at 'delta' (--keys); it is a fedscmr run; "
      "its numbers: ns.0, rounds.",
    ),
    (
      [muscle],
      f"error: {muscle}/results.json names no system: it was written before runs named their "
      "system; run it again (it resumes and rewrites results.json), or use --keys.",
    ),
    (
      [rcsr, fedscmr],
      f"error: the runs are of different systems: {rcsr} (rcsr); {fedscmr} (fedscmr); "
      "summarise them separately.",
    ),
    (
      [rcsr],
      f'error: {rcsr}/results.json has no "report" section: it was written before runs '
      "recorded their result tables; run it again (it resumes and rewrites the report).",
    ),
  ]
  from absl import flags

  for args, line in cases:
    flags.FLAGS.unparse_flags()
    argv = flags.FLAGS(["summarize", *map(str, args)])
    with pytest.raises(SystemExit) as e:
      summarize.main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and err == line + "\n", err
  flags.FLAGS.unparse_flags()


def test_a_system_summary_refuses_configs_differing_in_more_than_the_seed(tmp_path):
  from fedjax_mm import runner

  report = {"final": {"rcsr": {"global.R@1": 1.0}}, "baselines": {}}
  a = _results_only(tmp_path / "a", {"system": "rcsr", "report": report})
  b = _results_only(tmp_path / "b", {"system": "rcsr", "report": report})
  (b / "config.json").write_text(json.dumps({"seed": 1, "rounds": 3}))
  assert summarize.system_of([a, b]) == "rcsr"
  with pytest.raises(ValueError, match="differ in more than the seed"):
    runner.system("rcsr").summarize([a, b])
