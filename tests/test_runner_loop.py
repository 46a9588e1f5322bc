"""The experiment loop on a toy experiment: SIGKILL anywhere, rerun, same files; the NaN guard."""

import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import loop_toy
import pytest

from fedjax_mm.runner import loop
from fedjax_mm.runner.errors import NonFiniteError, Preempted

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _start(workdir, *pause) -> subprocess.Popen:
  """``tests/loop_toy.py`` in a subprocess on the real CPU device, as ``experiment_main``."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env["PYTHONPATH"] = str(ROOT)
  cmd = [sys.executable, str(ROOT / "tests" / "loop_toy.py"), str(workdir), *pause]
  return subprocess.Popen(
    cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )


def _finish(proc: subprocess.Popen) -> str:
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  return out


def _outputs(workdir: pathlib.Path):
  """``metrics.jsonl`` as text and ``results.json`` without its wall time."""
  results = json.loads((workdir / "results.json").read_text())
  del results["wall_time_s"]
  return (workdir / "metrics.jsonl").read_text(), results


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("toy") / "reference"
  out = _finish(_start(workdir))
  assert "resumed" not in out
  return _outputs(workdir)


def test_the_uninterrupted_run(reference):
  metrics, results = reference
  rows = [json.loads(line) for line in metrics.splitlines()]
  for m in ("one", "two"):
    draws = [r["round"] for r in rows if r["run"] == m and "draw" in r]
    assert draws == [1, 2, 3, 4, 5]  # Every round once, in order.
    evaluated = [(r["round"], r["user a/x"]) for r in rows if r["run"] == m and "user a/x" in r]
    step = loop_toy.STEPS[m]
    assert evaluated == [
      (2, 2 * step),
      (4, 4 * step),
      (5, 5 * step),
    ]  # Every 2 rounds and the last.
  assert results["final"] == {
    "one": {"user a": 5.0, "user b": 5.0},
    "two": {"user a": 10.0, "user b": 10.0},
  }
  assert results["traffic"] == {"one": [5 * 2 * 4, 5 * 2 * 8]}  # "two" sends nothing: no ledger.
  assert results["ledger_rounds"] == [1, 2, 3, 4, 5]
  assert results["gap"] == [[2, 2.0], [4, 4.0], [5, 5.0]]
  assert len({d for _, d in results["draws"]["one"] + results["draws"]["two"]}) == 10


@pytest.mark.parametrize(
  "pause,resumes_from",
  [
    ("round:1", 0),  # Before the first checkpoint.
    ("round:3", 2),  # Between checkpoints, "one" a round ahead of "two".
    ("checkpoint:4", 2),  # Round 4's checkpoint on disk, never finalised; rounds after it logged.
    ("report", 5),  # report.md written, results.json not: the rerun runs no round.
  ],
)
def test_killed_anywhere_the_rerun_ends_as_the_uninterrupted_run(
  tmp_path, reference, pause, resumes_from
):
  workdir = tmp_path / "run"
  proc = _start(workdir, pause)
  marker = pathlib.Path(f"{workdir}.paused")
  intact = workdir / "checkpoints" / str(resumes_from)  # Finalised steps are renamed into place.
  deadline = time.time() + 300
  while not marker.exists() or (resumes_from and not intact.exists()):
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert time.time() < deadline, pause
    time.sleep(0.05)
  proc.kill()  # SIGKILL: no handler, no cleanup.
  proc.wait()
  if pause == "checkpoint:4":
    names = [p.name for p in (workdir / "checkpoints").iterdir()]
    assert "4" not in names and any(n.startswith("4.orbax-checkpoint-tmp") for n in names), names
  if pause == "report":
    assert (workdir / "report.md").exists() and not (workdir / "results.json").exists()

  out = _finish(_start(workdir))
  assert (f"(resumed at round {resumes_from})" in out) == (resumes_from > 0), out
  metrics, results = _outputs(workdir)
  # The same lines in the same order: none lost, none twice.
  assert metrics.splitlines() == reference[0].splitlines()
  assert results == reference[1]


def test_a_nan_stops_the_run_and_names_the_checkpoint_a_rerun_resumes_from(tmp_path):
  config = loop_toy.get_config()
  config.nan_at = 3
  with pytest.raises(NonFiniteError) as info:
    loop.run(loop_toy.experiment, config, tmp_path / "run", progress=False)
  assert str(info.value) == (
    "two round 3: an update produced NaN/Inf for user b; "
    "the last good checkpoint (round 2) is intact."
  )
  rounds = [json.loads(line)["round"] for line in (tmp_path / "run" / "metrics.jsonl").open()]
  assert max(rounds) == 2  # Round 3 was neither logged nor saved.
  assert not (tmp_path / "run" / "checkpoints" / "3").exists()


@pytest.mark.parametrize("stop", ["preempted", "nan"])
def test_the_bar_shows_the_rounds_finished_when_the_run_stops(tmp_path, monkeypatch, capsys, stop):
  """A preemption after round 3 leaves the bar at 3/5; a NaN inside round 3 at 2/5."""
  config = loop_toy.get_config()
  if stop == "nan":
    config.nan_at, error = 3, NonFiniteError
  else:  # What every process sees once a notice has come during round 3.
    monkeypatch.setattr(loop.processes, "preempted", lambda step: step == 3)
    error = Preempted
  with pytest.raises(error):
    loop.run(loop_toy.experiment, config, tmp_path / "run", progress=True)
  bar = capsys.readouterr().err.split("\r")[-1]  # The bar's last state, as left on screen.
  assert f"{2 if stop == 'nan' else 3}/5" in bar, bar


def test_states_larger_than_the_memory_left_are_refused_before_anything_is_made(
  tmp_path, monkeypatch
):
  """On a CPU the system kills a run whose states do not fit, with no word; the loop sizes
  them first (jax.eval_shape of init, nothing allocated) and says so in one line."""
  from fedjax_mm.runner.errors import ConfigError

  # Each toy method: a round counter (4 bytes), two float32 scalars (8), a threefry key (8).
  monkeypatch.setattr(loop, "memory_available", lambda: 39)
  with pytest.raises(ConfigError) as info:
    loop.run(loop_toy.experiment, loop_toy.get_config(), tmp_path / "run", progress=False)
  assert str(info.value) == (
    "the states of the 2 methods take 40 B (the largest: one 20 B, two 20 B), more than the "
    "39 B of memory available here, before any activation or compiled program: the system "
    "would kill the run. Run fewer methods (--config.methods) or smaller models."
  )
  assert not (tmp_path / "run").exists()
  monkeypatch.setattr(loop, "memory_available", lambda: 40)  # Exactly the states' 40 bytes.
  loop.run(loop_toy.experiment, loop_toy.get_config(), tmp_path / "run", progress=False)


def test_restored_state_keeps_each_leafs_placement_so_the_round_compiles_once():
  """A fresh state's leaves are uncommitted; restored ones must be too (and committed ones
  stay on their sharding): jit keys its cache on argument shardings, so a committed copy
  made every resumed run compile its rounds again (seen in FedRGB's resume test)."""
  state = loop_toy.experiment(loop_toy.get_config()).init()
  restored = loop._unpack(loop._pack(state["one"]), state["one"])
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state["one"]), strict=True):
    assert got.committed == want.committed is False
  step = jax.jit(lambda s: jax.tree.map(lambda x: x, s))
  step(state["one"])
  step(restored)
  assert step._cache_size() == 1
  # A committed template (a sharded state) gives leaves on its shardings.
  device = jax.devices()[-1]
  placed = jax.device_put(state["two"], device)
  back = loop._unpack(loop._pack(placed), placed)
  for got in jax.tree.leaves(back):
    assert got.committed and got.sharding == jax.sharding.SingleDeviceSharding(device)
  assert all(
    bool((jax.random.key_data(a) == jax.random.key_data(b)).all())
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
    else bool((a == b).all())
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(placed), strict=True)
  )


def test_a_weakly_typed_leaf_gets_its_dtype_so_fresh_and_restored_rounds_are_one_program():
  """A checkpoint restores every leaf strongly typed; the loop types a fresh state's weak
  leaves the same, keeping values, placement and keys (RCSR's ``last_wr`` was weak, and
  every resumed RCSR run compiled its rounds again)."""
  device = jax.devices()[-1]
  state = {
    "weak": jnp.full((3,), 0.25),
    "placed": jax.device_put(jnp.full((2,), 1.5), device),
    "strong": jnp.arange(4, dtype=jnp.int32),
    "key": jax.random.key(0),
    "scalar": jnp.asarray(2.0),
  }
  assert jax.typeof(state["weak"]).weak_type and jax.typeof(state["placed"]).weak_type
  typed = loop.strongly_typed(state)
  for name, x in typed.items():
    assert not jax.typeof(x).weak_type, name
    assert x.dtype == state[name].dtype and x.committed == state[name].committed, name
  assert typed["placed"].sharding == jax.sharding.SingleDeviceSharding(device)
  assert typed["strong"] is state["strong"] and typed["key"] is state["key"]
  assert all(bool((typed[k] == state[k]).all()) for k in ("weak", "placed", "scalar"))
  fresh = {k: state[k] for k in ("weak", "strong", "key", "scalar")}  # as init gives them
  typed = loop.strongly_typed(fresh)
  restored = loop._unpack(loop._pack(typed), typed)
  step = jax.jit(lambda s: jax.tree.map(lambda x: x, s))
  step(typed)
  step(restored)
  assert step._cache_size() == 1
  step(fresh)  # ... where the weak fresh state was another program
  assert step._cache_size() == 2


def test_the_bar_names_the_method_and_phase_within_a_round(tmp_path, capsys):
  """One round of every method may take minutes: the bar says which method does what
  (toy: evaluation every 2 rounds and at the last), then ends on its own label."""
  loop.run(loop_toy.experiment, loop_toy.get_config(), tmp_path / "run", progress=True)
  states = [s.strip() for s in capsys.readouterr().err.split("\r") if s.strip()]
  phases = [s[len("rounds (") : s.index(")")] for s in states if s.startswith("rounds (")]
  # Every phase is drawn as it starts (the label refreshes at once, unlike the count).
  one_round = ["one: training", "two: training"]
  evaluated = ["one: training", "one: evaluation", "two: training", "two: evaluation"]
  assert phases == one_round + evaluated + one_round + 2 * evaluated, phases
  assert states[-1].startswith("rounds: 100%") and "5/5" in states[-1], states[-1]
