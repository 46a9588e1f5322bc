"""The CreamFL command end to end: smoke run, resume, refusal, one-line config errors."""

import json

import experiment_main
import pytest

from experiments import creamfl as creamfl_config
from fedjax_mm.runner import creamfl as runner
from fedjax_mm.runner.workdir import WorkdirError


@pytest.mark.parametrize(
  "key,value,message",
  [
    ("methods", ("CreamFL", "FedXYZ"), "unknown ['FedXYZ']"),
    ("creamfl.num_selected", 7, "num_selected (7)"),
    ("creamfl.muscle_partners", 4, "muscle_partners (M=4)"),
    ("creamfl.muscle_tau_reduced", 0.3, "gamma > 0"),
    ("public.size", 10, "multiple of creamfl.batch_size"),
    ("test.folds", 4, "must divide test.size"),
    ("creamfl.inter_temperature", 0.0, "inter_temperature must be > 0"),
  ],
)
def test_validate_rejects_bad_configs(key, value, message):
  config = creamfl_config.get_config("smoke")
  node, leaf = config, key.split(".")
  for part in leaf[:-1]:
    node = node[part]
  node[leaf[-1]] = value
  with pytest.raises(runner.ConfigError, match=None) as e:
    runner.validate(config)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_encoder_of_the_wrong_modality():
  config = creamfl_config.get_config("smoke")
  config.clients.text.encoder = "vit_t"
  with pytest.raises(runner.ConfigError, match="encodes image, not text"):
    runner.validate(config)


def test_bad_config_exits_2_in_one_line(tmp_path, main_cache):
  code, _, err = experiment_main.run(
    "experiments/creamfl.py:smoke",
    tmp_path / "run",
    "--config.creamfl.num_selected=0",
    cache_dir=main_cache,
    timeout=300,
  )
  assert code == 2, err[-2000:]
  lines = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(lines) == 1 and "num_selected" in lines[0], err[-2000:]
  assert not (tmp_path / "run").exists()  # Nothing was written.


def test_smoke_run_resume_and_refusal(tmp_path, capsys):
  config = creamfl_config.get_config("smoke")
  workdir = tmp_path / "run"
  result = runner.run(config, workdir, progress=False)
  out = capsys.readouterr().out
  assert "| CreamFL+Muscle" in out and "| local" in out and "R@1_sum" in out
  for name in ("config.json", "metrics.jsonl", "report.md", "curves.png", "results.json"):
    assert (workdir / name).exists(), name
  stored = json.loads((workdir / "results.json").read_text())
  assert set(stored["recall"]) == set(runner.METHODS)
  for recall in stored["recall"].values():
    assert set(recall) == set(runner.RECALL_KEYS)
    assert all(0.0 <= v <= 100.0 for v in recall.values())
    assert recall["i2t_R@1"] <= recall["i2t_R@5"] <= recall["i2t_R@10"]
  # Bytes: the server alone sends nothing; every selected client receives I_glob and T_glob.
  assert stored["traffic"]["local"] == {"up_per_round": 0.0, "down_per_round": 0.0}
  matrix = config.public.size * config.rep_dim * 4
  for method in runner.METHODS[1:]:
    traffic = stored["traffic"][method]
    assert traffic["down_per_round"] == config.creamfl.num_selected * 2 * matrix
    assert config.creamfl.num_selected * matrix <= traffic["up_per_round"]
    assert traffic["up_per_round"] <= config.creamfl.num_selected * 2 * matrix
  rounds = sorted({json.loads(line)["round"] for line in (workdir / "metrics.jsonl").open()})
  assert rounds == list(range(1, config.rounds + 1))

  # The same command again resumes from the last checkpoint and reproduces the results.
  again = runner.run(config, workdir, progress=False)
  assert "resumed at round" in capsys.readouterr().out
  assert again["recall"] == result["recall"] and again["traffic"] == result["traffic"]

  # The seeds summary: identical runs have zero spread.
  summary = runner.summarize([workdir, workdir])
  table = summary.split("\n\n")[0]
  assert "| CreamFL " in table and table.count("±") == table.count("± 0.00") > 10

  # Another config in the same workdir is refused.
  config.rounds += 1
  with pytest.raises(WorkdirError, match="rounds"):
    runner.run(config, workdir, progress=False)
