"""The RCSR command end to end: bad configs are one line and exit 2; the smoke run
writes its table, results (per-client scores, fairness, q) and checkpoints, and a run
killed after a checkpoint resumes bit for bit."""

import json
import re
import shutil

import experiment_main
import jax
import numpy as np
import pytest
import rounding

from experiments import rcsr as rcsr_config
from fedjax_mm.algorithms import rcsr as rcsr_alg
from fedjax_mm.core import cost
from fedjax_mm.runner import rcsr as runner
from fedjax_mm.runner.errors import ConfigError


@pytest.mark.parametrize(
  "key,value,message",
  [
    ("missing_rate", 1.0, "missing_rate must be in [0, 1)"),
    ("missing_rate", -0.1, "missing_rate must be in [0, 1)"),
    ("participation", 0.1, "participation * num_clients must be >= 1"),
    ("methods", ("rcsr", "fedsgd"), "unknown ['fedsgd']"),
    ("public_size", 0, "public_size must be >= 1"),
    ("public_size", 40, "global_test + public_size must be <= 40"),
    ("devices", 3, "devices (3) must divide the 2 clients a round trains"),
    ("devices", 9, "devices must be an int in [1, 8], the cpu devices"),
    ("kmeans_k", 81, "kmeans_k (81) must be at most the 80 captions it clusters"),
    ("rcsr.router_width", 15, "rcsr.router_width (15) must be a multiple of rcsr.router_heads (4)"),
    ("image_size", 18, "image_size must be a multiple of vit_t's patch (4), got 18."),
    ("image_encoder", "cnn_m", "image_encoder must be one of vit_t, vit_s, vit_b, vitc_t"),
    ("client_map", "foo", "client_map must be 'auto', 'vmap', 'scan' or 'map:<k>'"),
    ("methods", ("rcsr", "rcsr"), "methods: each at most once"),
    # World-CLIP's towers were pretrained on 32x32 images and 16-token captions.
    ("pretrained", True, "world-clip/vit_t was pretrained with image_size=32; set image_size=32"),
  ],
)
def test_validate_names_the_key(key, value, message):
  config = rcsr_config.get_config("smoke")
  *parents, leaf = key.split(".")
  node = config
  for p in parents:
    node = node[p]
  node[leaf] = value
  with pytest.raises(ConfigError, match=re.escape(message)):
    runner.validate(config)


@pytest.mark.parametrize("ema", [1.0, -0.1])
def test_validate_creamfl_ema(ema):
  config = rcsr_config.get_config("smoke")
  config.rcsr.creamfl_ema = ema
  with pytest.raises(ConfigError, match=re.escape("rcsr.creamfl_ema must be in [0, 1)")):
    runner.validate(config)


def test_devices_split_the_sampled_clients_and_change_no_result():
  """``config.devices=2``: the round's 2 sampled clients train one per device (the loop
  over clients, outermost in the round, has length 1 where one device loops over both) on
  a replicated state, and two rounds give the shared model, the personal adapters and the
  metrics of one device (float rounding apart). "auto" loops over the clients on one
  device too, though this process has 8 (the round is traced in the one-device mesh)."""
  outcomes = {}
  for devices in (1, 2):
    config = rcsr_config.get_config("smoke")
    config.methods = ("rcsr",)
    config.devices = devices
    exp = runner.experiment(config)
    state = exp.init()["rcsr"]
    # Every leaf (the method's switches too) is placed as the round returns it, so the
    # second round reuses the first's compile.
    assert {len(x.sharding.device_set) for x in jax.tree.leaves(state)} == {devices}
    round_fn = exp.methods["rcsr"]
    for _ in range(2):
      state, out = round_fn(state)
    traced = jax.make_jaxpr(round_fn)(state)  # traced once: the loop's length and the program
    (client_loop, *_) = cost.equations(traced, "scan")
    if devices == 1:  # "auto" traces the program that "scan" does
      config.client_map = "scan"
      looped = runner.experiment(config).methods["rcsr"]
      assert str(jax.make_jaxpr(looped)(state)) == str(traced)
    outcomes[devices] = (state.params, state.personal, out, client_loop.params["length"])
  assert {len(x.sharding.device_set) for x in jax.tree.leaves(outcomes[2][0])} == {2}
  assert outcomes[1][3] == 2 and outcomes[2][3] == 1
  numbers = lambda o: jax.tree.map(np.asarray, o[:3])
  rounding.assert_close(numbers(outcomes[2]), numbers(outcomes[1]))


def test_smoke_run_and_resume(tmp_path, main_cache):
  code, out, err = experiment_main.run(
    "experiments/rcsr.py:smoke", tmp_path / "run", cache_dir=main_cache, timeout=1200
  )
  assert code == 0, err[-3000:]
  assert "| rcsr_p" in out and "| pfedmma" in out and "| chance" in out
  assert "| mfcpl" in out and "| fedmekt" in out and "| creamfl" in out
  results = json.loads((tmp_path / "run" / "results.json").read_text())
  for m in ("fedavg", "rcsr", "rcsr_p", "pfedmma", "mfcpl", "fedmekt", "creamfl"):
    final = results["methods"][m]
    assert len(final["own"]["R@1"]) == 4 and "std_R@1" in final["fairness"]
    assert abs(sum(final["q"]) - 1) < 1e-5
  assert results["methods"]["fedavg"]["q"] == [0.25] * 4  # no q game for FedAvg
  ledger = results["bytes_per_client_round"]
  assert ledger["pfedmma"] == ledger["fedavg"]  # the client-specific adapters stay home
  assert ledger["rcsr"]["up"] == ledger["fedavg"]["up"] + 7 * 4  # gamma_k, m_k, l_k
  # MFCPL: + per-class prototypes and counts of each held modality (kmeans_k = 3, d = 8);
  # FedMEKT and CreamFL: + public-set representations of each held modality up, both
  # modalities' down (public_size = 4).
  cfg = rcsr_config.get_config("smoke")
  c, d, p = cfg.kmeans_k, cfg.dim, cfg.public_size
  fedavg = ledger["fedavg"]
  assert ledger["mfcpl"] == {
    "up": fedavg["up"] + 2 * c * (d + 1) * 4,
    "down": fedavg["down"] + 2 * c * d * 4,
    "up_single": fedavg["up"] + c * (d + 1) * 4,
  }
  for m in ("fedmekt", "creamfl"):
    assert ledger[m] == {
      "up": fedavg["up"] + 2 * p * d * 4,
      "down": fedavg["down"] + 2 * p * d * 4,
      "up_single": fedavg["up"] + p * d * 4,
    }
  assert (tmp_path / "run" / "checkpoints").exists()

  # A crash after round 1's checkpoint: the rerun (same command, so the same devices and
  # flags; its executables from the shared cache) resumes and ends bit for bit where the
  # uninterrupted run ended.
  workdir = tmp_path / "run"
  rounds = rcsr_config.get_config("smoke").rounds
  shutil.rmtree(workdir / "checkpoints" / str(rounds))
  (workdir / "results.json").unlink()
  compiled = experiment_main.cached_programs(main_cache)
  code, out, err = experiment_main.run(
    "experiments/rcsr.py:smoke", workdir, cache_dir=main_cache, timeout=1200
  )
  assert code == 0, err[-3000:]
  assert f"resumed at round {rounds - 1}" in out
  experiment_main.assert_resume_compiled_nothing_new(main_cache, compiled)
  resumed = json.loads((workdir / "results.json").read_text())
  assert resumed["methods"] == results["methods"]

  # The seeds' summary reads the same numbers back, with RCSR minus each row paired.
  table = runner.SYSTEM.summarize([workdir, workdir])
  rcsr, fedavg = (results["methods"][m]["global"]["R@1"] for m in ("rcsr", "fedavg"))
  assert f" {rcsr:.1f} ± 0.0 |" in table
  assert re.search(r"\| rcsr - fedavg \(paired\) +\| ", table)
  d = f"{rcsr - fedavg:+.1f}"
  assert f" {d} [{d}, {d}] |" in table.split("rcsr - fedavg (paired)")[1].split("\n")[0]


@pytest.mark.parametrize("variant", [None, "ablations", "baselines", "sweeps", "smoke"])
def test_every_variant_validates(variant):
  config = rcsr_config.get_config(variant)
  runner.validate(config)
  assert len(set(config.methods)) == len(config.methods)


def test_unknown_variant_names_the_known_ones():
  with pytest.raises(ValueError, match="known: smoke, ablations, baselines, sweeps"):
    rcsr_config.get_config("sweep")


def test_recall_equals_the_whole_similarity_matrix():
  """R@K of paired embeddings, formed a chunk of queries at a time, equals the ranks read
  off the whole ``n x n`` similarity matrix (ties counted for the query)."""
  rng = np.random.default_rng(0)
  z_i = rng.normal(size=(37, 6)).astype(np.float32)
  z_t = rng.normal(size=(37, 6)).astype(np.float32)
  z_t[5] = z_t[3]  # a tie: image 3's caption 5 is as similar as its own
  sims = z_i.astype(np.float64) @ z_t.T.astype(np.float64)
  diag = np.diagonal(sims)
  rank_i2t = (sims > diag[:, None]).sum(1)
  rank_t2i = (sims > diag[None, :]).sum(0)
  got = rcsr_alg.recall(jax.numpy.asarray(z_i), jax.numpy.asarray(z_t), runner.KS)
  for k in runner.KS:
    i2t, t2i = 100 * np.mean(rank_i2t < k), 100 * np.mean(rank_t2i < k)
    np.testing.assert_allclose(got[f"i2t_R@{k}"], i2t, rtol=1e-6)
    np.testing.assert_allclose(got[f"t2i_R@{k}"], t2i, rtol=1e-6)
    np.testing.assert_allclose(got[f"R@{k}"], (i2t + t2i) / 2, rtol=1e-6)
