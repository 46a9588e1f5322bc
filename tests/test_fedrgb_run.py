"""The FedRGB command end to end: validation (exit 2), the smoke run, resume."""

import collections
import json
import re
import shutil

import experiment_main
import jax
import numpy as np
import pytest

from experiments import fedrgb as fedrgb_config
from fedjax_mm.core import cost
from fedjax_mm.runner import fedrgb as runner
from fedjax_mm.runner.errors import ConfigError


@pytest.mark.parametrize(
  "key,value,message",
  [
    ("fedrgb.rho", -0.1, "fedrgb.rho must be >= 0, got -0.1."),
    ("fedrgb.gamma", float("nan"), "fedrgb.gamma must be finite and >= 0, got nan."),
    ("fedrgb.dro_form", "eq7", "fedrgb.dro_form must be one of ['appb', 'eq6', 'eq12']"),
    ("fedrgb.dro_source", "authors", "fedrgb.dro_source must be one of ['paper', 'code']"),
    ("methods", ("fedrgb", "fedprox"), "unknown ['fedprox']"),
    ("learning_rate", float("nan"), "learning_rate must be finite and > 0, got nan."),
    ("fedema_tau", 0.0, "fedema_tau must be > 0, got 0.0."),
    ("fedx.target_tau", 0.0, "fedx.target_tau must be > 0, got 0.0."),
    ("fedmae.mask_ratio", 1.0, "fedmae.mask_ratio must be in (0, 1)"),
    ("fedmae.weight", -1.0, "fedmae.weight must be >= 0, got -1.0."),
    ("fedx.weight", -1.0, "fedx.weight must be >= 0, got -1.0."),
    ("gallery", 99, "test_per_client (8) must be >= gallery (99)"),
    ("ood_test", 3, "ood_test (3) must be >= gallery (4)"),
    ("num_clients", 1, "num_clients must be >= 2"),
    ("devices", 2, "devices (2) must divide num_clients (3)"),
    ("devices", 9, "devices must be an int in [1, 8], the cpu devices"),
    ("text_encoder", "vit_t", "text_encoder: unknown text encoder 'vit_t'"),
    ("distortion.steps", -1, "distortion.steps must be >= 0, got -1."),
    ("distortion.retrain", ("own", "full"), "distortion.retrain: each of ['own', 'task']"),
    ("downstream.fractions", (0.0, 0.1), "downstream.fractions[0] must be in (0, 1], got 0.0."),
    ("downstream.test", 0, "downstream.test must be >= 1, got 0."),
    ("downstream.learning_rate", -1.0, "downstream.learning_rate must be > 0, got -1.0."),
    ("segmentation.target", "blob", "segmentation.target must be 'objects' or a shape"),
    ("segmentation.steps", -1, "segmentation.steps must be >= 0, got -1."),
    ("segmentation.width", 6, "segmentation.width must be a positive multiple of 4"),
    ("segmentation.width", 0, "segmentation.width must be >= 4, got 0."),
    ("image_size", 18, "image_size must be a multiple of 4"),
    ("downstream.fractions", (), "downstream.fractions is empty"),
    ("client_map", "foo", "client_map must be 'auto', 'vmap', 'scan' or 'map:<k>'"),
    ("methods", ("fedrgb", "fedrgb"), "methods: each at most once"),
    # A shipped checkpoint pretrained on other sizes: named before any data is built.
    ("pretrained", True, "world-clip/cnn_s was pretrained with image_size=32; set image_size=32"),
    ("segmentation.learning_rate", 0.0, "segmentation.learning_rate must be > 0, got 0.0."),
  ],
)
def test_validate_names_the_key(key, value, message):
  config = fedrgb_config.get_config("smoke")
  *parents, leaf = key.split(".")
  node = config
  for p in parents:
    node = node[p]
  node[leaf] = value
  with pytest.raises(ConfigError, match=re.escape(message)):
    runner.validate(config)


@pytest.mark.parametrize("variant", [None, "ablations", "smoke"])
def test_every_variant_of_the_config_is_valid(variant):
  runner.validate(fedrgb_config.get_config(variant))


def test_categories_are_the_five_shape_bits():
  multilabel = np.zeros((3, 10), np.float32)
  multilabel[1, [0, 2, 7]] = 1  # shape 7 is not one of the five attributes
  multilabel[2, :5] = 1
  np.testing.assert_array_equal(runner.categories(multilabel), [0, 1 + 4, 31])


def test_devices_split_the_clients():
  """``config.devices=2`` with 4 clients: every loop over the 4 clients (stage 1, the DRO
  losses, stage 2) runs over 2 on each device, on a replicated state, and the round's
  losses and DRO weights are one device's up to float rounding (the parameters then
  differ by Adam's amplified rounding, as CreamFL's do: see docs/results/creamfl.md). "auto" loops over
  the clients on one device too, though this process has 8 (the round is traced in the
  one-device mesh). The distortion matrix's retraining (a loop over the clients too) of
  one final model is one device's up to rounding as well."""
  outcomes = {}
  for devices in (1, 2):
    config = fedrgb_config.get_config("smoke")
    config.methods = ("fedrgb",)
    config.num_clients = 4
    config.devices = devices
    config.rounds = 1  # so that the round's state is the final one, which evaluate retrains
    config.distortion.retrain = ("own",)
    config.downstream.enabled = config.segmentation.enabled = False
    exp = runner.experiment(config)
    state = exp.init()["fedrgb"]
    # Every leaf (the row too) is placed as the round returns it: no second compile.
    assert {len(x.sharding.device_set) for x in jax.tree.leaves(state)} == {devices}
    round_fn = exp.methods["fedrgb"]
    loops = cost.equations(jax.make_jaxpr(round_fn)(state), "scan")
    state, out = round_fn(state)
    lengths = collections.Counter(e.params["length"] for e in loops)
    outcomes[devices] = (exp, state, out, lengths)
  (exp1, state1, one, on_one), (exp2, state, two, on_two) = outcomes[1], outcomes[2]
  assert {len(x.sharding.device_set) for x in jax.tree.leaves(state["rgb"].encoder)} == {2}
  split = on_one[4] - on_two[4]
  assert split >= 3 and on_two[2] - on_one[2] == split and on_one.total() == on_two.total()
  for key in ("stage1_loss", "stage2_loss", "dro_loss_start", "weights"):
    np.testing.assert_allclose(two[key], one[key], rtol=1e-4)
  # One device's final model, evaluated by both: placed as the two-device run places it.
  placed = jax.tree.map(lambda x, y: jax.device_put(x, y.sharding), state1, state)
  d1, d2 = (e.evaluate(s)["distortion"]["own"] for e, s in ((exp1, state1), (exp2, placed)))
  assert np.asarray(d1["matrix"]).shape == (4, 4)
  np.testing.assert_allclose(d2["matrix"], d1["matrix"], rtol=1e-4, atol=1e-5)
  for key in ("paired_cosine", "unpaired_cosine"):
    np.testing.assert_allclose(d2[key], d1[key], rtol=1e-5)


def test_smoke_run_and_resume(tmp_path, compilation_cache, capsys):
  config = fedrgb_config.get_config("smoke")
  workdir = tmp_path / "run"
  reference = runner.run(config, workdir, progress=False)
  out = capsys.readouterr().out
  assert "| fedrgb" in out and "| local" in out and "| chance" in out
  assert "| centralised" in out and "| fedema" in out
  assert "| fedx" in out and "| fedmae" in out
  # The retrieval table prints the paper's batch R@1 and R@5, mean and worst client, as
  # results.json holds them, and a chance cell under every column.
  lines = out[out.index("| Method      | T2I@1 (batch") :].split("\n\n")[0].splitlines()
  header = [c.strip() for c in lines[0].strip("|").split("|")]
  cells = {
    row[0]: dict(zip(header, row, strict=True))
    for row in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])
    if row[0] in (*config.methods, "chance")
  }
  assert set(cells) == {*config.methods, "chance"}
  g = config.gallery
  gallery_r5 = reference["methods"]["fedrgb"]["own"]["gallery_t2i_R@5"]
  assert cells["fedrgb"][f"T2I@5 (batch {g}) worst"] == f"{min(gallery_r5):.1f}"
  assert cells["fedrgb"][f"T2I@5 (batch {g}) mean"] == f"{np.mean(gallery_r5):.1f}"
  assert cells["chance"][f"T2I@5 (batch {g}) mean"] == f"{100 * min(1, 5 / g):.1f}"
  k = config.num_clients
  for m in config.methods:
    final = reference["methods"][m]
    assert len(final["own"]["i2t_R@1"]) == k
    assert final["worst"]["t2i_R@1"] == min(final["own"]["t2i_R@1"])
    assert final["mean"]["t2i_R@1"] == pytest.approx(np.mean(final["own"]["t2i_R@1"]))
    assert all(0 <= v <= 100 for v in final["ood"].values())
  weights = np.asarray(reference["methods"]["fedrgb"]["weights"])
  np.testing.assert_allclose(weights.sum(), 1.0, atol=1e-5)
  chi2 = np.sum((k * weights - 1) ** 2) / (2 * k)  # D(N w || 1), the paper's ball
  assert chi2 <= config.fedrgb.rho + 1e-5
  # Distortion and downstream accuracy after the last round, for the global models only.
  assert "distortion" not in reference["methods"]["local"]
  for m in ("fedavg", "fedrgb", "fedx", "fedmae"):
    final = reference["methods"][m]
    for retrain in config.distortion.retrain:
      d = final["distortion"][retrain]
      assert np.asarray(d["matrix"]).shape == (k, k)
      assert d["summary"]["all"] == pytest.approx(np.mean(d["matrix"]))
    for task in runner.DOWNSTREAM:
      assert set(final["downstream"][task]) == {"1%", "10%"}
      assert all(0 <= v <= 100 for v in final["downstream"][task].values())
    assert set(final["segmentation"]) == {"1%", "10%"}
    assert all(0 <= v <= 100 for v in final["segmentation"].values())
  # FedAvg's own client update is L_task: "own" and "task" are one retraining.
  assert (
    reference["methods"]["fedavg"]["distortion"]["own"]
    == (reference["methods"]["fedavg"]["distortion"]["task"])
  )
  assert set(reference["downstream_majority"]) == set(runner.DOWNSTREAM)
  assert "| majority class" in out and "| no retraining" in out and "| all positive" in out
  assert set(reference["segmentation_initial"]) == {"1%", "10%"}
  traffic = reference["traffic_bytes"]
  assert traffic["local"]["stage1"] == 0 and traffic["fedavg"]["stage2"] == 0
  assert traffic["fedrgb"]["stage2"] > 0
  assert traffic["centralised"]["stage1"] == traffic["centralised"]["stage2"] == 0
  assert traffic["fedema"] == traffic["fedavg"] == traffic["fedx"]
  assert traffic["fedmae"]["stage1"] > traffic["fedavg"]["stage1"]  # + its decoder
  assert traffic["fedmae"]["full_model"] == traffic["fedavg"]["full_model"]
  assert sum(reference["client_categories"]) == k * (
    config.train_per_client + config.test_per_client
  )

  # A crash after round 1's checkpoint: the rerun resumes and ends bit for bit where the
  # uninterrupted run ended.
  shutil.rmtree(workdir / "checkpoints" / str(config.rounds))
  (workdir / "results.json").unlink()
  compiled = experiment_main.cached_programs(compilation_cache)
  resumed = runner.run(config, workdir, progress=False)
  assert f"resumed at round {config.rounds - 1}" in capsys.readouterr().out
  experiment_main.assert_resume_compiled_nothing_new(compilation_cache, compiled)
  assert resumed["methods"] == reference["methods"]
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  for m in config.methods:
    assert sorted(r["round"] for r in records if r["run"] == m) == list(range(1, config.rounds + 1))

  # The seeds' summary reads the same numbers back, with the paired difference.
  table = runner.SYSTEM.summarize([workdir, workdir])
  fedrgb = reference["methods"]["fedrgb"]["mean"]["gallery_t2i_R@1"]
  fedavg = reference["methods"]["fedavg"]["mean"]["gallery_t2i_R@1"]
  assert f" {fedrgb:.1f} ± 0.0 |" in table
  d = f"{fedrgb - fedavg:+.1f}"
  assert f" {d} [{d}, {d}] |" in table.split("fedrgb - fedavg (paired)")[1]
  dice = table.split("Segmentation Dice (%)")[1]
  fedrgb_dice = reference["methods"]["fedrgb"]["segmentation"]["10%"]
  fedavg_dice = reference["methods"]["fedavg"]["segmentation"]["10%"]
  assert f" {fedrgb_dice:.1f} ± 0.0 |" in dice.split("| fedrgb ")[1].split("\n")[0]
  paired = dice.split("fedrgb - fedavg (paired)")[1].split("\n")[0]
  d = f"{fedrgb_dice - fedavg_dice:+.1f}"
  assert f" {d} [{d}, {d}] |" in paired
  assert "| all positive" in dice and "| initial model" in dice
  assert "| majority class" in table.split("Downstream accuracy (%)")[1]
  other = tmp_path / "other"
  shutil.copytree(workdir, other, ignore=shutil.ignore_patterns("checkpoints", "tb"))
  cfg = json.loads((other / "config.json").read_text())
  (other / "config.json").write_text(json.dumps(cfg | {"rounds": 3}))
  with pytest.raises(ValueError, match="more than the seed"):
    runner.SYSTEM.summarize([workdir, other])


def test_segmentation_target_is_every_object_or_one_shape():
  mask = np.array([[[0, 1, 2], [3, 0, 1]]])  # 0 background, 1 + shape
  np.testing.assert_array_equal(
    runner.segmentation_target(mask, "objects"), [[[False, True, True], [True, False, True]]]
  )
  np.testing.assert_array_equal(
    runner.segmentation_target(mask, "circle"), [[[False, True, False], [False, False, True]]]
  )
  np.testing.assert_array_equal(
    runner.segmentation_target(mask, "square"), [[[False, False, True], [False, False, False]]]
  )
