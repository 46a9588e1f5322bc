"""Tests of fedjax_mm.runner.workdir: fresh runs, resumes, refusals, overwrite."""

import json

import pytest

from fedjax_mm.runner import WorkdirError, config_diff, prepare_workdir

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
