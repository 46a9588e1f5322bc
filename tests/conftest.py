"""Test configuration: 8 fake CPU devices, fast compiles, float64 where a test asks for it.

The XLA flags must be set before jax is imported anywhere, so they live here, at
the top of the first module pytest imports.

``--xla_backend_optimization_level=0`` skips LLVM's optimisation passes on the CPU
backend: the same HLO, the same semantics, slower kernels but much faster compiles.
The tests' programs are tiny and compiled once or twice each, so the whole suite
runs about a quarter faster (a subset on 2 cores: 186 s -> 133 s).
``--xla_cpu_use_fusion_emitters=false`` has XLA:CPU emit its fusions with the older
elemental emitters instead of the MLIR fusion emitters: the same HLO after fusion, and
about half the compile time of a large round (RCSR's ``round_step``: 13.6 s -> 6.9 s
on this CPU); the whole suite on 2 cores, 37 -> 24 minutes. Its fusions round
differently, so two programs that compute the same float32 arithmetic are compared
at ``rounding.py``'s tolerance, not bit for bit. The experiments' subprocesses
(``experiment_main``) get the same flags, without the fake devices.
"""

import gc
import os

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = " ".join(
  [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8", FAST_COMPILE]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache as cc  # noqa: E402

#: The slowest test files, slowest first (about 100-300 s each on 2 cores). The README's
#: ``-n 2 --dist loadfile`` hands whole files to its two processes in collection order,
#: so a slow file collected last (alphabetically, test_rcsr_*) can run alone at the end
#: while the other process idles; handed out first, the short files fill in behind.
SLOW_FIRST = (
  "test_distributed_main.py",
  "test_rcsr_alg.py",
  "test_fedrgb_run.py",
  "test_rcsr_run.py",
  "test_paper_configs.py",
  "test_creamfl_run.py",
  "test_fedmuscle_baselines.py",
  "test_fedmuscle_ssl.py",
  "test_faults.py",
  "test_creamfl.py",
  "test_fedmuscle_run.py",
  "test_faults_run.py",
  "test_fedmuscle.py",
  "test_fedrgb.py",
  "test_runner_faults.py",
)


#: Files whose every test runs the library's loop in subprocesses (several processes, or a
#: run killed and resumed): end to end, though they use no ``main_cache``.
E2E_FILES = ("test_benchmarks.py", "test_distributed.py", "test_runner_loop.py")

#: In-process files that take longest (measured on 2 cores); with the e2e tests they form
#: the slow tier, so that ``-m "not slow"`` runs in a few minutes.
SLOW_FILES = (
  "test_rcsr_alg.py",
  "test_fedmuscle_baselines.py",
  "test_fedmuscle_ssl.py",
  "test_faults.py",
  "test_creamfl.py",
  "test_fedmuscle.py",
  "test_fedrgb.py",
  "test_paper_configs.py",
  "test_fedrgb_faults.py",
  "test_fedrgb_ssl.py",
  "test_rcsr_faults.py",
)

#: Single slow tests (``file::name``, every parametrisation) of files that are otherwise fast:
#: whole rounds compared across device counts or paddings, pretraining runs.
SLOW_TESTS = (
  "test_cost.py::test_method_costs_split_users_and_server",
  "test_core_features.py::test_a_round_on_cached_features_is_the_raw_round",
  "test_creamfl_run.py::test_padding_clients_change_no_draw_and_no_result",
  "test_creamfl_run.py::test_padding_clients_change_no_fedavg_tower",
  "test_creamfl_fedavg.py::test_round_averages_the_trained_towers_with_the_iot_factor",
  "test_creamfl_spaces.py::test_one_space_is_the_single_key_round",
  "test_creamfl_spaces.py::test_mixed_spaces_round_on_the_world",
  "test_fedmuscle_hf.py::test_fedmuscle_round_with_an_hf_text_user",
  "test_fedmuscle_probe.py::test_probes_are_reported_for_the_initial_models_and_every_method",
  "test_fedmuscle_probe.py::test_probes_equal_a_direct_fit_on_the_initial_models",
  "test_fedmuscle_token_spaces.py::test_a_round_with_three_token_spaces",
  "test_fedrgb_run.py::test_devices_split_the_clients",
  "test_fedscmr.py::test_fedcmr_round_equals_its_steps_done_by_hand",
  "test_fedscmr.py::test_round_averages_the_common_subspace_only",
  "test_fedscmr_run.py::test_default_features_are_the_frozen_world_clip_encoders",
  "test_fedscmr_run.py::test_devices_spread_the_clients_and_change_no_result",
  "test_models_hf_segformer.py::test_zoo_segmentation_user_trains_only_adapters_and_heads",
  "test_pretrained.py::test_pretraining_resumes_from_the_last_epoch_bit_for_bit",
  "test_pretrained.py::test_distillation_acts_trains_the_teacher_first_and_resumes_bit_for_bit",
  "test_pretrained.py::test_pretrain_smoke_run_writes_folders_that_reproduce_their_quality",
  "test_pretrained.py::test_shipped_feature_stats_are_the_pretraining_datas",
  "test_pretrained.py::test_shipped_pair_reproduces_its_recorded_quality",
  "test_algorithm_interface.py::test_rcsr_round_through_the_interface_is_round_step",
  "test_algorithm_interface.py::test_fedrgb_round_through_the_interface_is_the_direct_call",
  "test_fedrgb_eval.py::test_distortion_entries_match_a_direct_computation",
  "test_fedrgb_eval.py::test_decoder_on_the_frozen_tower_segments_a_bright_square_beyond_all_positive",
  "test_pretrained.py::test_pretraining_is_deterministic",
  "test_runner_faults.py::test_a_nan_before_the_first_checkpoint_says_so",
  "test_runner_faults.py::test_every_runner_refuses_a_workdir_in_use_and_touches_nothing",
  "test_rcsr.py::test_router_loss_has_no_gradient_into_prototypes_targets",
  "test_rcsr_run.py::test_devices_split_the_sampled_clients_and_change_no_result",
)


def pytest_configure(config):
  """Keeps :data:`SLOW_FIRST`'s order under ``--dist loadfile``.

  pytest-xdist (3.x) hands out a loadfile run's files sorted by their number of tests,
  most first, unless told ``--no-loadscope-reorder``: the order sorted below was lost (the
  parametrised validation files went first, test_rcsr_alg 30th of 73, and one-test e2e
  files last), so a slow file could still run alone at the end.
  """
  if getattr(config.option, "loadscopereorder", None):
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
  """Marks the tiers and orders the collected tests by :data:`SLOW_FIRST`.

  ``e2e``: a test that runs ``experiments.main`` in a subprocess (it asks for the
  ``main_cache`` fixture) or is in :data:`E2E_FILES`. ``slow``: every e2e test, every
  test that runs a whole experiment in this process (it asks for ``compilation_cache``),
  every test of :data:`SLOW_FILES` and each of :data:`SLOW_TESTS`. The sort is stable: a file's tests keep their order, and
  every process collects the same order, as xdist requires.
  """
  for item in items:
    fixtures = getattr(item, "fixturenames", ())
    e2e = "main_cache" in fixtures or item.path.name in E2E_FILES
    if e2e:
      item.add_marker(pytest.mark.e2e)
    name = f"{item.path.name}::{getattr(item, 'originalname', item.name)}"
    if e2e or "compilation_cache" in fixtures or item.path.name in SLOW_FILES or name in SLOW_TESTS:
      item.add_marker(pytest.mark.slow)
  rank = {name: i for i, name in enumerate(SLOW_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="module", autouse=True)
def release_executables():
  """Drops every compiled executable after each test module.

  XLA's CPU backend keeps about nine memory mappings per loaded executable, and jit
  caches keep executables alive for the life of the process. The whole suite compiles
  thousands of programs, and at Linux's default limit of 65,530 mappings per process
  LLVM fails with "Cannot allocate memory" and the process segfaults inside the next
  compile (seen in test_rcsr_alg, 85% into a full run; reproduced by compiling 7,000
  distinct tiny programs in one process). Clearing the caches returns the mappings.
  """
  yield
  jax.clear_caches()
  gc.collect()


def _memory_mappings() -> tuple[int, int] | None:
  """(mappings this process holds, the kernel's per-process limit), where Linux says."""
  try:
    with open("/proc/self/maps", "rb") as maps:
      held = maps.read().count(b"\n")
    with open("/proc/sys/vm/max_map_count") as limit:
      return held, int(limit.read())
  except OSError:
    return None


@pytest.fixture(autouse=True)
def release_executables_when_crowded():
  """Also clears JAX's caches after any test that leaves the process at half the limit.

  One module alone can compile enough programs to near the limit (test_rcsr_alg
  reached 52,316 mappings of 65,530 before its end), so the per-module release
  above is not always soon enough. Clearing only when crowded keeps the compiled
  programs that a module's later tests reuse in every other case.
  """
  yield
  counts = _memory_mappings()
  if counts is not None and counts[0] > counts[1] // 2:
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def x64():
  """Runs a test with float64 enabled, restoring the previous setting after."""
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", previous)


@pytest.fixture(scope="session")
def main_cache(tmp_path_factory):
  """JAX compilation cache shared by the ``experiments.main`` subprocesses of one session."""
  return tmp_path_factory.mktemp("jax_cache")


@pytest.fixture
def compilation_cache(tmp_path):
  """A persistent compilation cache for this test only, every program kept (its folder is
  the fixture's value): the resumed run reuses the first run's executables instead of
  compiling them again.

  JAX opens its persistent cache once per process and keeps it open whatever the config
  says later, so the fixture resets it on both sides: without that, every later test of
  the session read and wrote this test's cache (a CI run segfaulted inside such a read,
  in a test that never asked for a cache).
  """
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
  previous = {name: getattr(jax.config, name) for name in names}
  cc.reset_cache()
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  try:
    yield tmp_path / "jax_cache"
  finally:
    for name, value in previous.items():
      jax.config.update(name, value)
    cc.reset_cache()
