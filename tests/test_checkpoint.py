"""Tests for the Orbax checkpointer: round trips, shardings, typed keys, atomicity, damage."""

import json
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import zlib

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fedjax_mm.core import checkpoint as checkpoint_lib
from fedjax_mm.core.checkpoint import Checkpointer, CheckpointError, DamagedCheckpointError
from fedjax_mm.core.ledger import Ledger

K = 8  # One client per fake device.


@flax.struct.dataclass
class Group:
  params: dict
  opt_state: optax.OptState
  rng: jax.Array  # Typed keys [K].
  mask: jax.Array


@flax.struct.dataclass
class State:
  group: Group
  server: dict
  legacy_rng: jax.Array  # jax.random.PRNGKey: uint32[2].
  round: int


def init_state(seed: int = 0, num_clients: int = K) -> State:
  """A small federated state, built with numpy (no compilation: tests stay fast)."""
  rng = np.random.default_rng(seed)
  params = {
    "dense": {
      "w": jnp.asarray(rng.standard_normal((num_clients, 3, 5), np.float32)),
      "b": jnp.asarray(rng.standard_normal((num_clients, 5)).astype(jnp.bfloat16)),
    },
    "scale": jnp.full((num_clients,), 0.5, jnp.float32),
  }
  group = Group(
    params=params,
    opt_state=jax.vmap(optax.adam(1e-3).init)(params),
    rng=jax.random.split(jax.random.key(seed), num_clients),
    mask=jnp.asarray(np.arange(num_clients) < num_clients - 1),
  )
  server = {"proj": jnp.eye(4, dtype=jnp.float32), "step": jnp.int32(seed)}
  return State(group, server, jax.random.PRNGKey(seed + 1), seed)


def advance(state: State) -> State:
  """A fake round: every client leaf changes (params, adam moments and count, keys)."""
  rng = np.random.default_rng(state.round + 100)

  def step(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(np.asarray(jax.random.key_data(x)) + np.uint32(1))
    if jnp.issubdtype(x.dtype, jnp.floating):
      noise = rng.standard_normal(x.shape).astype(x.dtype)
      return jnp.asarray(np.asarray(x) + noise)
    if jnp.issubdtype(x.dtype, jnp.integer):
      return jnp.asarray(np.asarray(x) + 1)
    return x

  return state.replace(group=jax.tree.map(step, state.group), round=state.round + 1)


def assert_bit_identical(expected, actual):
  assert jax.tree.structure(expected) == jax.tree.structure(actual)
  for x, y in zip(jax.tree.leaves(expected), jax.tree.leaves(actual), strict=True):
    if isinstance(x, int):
      assert type(y) is int and x == y
      continue
    assert x.shape == y.shape and x.dtype == y.dtype
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      assert jax.random.key_impl(x) == jax.random.key_impl(y)
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    np.testing.assert_array_equal(np.ravel(x).view(np.uint8), np.ravel(y).view(np.uint8))


def test_round_trip_concrete_target(tmp_path):
  state = advance(advance(init_state()))
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() is None
    assert ckpt.save(2, state)
    ckpt.wait()
    assert ckpt.latest_step() == 2
    restored = ckpt.restore(init_state(seed=5))
  assert_bit_identical(state, restored)
  assert isinstance(restored, State) and isinstance(
    restored.group.opt_state[0], optax.ScaleByAdamState
  )
  # The target was uncommitted (made outside jit): so is the result.
  assert not restored.group.params["scale"].committed


def test_restore_into_eval_shape_target(tmp_path):
  state = advance(init_state(seed=3))
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, state)
    ckpt.wait()
  abstract = jax.eval_shape(init_state)
  # A fresh Checkpointer, as in a resumed run.
  with Checkpointer(tmp_path) as ckpt:
    restored = ckpt.restore(abstract)
  # eval_shape turns the Python round counter into a 0-d int32 array.
  assert int(restored.round) == state.round
  assert_bit_identical(state.replace(round=0), restored.replace(round=0))
  assert jax.dtypes.issubdtype(restored.group.rng.dtype, jax.dtypes.prng_key)
  # Restored keys are live: they generate the same numbers as the originals.
  np.testing.assert_array_equal(
    jax.vmap(jax.random.uniform)(restored.group.rng), jax.vmap(jax.random.uniform)(state.group.rng)
  )
  leaf = restored.group.params["dense"]["w"]
  assert isinstance(leaf, jax.Array) and not leaf.committed


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_key_implementations_round_trip(tmp_path, impl):
  keys = jax.random.split(jax.random.key(7, impl=impl), 4)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(0, {"keys": keys})
    restored = ckpt.restore(jax.eval_shape(lambda: {"keys": keys}))
  assert_bit_identical({"keys": keys}, restored)


def test_restore_onto_client_sharding(tmp_path):
  mesh = jax.make_mesh((8,), ("clients",))
  clients = NamedSharding(mesh, P("clients"))
  replicated = NamedSharding(mesh, P())

  def sharding_of(path, x):
    # Everything under the client group is stacked [K, ...]; the rest is server state.
    return clients if path[0].name == "group" else replicated

  state = advance(init_state())
  # Save from a sharded state, as a real run on 8 devices would.
  shardings = jax.tree.map_with_path(sharding_of, jax.eval_shape(init_state))
  sharded_state = jax.tree.map(
    lambda x, s: jax.device_put(x, s) if isinstance(x, jax.Array) else x, state, shardings
  )
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, sharded_state)
    ckpt.wait()
    abstract = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      jax.eval_shape(init_state),
      shardings,
    )
    restored = ckpt.restore(abstract)
  assert_bit_identical(state.replace(round=0), restored.replace(round=0))
  for path, leaf in jax.tree.leaves_with_path(restored):
    expected = clients if path[0].name == "group" else replicated
    assert leaf.sharding.is_equivalent_to(expected, leaf.ndim), path
  rng = restored.group.rng
  assert rng.sharding == clients and len(rng.addressable_shards) == 8
  assert rng.addressable_shards[0].data.shape == (1,)


def test_sharded_save_restores_unsharded(tmp_path):
  """A checkpoint written from 8 devices restores without its stored sharding."""
  mesh = jax.make_mesh((8,), ("clients",))
  x = jax.device_put(jnp.arange(16.0).reshape(8, 2), NamedSharding(mesh, P("clients")))
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(0, {"x": x})
    restored = ckpt.restore({"x": jax.ShapeDtypeStruct((8, 2), jnp.float32)})
  assert not restored["x"].committed and len(restored["x"].devices()) == 1
  np.testing.assert_array_equal(restored["x"], np.arange(16.0).reshape(8, 2))


def test_metadata_round_trip(tmp_path):
  ledger = Ledger.zeros(3).add(up=[1, 2, 3], down=np.int64(2**40), round=0)
  metadata = {
    "config": {"lr": 1e-3, "users": ["a", "b", "c"], "shape": (32, 256)},
    "round": np.int32(1),
    "loss": jnp.float32(0.25),
    "ledger": ledger,
  }
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, {"x": jnp.zeros(2)}, metadata=metadata)
    ckpt.save(2, {"x": jnp.ones(2)})
    assert ckpt.restore_metadata() == {}
    meta = ckpt.restore_metadata(step=1)
  assert meta["config"] == {"lr": 1e-3, "users": ["a", "b", "c"], "shape": [32, 256]}
  assert meta["round"] == 1 and meta["loss"] == 0.25
  assert Ledger.from_dict(meta["ledger"]) == ledger
  with pytest.raises(TypeError, match="JSON"):
    Checkpointer(tmp_path / "bad").save(0, {"x": jnp.zeros(2)}, metadata={"f": object()})


def test_max_to_keep_and_interval(tmp_path):
  state = init_state()
  with Checkpointer(tmp_path, max_to_keep=2, save_interval_steps=2) as ckpt:
    saved = [ckpt.save(step, state.replace(round=step)) for step in range(7)]
    assert saved == [True, False, True, False, True, False, True]
    assert ckpt.save(7, state.replace(round=7), force=True)
    ckpt.wait()
    assert ckpt.all_steps() == [6, 7]
    assert ckpt.latest_step() == 7
    assert ckpt.restore(state).round == 7
    assert ckpt.restore(state, step=6).round == 6
    with pytest.raises(FileNotFoundError):
      ckpt.restore(state, step=4)
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() == 7
  with pytest.raises(FileNotFoundError):
    Checkpointer(tmp_path / "empty").restore(state)


def test_incomplete_steps_are_ignored(tmp_path):
  state = init_state()
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(3, state.replace(round=3))
  # What a crash leaves behind: Orbax's tmp directory, and (on a file system
  # without atomic rename) a step directory that was never finalised.
  (tmp_path / "5.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
  (tmp_path / "4" / "state").mkdir(parents=True)
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() == 3
    assert ckpt.all_steps() == [3]
    assert ckpt.restore(state).round == 3
  # The tmp directory is cleaned up when a Checkpointer opens the directory.
  assert not (tmp_path / "5.orbax-checkpoint-tmp").exists()


class _Stop(BaseException):
  pass


def test_a_signal_during_the_save_is_raised_once_the_save_is_in_flight(tmp_path):
  # A runner's SIGTERM handler raises; arriving inside the manager's save (after Orbax made
  # its tmp folder, before the write was handed to its thread) it would abandon the step.
  # Held back, it is raised when the save returns, and the close that unwinding runs
  # finalises the step.
  def stop(signum, frame):
    raise _Stop(signum)

  before = signal.signal(signal.SIGTERM, stop)
  try:
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, {"x": jnp.full((64,), 1.0), "round": 1})
    real_save = ckpt._manager.save

    def save_with_a_signal(*args, **kwargs):
      os.kill(os.getpid(), signal.SIGTERM)
      for _ in range(1000):  # Bytecodes at which an unheld handler would have run.
        pass
      return real_save(*args, **kwargs)

    ckpt._manager.save = save_with_a_signal
    with pytest.raises(_Stop):
      ckpt.save(2, {"x": jnp.full((64,), 2.0), "round": 2})
    assert signal.getsignal(signal.SIGTERM) is stop  # The runner's handler is back.
    ckpt.close()
  finally:
    signal.signal(signal.SIGTERM, before)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.restore({"x": jnp.zeros((64,)), "round": 0})["round"] == 2


def test_crash_mid_save_keeps_previous_step(tmp_path):
  """A process killed while writing step 2 leaves step 1 restorable."""
  script = textwrap.dedent(
    f"""
    import os
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax.numpy as jnp
    from orbax.checkpoint._src.path import atomicity
    from fedjax_mm.core.checkpoint import CheckpointError, Checkpointer, DamagedCheckpointError

    ckpt = Checkpointer({str(tmp_path)!r})
    ckpt.save(1, {{"x": jnp.full((64,), 1.0), "round": 1}})
    ckpt.wait()

    async def die(*args, **kwargs):  # Killed after writing, before the rename.
      os._exit(17)

    atomicity.AtomicRenameTemporaryPath.finalize = die
    ckpt.save(2, {{"x": jnp.full((64,), 2.0), "round": 2}})
    ckpt.wait()
    os._exit(0)  # Not reached.
    """
  )
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
  assert result.returncode == 17, result.stderr.decode()[-2000:]
  # The dead process left its partial step 2 behind.
  assert any(name.startswith("2.") for name in os.listdir(tmp_path))
  target = {"x": jax.ShapeDtypeStruct((64,), jnp.float32), "round": 0}
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() == 1
    restored = ckpt.restore(target)
    np.testing.assert_array_equal(restored["x"], np.full((64,), 1.0))
    assert restored["round"] == 1
    # Training resumes and step 2 can be written again.
    ckpt.save(2, {"x": jnp.full((64,), 2.0), "round": 2})
    ckpt.wait()
    assert ckpt.latest_step() == 2


# ---------------------------------------------------------------------------
# Damaged checkpoints


def _flip_array_bytes(step_dir: pathlib.Path) -> None:
  """Flips one byte in the middle of the biggest chunk file Orbax wrote for the state.

  With the 64 KiB of noise in every saved state, that file holds the noise's
  compressed chunk; Orbax decodes the flipped chunk without complaint and
  returns wrong numbers, which only the checksums reveal.
  """
  files = list((step_dir / "state" / "ocdbt.process_0" / "d").iterdir())
  biggest = max(files, key=lambda p: p.stat().st_size)
  data = bytearray(biggest.read_bytes())
  data[len(data) // 2] ^= 0xFF
  biggest.write_bytes(bytes(data))


def _damage(step_dir: pathlib.Path, how: str) -> None:
  if how == "flipped array bytes":
    _flip_array_bytes(step_dir)
  elif how == "missing manifest":
    (step_dir / "state" / "manifest.ocdbt").unlink()
  elif how == "missing checksums":
    shutil.rmtree(step_dir / "checksums")
  elif how == "truncated metadata":
    path = step_dir / "metadata" / "metadata"
    path.write_bytes(path.read_bytes()[:5])
  elif how == "altered metadata":  # Still valid JSON: only the checksum tells.
    path = step_dir / "metadata" / "metadata"
    path.write_text(path.read_text().replace('"round": 3', '"round": 4'))
  else:
    raise ValueError(how)


def _with_noise(state: State, seed: int) -> dict:
  """``state`` plus 64 KiB of incompressible noise: a chunk big enough to corrupt silently."""
  noise = np.random.default_rng(seed).standard_normal(16384).astype(np.float32)
  return {"fed": state, "noise": jnp.asarray(noise)}


def _target() -> dict:
  return {"fed": init_state(), "noise": jax.ShapeDtypeStruct((16384,), jnp.float32)}


def _save_rounds(directory, rounds=(1, 2, 3)) -> dict[int, dict]:
  states, state = {}, init_state()
  with Checkpointer(directory, max_to_keep=None) as ckpt:
    for r in rounds:
      state = advance(state)
      states[r] = _with_noise(state, r)
      ckpt.save(r, states[r], metadata={"round": r})
  return states


def test_flipped_array_bytes_fail_the_checksum(tmp_path):
  states = _save_rounds(tmp_path)
  _flip_array_bytes(tmp_path / "3")
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(
      DamagedCheckpointError, match=r"array \['noise'\] of step 3 reads back .* crc32"
    ):
      ckpt.restore(_target())
    assert_bit_identical(states[2], ckpt.restore(_target(), step=2))  # Others are intact.


@pytest.mark.parametrize("cuts", [(), (0,), (1,), (5, 5), (3, 64, 4095), (65_537,)])
def test_crc32_combine_equals_the_crc32_of_the_whole(cuts):
  # The pieces of a split array are summed apart and combined (several processes).
  data = np.random.default_rng(len(cuts)).integers(0, 256, 100_003, np.uint8).tobytes()
  bounds = [0, *cuts, len(data)]
  crc = 0  # zlib.crc32(b"")
  for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
    crc = checkpoint_lib._crc32_combine(crc, zlib.crc32(data[start:stop]), stop - start)
  assert crc == zlib.crc32(data)


def test_row_pieces_of_split_arrays():
  # What each process sums of a split array: whole rows in row order, one holder a piece.
  mesh = jax.make_mesh((4, 2), ("clients", "copies"))
  x = jax.device_put(jnp.zeros((8, 3)), NamedSharding(mesh, P("clients")))
  pieces = checkpoint_lib._row_pieces(x)
  assert [(start, stop) for start, stop, _ in pieces] == [(0, 2), (2, 4), (4, 6), (6, 8)]
  for start, _, device in pieces:  # Of the two copies, the device with the smaller id.
    holders = [d for d, i in x.sharding.devices_indices_map(x.shape).items() if i[0].start == start]
    assert device == min(holders, key=lambda d: d.id) and len(holders) == 2
  columns = jax.device_put(jnp.zeros((3, 8)), NamedSharding(mesh, P(None, "clients")))
  assert checkpoint_lib._row_pieces(columns) is None  # Not whole rows: not summed.


@pytest.mark.parametrize(
  "how",
  [
    "flipped array bytes",
    "missing manifest",
    "missing checksums",
    "truncated metadata",
    "altered metadata",
  ],
)
def test_restore_latest_good_sets_the_damaged_step_aside(tmp_path, caplog, how):
  states = _save_rounds(tmp_path)
  _damage(tmp_path / "3", how)
  damaged_files = {
    p.relative_to(tmp_path / "3"): p.read_bytes()
    for p in (tmp_path / "3").rglob("*")
    if p.is_file()
  }
  with caplog.at_level(logging.WARNING), Checkpointer(tmp_path, max_to_keep=2) as ckpt:
    step, state = ckpt.restore_latest_good(_target())
    assert step == 2
    assert_bit_identical(states[2], state)
    assert ckpt.restore_metadata(step) == {"round": 2}
    assert ckpt.all_steps() == [1, 2]
    # The run goes on and saves round 3 again, then more: Orbax's garbage
    # collection (max_to_keep=2) never touches the folder set aside.
    for r in (3, 4, 5):
      ckpt.save(r, states[3], metadata={"round": r})
    ckpt.wait()
    assert ckpt.all_steps() == [4, 5]
  (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("3.damaged-")]
  # Set aside, not deleted: every file is still there, as it was.
  assert {
    p.relative_to(aside): p.read_bytes() for p in aside.rglob("*") if p.is_file()
  } == damaged_files
  (line,) = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
  assert line.startswith("checkpoint of round 3 is damaged (")
  assert f"set aside as {aside}; resuming from round 2" in line and "\n" not in line


def test_no_intact_step_is_an_error_that_moves_nothing(tmp_path):
  _save_rounds(tmp_path, rounds=(1, 2))
  _damage(tmp_path / "2", "flipped array bytes")
  _damage(tmp_path / "1", "missing manifest")
  before = sorted(p.name for p in tmp_path.iterdir())
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(CheckpointError) as info:
      ckpt.restore_latest_good(_target())
  message = str(info.value)
  assert "no intact checkpoint" in message and "\n" not in message
  assert "round 2: DamagedCheckpointError" in message and "round 1: " in message
  assert f"move {tmp_path} aside" in message
  assert sorted(p.name for p in tmp_path.iterdir()) == before
  with Checkpointer(tmp_path / "none") as ckpt:
    assert ckpt.restore_latest_good(_target()) is None  # No checkpoint is not an error.


def test_a_step_saved_without_checksums_is_read_unverified(tmp_path):
  """Steps written before checksums existed: Orbax's step metadata lists no such item."""
  states = _save_rounds(tmp_path, rounds=(1,))
  step_dir = tmp_path / "1"
  meta = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
  del meta["item_handlers"]["checksums"]
  (step_dir / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))
  shutil.rmtree(step_dir / "checksums")
  with Checkpointer(tmp_path) as ckpt:
    assert_bit_identical(states[1], ckpt.restore(_target()))
    assert ckpt.restore_metadata() == {"round": 1}


def test_failed_reads_leave_no_tracebacks_at_exit(tmp_path):
  """Orbax's failed reads spill "Event loop is closed" tracebacks unless silenced."""
  script = textwrap.dedent(
    f"""
    import os, pathlib, sys
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp
    from fedjax_mm.core.checkpoint import CheckpointError, Checkpointer

    root = pathlib.Path({str(tmp_path)!r})
    # Many leaves: many sibling reads are orphaned by each failure.
    x = {{f"x{{i}}": jnp.arange(1024.0 + i) for i in range(40)}}
    ckpt = Checkpointer(root, max_to_keep=None)
    for step in (1, 2, 3):
      ckpt.save(step, x)
    ckpt.wait()
    for step in (1, 2, 3):
      (root / str(step) / "state" / "manifest.ocdbt").write_bytes(b"garbage")
    for _ in range(6):  # Each failed read may spill its own; six make some near certain.
      try:
        ckpt.restore_latest_good(jax.eval_shape(lambda: x))
      except CheckpointError as e:
        print("refused", file=sys.stderr)
    ckpt.close()
    """
  )
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=300)
  stderr = result.stderr.decode()
  assert result.returncode == 0, stderr[-3000:]
  assert stderr.count("refused") == 6, stderr[-3000:]
  assert "Traceback" not in stderr and "Event loop is closed" not in stderr, stderr[-3000:]
  assert "never retrieved" not in stderr, stderr[-3000:]


def test_the_asyncio_filter_keeps_other_tasks_errors():
  """Only orphaned Orbax/TensorStore reads are dropped from asyncio's log."""

  def record(message, error):
    return logging.LogRecord(
      "asyncio", logging.ERROR, __file__, 1, message, None, (type(error), error, None)
    )

  def raised_here():
    try:
      raise ValueError("DATA_LOSS: some other library")
    except ValueError as e:
      return e

  keep = checkpoint_lib._drop_orphaned_orbax_reads
  assert keep(record("Task exception was never retrieved", raised_here()))
  assert keep(record("Something else", ValueError("x [tensorstore_spec='{}']")))
  assert not keep(
    record(
      "Future exception was never retrieved", ValueError("DATA_LOSS: x [tensorstore_spec='{}']")
    )
  )
