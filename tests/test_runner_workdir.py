"""Tests of fedjax_mm.runner.workdir: fresh runs, resumes, refusals, overwrite, the lock."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

from fedjax_mm.runner import WorkdirError, config_diff, prepare_workdir
from fedjax_mm.runner.workdir import LOCK_FILE, lock_workdir

CONFIG = {"seed": 0, "muscle": {"tau_full": 0.2, "sizes": [1, 2]}, "name": "fedmuscle"}


def test_fresh_run_creates_parents_and_writes_sorted_config(tmp_path):
  workdir = tmp_path / "runs" / "x"
  assert prepare_workdir(workdir, CONFIG) is False
  text = (workdir / "config.json").read_text()
  assert json.loads(text) == CONFIG
  assert text.index('"muscle"') < text.index('"name"') < text.index('"seed"')  # Sorted keys.
  assert '\n  "muscle": {' in text  # indent=2.
  assert sorted(p.name for p in workdir.iterdir()) == ["config.json"]  # No temp file left.


def test_empty_existing_folder_is_a_fresh_run(tmp_path):
  assert prepare_workdir(tmp_path, CONFIG) is False
  assert (tmp_path / "config.json").exists()


def test_resume_ignores_key_order_and_tuple_vs_list(tmp_path):
  prepare_workdir(tmp_path, CONFIG)
  (tmp_path / "checkpoints").mkdir()
  before = (tmp_path / "config.json").stat().st_mtime_ns
  reordered = {"name": "fedmuscle", "muscle": {"sizes": (1, 2), "tau_full": 0.2}, "seed": 0}
  assert prepare_workdir(tmp_path, reordered) is True
  assert prepare_workdir(tmp_path, reordered, overwrite=True) is True  # Relaunch resumes.
  assert (tmp_path / "config.json").stat().st_mtime_ns == before  # Not rewritten.
  assert (tmp_path / "checkpoints").exists()


def test_different_config_is_refused_naming_the_key(tmp_path):
  prepare_workdir(tmp_path, CONFIG)
  changed = {**CONFIG, "muscle": {**CONFIG["muscle"], "tau_full": 0.3}}
  with pytest.raises(WorkdirError) as info:
    prepare_workdir(tmp_path, changed)
  message = str(info.value)
  assert "muscle.tau_full: 0.2 != 0.3" in message
  assert str(tmp_path) in message
  assert "--overwrite" in message and "--workdir" in message
  assert "\n" not in message
  assert json.loads((tmp_path / "config.json").read_text()) == CONFIG  # Untouched.


def test_overwrite_moves_the_old_workdir_aside(tmp_path):
  workdir = tmp_path / "x"
  prepare_workdir(workdir, CONFIG)
  (workdir / "metrics.jsonl").write_text('{"round": 0}\n')
  changed = {**CONFIG, "seed": 1}
  assert prepare_workdir(workdir, changed, overwrite=True) is False
  assert json.loads((workdir / "config.json").read_text()) == changed
  assert not (workdir / "metrics.jsonl").exists()
  (old,) = [p for p in tmp_path.iterdir() if p.name.startswith("x.old-")]
  assert json.loads((old / "config.json").read_text()) == CONFIG
  assert (old / "metrics.jsonl").read_text() == '{"round": 0}\n'
  # A second overwrite within the same second gets a distinct name.
  prepare_workdir(workdir, CONFIG, overwrite=True)
  assert len([p for p in tmp_path.iterdir() if p.name.startswith("x.old-")]) == 2


def test_non_empty_folder_without_config_is_refused(tmp_path):
  (tmp_path / "notes.txt").write_text("mine")
  with pytest.raises(WorkdirError, match="no config.json"):
    prepare_workdir(tmp_path, CONFIG)
  assert not (tmp_path / "config.json").exists()


def test_unreadable_config_is_refused(tmp_path):
  (tmp_path / "config.json").write_text('{"seed": ')
  with pytest.raises(WorkdirError, match="unreadable"):
    prepare_workdir(tmp_path, CONFIG)


def test_file_path_is_refused_even_with_overwrite(tmp_path):
  path = tmp_path / "file"
  path.write_text("x")
  for overwrite in (False, True):
    with pytest.raises(WorkdirError, match="is a file"):
      prepare_workdir(path, CONFIG, overwrite=overwrite)
  assert path.read_text() == "x"


def test_a_workdir_that_cannot_be_made_or_written_is_refused(tmp_path):
  (tmp_path / "file").write_text("x")
  with pytest.raises(WorkdirError, match=r"file/run cannot be created \(Not a directory\)"):
    with lock_workdir(tmp_path / "file" / "run"):
      pass


def test_a_workdir_whose_lock_cannot_be_written_is_refused(tmp_path, monkeypatch):
  # A read-only folder (not one as root, who writes anyway): the lock's os.open fails.
  def read_only(path, flags, mode=0o777):
    raise PermissionError(13, "Permission denied", str(path))

  monkeypatch.setattr(os, "open", read_only)
  with pytest.raises(WorkdirError, match=r"its lock .* cannot be written \(Permission denied\)"):
    with lock_workdir(tmp_path):
      pass


def test_non_serialisable_config_raises_type_error(tmp_path):
  with pytest.raises(TypeError, match="to_dict"):
    prepare_workdir(tmp_path / "x", {"f": object()})
  assert not (tmp_path / "x").exists()


def test_config_diff():
  a = {"a": 1, "b": {"c": (1, 2), "d": "x"}, "gone": 0}
  b = {"a": 1.0, "b": {"c": [1, 2], "d": "y"}, "new": {"k": 1}}
  assert config_diff(a, b) == [
    "a: 1 != 1.0",
    'b.d: "x" != "y"',
    "gone: 0 != <missing>",
    'new: <missing> != {"k": 1}',
  ]
  assert config_diff(CONFIG, dict(reversed(list(CONFIG.items())))) == []


# ---------------------------------------------------------------------------
# The lock


def _snapshot(folder: pathlib.Path) -> dict[str, bytes]:
  """Every file under ``folder`` (relative path -> bytes), to prove nothing was touched."""
  return {
    str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
  }


def _write_lock(workdir: pathlib.Path, pid: int, host: str | None = None, **extra) -> None:
  record = {"pid": pid, "host": host or socket.gethostname(), "since": "then", "token": "t"}
  (workdir / LOCK_FILE).write_text(json.dumps(record | extra))


@pytest.fixture
def live_pid():
  """The pid of a process that stays alive for the test (not ours)."""
  proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
  yield proc.pid
  proc.kill()
  proc.wait()


def _resumable_workdir(workdir: pathlib.Path) -> pathlib.Path:
  prepare_workdir(workdir, CONFIG)
  (workdir / "metrics.jsonl").write_text('{"round": 1, "run": "x"}\n')
  return workdir


def test_a_live_lock_refuses_at_once_and_touches_nothing(tmp_path, live_pid):
  workdir = _resumable_workdir(tmp_path / "run")
  _write_lock(workdir, live_pid)
  before = _snapshot(workdir)
  started = time.monotonic()
  with pytest.raises(WorkdirError) as info:
    with lock_workdir(workdir):
      pytest.fail("entered a workdir held by a live process")
  assert time.monotonic() - started < 0.5  # Refused at once, no waiting.
  message = str(info.value)
  assert f"in use by pid {live_pid} on host {socket.gethostname()}" in message
  assert "\n" not in message and "--workdir" in message
  assert _snapshot(workdir) == before  # Byte-identical, the lock included.


def test_a_second_process_is_refused_while_the_first_holds_the_lock(tmp_path):
  workdir = _resumable_workdir(tmp_path / "run")
  script = (
    "import sys\n"
    "from fedjax_mm.runner.workdir import WorkdirError, lock_workdir\n"
    "try:\n"
    f"  with lock_workdir({str(workdir)!r}):\n"
    "    sys.exit(0)\n"
    "except WorkdirError as e:\n"
    "  print(e, file=sys.stderr)\n"
    "  sys.exit(2)\n"
  )
  with lock_workdir(workdir):
    before = _snapshot(workdir)
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert child.returncode == 2, child.stderr
    assert f"in use by pid {os.getpid()}" in child.stderr
    assert _snapshot(workdir) == before
  assert not (workdir / LOCK_FILE).exists()  # Released on exit...
  child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
  assert child.returncode == 0, child.stderr  # ... so the next run gets it.


def test_a_dead_holder_does_not_block(tmp_path):
  workdir = _resumable_workdir(tmp_path / "run")
  done = subprocess.Popen([sys.executable, "-c", "pass"])
  done.wait()  # Exited and reaped: its pid names no process.
  _write_lock(workdir, done.pid)
  with lock_workdir(workdir):
    holder = json.loads((workdir / LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["token"] != "t"
  assert not (workdir / LOCK_FILE).exists()
  assert (workdir / "metrics.jsonl").read_text() == '{"round": 1, "run": "x"}\n'


@pytest.mark.skipif(not pathlib.Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_zombie_or_a_reused_pid_does_not_block(tmp_path):
  workdir = _resumable_workdir(tmp_path / "run")
  # A zombie: exited, not yet reaped by its parent (us), so os.kill(pid, 0) still succeeds.
  zombie = subprocess.Popen([sys.executable, "-c", "pass"])
  stat = pathlib.Path(f"/proc/{zombie.pid}/stat")
  deadline = time.monotonic() + 30
  while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
    assert time.monotonic() < deadline
    time.sleep(0.02)
  _write_lock(workdir, zombie.pid)
  with lock_workdir(workdir):
    pass
  zombie.wait()
  # A pid now used by another process than the one that wrote the lock (after a reboot).
  _write_lock(workdir, os.getpid(), start=-1)
  with lock_workdir(workdir):
    pass


def test_a_lock_from_another_host_is_never_taken_over(tmp_path):
  workdir = _resumable_workdir(tmp_path / "run")
  _write_lock(workdir, 1, host="some-other-machine")
  with pytest.raises(
    WorkdirError, match=f"on host some-other-machine.*delete {workdir / LOCK_FILE}"
  ):
    with lock_workdir(workdir):
      pass
  (workdir / LOCK_FILE).write_text("")  # Unreadable (after a grace period): refused, not taken.
  with pytest.raises(WorkdirError, match="unreadable lock file"):
    with lock_workdir(workdir):
      pass


def test_the_lock_is_released_on_exceptions_and_nested_use_is_refused(tmp_path):
  with pytest.raises(KeyError):
    with lock_workdir(tmp_path / "run"):
      with pytest.raises(WorkdirError, match=f"in use by pid {os.getpid()}"):
        with lock_workdir(tmp_path / "run"):
          pass
      raise KeyError("the run failed")
  assert list((tmp_path / "run").iterdir()) == []


def test_prepare_workdir_under_the_lock(tmp_path):
  workdir = tmp_path / "x"
  with lock_workdir(workdir):
    assert prepare_workdir(workdir, CONFIG) is False  # The lock alone is not content.
  with lock_workdir(workdir):
    assert prepare_workdir(workdir, CONFIG) is True
    assert prepare_workdir(workdir, {**CONFIG, "seed": 1}, overwrite=True) is False
    # The lock stays with the workdir's name, not with the folder moved aside.
    assert json.loads((workdir / LOCK_FILE).read_text())["pid"] == os.getpid()
    (old,) = [p for p in tmp_path.iterdir() if p.name.startswith("x.old-")]
    assert not (old / LOCK_FILE).exists()
  assert not (workdir / LOCK_FILE).exists()
  assert sorted(p.name for p in old.iterdir()) == ["config.json"]
