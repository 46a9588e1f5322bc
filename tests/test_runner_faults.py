"""Faults the experiment loop survives: a workdir in use, a damaged checkpoint, an early NaN."""

import json
import pathlib
import socket
import subprocess
import sys

import experiment_main
import pytest

from experiments import creamfl as creamfl_config
from experiments import fedmuscle as fedmuscle_config
from experiments import fedscmr as fedscmr_config
from fedjax_mm.runner import creamfl, fedmuscle, fedscmr
from fedjax_mm.runner.errors import NonFiniteError, checkpoint_note
from fedjax_mm.runner.workdir import LOCK_FILE, WorkdirError, prepare_workdir
from fedjax_mm.runner.writers import read_metrics

RUNNERS = {
  "fedmuscle": (fedmuscle, fedmuscle_config),
  "creamfl": (creamfl, creamfl_config),
  "fedscmr": (fedscmr, fedscmr_config),
}


def _snapshot(folder: pathlib.Path) -> dict[str, bytes]:
  return {
    str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
  }


@pytest.mark.parametrize("name", RUNNERS)
def test_every_runner_refuses_a_workdir_in_use_and_touches_nothing(tmp_path, name):
  runner, module = RUNNERS[name]
  config = module.get_config("smoke")
  workdir = tmp_path / "run"
  # A run of the same config in progress: its config, a metrics line, its lock.
  prepare_workdir(workdir, config.to_dict())
  (workdir / "metrics.jsonl").write_text('{"round": 1, "run": "x"}\n')
  holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
  try:
    record = {"pid": holder.pid, "host": socket.gethostname(), "since": "then", "token": "t"}
    (workdir / LOCK_FILE).write_text(json.dumps(record))
    before = _snapshot(workdir)
    with pytest.raises(WorkdirError, match=f"in use by pid {holder.pid} on host"):
      runner.run(config, workdir, progress=False)
    assert _snapshot(workdir) == before  # metrics.jsonl, config.json and the lock: byte-identical.
  finally:
    holder.kill()
    holder.wait()


def test_a_damaged_checkpoint_is_set_aside_and_the_run_resumes_from_the_one_before(
  tmp_path, main_cache
):
  config = "experiments/fedmuscle.py:smoke"  # 3 rounds; checkpoints of rounds 2 and 3 are kept.
  workdir = tmp_path / "run"
  code, _, err = experiment_main.run(config, workdir, cache_dir=main_cache)
  assert code == 0, err[-3000:]
  lines = lambda: sorted(json.dumps(r, sort_keys=True) for r in read_metrics(workdir))
  reference, results = lines(), json.loads((workdir / "results.json").read_text())
  checkpoints = workdir / "checkpoints"
  assert sorted(p.name for p in checkpoints.iterdir()) == ["2", "3"]
  # The disk flips bytes in every chunk file of round 3's state.
  for chunk in (checkpoints / "3" / "state" / "ocdbt.process_0" / "d").iterdir():
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))

  code, out, err = experiment_main.run(config, workdir, cache_dir=main_cache)
  assert code == 0, err[-3000:]
  (line,) = [line for line in err.splitlines() if "is damaged" in line]
  assert "checkpoint of round 3 is damaged (" in line and line.endswith("resuming from round 2")
  assert "resumed at round 2" in out
  # Round 3 ran again from round 2's state, exactly as the first time.
  assert lines() == reference
  assert json.loads((workdir / "results.json").read_text())["fedmuscle"] == results["fedmuscle"]
  (aside,) = [p for p in checkpoints.iterdir() if p.name.startswith("3.damaged-")]
  assert (aside / "state").is_dir()  # Set aside, not deleted.
  assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["2", "3"]
  assert not (workdir / LOCK_FILE).exists()  # Released at the end of the run.


@pytest.mark.parametrize(
  "name,overrides,first",
  [
    ("fedmuscle", {"learning_rate": 1e30}, "fedmuscle round 1: "),
    ("creamfl", {"server_learning_rate": 1e30, "methods": ("local",)}, "local round 1: "),
    ("fedscmr", {"learning_rate": 1e30}, "dscmr round 1: "),
  ],
)
def test_a_nan_before_the_first_checkpoint_says_so(tmp_path, name, overrides, first):
  runner, module = RUNNERS[name]
  config = module.get_config("smoke")
  config.update(overrides)  # Finite learning rates, so valid; the first steps overflow.
  with pytest.raises(NonFiniteError) as info:
    runner.run(config, tmp_path / "run", progress=False)
  message = str(info.value)
  assert message.startswith(first) and message.endswith("; no checkpoint yet."), message
  assert not (tmp_path / "run" / LOCK_FILE).exists()  # Released on the exception too.
  assert checkpoint_note(3) == "the last good checkpoint (round 3) is intact"
