"""The FedMuscle command end to end: smoke run, validation, refusal, resume after SIGKILL."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from experiments import fedmuscle as fedmuscle_config
from fedjax_mm.runner import fedmuscle as runner

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _main(workdir, *overrides, wait=True):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env["PYTHONPATH"] = str(ROOT)
  cmd = [
    sys.executable,
    "-m",
    "experiments.main",
    "--config=experiments/fedmuscle.py:smoke",
    f"--workdir={workdir}",
    *overrides,
  ]
  proc = subprocess.Popen(
    cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )
  if not wait:
    return proc
  out, err = proc.communicate(timeout=600)
  return proc.returncode, out, err


@pytest.mark.parametrize(
  "override,message",
  [
    ("--config.muscle.num_partners=3", "num_partners"),
    ("--config.muscle.batch_size=1", "at least 2"),
    ("--config.muscle.tau_reduced=0.25", "gamma > 0"),
    ("--config.muscle.loss=cosine", "muscle.loss"),
    ("--config.public.modalities=('text',)", "needs image in the public set"),
  ],
)
def test_bad_config_is_one_line_and_exit_2(tmp_path, override, message):
  code, _, err = _main(tmp_path / "run", override)
  assert code == 2, err[-2000:]
  lines = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(lines) == 1 and message in lines[0], err[-2000:]
  assert not (tmp_path / "run").exists()  # Nothing was written.


def test_unknown_model_and_task_names():
  config = fedmuscle_config.get_config("smoke")
  config.users[0]["encoder"] = "vit_xxl"
  with pytest.raises(runner.ConfigError, match="unknown encoder 'vit_xxl'"):
    runner.validate(config)
  config = fedmuscle_config.get_config("smoke")
  config.users[1]["task"] = "detection"
  with pytest.raises(runner.ConfigError, match="unknown task 'detection'"):
    runner.validate(config)


def test_smoke_run_resume_after_kill_and_refusal(tmp_path):
  # Uninterrupted reference.
  code, out, err = _main(tmp_path / "ref", "--config.rounds=4")
  assert code == 0, err[-3000:]
  assert "Delta =" in out and "| user 1" in out
  for name in (
    "config.json",
    "metrics.jsonl",
    "report.md",
    "metrics.png",
    "delta.png",
    "results.json",
  ):
    assert (tmp_path / "ref" / name).exists(), name
  assert list((tmp_path / "ref" / "tb").iterdir())
  reference = json.loads((tmp_path / "ref" / "results.json").read_text())

  # Killed mid-run (SIGKILL once round 2 is checkpointed), then resumed by the same command.
  proc = _main(tmp_path / "run", "--config.rounds=4", wait=False)
  deadline = time.time() + 600
  while not (tmp_path / "run" / "checkpoints" / "2" / "_CHECKPOINT_METADATA").exists():
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert time.time() < deadline
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  code, out, err = _main(tmp_path / "run", "--config.rounds=4")
  assert code == 0, err[-3000:]
  assert "resumed at round" in out
  resumed = json.loads((tmp_path / "run" / "results.json").read_text())
  assert resumed["fedmuscle"] == reference["fedmuscle"] and resumed["local"] == reference["local"]
  assert resumed["traffic_total"] == reference["traffic_total"]  # The ledger survived the kill.
  assert reference["traffic_total"]["up"] == 3 * 4 * reference["traffic_per_round"]["up"]
  rounds = [
    json.loads(line)["round"]
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  ]
  assert sorted(set(rounds)) == [1, 2, 3, 4]

  # A different config in the same workdir is refused, and nothing is touched.
  code, _, err = _main(tmp_path / "run", "--config.rounds=5")
  assert code == 2 and "rounds: 4 != 5" in err and "--overwrite" in err


def test_delta_leaves_out_users_whose_local_metric_is_zero():
  value, excluded = runner._delta([0.6, 0.3, 0.5], [0.5, 0.0, 0.25])
  assert excluded == [1]
  assert value == pytest.approx(((0.6 - 0.5) / 0.5 + (0.5 - 0.25) / 0.25) / 2)
  value, excluded = runner._delta([0.6, 0.3], [0.0, 0.0])
  assert excluded == [0, 1] and value != value  # NaN: no user has a defined gain.
