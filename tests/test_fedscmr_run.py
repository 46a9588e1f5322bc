"""The FedSCMR command end to end: validation (exit 2), the smoke run, resume, refusal."""

import json
import shutil

import experiment_main
import jax
import pytest

from experiments import fedscmr as fedscmr_config
from fedjax_mm.runner import fedscmr as runner
from fedjax_mm.runner.workdir import WorkdirError


@pytest.fixture
def compilation_cache(tmp_path):
  """A persistent compilation cache for this test only: the resumed run reuses the
  first run's executables instead of compiling them again."""
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
  previous = {name: getattr(jax.config, name) for name in names}
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  try:
    yield
  finally:
    for name, value in previous.items():
      jax.config.update(name, value)


def test_bad_config_is_one_line_and_exit_2(tmp_path, main_cache):
  code, _, err = experiment_main.run(
    "experiments/fedscmr.py:smoke",
    tmp_path / "run",
    "--config.fedscmr.gamma=-1",
    cache_dir=main_cache,
    timeout=300,
  )
  assert code == 2, err[-2000:]
  lines = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(lines) == 1 and "gamma must be >= 0" in lines[0], err[-2000:]
  assert not (tmp_path / "run").exists()  # Nothing was written.


@pytest.mark.parametrize(
  "key,value,message",
  [
    ("methods", ("fedscmr", "fedsgd"), "unknown ['fedsgd']"),
    ("clients", [{"name": "A", "classes": 4, "train_size": 8}], "at least 2 clients"),
    ("features.text_encoder", "bert", "unknown 'bert'"),
    ("rounds", 0, "rounds must be >= 1"),
    ("dscmr.alpha", -0.5, "alpha must be >= 0"),
  ],
)
def test_validate_names_the_key(key, value, message):
  config = fedscmr_config.get_config("smoke")
  *parents, leaf = key.split(".")
  node = config
  for p in parents:
    node = node[p]
  node[leaf] = value
  with pytest.raises(runner.ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
    runner.validate(config)


def test_smoke_run_resume_and_refusal(tmp_path, compilation_cache, capsys):
  config = fedscmr_config.get_config("smoke")
  workdir = tmp_path / "run"
  reference = runner.run(config, workdir, progress=False)
  out = capsys.readouterr().out
  assert "| FedSCMR" in out and "| mAP    | Img2Txt | DSCMR" in out
  for name in ("config.json", "metrics.jsonl", "report.md", "metrics.png", "results.json"):
    assert (workdir / name).exists(), name
  assert list((workdir / "tb").iterdir())
  report = (workdir / "report.md").read_text()
  assert "Tables 1-2" in report and "N=10 C" in report
  methods = reference["methods"]
  assert set(methods) == set(config.methods)
  for m in methods.values():
    for client in ("A", "B", "C"):
      assert set(m[client]) == {
        f"{metric}@{n}/{d}"
        for metric in ("mAP", "NDCG")
        for n in (5, 10)
        for d in ("img2txt", "txt2img")
      }
      assert all(0 <= v <= 1 for v in m[client].values())
  assert sum(reference["last_weights"]["fedscmr"]) == pytest.approx(1.0, rel=1e-5)
  assert set(reference["classes"]) == {"A", "B", "C"}

  # A crash after round 1's checkpoint: the same command resumes and ends where the
  # uninterrupted run ended, bit for bit.
  shutil.rmtree(workdir / "checkpoints" / str(config.rounds))
  (workdir / "results.json").unlink()
  resumed = runner.run(config, workdir, progress=False)
  assert f"resumed at round {config.rounds - 1}" in capsys.readouterr().out
  assert resumed["methods"] == reference["methods"]
  assert resumed["last_weights"] == reference["last_weights"]
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  for m in config.methods:
    assert sorted(r["round"] for r in records if r["run"] == m) == list(range(1, config.rounds + 1))

  # A different config in the same workdir is refused.
  config.rounds += 1
  with pytest.raises(WorkdirError, match="rounds: 2 != 3"):
    runner.run(config, workdir, progress=False)


def test_summary_over_runs_is_mean_and_std():
  one = {
    "clients": ["A", "B"],
    "ns": [10],
    "seed": 0,
    "methods": {
      m: {
        c: {f"{k}@10/{d}": v for k in ("mAP", "NDCG") for d in ("img2txt", "txt2img")}
        for c, v in (("A", 0.5), ("B", 0.7))
      }
      for m in ("fedavg", "fedscmr")
    },
  }
  two = json.loads(json.dumps(one))
  two["seed"] = 1
  for m in two["methods"].values():
    for c in m.values():
      for k in c:
        c[k] += 0.1
  tables = runner.tables([one, two])
  # A at N=10: values 0.5 and 0.6, sample std 0.0707.
  assert "| mAP    | Img2Txt | FedAvg  | 0.5500 ± 0.0707 | 0.7500 ± 0.0707 |" in tables["main"]
  assert "ablation" not in tables
