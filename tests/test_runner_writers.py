"""Tests of fedjax_mm.runner.writers: JSON Lines round trip, NaN, resume, TensorBoard."""

import json
import math
import struct
import sys
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mm.runner import MetricWriter, metric_series, read_metrics
from fedjax_mm.runner import writers as writers_lib


def test_jsonl_round_trips_through_read_metrics(tmp_path):
  with MetricWriter(tmp_path, "fedmuscle") as writer:
    writer.write(0, {"loss": 1.5, "bytes_up": 2**40, "ok": True})
    writer.write(
      np.int64(1),
      {"loss": np.float32(0.25), "acc": jnp.asarray(0.5), "n": np.asarray(7), "f": np.float64(2)},
    )
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert json.loads(lines[0]) == {
    "round": 0,
    "run": "fedmuscle",
    "loss": 1.5,
    "bytes_up": 2**40,
    "ok": 1,
  }
  rows = read_metrics(tmp_path)
  assert rows[1] == {"round": 1, "run": "fedmuscle", "loss": 0.25, "acc": 0.5, "n": 7, "f": 2.0}
  assert isinstance(rows[0]["bytes_up"], int) and isinstance(rows[1]["n"], int)
  assert metric_series(rows, "loss") == [(0, 1.5), (1, 0.25)]
  assert read_metrics(tmp_path / "missing") == []


def test_non_finite_values_are_null_in_json_and_nan_when_read(tmp_path):
  with MetricWriter(tmp_path, "a", tensorboard=False) as writer:
    writer.write(0, {"loss": float("nan"), "up": np.float32(np.inf), "down": -math.inf, "x": 1.0})
  line = (tmp_path / "metrics.jsonl").read_text()
  assert json.loads(line) == {
    "round": 0,
    "run": "a",
    "loss": None,
    "up": None,
    "down": None,
    "x": 1.0,
  }
  assert "NaN" not in line and "Infinity" not in line  # Strict JSON.
  (row,) = read_metrics(tmp_path)
  assert math.isnan(row["loss"]) and math.isnan(row["up"]) and math.isnan(row["down"])


def test_resume_drops_later_rounds_of_that_run_only(tmp_path):
  with MetricWriter(tmp_path, "fedmuscle", tensorboard=False) as a:
    with MetricWriter(tmp_path, "local", tensorboard=False) as b:
      for r in range(5):
        a.write(r, {"loss": float(r)})
        b.write(r, {"loss": -float(r)})
  # Checkpoint after round 2; rounds 3-4 of "fedmuscle" are replayed.
  with MetricWriter(tmp_path, "fedmuscle", resume_round=2, tensorboard=False) as a:
    assert [r["round"] for r in read_metrics(tmp_path, run="fedmuscle")] == [0, 1, 2]
    a.write(3, {"loss": 30.0})
  assert [(r["round"], r["loss"]) for r in read_metrics(tmp_path, run="fedmuscle")] == [
    (0, 0.0),
    (1, 1.0),
    (2, 2.0),
    (3, 30.0),
  ]
  assert [r["round"] for r in read_metrics(tmp_path, run="local")] == [0, 1, 2, 3, 4]
  # resume_round=-1 drops all of the run's lines.
  MetricWriter(tmp_path, "local", resume_round=-1, tensorboard=False).close()
  assert read_metrics(tmp_path, run="local") == []


def test_torn_last_line_is_skipped_and_repaired(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"round": 0, "run": "a", "x": 1}\n{"round": 1, "run": "a", "x"')
  assert [r["round"] for r in read_metrics(tmp_path)] == [0]
  with MetricWriter(tmp_path, "a", tensorboard=False) as writer:
    writer.write(1, {"x": 2})
  assert [(r["round"], r["x"]) for r in read_metrics(tmp_path)] == [(0, 1), (1, 2)]
  # A complete last record without its newline is kept and terminated.
  path.write_text('{"round": 0, "run": "a", "x": 1}')
  MetricWriter(tmp_path, "a", tensorboard=False).close()
  assert path.read_text() == '{"round": 0, "run": "a", "x": 1}\n'
  path.write_text('garbage\n{"round": 0, "run": "a"}\n')
  with pytest.raises(ValueError, match="metrics.jsonl:1"):
    read_metrics(tmp_path)


def _read_events(folder):
  """Parses every TFRecord event file of a folder, in name order (TensorBoard's)."""
  from tensorboardX.proto import event_pb2

  events = []
  for path in sorted(folder.glob("events.out.tfevents.*")):
    data, i = path.read_bytes(), 0
    while i < len(data):
      (length,) = struct.unpack("<Q", data[i : i + 8])  # Then crc32 (4), record, crc32 (4).
      event = event_pb2.Event()
      event.ParseFromString(data[i + 12 : i + 12 + length])
      events.append((path.name, event))
      i += 12 + length + 4
  return events


def _scalars(events):
  return [(e.step, v.tag, v.simple_value) for _, e in events for v in e.summary.value]


def test_tensorboard_event_files_hold_the_scalars_and_purge_on_resume(tmp_path):
  folder = tmp_path / "tb" / "fedmuscle"
  with MetricWriter(tmp_path, "fedmuscle") as writer:
    writer.write(0, {"user_1/f1": 0.5, "bytes": 10})
    writer.write(1, {"user_1/f1": 0.75, "bytes": 20})
  assert _scalars(_read_events(folder)) == [
    (0, "user_1/f1", 0.5),
    (0, "bytes", 10.0),
    (1, "user_1/f1", 0.75),
    (1, "bytes", 20.0),
  ]
  # Reopened within the same second: the first file survives, the new one
  # starts with a SessionLog.START at step 1 (TensorBoard's purge marker).
  with MetricWriter(tmp_path, "fedmuscle", resume_round=0) as writer:
    writer.write(1, {"user_1/f1": 0.5})
  events = _read_events(folder)
  assert len({name for name, _ in events}) == 2
  (start,) = [e for _, e in events if e.HasField("session_log")]
  assert start.session_log.status == start.session_log.START and start.step == 1
  assert _scalars(events)[-1] == (1, "user_1/f1", 0.5)
  assert not (tmp_path / "tb" / "local").exists()


def test_missing_tensorboardx_warns_once_and_writes_jsonl(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "tensorboardX", None)  # Makes the import fail.
  monkeypatch.setattr(writers_lib, "_warned_no_tensorboard", False)
  with pytest.warns(RuntimeWarning, match="tensorboardX is not installed"):
    MetricWriter(tmp_path, "a").close()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with MetricWriter(tmp_path, "a") as writer:
      writer.write(0, {"x": 1.0})
  assert read_metrics(tmp_path) == [{"round": 0, "run": "a", "x": 1.0}]
  assert not (tmp_path / "tb").exists()


@pytest.mark.parametrize(
  "value", [np.zeros(3), jnp.ones((1,)), [1.0], "0.5", None, 1 + 2j, {"a": 1}], ids=repr
)
def test_non_scalar_values_raise_type_error(tmp_path, value):
  with MetricWriter(tmp_path, "a", tensorboard=False) as writer:
    with pytest.raises(TypeError, match="'bad'"):
      writer.write(0, {"ok": 1.0, "bad": value})
  assert read_metrics(tmp_path) == []  # Nothing half-written.


def test_argument_checks(tmp_path):
  with pytest.raises(ValueError, match="run"):
    MetricWriter(tmp_path, "a/b")
  writer = MetricWriter(tmp_path, "a", tensorboard=False)
  with pytest.raises(ValueError, match="reserved"):
    writer.write(0, {"round": 1})
  with pytest.raises(TypeError, match="round"):
    writer.write(0.0, {"x": 1})
  with pytest.raises(ValueError, match="non-negative"):
    writer.write(-1, {"x": 1})
  writer.close()
  writer.close()  # Idempotent.
  with pytest.raises(ValueError, match="closed"):
    writer.write(0, {"x": 1})


def test_resuming_several_runs_keeps_every_runs_lines(tmp_path):
  # Writers of two runs share metrics.jsonl; the second one's resume rewrites the file
  # (atomic rename). The first writer must still reach the file on disk.
  for run in ("a", "b"):
    with MetricWriter(tmp_path, run, tensorboard=False) as w:
      for r in (1, 2, 3):
        w.write(r, {"x": r})
  first = MetricWriter(tmp_path, "a", resume_round=2, tensorboard=False)
  second = MetricWriter(tmp_path, "b", resume_round=2, tensorboard=False)
  first.write(3, {"x": 30})
  second.write(3, {"x": 31})
  first.close()
  second.close()
  rows = read_metrics(tmp_path)
  assert [(r["run"], r["round"], r["x"]) for r in rows if r["round"] == 3] == [
    ("a", 3, 30),
    ("b", 3, 31),
  ]
  assert len(rows) == 6
