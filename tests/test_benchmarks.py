"""The benchmark scripts run, at toy sizes, and print the figures the docs quote.

Timings are never asserted (they belong to the scripts' own output); these
tests check that each script completes, prints every row and target line, and
that the work counts it prints are XLA's.
"""

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from fedjax_mm import losses
from fedjax_mm.algorithms import fedmuscle
from fedjax_mm.core import cost


def _run(module, *flags):
  done = subprocess.run(
    [sys.executable, "-m", f"experiments.benchmarks.{module}", *flags],
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def _unit(x):
  return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def test_muscle_loss_prints_xla_flop_counts_and_ratios():
  out = _run("muscle_loss", "--batches=16", "--max_partners=2", "--dim=256", "--repeats=1")
  rows = {
    (int(m.group(1)), int(m.group(2))): m.group(0)
    for m in re.finditer(r"^\s*(\d+)\s+(\d+)\s+[\d.]+ \|.*$", out, re.M)
  }
  assert set(rows) == {(16, 1), (16, 2)}
  # The contraction's FLOP column equals XLA's count of the same compiled function.
  keys = jax.random.split(jax.random.key(42), 2)
  anchor = _unit(jax.random.normal(keys[0], (16, 256)))
  others = _unit(jax.random.normal(keys[1], (2, 16, 256)))
  gamma = float(losses.muscle_gamma(0.2, 0.15))

  def contract(anchor, others):
    return losses.muscle_loss(anchor, others, tau=0.2, gamma=gamma, method="contract").mean()

  grad = jax.value_and_grad(contract, argnums=(0, 1))
  expected = cost.flops(grad, anchor, others) / 1e6
  assert expected > 1.0  # millions: large enough for the printed 0.1 resolution to matter
  printed = float(rows[16, 2].split("|")[1].split()[2])
  assert printed == pytest.approx(expected, rel=0.05)
  # Time ratio and FLOP ratio in brackets, for both comparisons.
  assert re.search(r"\d+\.\dx \(\d+\.\dx\)\s+\d+\.\dx \((\d+\.\dx|-)\)", rows[16, 2])
  assert "M=3: contraction vs the paper's protocol" in out and "FLOP ratio" in out


def test_muscle_loss_user_form_is_the_fedmuscle_rounds_work():
  # --grad=user times what FedMuscle's round computes: the server's targets forward
  # only, then the user's gradient w.r.t. its own representation.
  out = _run(
    "muscle_loss", "--batches=16", "--max_partners=2", "--dim=256", "--repeats=1", "--grad=user"
  )
  assert "anchor only" in out
  row = re.search(r"^\s*16\s+2\s+[\d.]+ \|.*$", out, re.M).group(0)
  keys = jax.random.split(jax.random.key(42), 2)
  anchor = _unit(jax.random.normal(keys[0], (16, 256)))
  others = _unit(jax.random.normal(keys[1], (2, 16, 256)))
  gamma = float(losses.muscle_gamma(0.2, 0.15))
  # FedMuscle's own per-user step, for 3 users whose partners are the 2 others.
  config = fedmuscle.MuscleConfig(num_partners=2, batch_size=16, tau_full=0.2, tau_reduced=0.15)
  users = jnp.concatenate([anchor[None], others])
  partners = jnp.array([[1, 2], [0, 2], [0, 1]])
  round_step = lambda z, p: fedmuscle.user_gradients(config, z, p)

  def everything(anchor, others):
    return losses.muscle_loss(anchor, others, tau=0.2, gamma=gamma, method="contract").mean()

  expected = cost.flops(round_step, users, partners) / 3 / 1e6
  printed = float(row.split("|")[1].split()[2])
  assert printed == pytest.approx(expected, rel=0.05)
  # Dropping the partners' gradient removes work: well below the default form's count.
  assert expected < 0.8 * cost.flops(jax.value_and_grad(everything, (0, 1)), anchor, others) / 1e6


def test_work_ratio_needs_exact_counts():
  # In a subprocess: the benchmark defines absl flags that other scripts also define.
  check = (
    "from experiments.benchmarks import muscle_loss as b\n"
    "assert b._work_ratio((300.0, 0.0, True), (3.0, 0.0, True)) == '100.0x'\n"
    "assert b._work_ratio((300.0, 0.0, False), (3.0, 0.0, True)) == '-'\n"
    "assert b._mflop((2.5e6, 0.0, False)) == '>=2.5'\n"
    "assert b._mflop((2.5e6, 0.0, True)) == '2.5'\n"
  )
  done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=False)
  assert done.returncode == 0, done.stderr[-3000:]


def test_engine_throughput_times_every_client_map_against_the_loop():
  out = _run(
    "engine_throughput",
    "--clients=2",
    "--steps=1",
    "--batch=2",
    "--repeats=2",
    "--client_maps=vmap,scan",
    "--xla_limit=2",
    "--devices=2",
  )
  assert "the engine on 2 of 2 devices" in out and "client_map='auto' is 'scan'" in out
  row = re.search(r"^\s+2 \|(.*)$", out, re.M).group(1)
  cells = [c.strip() for c in row.split("|")]
  assert len(cells) == 4  # loop, vmap, scan, auto
  assert all(re.fullmatch(r"[\d.]+ \([\d.]+\) [\d.]+x", c) for c in cells[1:]), cells
  assert "XLA's native convolution" in out
  assert re.search(r"auto \(\w+\) / loop, worst over N: [\d.]+x", out)


def test_cnn_step_times_the_zoo_against_its_alternatives():
  out = _run("cnn_step", "--models=cnn_s", "--steps=1", "--batch=2", "--repeats=2")
  row = re.search(r"^\s+cnn_s \|(.*)$", out, re.M).group(1)
  cells = [c.strip() for c in row.split("|")]
  assert len(cells) == 5  # zoo, nnx_norm, xla_conv, gradient differences, products alone
  assert re.fullmatch(r"[\d.]+ \([\d.]+\)", cells[0]), cells
  assert all(re.fullmatch(r"[\d.]+ \([\d.]+\) [\d.]+x", c) for c in cells[1:3]), cells
  # The alternatives compute the same gradient, up to float32 rounding.
  diffs = [float(d) for d in cells[3].split(",")]
  assert len(diffs) == 2 and all(d < 1e-4 for d in diffs), diffs
  # The step's products timed alone: a ratio, then the two times it divides (per step).
  ratio, products, step = re.fullmatch(r"([\d.]+) \(([\d.]+) of ([\d.]+) ms\)", cells[4]).groups()
  assert float(products) > 0 and float(step) > 0 and float(ratio) > 0


def test_vs_flower_runs_the_engine_alone_without_the_peers_extra():
  # flwr and torch are optional (the `peers` extra): the engine's contender needs neither.
  out = _run(
    "vs_flower",
    "--contenders=engine",
    "--clients=2",
    "--devices=2",
    "--rounds=2",
    "--steps=1",
    "--batch=2",
  )
  assert "engine on 2 device(s), client_map auto = 'scan'" in out
  rate = re.search(r"^\s+2 \|\s+([\d.]+)$", out, re.M).group(1)
  assert float(rate) > 0


@pytest.mark.parametrize(
  "module,flag,message",
  [
    (
      "engine_throughput",
      "--clients=8,abc",
      "--clients must be positive integers, comma-separated",
    ),
    ("vs_flower", "--clients=0", "--clients must be positive integers, comma-separated"),
    ("vs_flower", "--torch_threads=two", "--torch_threads must be positive integers"),
    ("muscle_loss", "--batches=0", "--batches must be positive integers, comma-separated"),
    ("muscle_loss", "--max_partners=0", "0 is not a positive integer"),
    ("gca", "--timing_public=", "--timing_public must be positive integers, comma-separated"),
    ("cnn_step", "--models=cnn_s,foo", "--models must be one or more of cnn_s, cnn_m, resnet_t"),
    ("vs_flower", "--rounds=1", "1 is not integer >= 2"),
    ("vs_flower", "--contenders=engine,flower", "--contenders must be one or more of engine,"),
    ("recall", "--chunk_size=0", "0 is not a positive integer"),
  ],
)
def test_a_bad_flag_value_is_absls_one_line_error(module, flag, message):
  """Not a traceback from the script's first use of the value, nor a run that times nothing."""
  done = subprocess.run(
    [sys.executable, "-m", f"experiments.benchmarks.{module}", flag],
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
  assert "Flags parsing error" in done.stderr and message in done.stderr, done.stderr[-3000:]


def test_recall_times_the_library_kernel_against_its_predecessors():
  out = _run("recall", "--pairs=96,100", "--dim=8", "--gallery=8", "--chunk_size=16", "--repeats=1")
  t, x = r"[\d.]+ms", r"[\d.]+x"
  rows = re.findall(
    rf"^\s*(\d+)\s+(\d+) \|\s+{t} \|\s+{t} \|\s+{t} \|\s+{x} \|\s+{x} \| (\d+) of (\d+)$",
    out,
    re.M,
  )
  assert [(n, folds) for n, folds, *_ in rows] == [("96", "1"), ("96", "12"), ("100", "1")], out
  assert "100: --gallery=8 does not divide it" in out
  for *_, differ, queries in rows:
    # Same dot products in another order: at most a near-tie or two may fall the other way.
    assert int(queries) in (192, 200) and int(differ) <= 2


def test_feature_cache_prints_both_variants_their_ratio_and_their_agreement():
  out = _run("feature_cache", "--config=experiments/fedmuscle.py:smoke", "--rounds=1")
  assert "every encoder every step" in out and "frozen features cached" in out
  assert re.search(r"uncached / cached: \d+\.\d\dx", out)
  # The smoke users' cached round computes what the raw one computes (float32 rounding).
  diff = float(re.search(r"difference after 2 rounds: (\S+) points", out).group(1))
  assert diff < 1e-3


def test_fedrgb_ssl_terms_prints_every_term_against_l_task():
  out = _run("fedrgb_ssl_terms", "--config=experiments/fedrgb.py:smoke")
  num = r"(-?\d+\.\d+)"
  rows = {
    (m, t): (float(v), float(r))
    for m, t, v, r in re.findall(rf"^(\w+)\s+(\w+)\s+{num}\s+{num}$", out, re.M)
  }
  names = ("local_contrastive", "local_relational", "global_contrastive", "global_relational")
  assert set(rows) == {("fedx", n) for n in names} | {
    (m, n) for m in ("fedmae", "fedmae_masked") for n in ("task", "reconstruction")
  }, out
  for m, base in (("fedx", "local_contrastive"), ("fedmae", "task"), ("fedmae_masked", "task")):
    assert rows[(m, base)][1] == 1.0
  # At the received model FedX's global relational term is at its minimum, 0, gradient 0;
  # its two other terms act.
  assert rows[("fedx", "global_relational")] == (0.0, 0.0)
  assert rows[("fedx", "local_relational")][1] > 0 and rows[("fedx", "global_contrastive")][1] > 0
  # Both FedMAE rows reconstruct the same masked images; only their L_task differs.
  assert rows[("fedmae", "reconstruction")][0] == rows[("fedmae_masked", "reconstruction")][0]
  assert rows[("fedmae", "task")][0] != rows[("fedmae_masked", "task")][0]
  assert len(re.findall(r"cosine\(others, L_task\)\s+[-+]\d\.\d{3}$", out, re.M)) == 3
