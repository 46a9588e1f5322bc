"""The FedSCMR command end to end: validation (exit 2), the smoke run, resume, refusal."""

import json
import shutil

import experiment_main
import jax
import ml_collections
import numpy as np
import pytest
import rounding

from experiments import fedscmr as fedscmr_config
from fedjax_mm import models
from fedjax_mm.core import cost
from fedjax_mm.core import features as features_lib
from fedjax_mm.runner import fedscmr as runner
from fedjax_mm.runner import fedscmr_report, report
from fedjax_mm.runner.workdir import WorkdirError


def test_a_damaged_encoder_checkpoint_is_one_line_and_exit_2(tmp_path, main_cache):
  # The default features: the shipped encoders, copied, one of them cut short.
  folders = {}
  for key, name in [("image_encoder", "world-clip/cnn_s"), ("text_encoder", "world-clip/gru")]:
    folders[key] = tmp_path / name.split("/")[1]
    shutil.copytree(models.pretrained.resolve(name), folders[key])
  weights = folders["image_encoder"] / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
  code, _, err = experiment_main.run(
    "experiments/fedscmr.py:smoke",
    tmp_path / "run",
    *(f"--config.features.{key}={folder}" for key, folder in folders.items()),
    cache_dir=main_cache,
    timeout=300,
  )
  assert code == 2 and "Traceback" not in err, err[-2000:]
  [line] = [line for line in err.splitlines() if line.startswith("error:")]
  assert line.startswith(f"error: {weights} cannot be read as safetensors ("), line
  assert line.endswith(
    "a copy cut short? Copy it again, or rebuild it with "
    "`python -m experiments.main --config=experiments/pretrain.py`."
  ), line
  assert not (tmp_path / "run").exists()


def test_a_full_disk_is_one_line_and_exit_2_and_the_command_resumes(tmp_path, main_cache):
  # The save of round 3 fails with ENOSPC and, as the run unwinds, so does closing the
  # metric files (no file name): the line names the first failure, the cause. Then, the
  # disk freed, the same command resumes and ends where an uninterrupted run ends.
  config, workdir, one = "experiments/fedscmr.py:smoke", tmp_path / "run", tmp_path / "one"
  flags = ("--config.methods=('fedscmr',)", "--config.ns=(5,)", "--config.rounds=6")
  code, out, err = experiment_main.run(
    config, workdir, *flags, cache_dir=main_cache, env={"FULL_DISK_AT_ROUND": "3"},
    module="tests.full_disk_main",
  )  # fmt: skip
  assert code == 2 and "Traceback" not in err, err[-3000:]
  [line] = [line for line in err.splitlines() if line.startswith("error:")]
  assert line == (
    f"error: a write failed: No space left on device ({workdir / 'checkpoints'}/"
    f"3.orbax-checkpoint-tmp/state). Every round checkpointed so far is kept in {workdir}; "
    "free some space, then the same command resumes from the last of them."
  )
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1", "2"]
  assert not (workdir / ".lock").exists()
  code, out, err = experiment_main.run(
    config, workdir, *flags, cache_dir=main_cache, module="tests.full_disk_main"
  )
  assert code == 0 and "(resumed at round 2)" in out, err[-3000:]
  code, _, err = experiment_main.run(config, one, *flags, cache_dir=main_cache)
  assert code == 0, err[-3000:]
  assert (workdir / "metrics.jsonl").read_text() == (one / "metrics.jsonl").read_text()


@pytest.mark.parametrize(
  "key,value,message",
  [
    ("methods", ("fedscmr", "fedsgd"), "unknown ['fedsgd']"),
    ("clients", [{"name": "A", "classes": 4, "train_size": 8}], "at least 2 clients"),
    ("features.text_encoder", "bert", "unknown 'bert'"),
    ("rounds", 0, "rounds must be >= 1"),
    ("dscmr.alpha", -0.5, "alpha must be >= 0"),
    ("devices", 0, "devices must be >= 1"),
    ("devices", 9, "devices must be an int in [1, 8], the cpu devices"),
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


def test_devices_spread_the_clients_and_change_no_result():
  """``config.devices=2``: the 3 clients, padded to 4, run as a loop of 2 on each device, and
  two rounds (with dropped clients and stragglers) give the real clients what one device
  gives them (float rounding apart); the padding client never counts."""
  outcomes = {}
  for devices in (1, 2):
    config = fedscmr_config.get_config("smoke")
    config.devices = devices
    config.faults.dropout = 0.34
    config.faults.stragglers = 0.5
    exp = runner.experiment(config)
    state = exp.init()["fedscmr"]
    round_fn = exp.methods["fedscmr"]
    for _ in range(2):
      state, stats = round_fn(state)
    if devices == 2:  # placement kept by the rounds
      params = state.groups[0].params
      assert {len(x.sharding.device_set) for x in jax.tree.leaves(params)} == {2}
      assert {x.shape[0] for x in jax.tree.leaves(params)} == {4}
      # The loop over clients runs over a device's 2, vmapped over the 2 devices.
      loops = cost.equations(jax.make_jaxpr(round_fn)(state), "scan")
      lengths = {e.params["length"] for e in loops}
      assert 2 in lengths and 4 not in lengths
    real = lambda x: np.asarray(x)[:3] if np.ndim(x) else np.asarray(x)  # the real clients
    outcomes[devices] = jax.tree.map(real, (state.groups[0].params, stats))
  one, two = outcomes[1], outcomes[2]
  assert np.asarray(one[1]["fault_counts"]["dropped"]) == 1  # faults were drawn
  rounding.assert_close(two, one)


def test_smoke_run_resume_and_refusal(tmp_path, compilation_cache, capsys):
  config = fedscmr_config.get_config("smoke")
  workdir = tmp_path / "run"
  reference = runner.run(config, workdir, progress=False)
  out = capsys.readouterr().out
  assert "| FedSCMR" in out and "| mAP    | Img2Txt | DSCMR" in out
  files = ("config.json", "metrics.jsonl", "report.md", "metrics.png", "global.png", "lambda.png")
  for name in (*files, "results.json"):
    assert (workdir / name).exists(), name
  assert list((workdir / "tb").iterdir())
  report = (workdir / "report.md").read_text()
  assert "Tables 1-2" in report and "N=10 C" in report
  assert "shared test (all classes)" in report and "own-class test" in report
  assert "random ranking (chance)" in report and "lambda.png" in report
  for key in ("methods", "methods_global"):
    methods = reference[key]
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
  for key in ("global_test", "own_test"):
    assert set(reference[key]) == set(config.methods)
    for m, summary in reference[key].items():
      mean = np.mean([v for c in reference[fedscmr_report.PROTOCOLS[key.split("_")[0]][0]][m].values()
                      for k, v in c.items() if k.startswith("mAP")])  # fmt: skip
      assert summary["mAP"] == pytest.approx(mean)
  assert set(reference["chance"]) == {"global_test", "own_test"}
  # lambda per round per client, for the aggregating systems only.
  assert set(reference["weights"]) == {"fedscmr"}
  lam = np.array([reference["weights"]["fedscmr"][c] for c in ("A", "B", "C")])
  assert lam.shape == (3, config.rounds)
  np.testing.assert_allclose(lam.sum(0), 1.0, rtol=1e-5)
  np.testing.assert_allclose(reference["last_weights"]["fedscmr"], lam[:, -1])
  assert len(reference["val_map"]["dscmr"]["A"]) == config.rounds
  assert set(reference["classes"]) == {"A", "B", "C"}

  # A crash after round 1's checkpoint: the same command resumes and ends where the
  # uninterrupted run ended, bit for bit.
  shutil.rmtree(workdir / "checkpoints" / str(config.rounds))
  (workdir / "results.json").unlink()
  compiled = experiment_main.cached_programs(compilation_cache)
  resumed = runner.run(config, workdir, progress=False)
  assert f"resumed at round {config.rounds - 1}" in capsys.readouterr().out
  experiment_main.assert_resume_compiled_nothing_new(compilation_cache, compiled)
  for key in ("methods", "methods_global", "weights", "val_map", "global_test", "chance"):
    assert resumed[key] == reference[key], key
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
  one["methods_global"] = one["methods"]
  two = json.loads(json.dumps(one))
  two["seed"] = 1
  for m in two["methods"].values():
    for c in m.values():
      for k in c:
        c[k] += 0.1
  config = ml_collections.ConfigDict({"clients": [{"name": "A"}, {"name": "B"}], "ns": [10]})
  tables = fedscmr_report.tables(config)
  finals = [{m: report.flatten(f) for m, f in fedscmr_report._final(r).items()} for r in (one, two)]
  main = tables[4].render_seeds(finals, [{}, {}])
  # A at N=10: values 0.5 and 0.6, mean 0.55, sample std 0.0707, 95% t half-width 12.706 x
  # 0.0707 / sqrt(2) = 0.6353 (the old table printed the std, 0.0707).
  assert "| mAP    | Img2Txt | FedAvg  | 0.5500 ± 0.6353 | 0.7500 ± 0.6353 |" in main
  assert tables[5].render_seeds(finals, [{}, {}]) is None  # FedSCMR alone: no ablation table


def test_summarize_shows_both_protocols_chance_and_the_paired_rows(tmp_path):
  dirs = []
  for seed, shift in ((0, 0.0), (1, 0.1)):
    metrics = lambda v: {
      c: {f"{k}@10/{d}": v for k in ("mAP", "NDCG") for d in ("img2txt", "txt2img")}
      for c in ("A", "B")
    }
    result = {
      "clients": ["A", "B"],
      "ns": [10],
      "seed": seed,
      "methods": {m: metrics(0.8 + shift) for m in ("dscmr", "fedscmr")},
      "methods_global": {"dscmr": metrics(0.3 + shift), "fedscmr": metrics(0.5 + shift)},
      "chance": {"global_test": {"mAP": 0.2, "NDCG": 0.2}, "own_test": {"mAP": 0.4, "NDCG": 0.4}},
    }
    chance = {"global": result["chance"]["global_test"], "own": result["chance"]["own_test"]}
    result["report"] = {
      "final": {m: report.flatten(f) for m, f in fedscmr_report._final(result).items()},
      "baselines": {"random ranking (chance)": report.flatten(chance)},
    }
    config = {"seed": seed, "clients": [{"name": "A"}, {"name": "B"}], "ns": [10]}
    (tmp_path / str(seed)).mkdir()
    (tmp_path / str(seed) / "config.json").write_text(json.dumps(config))
    (tmp_path / str(seed) / "results.json").write_text(json.dumps(result))
    dirs.append(tmp_path / str(seed))
  text = runner.SYSTEM.summarize(dirs)
  shared = text.index("Ranking on the shared test")
  own = text.index("Ranking on the own-class test")
  assert shared < own
  cells = lambda part, name: [
    c.strip() for c in part.split(f"| {name} ")[1].split("\n")[0].split("|")[1:-1]
  ]
  assert cells(text[shared:own], "FedSCMR")[0] == "0.5500 ± 0.6353"
  assert cells(text[shared:own], "random ranking (chance)")[0] == "0.2000 ± 0.0000"
  assert cells(text[own:], "DSCMR")[0] == "0.8500 ± 0.6353"
  # FedSCMR - DSCMR, seed by seed: +0.2 both times, an interval of no width: reproduced.
  paired = text[shared:own].split("| FedSCMR - DSCMR (paired) |")[1].split("\n")[0]
  assert "+0.2000 [+0.2000, +0.2000]" in paired and paired.rstrip(" |").endswith("reproduced")


def test_default_features_are_the_frozen_world_clip_encoders():
  from flax import nnx

  from fedjax_mm import data, models

  config = fedscmr_config.get_config()
  runner.validate(config)  # The shipped checkpoints resolve.
  assert (config.features.image_encoder, config.features.text_encoder) == (
    "world-clip/cnn_m",
    "world-clip/transformer_t",
  )
  f = features_lib.pretrained_features(
    3, 6, image_encoder=config.features.image_encoder, text_encoder=config.features.text_encoder
  )
  world = data.generate(3, 6)
  np.testing.assert_array_equal(f.labels, world["retrieval_label"])
  encoder = models.build_encoder(
    "cnn_m",
    rngs=nnx.Rngs(5),
    **{
      k: models.pretrained.read_config("world-clip/cnn_m")[k]
      for k in models.pretrained.size_keys("image")
    },
  )
  models.pretrained.load_into(encoder, "world-clip/cnn_m")
  np.testing.assert_allclose(f.image, np.asarray(encoder(world["image"])[0]), rtol=1e-5, atol=1e-5)
  assert f.text.shape == (6, models.pretrained.read_config("world-clip/transformer_t")["features"])
  config.features.image_encoder = "world-clip/transformer_t"
  with pytest.raises(runner.ConfigError, match="is a text encoder"):
    runner.validate(config)
