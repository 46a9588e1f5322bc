"""The CreamFL command end to end: smoke run, resume, refusal, one-line config errors."""

import itertools
import json

import experiment_main
import jax
import numpy as np
import pytest
import rounding

from experiments import creamfl as creamfl_config
from fedjax_mm import core, data, metrics
from fedjax_mm.algorithms import creamfl
from fedjax_mm.runner import creamfl as runner
from fedjax_mm.runner import creamfl_report
from fedjax_mm.runner.workdir import WorkdirError


@pytest.mark.parametrize(
  "key,value,message",
  [
    ("methods", ("CreamFL", "FedXYZ"), "unknown ['FedXYZ']"),
    ("creamfl.num_selected", 7, "num_selected (7)"),
    ("creamfl.muscle_partners", 4, "muscle_partners (M=4)"),
    ("creamfl.muscle_tau_reduced", 0.3, "gamma > 0"),
    ("public.size", 10, "multiple of creamfl.batch_size"),
    ("test.sizes", (4, 6), "every size must divide the largest (6)"),
    ("test.sizes", (3, 3), "test.sizes must be distinct sizes >= 2"),
    ("test.private_size", 1, "test.private_size must be 0"),
    ("creamfl.inter_temperature", 0.0, "inter_temperature must be > 0"),
    ("creamfl.fedet_diversity_weight", -0.1, "fedet_diversity_weight must be >= 0"),
    ("creamfl.public_batch_size", 9, "public_batch_size (9) must be between 1 and public.size (8)"),
    ("faults.dropout", 0.34, "FedAvg, FedIoT simulate no client faults"),
    ("vqa.steps", 0, "vqa.steps must be >= 1"),
    ("vqa.learning_rate", 0.0, "vqa.learning_rate must be > 0"),
    ("vqa.features", "tokens", "vqa.features must be one of representation, pooled"),
    ("devices", 9, "devices must be an int in [1, 8], the cpu devices"),
  ],
)
def test_validate_rejects_bad_configs(key, value, message):
  config = creamfl_config.get_config("smoke")
  node, leaf = config, key.split(".")
  for part in leaf[:-1]:
    node = node[part]
  node[leaf[-1]] = value
  with pytest.raises(runner.ConfigError, match=None) as e:
    runner.validate(config)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_encoder_of_the_wrong_modality():
  config = creamfl_config.get_config("smoke")
  config.clients.text.encoder = "vit_t"
  with pytest.raises(runner.ConfigError, match="encodes image, not text"):
    runner.validate(config)


def _one_round(config, monkeypatch, *, devices=1, padded_to=None):
  """Each method's state and outputs after one round, the real clients' rows only."""
  config.devices = devices
  with monkeypatch.context() as patch:
    if padded_to:  # every group padded to padded_to clients, whatever the mesh
      patch.setattr(core, "padded_size", lambda num, mesh: padded_to)
    exp = runner.experiment(config)
  states = exp.init()
  nums = [config.clients[g].num for g in runner.GROUPS]
  out = {}
  for m in config.methods:
    state, stats = exp.methods[m](states[m])
    real = lambda per_group: [np.asarray(x)[:n] for x, n in zip(per_group, nums, strict=True)]
    groups = [jax.tree.map(lambda x, n=n: np.asarray(x)[:n], g.params) for g, n in zip(state.groups, nums, strict=True)]  # fmt: skip
    masks = {k: real(stats[k]) for k in ("active", "dropped") if k in stats}
    losses = {k: stats[k] for k in ("server_loss", "kd_loss") if k in stats}
    losses["client_loss"] = real(stats["client_loss"]) if "client_loss" in stats else []
    out[m] = {"server": state.server_params, "groups": groups, "masks": masks, "losses": losses,
              "traffic": exp.traffic(m, stats), "state": state}  # fmt: skip
  return out


def test_padding_clients_change_no_draw_and_no_result(monkeypatch):
  """Every group padded from 2 to 4 clients (one device): the same clients take part, the
  same are dropped, slowed and corrupted, the same partners are drawn, and the round gives
  the server and the real clients what the unpadded round gives them (float rounding apart).
  Then on 2 devices (a client per device, each group a loop of one per device): the same
  draws and traffic, and the same losses up to the rounding that Adam's steps amplify (the
  devices sum in another order; Adam turns a difference in the last bit of a near-zero
  gradient into a step of the learning rate's size)."""
  config = creamfl_config.get_config("smoke")
  config.methods = ("CreamFL",)  # GCA, both LCR terms, distillation
  config.faults.dropout = 0.5
  config.faults.stragglers = 0.5
  config.faults.byzantine = 0.25
  plain = _one_round(config, monkeypatch)
  padded = _one_round(config, monkeypatch, padded_to=4)
  spread = _one_round(config, monkeypatch, devices=2)
  for m in config.methods:
    assert int(plain[m]["state"].round) == 1 and plain[m]["masks"]["dropped"]
    assert any(a.any() for a in plain[m]["masks"]["dropped"])  # faults were drawn
    rounding.assert_close(
      [padded[m][k] for k in ("server", "groups", "losses")],
      [plain[m][k] for k in ("server", "groups", "losses")],
    )
    for other in (padded, spread):
      same = jax.tree.map(np.array_equal, other[m]["masks"], plain[m]["masks"])
      assert all(jax.tree.leaves(same))
      assert all(np.array_equal(a, b) for a, b in zip(other[m]["traffic"], plain[m]["traffic"], strict=True))  # fmt: skip
    params = spread[m]["state"].groups[0].params
    assert {(x.shape[0], len(x.sharding.device_set)) for x in jax.tree.leaves(params)} == {(2, 2)}
    for got, want in zip(jax.tree.leaves(spread[m]["losses"]), jax.tree.leaves(plain[m]["losses"]), strict=True):  # fmt: skip
      np.testing.assert_allclose(got, want, rtol=1e-3)


def test_padding_clients_change_no_fedavg_tower(monkeypatch):
  """Table 1's FedAvg row (towers averaged across groups) with every group padded to 4."""
  config = creamfl_config.get_config("smoke")
  config.methods = ("FedAvg",)
  plain = _one_round(config, monkeypatch)["FedAvg"]
  padded = _one_round(config, monkeypatch, padded_to=4)["FedAvg"]
  rounding.assert_close(
    [padded[k] for k in ("server", "groups", "losses")],
    [plain[k] for k in ("server", "groups", "losses")],
  )
  assert all(np.array_equal(a, b) for a, b in zip(padded["traffic"], plain["traffic"], strict=True))


def test_smoke_run_resume_and_refusal(tmp_path, compilation_cache, capsys):
  config = creamfl_config.get_config("smoke")
  workdir = tmp_path / "run"
  result = runner.run(config, workdir, progress=False)
  out = capsys.readouterr().out
  assert "| CreamFL+Muscle" in out and "| local" in out and "R@1_sum" in out and "3 test:" in out
  assert "Table 2 analogue (VQA accuracy %)" in out
  for name in ("config.json", "metrics.jsonl", "report.md", "curves.png", "results.json"):
    assert (workdir / name).exists(), name
  stored = json.loads((workdir / "results.json").read_text())
  assert set(stored["recall"]) == set(runner.METHODS)
  # The paper's protocol: tests on the public distribution, one per size, named by its size.
  protocol = stored["protocol"]
  assert protocol["test_sizes"] == [3, 6] and protocol["folds"] == {"3": 2, "6": 1}
  assert protocol["shift"] == config.public.shift == 1.0
  assert protocol["r1_sum"] == "i2t_R@1(3) + t2i_R@1(3) + i2t_R@1(6) + t2i_R@1(6)"
  for m, recall in stored["recall"].items():
    assert set(recall) == {"3", "6"}
    for table in (*recall.values(), stored["private_recall"][m]):
      assert set(table) == set(runner.RECALL_KEYS)
      assert all(0.0 <= v <= 100.0 for v in table.values())
      assert table["i2t_R@1"] <= table["i2t_R@5"] <= table["i2t_R@10"]
    # R@1_sum is the sum of its 4 parts: i2t and t2i R@1 on both test sizes.
    parts = [recall[n][k] for n in ("3", "6") for k in ("i2t_R@1", "t2i_R@1")]
    assert stored["r1_sum"][m] == pytest.approx(sum(parts), abs=1e-9)
    assert stored["rsum"][m] == pytest.approx(
      sum(v for table in recall.values() for v in table.values()), abs=1e-9
    )
  assert stored["chance"]["3"]["t2i_R@1"] == pytest.approx(100 / 3)
  assert stored["chance"]["private"]["t2i_R@1"] == pytest.approx(100 / 4)
  report = (workdir / "report.md").read_text()
  assert "chance (random ranking)" in report and "Private distribution (shift 0" in report
  # Table 2's analogue: a VQA block for every row, on the final server.
  assert "Table 2 analogue (VQA accuracy %)" in report and "| majority answer per type" in report
  block = stored["vqa"]
  assert set(block["methods"]) == set(runner.METHODS)
  qa = runner.vqa_data(config)  # the same questions, rebuilt
  counts = np.bincount(np.asarray(qa.test["type"]), minlength=data.vqa.NUM_TYPES)
  types = data.vqa.QUESTION_TYPES
  assert block["protocol"]["test_questions_per_type"] == dict(
    zip(types, counts.tolist(), strict=True)
  )
  assert block["protocol"]["test_images"] == config.vqa.test_images
  assert block["protocol"]["test_questions"] == counts.sum() == len(qa.test["answer"])
  for m, scores in block["methods"].items():
    for prefix in ("", "blind_"):
      per_type = scores[f"{prefix}per_type"]
      assert set(per_type) == set(types)
      assert all(0.0 <= v <= 100.0 for v in (scores[f"{prefix}accuracy"], *per_type.values()))
      # Overall accuracy is the question-weighted mean of the per-type accuracies.
      weighted = sum(c * per_type[t] for t, c in zip(types, counts, strict=True)) / counts.sum()
      assert scores[f"{prefix}accuracy"] == pytest.approx(weighted, abs=1e-4), m
  # The majority baseline against numpy: each type's most frequent training answer.
  train_type, train_answer = np.asarray(qa.train["type"]), np.asarray(qa.train["answer"])
  best = [
    np.bincount(train_answer[train_type == t], minlength=data.vqa.NUM_ANSWERS).argmax()
    for t in range(data.vqa.NUM_TYPES)
  ]
  right = np.asarray(best)[np.asarray(qa.test["type"])] == np.asarray(qa.test["answer"])
  assert block["majority"]["accuracy"] == pytest.approx(100 * right.mean(), abs=1e-4)
  # Bytes: the server alone sends nothing; every selected client receives I_glob and T_glob.
  assert stored["traffic"]["local"] == {"up_per_round": 0.0, "down_per_round": 0.0}
  matrix = config.public.size * config.rep_dim * 4
  for method in runner.ROWS:
    traffic = stored["traffic"][method]
    assert traffic["down_per_round"] == config.creamfl.num_selected * 2 * matrix
    assert config.creamfl.num_selected * matrix <= traffic["up_per_round"]
    assert traffic["up_per_round"] <= config.creamfl.num_selected * 2 * matrix
  # FedAvg / FedIoT send the selected clients' towers both ways (Fig. 4: more than representations).
  for method in runner.PARAMETER_ROWS:
    traffic = stored["traffic"][method]
    assert (
      traffic["up_per_round"]
      == traffic["down_per_round"]
      > 2 * stored["traffic"]["CreamFL"]["down_per_round"]
    )
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
  rounds = sorted({r["round"] for r in records})
  assert rounds == list(range(1, config.rounds + 1))
  # VQA runs once, on the final server: logged in the last round's line only.
  for r in records:
    assert ("CreamFL/vqa/accuracy" in r) == (r["round"] == config.rounds)
  # Table 1's baselines ran as their own rows: FedMD differs from reamFL+Mean only in the
  # clients' local distillation, FedET / FedGEMS also in the aggregation; each changes
  # what the server distils into (its eq. (7) loss) from the first round on.
  kd = {m: [r[f"{m}/kd_loss"] for r in records if f"{m}/kd_loss" in r] for m in runner.ROWS}
  for method in ("FedMD", "FedET", "FedGEMS"):
    assert len(kd[method]) == config.rounds and kd[method][0] != kd["reamFL+Mean"][0], method
  assert kd["FedET"][0] != kd["FedMD"][0] != kd["FedGEMS"][0]
  # The FedET row ran with its diversity regulariser in the server's distillation.
  assert float(creamfl.variant(**runner.ROWS["FedET"]).diversity) == 1.0
  assert config.creamfl.fedet_diversity_weight > 0
  # FedIoT's 100x on multimodal clients moves the server's towers: round 2's clients start apart.
  loss = {
    m: [r[f"{m}/client_loss"] for r in records if f"{m}/client_loss" in r]
    for m in runner.PARAMETER_ROWS
  }
  assert loss["FedAvg"][0] == loss["FedIoT"][0] and loss["FedAvg"][1] != loss["FedIoT"][1]

  # The same command again resumes from the last checkpoint and reproduces the results,
  # with the programs the first run compiled.
  compiled = experiment_main.cached_programs(compilation_cache)
  again = runner.run(config, workdir, progress=False)
  assert "resumed at round" in capsys.readouterr().out
  experiment_main.assert_resume_compiled_nothing_new(compilation_cache, compiled)
  assert again["recall"] == result["recall"] and again["traffic"] == result["traffic"]
  assert again["vqa"] == result["vqa"]  # evaluated anew on the restored servers: the same

  # The seeds summary: identical runs have zero spread.
  summary = runner.SYSTEM.summarize([workdir, workdir])
  table = summary.split("R@1_sum (public-distribution tests):\n\n")[1].split("\n\n")[0]
  assert "| CreamFL " in table and table.count("±") == table.count("± 0.00") > 10
  assert "| CreamFL - FedAvg (paired) " in table
  vqa_table = summary.split("Table 2 analogue (VQA accuracy %):\n\n")[1].split("\n\n")[0]
  assert "| FedGEMS " in vqa_table and vqa_table.count("±") == vqa_table.count("± 0.00") > 10

  # Another config in the same workdir is refused.
  config.rounds += 1
  with pytest.raises(WorkdirError, match="rounds"):
    runner.run(config, workdir, progress=False)


def test_r1_sum_is_the_sum_of_the_four_r1_values():
  """CreamFL's R@1_sum: i2t + t2i R@1 on the 1K and on the 5K test (132.88 for CreamFL)."""
  recall = {
    "1K": dict.fromkeys(runner.RECALL_KEYS, 50.0) | {"i2t_R@1": 49.66, "t2i_R@1": 38.94},
    "5K": dict.fromkeys(runner.RECALL_KEYS, 50.0) | {"i2t_R@1": 25.33, "t2i_R@1": 18.95},
  }
  assert runner.r1_sum(recall, (1000, 5000)) == pytest.approx(49.66 + 38.94 + 25.33 + 18.95)
  assert runner.r1_sum(recall, (1000,)) == pytest.approx(49.66 + 38.94)
  assert creamfl_report.rsum(recall, (1000, 5000)) == pytest.approx(
    sum(sum(t.values()) for t in recall.values())
  )
  assert [creamfl_report.size_label(n) for n in (1000, 5000, 250)] == ["1K", "5K", "250"]


@pytest.mark.parametrize("num_images,captions", [(3, 2), (4, 1), (2, 3)])
def test_chance_recall_is_a_random_rankings_recall(num_images, captions):
  """Against enumeration of every ranking of the candidates (all equally likely)."""
  ks = (1, 2, 5)
  got = metrics.retrieval.chance_recall(num_images, captions, ks)
  # i2t: image 0's C correct captions among C N candidates.
  candidates = num_images * captions
  rankings = list(itertools.permutations(range(candidates)))
  for k in ks:
    found = [any(c < captions for c in order[:k]) for order in rankings]
    assert got[f"i2t_R@{k}"] == pytest.approx(100 * np.mean(found))
    # t2i: a caption's one correct image among N.
    found = [0 in order[:k] for order in itertools.permutations(range(num_images))]
    assert got[f"t2i_R@{k}"] == pytest.approx(100 * np.mean(found))


def test_summarize_refuses_results_without_a_report_section(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"seed": 0}))
  (tmp_path / "results.json").write_text(json.dumps({"recall": {}, "r1_sum": {}, "seed": 0}))
  with pytest.raises(ValueError, match='has no "report" section'):
    runner.SYSTEM.summarize([tmp_path])
