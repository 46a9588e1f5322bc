"""The FedMuscle command end to end: smoke run, validation, refusal, resume after SIGKILL,
SIGTERM and Ctrl-C."""

import json
import signal
import time

import experiment_main
import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from experiments import fedmuscle as fedmuscle_config
from fedjax_mm import data, models
from fedjax_mm.runner import fedmuscle as runner
from fedjax_mm.runner.workdir import config_diff
from fedjax_mm.runner.writers import read_metrics

CONFIG = "experiments/fedmuscle.py:smoke"


@pytest.mark.parametrize(
  "config,override,line",
  [
    (
      CONFIG,
      "--config.muscle.los=pairwise",
      "--config.muscle.los=pairwise: muscle has no key 'los'; did you mean 'muscle.loss'?",
    ),
    (CONFIG, "--config.roundz=4", "--config.roundz=4: the config has no key 'roundz'; did you "),
    (CONFIG, "--config.muscle.loss.x=1", "--config.muscle.loss.x=1: muscle.loss is a str, it has "),
    (CONFIG, "--config.rounds=abc", "flag --config.rounds=abc: invalid literal for int() with "),
    (CONFIG, "--bogus=1", "Unknown command line flag 'bogus'"),
    (
      "experiments/fedmuscle.py:cifar",
      None,
      "flag --config=experiments/fedmuscle.py:cifar: Error whilst parsing config file: "
      "ValueError: unknown variant 'cifar'; expected cnn_m, ",
    ),
    (
      "experiments/nowhere/fedmuscle.py",
      None,
      "--config=experiments/nowhere/fedmuscle.py: no such",
    ),
    (
      "experiments/faults.py",
      None,
      "--config=experiments/faults.py: experiments/faults.py defines no get_config(), so ",
    ),
  ],
)
def test_bad_command_line_is_one_line_and_exit_2(tmp_path, main_cache, config, override, line):
  # absl prints a bad flag on several lines (a config file that fails to load: with its
  # traceback) and ml_collections lets an unknown key escape as a bare exception; the
  # command reports each like a bad config value: one line, exit status 2.
  overrides = () if override is None else (override,)
  code, out, err = experiment_main.run(config, tmp_path / "run", *overrides, cache_dir=main_cache)
  assert code == 2 and out == "", err[-2000:]
  assert len(err.splitlines()) == 1 and err.startswith(f"error: {line}"), err[-2000:]
  assert not (tmp_path / "run").exists()


def test_help_prints_the_usage_and_exits_0(tmp_path, main_cache):
  # absl exits 1 after printing the usage; asking for help is no failure.
  config = "experiments/fedmuscle.py"
  code, out, err = experiment_main.run(config, tmp_path / "run", "--help", cache_dir=main_cache)
  assert code == 0, err[-2000:]
  assert "--config: Experiment config file." in out and "--workdir:" in out, out[-2000:]
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
  "name,body,line",
  [
    (
      "mine",
      "import ml_collections\n\ndef get_config():\n  return ml_collections.ConfigDict()\n",
      "no runner for config 'mine'; known: creamfl, fedmuscle, fedrgb, fedscmr, pretrain, rcsr",
    ),
    ("fedmuscle", "def get_config(:\n  pass\n", "--config={path}: SyntaxError: "),
    (
      "fedmuscle",
      "def get_config():\n  raise RuntimeError('boom')\n",
      "--config={path}: RuntimeError: boom (at {path}:2)",
    ),
  ],
)
def test_a_config_file_that_runs_nothing_is_one_line_and_exit_2(
  tmp_path, main_cache, name, body, line
):
  config = tmp_path / f"{name}.py"
  config.write_text(body)
  code, out, err = experiment_main.run(str(config), tmp_path / "run", cache_dir=main_cache)
  assert code == 2 and out == "", err[-2000:]
  assert len(err.splitlines()) == 1 and err.startswith(f"error: {line.format(path=config)}"), err
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
  "variant,changed",
  [
    ("coco", ["public.max_objects: 3 != 5", "public.min_visible: 0.4 != 0.3"]),
    ("in_distribution", ["public.shift: 1.0 != 0.0"]),
  ],
)
def test_public_set_blocks_change_only_the_public_set(variant, changed):
  default, block = fedmuscle_config.get_config(), fedmuscle_config.get_config(variant)
  assert config_diff(default.to_dict(), block.to_dict()) == changed


def test_unknown_variant_names_the_known_ones():
  with pytest.raises(ValueError, match="expected cnn_m, coco, in_distribution"):
    fedmuscle_config.get_config("cifar")


def test_standardize_needs_statistics_and_can_be_turned_off(tmp_path):
  from flax import nnx

  from fedjax_mm import models

  config = fedmuscle_config.get_config("smoke")
  users = runner.validate(config)
  assert all(runner._model_config(config, u)["standardize"] for u in users)
  config.users[0]["standardize"] = False  # one user opts out
  assert [runner._model_config(config, u)["standardize"] for u in users] == [False, True, True]
  config.standardize = False
  config.users[1]["standardize"] = True
  assert [runner._model_config(config, u)["standardize"] for u in users] == [False, True, False]
  config.pretrained = ""  # from scratch: nothing to standardise with
  assert not any(runner._model_config(config, u)["standardize"] for u in users)
  model = models.build(runner._model_config(config, users[0]), rngs=nnx.Rngs(0))
  assert model.standardize is None

  config = fedmuscle_config.get_config("smoke")
  config.users[0]["standardize"] = "yes"
  with pytest.raises(runner.ConfigError, match="user 1: standardize must be True or False"):
    runner.validate(config)
  # A checkpoint written before the statistics existed names what to do.
  folder = tmp_path / "cnn_s"
  encoder = models.build_encoder("cnn_s", rngs=nnx.Rngs(0))
  models.pretrained.save(folder, encoder, models.pretrained.read_config("world-clip/cnn_s"))
  config = fedmuscle_config.get_config("smoke")
  config.users[0]["pretrained"] = str(folder)
  with pytest.raises(runner.ConfigError, match="carries no feature statistics"):
    runner.validate(config)


@pytest.mark.parametrize("modalities", [("audio",), ("image", "audio"), (), ("image", "image")])
def test_public_modalities_are_image_and_text_each_once(modalities):
  """A modality the public set cannot hold is one line naming it (("image", "audio") was a
  KeyError traceback when the public set was built)."""
  config = fedmuscle_config.get_config("smoke")
  config.public.modalities = modalities
  with pytest.raises(runner.ConfigError, match="public.modalities must name one or both of"):
    runner.validate(config)


def test_unknown_model_and_task_names():
  config = fedmuscle_config.get_config("smoke")
  config.users[0]["encoder"] = "vit_xxl"
  with pytest.raises(runner.ConfigError, match="unknown encoder 'vit_xxl'"):
    runner.validate(config)
  config = fedmuscle_config.get_config("smoke")
  config.users[1]["task"] = "detection"
  with pytest.raises(runner.ConfigError, match="unknown task 'detection'"):
    runner.validate(config)


def test_each_task_has_its_own_test_size():
  config = fedmuscle_config.get_config("smoke")
  config.users = [*config.users, dict(config.users[0])]  # two MLC users share a task's pool
  config.test_sizes.mlc = 5
  config.test_sizes.ic10 = 7
  users = runner.validate(config)
  assert runner.test_sizes(config) == {"mlc": 5, "ic100": 24, "ic10": 7, "ss": 24, "tc": 24}
  _, test, _ = runner._user_data(config, users)
  assert [len(test[u.index]["image"]) for u in users] == [5, 7, 24, 5]
  # The MLC users' test sets are disjoint slices of their task's pool.
  a, b = (test[u.index]["image"].reshape(5, -1) for u in users if u.task == "mlc")
  assert not {r.tobytes() for r in a} & {r.tobytes() for r in b}
  # Unset, every task falls back to test_size; the paper's sizes are set per task.
  assert set(runner.test_sizes(fedmuscle_config.get_config("smoke")).values()) == {24}
  paper = runner.test_sizes(fedmuscle_config.get_config("paper_setup2"))
  assert paper == {"mlc": 1000, "ic100": 2000, "ic10": 4000, "ss": 3000, "tc": 5000}  # App. G
  bad = fedmuscle_config.get_config("smoke")
  bad.test_sizes.detection = 3
  with pytest.raises(runner.ConfigError, match=r"^test_sizes: unknown task 'detection'"):
    runner.validate(bad)
  bad.test_sizes = ml_collections.ConfigDict({"mlc": 2.5})  # a hand-written config
  with pytest.raises(runner.ConfigError, match=r"^test_sizes\.mlc must be an int >= 1"):
    runner.test_sizes(bad)


def test_public_max_objects_gives_richer_public_scenes_only():
  """The COCO-like block: more objects per public scene; the users' sets are unchanged."""
  config = fedmuscle_config.get_config("smoke")
  users = runner.validate(config)
  train3, test3, public3 = runner._user_data(config, users)
  # The default (3) is the world's own default: the public set as before this key existed.
  before = data.generate(config.seed * 1000 + 1, config.public.size, shift=config.public.shift)
  np.testing.assert_array_equal(np.asarray(public3["image"]), before["image"])
  config.public.max_objects = 9  # 9 objects, 40% of each visible, do not fit 32 x 32
  runner.validate(config)
  with pytest.raises(runner.ConfigError, match="^public.max_objects / public.min_visible: Could"):
    runner._user_data(config, users)
  config.public.max_objects, config.public.min_visible = 5, 0.3  # the COCO-like block
  runner.validate(config)
  train5, test5, public5 = runner._user_data(config, users)
  for a, b in ((train3, train5), (test3, test5)):
    for i in a:
      np.testing.assert_array_equal(np.asarray(a[i]["image"]), np.asarray(b[i]["image"]))
  assert public5["image"].shape == public3["image"].shape
  assert not np.array_equal(np.asarray(public5["image"]), np.asarray(public3["image"]))
  # What the key means: more objects in a scene (shift 1 favours the most objects).
  world = lambda m, v: data.WorldConfig(max_objects=m, min_visible_fraction=v)
  scenes = lambda m, v: data.generate(1, 400, config=world(m, v), shift=1.0)["num_objects"]
  assert scenes(5, 0.3).mean() > scenes(3, 0.4).mean() + 1.5
  config.public.max_objects = 10
  with pytest.raises(runner.ConfigError, match=r"public\.max_objects must be"):
    runner.validate(config)
  config.public.max_objects = 5
  config.data.source = "tfds"
  with pytest.raises(runner.ConfigError, match="public.max_objects and public.min_visible apply"):
    runner.validate(config)


def test_smoke_run_resume_after_kill_and_refusal(tmp_path, main_cache):
  def main(workdir, *overrides):
    return experiment_main.run(CONFIG, workdir, *overrides, cache_dir=main_cache)

  # Uninterrupted reference.
  code, out, err = main(tmp_path / "ref", "--config.rounds=4")
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
  assert len(reference["trivial"]) == 3 and "trivial" in out

  # Killed mid-run (SIGKILL once round 2 is checkpointed), then resumed by the same command.
  proc = experiment_main.start(CONFIG, tmp_path / "run", "--config.rounds=4", cache_dir=main_cache)
  deadline = time.time() + 600
  while not (tmp_path / "run" / "checkpoints" / "2" / "_CHECKPOINT_METADATA").exists():
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert time.time() < deadline
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  compiled = experiment_main.cached_programs(main_cache)
  code, out, err = main(tmp_path / "run", "--config.rounds=4")
  assert code == 0, err[-3000:]
  assert "resumed at round" in out
  experiment_main.assert_resume_compiled_nothing_new(main_cache, compiled)
  resumed = json.loads((tmp_path / "run" / "results.json").read_text())
  assert resumed["fedmuscle"] == reference["fedmuscle"] and resumed["local"] == reference["local"]
  assert resumed["traffic_total"] == reference["traffic_total"]  # The ledger survived the kill.
  assert reference["traffic_total"]["up"] == 3 * 4 * reference["traffic_per_round"]["up"]
  # Every run's metrics, before and after the kill, are those of the uninterrupted run, once each.
  lines = lambda workdir: sorted(json.dumps(r, sort_keys=True) for r in read_metrics(workdir))
  assert lines(tmp_path / "run") == lines(tmp_path / "ref")

  # A different config in the same workdir is refused, and nothing is touched.
  code, _, err = main(tmp_path / "run", "--config.rounds=5")
  assert code == 2 and "rounds: 4 != 5" in err and "--overwrite" in err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_run_cleanly_and_the_command_resumes(tmp_path, main_cache, sig):
  # SIGTERM (a scheduler's preemption) and Ctrl-C unwind the run: the save in flight is
  # finished, so the last round logged is the last one checkpointed; the lock is released;
  # one line on stderr, no traceback, exit status 128 + the signal's number.
  workdir = tmp_path / "run"
  proc = experiment_main.start(  # As a shell's foreground job: SIGINT is Ctrl-C.
    CONFIG, workdir, "--config.rounds=12", cache_dir=main_cache, module="tests.foreground_main"
  )
  deadline = time.time() + 600
  while not (workdir / "checkpoints" / "1" / "_CHECKPOINT_METADATA").exists():
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert time.time() < deadline
    time.sleep(0.05)
  proc.send_signal(sig)
  _, err = proc.communicate(timeout=600)
  assert proc.returncode == 128 + sig, err[-3000:]
  assert "Traceback" not in err and err.splitlines()[-1] == (
    f"stopped by {signal.Signals(sig).name}: every round checkpointed so far is kept in "
    f"{workdir}; the same command resumes from the last of them"
  ), err[-3000:]
  steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir())  # No tmp folder.
  assert all((workdir / "checkpoints" / str(s) / "_CHECKPOINT_METADATA").exists() for s in steps)
  assert max(r["round"] for r in read_metrics(workdir)) == steps[-1] < 12
  assert not (workdir / ".lock").exists()
  if sig == signal.SIGTERM:
    code, out, err = experiment_main.run(
      CONFIG, workdir, "--config.rounds=12", cache_dir=main_cache
    )
    assert code == 0 and f"resumed at round {steps[-1]}" in out, err[-3000:]


def test_delta_leaves_out_users_whose_local_metric_is_zero():
  value, excluded = runner._delta([0.6, 0.3, 0.5], [0.5, 0.0, 0.25])
  assert excluded == [1]
  assert value == pytest.approx(((0.6 - 0.5) / 0.5 + (0.5 - 0.25) / 0.25) / 2)
  value, excluded = runner._delta([0.6, 0.3], [0.0, 0.0])
  assert excluded == [0, 1] and value != value  # NaN: no user has a defined gain.


def _encoder_sources(state):
  """(names of trained parameters, the encoder's frozen and trained values by name)."""
  from flax import nnx

  trained = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(state.params)}
  frozen = {
    ".".join(map(str, p[1:])): v[...]
    for p, v in nnx.to_flat_state(state.shared)
    if p[0] == "encoder"
  }
  trained_encoder = {  # Stacked over the group's one client.
    ".".join(map(str, p[1:])): v[...][0]
    for p, v in nnx.to_flat_state(state.params)
    if p[0] == "encoder"
  }
  return trained, frozen, trained_encoder


@pytest.mark.parametrize("fine_tune", ["adapters", "full"])
def test_users_start_from_the_shipped_encoders(fine_tune):
  import numpy as np
  from flax import nnx

  from fedjax_mm import models

  config = fedmuscle_config.get_config("smoke")
  config.fine_tune = fine_tune
  users, _, states, *_ = runner.build(config)
  assert {u.encoder for u in users} - models.LORA_ENCODERS  # a CNN among them
  for u, state in zip(users, states, strict=True):
    shipped = models.pretrained.read_tensors(f"world-clip/{u.encoder}")
    trained, frozen, trained_encoder = _encoder_sources(state)
    if fine_tune == "adapters":  # Base weights frozen and shared; adapters (if any) train.
      assert not any(p.startswith("encoder") and "lora" not in p for p in trained)
      assert any("lora" in p for p in trained) == (u.encoder in models.LORA_ENCODERS)
      assert any(p.startswith(("projector", "head")) for p in trained)
      source = frozen
    else:  # Every parameter trains, from the shipped weights.
      assert not frozen and not any("lora" in p for p in trained)
      source = trained_encoder
    shipped.pop("projection.kernel")
    # Its features standardised with the shipped statistics, held fixed in either mode.
    stats = {
      ".".join(map(str, p[1:])): v[...]
      for p, v in nnx.to_flat_state(state.shared)
      if p[0] == "standardize"
    }
    assert stats.keys() == {"mean", "std"}
    for key in ("mean", "std"):
      np.testing.assert_array_equal(stats[key], shipped.pop(f"pooled.{key}"), err_msg=u.name)
    assert not any(p.startswith("standardize") for p in trained)
    assert source.keys() == shipped.keys()
    for name, value in shipped.items():
      np.testing.assert_array_equal(np.asarray(source[name]), value, err_msg=f"{u.name} {name}")


@pytest.mark.parametrize("encoder,fine_tune", [("vit_t", None), ("cnn_s", None), ("cnn_s", "full")])
def test_unaligned_users_are_those_whose_head_the_contrastive_epochs_cannot_reach(
  encoder, fine_tune
):
  """A segmentation user is unaligned exactly when the gradient of its predictions
  with respect to what the contrastive epochs train (under z) is zero."""
  config = fedmuscle_config.get_config("setup2")
  ss = next(i for i, u in enumerate(config.users) if u["task"] == "ss")
  config.users[ss]["encoder"] = encoder
  if fine_tune:
    config.users[ss]["fine_tune"] = fine_tune
  users = runner.validate(config)
  u = users[ss]
  model = models.build(runner._model_config(config, u), rngs=nnx.Rngs(0))
  wrt = nnx.All(
    models.trainable_filter(lora=runner._frozen_base(config, u)), models.representation_filter
  )
  graphdef, aligned, rest = nnx.split(model, wrt, ...)
  images = np.random.default_rng(0).uniform(size=(2, 32, 32, 3)).astype(np.float32)

  def predictions(aligned_state):
    return nnx.merge(graphdef, aligned_state, rest).forward(images)[1].sum()

  grads = jax.grad(predictions)(aligned)
  reached = sum(float(np.abs(g).sum()) for g in jax.tree.leaves(grads)) > 0
  assert reached == (u not in runner.unaligned_users(config, users))
  assert reached == (encoder == "vit_t" or fine_tune == "full")
