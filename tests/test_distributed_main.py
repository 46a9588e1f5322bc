"""``experiments.main --distributed``: two processes on loopback run one experiment, written once.

Each process gets one CPU device (``experiment_main`` passes no fake-device
flag), and the runner spreads the clients over both (``core.job_mesh``: one
device of each process), so each process trains half of them. Process 0 writes
the workdir; both take part in the rounds' collectives and the Orbax
checkpoints. The reference is one process with two CPU devices
(``--cpu_devices=2 --config.devices=2``), the same mesh in one process: the
two-process workdir must hold the same files, each written once, with the same
metric lines and results, bit for bit.
"""

import concurrent.futures
import json
import pathlib
import re
import shutil
import signal
import socket
import time

import experiment_main
import pytest

from experiments.main import distributed_args

CONFIG = "experiments/fedscmr.py:smoke"  # The smallest smoke run: bag-of-words text, no encoder.
OVERRIDES = ("--config.methods=('fedscmr',)", "--config.ns=(5,)")  # One system and one N.
# The one-process reference: the two processes' mesh (a device of each) as two devices of one.
REFERENCE = ("--cpu_devices=2", "--config.devices=2")
# Cache every program, not only those compiling for over a second, so that the
# two processes reuse the reference's compilations.
ENV = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(workdir, *overrides, cache_dir, config=CONFIG, base=OVERRIDES):
  """Runs the command as processes 0 and 1 of one job: ``[(exit code, stdout, stderr)] * 2``."""
  return _finish(_start(workdir, *overrides, cache_dir=cache_dir, config=config, base=base))


def _start(workdir, *overrides, cache_dir, config=CONFIG, base=OVERRIDES, env=None, **kwargs):
  """Starts the command as processes 0 and 1 of one job; :func:`_finish` waits for them."""
  flags = ["--distributed", f"--coordinator=localhost:{_free_port()}", "--num_processes=2"]
  return [
    experiment_main.start(
      config,
      workdir,
      *base,
      *overrides,
      *flags,
      f"--process_id={i}",
      cache_dir=cache_dir,
      env=ENV | (env or {}),
      **kwargs,
    )
    for i in range(2)
  ]


def _finish(procs, timeout=900):
  """Waits for both processes: ``[(exit code, stdout, stderr)] * 2``."""
  try:  # Both pipes drained at once: a process blocked on a full pipe would stall the other.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      outputs = list(pool.map(lambda p: p.communicate(timeout=timeout), procs))
  finally:
    for p in procs:
      p.kill()
  return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]


def _listing(workdir: pathlib.Path) -> list[str]:
  """Every path in ``workdir``, except what Orbax writes inside a step (it names files per
  process) and the name of a TensorBoard event file (it holds a time and the host)."""
  paths = []
  for path in workdir.rglob("*"):
    parts = path.relative_to(workdir).parts
    if parts[0] == "checkpoints" and len(parts) > 2:
      continue
    if parts[0] == "tb" and len(parts) == 3:
      parts = (*parts[:2], "<event file>")
    paths.append("/".join(parts))
  return sorted(paths)


def _own_lines(stdout: str) -> list[str]:
  """What the command printed, without gloo's line on joining the job (its CPU collectives')."""
  return [line for line in stdout.splitlines() if not line.startswith("[Gloo]")]


def _results(workdir: pathlib.Path) -> str:
  """``results.json`` without the wall time, as text (NaN compares equal to NaN there)."""
  results = json.loads((workdir / "results.json").read_text())
  results.pop("wall_time_s", None)  # RCSR and FedRGB write none.
  return json.dumps(results, sort_keys=True)


def _config(workdir: pathlib.Path) -> tuple[int, dict]:
  """``config.json`` as ``(devices, the rest)``: ``devices`` is a count per process, 2 in the
  reference and 1 in each of the job's two processes, the same mesh of two devices."""
  config = json.loads((workdir / "config.json").read_text())
  return config.pop("devices"), config


@pytest.fixture(scope="module")
def runs(tmp_path_factory, main_cache):
  """The reference (one process) and the two-process job of the same command, finished."""
  one, two = tmp_path_factory.mktemp("one") / "run", tmp_path_factory.mktemp("two") / "run"
  code, _, err = experiment_main.run(
    CONFIG, one, *OVERRIDES, *REFERENCE, cache_dir=main_cache, env=ENV
  )
  assert code == 0, err[-3000:]
  outputs = _launch(two, cache_dir=main_cache)
  for code, _, err in outputs:
    assert code == 0, err[-3000:]
  return one, two, outputs


def test_two_processes_write_once_what_one_writes(runs):
  one, two, [(_, out0, err0), (_, out1, err1)] = runs
  # Process 0 prints the tables and shows the progress bar; process 1 is quiet.
  assert "FedSCMR" in out0 and "rounds:" in err0
  assert _own_lines(out1) == [] and "rounds:" not in err1
  listing = _listing(two)
  assert listing == _listing(one)
  assert listing.count("tb/fedscmr/<event file>") == 1
  assert [p for p in listing if p.startswith("checkpoints/")] == ["checkpoints/1", "checkpoints/2"]
  # The same lines, byte for byte, each once (one writer); the same config and results.
  metrics = (two / "metrics.jsonl").read_text()
  assert metrics == (one / "metrics.jsonl").read_text()
  assert len(metrics.splitlines()) == 2  # Rounds 1 and 2 of the one system.
  (devices_one, config_one), (devices_two, config_two) = _config(one), _config(two)
  assert (devices_one, devices_two) == (2, 1) and config_two == config_one
  assert _results(two) == _results(one)
  # Every array in the checkpoints carries the CRC-32 the reference records for it, the
  # packed client states split over the two processes too (summed from their pieces).
  for step in ("1", "2"):
    sums_one, sums_two = (
      json.loads((workdir / "checkpoints" / step / "checksums" / "metadata").read_text())
      for workdir in (one, two)
    )
    assert sums_two == sums_one


# FedRGB, one method and one round: it keeps its state replicated and splits the clients a
# round trains, where FedSCMR pads its group. CreamFL (padded groups, like FedSCMR) and
# RCSR (like FedRGB) were compared the same way by hand (docs/guides/multi_host.md); each case costs 1-2
# minutes of this suite.
FEDRGB = ("--config.methods=('fedrgb',)", "--config.num_clients=4", "--config.rounds=1")


def test_fedrgb_spreads_its_clients_over_the_processes(tmp_path, main_cache):
  config = "experiments/fedrgb.py:smoke"
  one, two = tmp_path / "one", tmp_path / "two"
  code, _, err = experiment_main.run(
    config, one, *FEDRGB, *REFERENCE, cache_dir=main_cache, env=ENV, timeout=900
  )
  assert code == 0, err[-3000:]
  for code, _, err in _launch(two, cache_dir=main_cache, config=config, base=FEDRGB):
    assert code == 0, err[-3000:]
  metrics = (two / "metrics.jsonl").read_text()
  assert metrics == (one / "metrics.jsonl").read_text() and metrics
  # The final evaluations (distortion, few-shot fine-tuning, segmentation) ran too.
  assert '"distortion"' in (one / "results.json").read_text()
  assert _results(two) == _results(one)


def test_devices_of_every_process_must_divide_fedrgbs_clients(tmp_path, main_cache):
  # FedRGB splits its clients evenly over the devices of both processes: 3 clients on 2
  # devices is refused before anything is written, in one line on each process.
  outputs = _launch(
    tmp_path / "run",
    cache_dir=main_cache,
    config="experiments/fedrgb.py:smoke",
    base=("--config.methods=('fedrgb',)",),
  )
  for code, _, err in outputs:
    assert code == 2, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
      "error: devices (1) x processes (2) = 2 must divide num_clients (3): each device "
      "trains an equal share of the clients."
    ], err[-3000:]
  assert not (tmp_path / "run").exists()


def test_a_refusal_ends_the_processes_together_when_one_starts_late(tmp_path, main_cache):
  # Process 1 sleeps 5 s after starting its backend; process 0 meets the config error
  # at once. Had it left the job at once, process 1 would have lost the coordination
  # service in its sleep and JAX would abort it (exit -6, seen in CI with a process
  # merely slow to start). Both wait for each other at JAX's shutdown barrier instead.
  procs = _start(
    tmp_path / "run",
    "--config.rounds=0",
    cache_dir=main_cache,
    env={"LATE_START": "1:5"},
    module="tests.lone_failure_main",
  )
  for code, _, err in _finish(procs, timeout=150):
    assert code == 2, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
      "error: rounds must be >= 1, got 0."
    ], err[-3000:]
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("file", ["config.json", "results.json"])
def test_process_0_failing_where_the_others_end_too_meets_them_at_the_barrier(
  tmp_path, main_cache, file
):
  """Process 0's disk fills where the other process ends too, not waiting on it.

  Writing ``config.json`` (claiming the workdir) the other hears that process 0
  could not claim it and refuses; writing ``results.json`` (after the last
  collective) the other has finished. Had process 0 left at once, the other would
  have lost the coordination service that process 0 holds, and JAX aborts it
  (exit -6 with a C++ stack trace; both seen by hand before this test).
  """
  workdir = tmp_path / "run"
  procs = _start(
    workdir,
    "--config.rounds=1",
    cache_dir=main_cache,
    env={"FULL_DISK": file},
    module="tests.lone_failure_main",
  )
  (code0, _, err0), (code1, _, err1) = _finish(procs, timeout=300)
  full = f"error: a write failed: No space left on device ({workdir}/{file})"
  assert code0 == 2 and full in err0 and "Traceback" not in err0, err0[-3000:]
  if file == "config.json":
    assert code1 == 2, err1[-3000:]
    assert [line for line in err1.splitlines() if line.startswith("error:")] == [
      f"error: --workdir {workdir}: process 0 could not claim it (see its error)."
    ], err1[-3000:]
    assert not (workdir / "config.json").exists()
  else:
    assert code1 == 0 and "error" not in err1, err1[-3000:]
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1"]
    assert not (workdir / "results.json").exists()
    # The same command, with room again, writes what the full disk stopped.
    for code, _, err in _launch(workdir, "--config.rounds=1", cache_dir=main_cache):
      assert code == 0, err[-3000:]
    assert json.loads((workdir / "results.json").read_text())
  assert not (workdir / ".lock").exists()


def test_two_processes_resume_together(runs, tmp_path, main_cache):
  one, finished, _ = runs
  two = tmp_path / "run"
  shutil.copytree(finished, two)
  # The same command again: both processes restore round 2 (a collective Orbax read of
  # the state stored once for both), find no round left and report anew, once.
  (code0, out0, err0), (code1, out1, err1) = _launch(two, cache_dir=main_cache)
  assert code0 == 0, err0[-3000:]
  assert code1 == 0, err1[-3000:]
  assert "resumed at round 2" in out0 and _own_lines(out1) == []
  # A resumed writer opens one more event file, as it does with one process.
  assert _listing(two) == sorted(_listing(finished) + ["tb/fedscmr/<event file>"])
  assert (two / "metrics.jsonl").read_text() == (one / "metrics.jsonl").read_text()
  assert _results(two) == _results(one)


def _wait_for(path: pathlib.Path, procs, timeout: float = 600) -> None:
  deadline = time.monotonic() + timeout
  while not path.exists():
    assert time.monotonic() < deadline, f"no {path} after {timeout} s"
    assert all(p.poll() is None for p in procs), "a process ended before " + str(path)
    time.sleep(0.05)


def _stopped_after(outputs) -> int:
  """The round both processes report stopping after, each with exit status 143."""
  stops = []
  for code, _, err in outputs:
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    stops += re.findall(r"^stopped by SIGTERM or Ctrl-C to a process of the job: every process stopped "
                        r"after round (\d+), which is checkpointed in ", err, re.MULTILINE)  # fmt: skip
  assert len(stops) == 2 and stops[0] == stops[1], stops
  return int(stops[0])


def _rounds(workdir: pathlib.Path) -> list[int]:
  return [
    json.loads(line)["round"] for line in (workdir / "metrics.jsonl").read_text().splitlines()
  ]


def test_sigterm_to_one_process_stops_the_job_after_one_round_and_it_resumes(tmp_path, main_cache):
  """JAX's preemption notifier takes SIGTERM in a job of several processes, where the process
  would otherwise go on to the end: the loop stops both processes after the same round,
  checkpointed, with exit status 143, and the same command resumes to what an
  uninterrupted run writes. Ctrl-C is sent on as SIGTERM, with the same effect."""
  rounds = ("--config.rounds=40",)
  one, workdir = tmp_path / "one", tmp_path / "run"
  code, _, err = experiment_main.run(
    CONFIG, one, *OVERRIDES, *REFERENCE, *rounds, cache_dir=main_cache, env=ENV
  )
  assert code == 0, err[-3000:]
  # A preemption notice to process 1 (not the writer) once round 1 is checkpointed.
  procs = _start(workdir, *rounds, cache_dir=main_cache)
  _wait_for(workdir / "checkpoints" / "1", procs)
  procs[1].send_signal(signal.SIGTERM)
  stopped = _stopped_after(_finish(procs))
  assert 1 <= stopped < 40
  assert max(int(p.name) for p in (workdir / "checkpoints").iterdir()) == stopped
  assert _rounds(workdir) == list(range(1, stopped + 1))
  assert not (workdir / ".lock").exists()
  # The same command, Ctrl-C to process 0 as soon as it holds the lock, sent on as a notice:
  # one taken while the job starts stops it at the round it resumes from (or, if the notice
  # is slower than building and restoring the states, after one more); without the loop's
  # catch-up the job would miss the sync point and run to the end.
  procs = _start(workdir, *rounds, cache_dir=main_cache)
  _wait_for(workdir / ".lock", procs)
  procs[0].send_signal(signal.SIGINT)
  resumed = _stopped_after(_finish(procs))
  assert resumed in (stopped, stopped + 1)
  assert _rounds(workdir) == list(range(1, resumed + 1))
  # Then to the end: what the uninterrupted one-process run wrote.
  (code0, out0, err0), (code1, _, err1) = _launch(workdir, *rounds, cache_dir=main_cache)
  assert code0 == 0 and code1 == 0, (err0[-3000:], err1[-3000:])
  assert f"resumed at round {resumed}" in out0
  assert (workdir / "metrics.jsonl").read_text() == (one / "metrics.jsonl").read_text()
  assert _results(workdir) == _results(one)


LEAVES = (
  "error: process {} of the job's 2 stopped on the error above and leaves the job (if it is "
  "a closed connection, another process stopped first: its output says why); the same "
  "command resumes from the last checkpoint."
)


@pytest.mark.parametrize("failing", [0, 1])
def test_a_process_that_fails_alone_ends_the_job_at_once_and_it_resumes(
  runs, tmp_path, main_cache, failing
):
  """One process fails in round 2 while the other waits in the round's collectives.

  JAX's exit would hold the failing process at its shutdown barrier, waiting for the
  other, which waited on its collectives: both aborted after 318 s with a C++ stack
  trace (exit 134), the failing one's own error line printed long before. Leaving
  the job at once ends both in seconds: the failing one with its own error (a full
  disk: one line, exit 2; anything else: its traceback, exit 1), the other on the
  closed connection, exit 1. The same command then resumes from round 1.
  """
  one, _, _ = runs
  workdir = tmp_path / "run"
  procs = _start(
    workdir,
    cache_dir=main_cache,
    env={"LONE_FAILURE": f"{failing}:2"},
    module="tests.lone_failure_main",
  )
  (code0, _, err0), (code1, _, err1) = _finish(procs, timeout=150)  # Not the 300 s barrier.
  if failing == 0:
    assert code0 == 2, err0[-3000:]
    assert f"error: a write failed: No space left on device ({workdir}/metrics.jsonl)" in err0
    assert "Traceback" not in err0 and LEAVES.format(0) not in err0
    assert code1 == 1 and err1.rstrip().endswith(LEAVES.format(1)), err1[-3000:]
  else:
    assert code1 == 1 and err1.rstrip().endswith(LEAVES.format(1)), err1[-3000:]
    assert "RuntimeError: lone_failure_main: process 1 fails in round 2" in err1
    assert code0 == 1 and err0.rstrip().endswith(LEAVES.format(0)), err0[-3000:]
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1"]
  assert not (workdir / ".lock").exists()
  (code0, out0, err0), (code1, _, err1) = _launch(workdir, cache_dir=main_cache)
  assert code0 == 0 and code1 == 0, (err0[-3000:], err1[-3000:])
  assert "resumed at round 1" in out0
  assert (workdir / "metrics.jsonl").read_text() == (one / "metrics.jsonl").read_text()
  assert _results(workdir) == _results(one)


def test_one_process_refuses_the_checkpoints_of_two(runs, tmp_path, main_cache):
  # The same config on one process of one device pads FedSCMR's 3 clients to 3, not to the
  # job's 4: the checkpoints cannot fit. Refused in one line, before any restore, and none
  # of them is set aside as damaged.
  _, finished, _ = runs
  workdir = tmp_path / "run"
  shutil.copytree(finished, workdir)
  code, out, err = experiment_main.run(CONFIG, workdir, *OVERRIDES, cache_dir=main_cache, env=ENV)
  assert code == 2 and out == "", err[-3000:]
  [line] = [line for line in err.splitlines() if line.startswith("error:")]
  assert "hold states of other sizes than this run's (round 2: fedscmr " in line, line
  assert "written by a job on another number of processes" in line, line
  assert _listing(workdir) == _listing(finished)


def test_a_refused_workdir_stops_both_processes(tmp_path, main_cache):
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text('{"seed": 99}\n')
  outputs = _launch(workdir, cache_dir=main_cache)
  errors = []
  for code, _, err in outputs:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, err[-3000:]
    errors.append(lines[0])
  assert "different config" in errors[0]
  assert "process 0 could not claim it" in errors[1]
  assert sorted(p.name for p in workdir.iterdir()) == ["config.json"]  # Lock released.


@pytest.mark.parametrize(
  "args,message",
  [
    ((False, "localhost:1234", 2, 0), "--coordinator, --num_processes, --process_id given without"),
    ((False, None, None, 1), "^--process_id given without --distributed$"),
    ((True, "localhost:1234", None, None), "needs --num_processes, --process_id too"),
    ((True, None, 2, 0), "needs --coordinator too"),
    ((True, "localhost", 2, 0), "must be HOST:PORT"),
    ((True, "localhost:1234", 2, 2), "must be in 0 .. 1"),
    ((True, "localhost:1234", 0, 0), "--num_processes=0 must be at least 1"),
  ],
)
def test_bad_distributed_flags(args, message):
  with pytest.raises(ValueError, match=message):
    distributed_args(*args)


def test_distributed_flags():
  assert distributed_args(False, None, None, None) is None
  assert distributed_args(True, None, None, None) == {}  # JAX finds the cluster itself.
  assert distributed_args(True, "10.0.0.1:1234", 4, 3) == {
    "coordinator_address": "10.0.0.1:1234",
    "num_processes": 4,
    "process_id": 3,
  }


def test_bad_distributed_flags_exit_2_in_one_line(tmp_path, main_cache):
  code, out, err = experiment_main.run(
    CONFIG, tmp_path / "run", "--distributed", "--coordinator=localhost:1234", cache_dir=main_cache
  )
  assert code == 2 and out == ""
  assert err.splitlines() == [
    "error: --distributed with --coordinator needs --num_processes, --process_id too "
    "(or none of the three, where JAX finds the cluster itself)"
  ]
  assert not (tmp_path / "run").exists()


def test_a_coordinator_that_never_answers_is_one_line_after_the_join_timeout(tmp_path, main_cache):
  # Process 1 alone: JAX would wait its 300 s, then abort with a C++ stack trace.
  port = _free_port()
  flags = ("--distributed", "--num_processes=2", "--process_id=1", "--join_timeout=2")
  code, out, err = experiment_main.run(
    CONFIG, tmp_path / "run", *flags, f"--coordinator=localhost:{port}", cache_dir=main_cache
  )
  assert code == 2 and out == "", err[-3000:]
  assert err.splitlines() == [
    f"waiting up to 2 s for process 0's coordinator at localhost:{port}",
    f"error: --coordinator=localhost:{port}: nothing answered there in 2 s (--join_timeout); "
    "start process 0 of the job on that host, or check the address and that the port is open "
    "to this host.",
  ]
  code, out, err = experiment_main.run(
    CONFIG, tmp_path / "run", *flags, "--coordinator=nohost.invalid:1234", cache_dir=main_cache
  )
  assert code == 2 and err.startswith("error: --coordinator=nohost.invalid:1234: no such host ("), (
    err
  )
  assert len(err.splitlines()) == 1, err
  assert not (tmp_path / "run").exists()


def test_a_job_that_never_fills_is_one_line_before_jax_aborts(tmp_path, main_cache):
  # Process 0 alone: JAX waits the join timeout for process 1, then aborts with a C++
  # stack trace (exit -6); a timer one second earlier says why and exits 2.
  code, out, err = experiment_main.run(
    CONFIG,
    tmp_path / "run",
    "--distributed",
    f"--coordinator=localhost:{_free_port()}",
    "--num_processes=2",
    "--process_id=0",
    "--join_timeout=3",
    cache_dir=main_cache,
  )
  assert code == 2 and out == "", err[-3000:]
  assert err.splitlines() == [
    "error: --distributed: the job's 2 processes did not all join within 3 s (--join_timeout); "
    "start the missing ones with the same command and their own --process_id, or give them "
    "longer."
  ]
  assert not (tmp_path / "run").exists()


def test_distributed_outside_a_cluster_exits_2_in_one_line(tmp_path, main_cache):
  # Alone, --distributed asks JAX to find the cluster; outside one JAX raises ValueError.
  code, out, err = experiment_main.run(
    CONFIG, tmp_path / "run", "--distributed", cache_dir=main_cache
  )
  assert code == 2 and out == "", err[-3000:]
  assert err.splitlines() == [
    "error: --distributed: coordinator_address should be defined: no cluster was found (Cloud "
    "TPU, SLURM, ...); elsewhere pass --coordinator=HOST:PORT --num_processes=N --process_id=I."
  ]
  assert not (tmp_path / "run").exists()
