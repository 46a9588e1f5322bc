"""FedRGB's distortion matrix and downstream fine-tuning against direct computations."""

import fedrgb_toys
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mm.algorithms import fedrgb_eval


def _tiny(method="fedrgb"):
  return fedrgb_toys.tiny(method, num_test=5)


@pytest.fixture(scope="module")
def tiny():
  alg, state, train, mask, test = _tiny()
  key = jax.random.key(3)
  run = jax.jit(
    lambda steps: fedrgb_eval.distortion_matrix(
      alg, state.encoder, state.aligner, state.teacher, key, train, mask, test, steps=steps
    ),
    static_argnums=0,
  )
  return alg, state, train, mask, test, key, run


def _np_paired_cos(embed, enc, al, pairs):
  z_i, z_t = (np.asarray(z, np.float64) for z in embed(enc, al, pairs["images"], pairs["captions"]))
  z_i /= np.linalg.norm(z_i, axis=-1, keepdims=True)
  z_t /= np.linalg.norm(z_t, axis=-1, keepdims=True)
  return np.mean(np.sum(z_i * z_t, -1))


def test_distortion_entries_match_a_direct_computation(tiny):
  """Entry (i, j): the global model's mean paired cosine on client j minus the model
  retrained on client i alone (its own stage-1 update, one client at a time)."""
  alg, state, train, mask, test, key, run = tiny
  got = {n: np.asarray(v) for n, v in run(3).items()}
  client = lambda tree, c: jax.tree.map(lambda x: x[c], tree)
  keys = jax.random.split(key, 3)
  single = jax.jit(
    lambda kk, a, m: alg.stage1_client(state.encoder, state.aligner, state.teacher, kk, a, m, 3)
  )
  embed = jax.jit(alg.embed)  # compiled once: test pairs all have one shape
  before = [_np_paired_cos(embed, state.encoder, state.aligner, client(test, j)) for j in range(3)]
  np.testing.assert_allclose(got["before"], before, atol=1e-5)
  for i in range(3):
    enc, al, _ = single(keys[i], client(train, i), mask[i])
    for j in range(3):
      want = before[j] - _np_paired_cos(embed, enc, al, client(test, j))
      # vmapped against one client at a time: Adam amplifies float rounding a little
      np.testing.assert_allclose(got["matrix"][i, j], want, atol=1e-3)
  assert np.abs(got["matrix"]).max() > 0.02  # three AdamW steps at lr 1e-2 do move it
  t0 = client(test, 0)
  z_i, z_t = embed(state.encoder, state.aligner, t0["images"], t0["captions"])
  s = np.asarray(z_i) @ np.asarray(z_t).T
  np.testing.assert_allclose(got["unpaired"][0], s[~np.eye(5, dtype=bool)].mean(), atol=1e-5)
  summary = fedrgb_eval.summarize_distortion(got["matrix"])
  off = got["matrix"][~np.eye(3, dtype=bool)]
  np.testing.assert_allclose(summary["off_diagonal"], off.mean(), rtol=1e-6)
  np.testing.assert_allclose(summary["all"], got["matrix"].mean(), rtol=1e-6)


def test_zero_retraining_steps_give_zero_distortion(tiny):
  *_, run = tiny
  # Zero up to float rounding (the retrained copies are evaluated vmapped, the global once).
  np.testing.assert_allclose(np.asarray(run(0)["matrix"]), np.zeros((3, 3)), atol=1e-6)


def test_retrain_task_drops_the_guidance():
  alg, *_ = _tiny()
  assert fedrgb_eval.retrainer(alg, "own") is alg
  assert fedrgb_eval.retrainer(alg, "task").config.method == "fedavg"
  fedavg, *_ = _tiny("fedavg")
  assert fedrgb_eval.retrainer(fedavg, "task") == fedavg
  with pytest.raises(ValueError, match="retrain"):
    fedrgb_eval.retrainer(alg, "full")


def test_subset_sizes():
  masks = fedrgb_eval.subset_masks(2000, (0.01, 0.1))
  np.testing.assert_array_equal(masks.sum(1), [20, 200])
  assert np.all(masks[1][masks[0]])  # the 1% subset is inside the 10% one
  np.testing.assert_array_equal(fedrgb_eval.subset_masks(40, (0.01, 0.1)).sum(1), [1, 4])
  assert fedrgb_eval.majority_accuracy(np.array([0, 1, 1, 2])) == 50.0


def test_finetuned_linear_layer_beats_nothing_learnt_on_a_separable_toy():
  """Dark images are class 0, bright ones class 1 (of a 3-way head with class 2 masked):
  a few fine-tuning steps separate them; nothing learnt (the zero-initialised layer)
  predicts class 0 for all."""
  alg, state, *_ = _tiny()
  rng = np.random.default_rng(1)
  y = rng.integers(0, 2, size=64)
  x = rng.uniform(0, 0.2, size=(64, 16, 16, 3)) + 0.8 * y[:, None, None, None]
  x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.int32)
  masks = jnp.asarray(fedrgb_eval.subset_masks(48, (0.25, 1.0)))
  fit = jax.jit(
    lambda: fedrgb_eval.finetune_accuracy(
      alg,
      state.encoder,
      state.aligner,
      jax.random.key(0),
      x[:48],
      y[:48],
      masks,
      x[48:],
      y[48:],
      num_classes=3,
      steps=30,
      batch_size=8,
      learning_rate=3e-3,
      classes=jnp.asarray([True, True, False]),
    )
  )
  nothing_learnt = 100 * np.mean(np.asarray(y[48:]) == 0)  # all-zero logits: argmax 0
  assert nothing_learnt == 50.0
  trained = np.asarray(fit())
  assert trained.min() >= 90.0, trained


def test_segmentation_loss_matches_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 4, 4)).astype(np.float32)
  targets = rng.random((3, 4, 4)) < 0.3
  p = 1 / (1 + np.exp(-logits.astype(np.float64)))
  ce = -(targets * np.log(p) + (1 - targets) * np.log(1 - p))
  p_t = np.where(targets, p, 1 - p)
  alpha_t = np.where(targets, 0.25, 0.75)
  focal = np.mean(alpha_t * (1 - p_t) ** 2 * ce)
  soft = (2 * np.sum(p * targets) + 1) / (np.sum(p) + np.sum(targets) + 1)
  got = fedrgb_eval.segmentation_loss(jnp.asarray(logits), jnp.asarray(targets))
  np.testing.assert_allclose(got, focal - np.log(soft), rtol=1e-5)


def test_decoder_on_the_frozen_tower_segments_a_bright_square_beyond_all_positive():
  """A bright square on a dark background: the decoder reads the frozen tower's map at 1/4
  resolution and, after training, beats the all-positive Dice; the tower is not trained
  (its parameters are inputs, and nothing but the decoder is returned), and the Dice is
  the metric's on the decoder's own logits."""
  alg, state, *_ = _tiny()
  rng = np.random.default_rng(2)
  n, size = 48, 16
  corner = rng.integers(0, size - 8, size=(n, 2))
  rows, cols = np.arange(size)[:, None], np.arange(size)[None, :]
  target = np.stack(
    [(rows >= r) & (rows < r + 8) & (cols >= c) & (cols < c + 8) for r, c in corner]
  )
  x = 0.1 * rng.random((n, size, size, 3)) + 0.8 * target[..., None]
  x, target = jnp.asarray(x, jnp.float32), jnp.asarray(target)
  assert alg.image_map(state.encoder, state.aligner, x[:2]).shape[1:3] == (4, 4)
  masks = jnp.asarray(fedrgb_eval.subset_masks(32, (0.25, 1.0)))
  fit = jax.jit(
    lambda steps: fedrgb_eval.segmentation_dice(
      alg,
      state.encoder,
      state.aligner,
      jax.random.key(0),
      x[:32],
      target[:32],
      masks,
      x[32:],
      target[32:],
      steps=steps,
      batch_size=8,
      learning_rate=1e-2,
      width=8,
    ),
    static_argnums=0,
  )
  all_positive = 100 * fedrgb_eval.all_positive_dice(np.asarray(target[32:]))
  np.testing.assert_allclose(all_positive, 100 * 2 * 0.25 / 1.25)
  trained = 100 * np.asarray(fit(60))
  assert trained.min() > all_positive + 20, (trained, all_positive)
  assert trained.shape == (2,)


def test_decoder_width_must_halve_at_every_upsampling():
  alg, state, *_ = _tiny()
  x = jnp.zeros((4, 16, 16, 3))  # the tower's map is 4 x 4: two upsamplings
  y = jnp.zeros((4, 16, 16), bool)
  with pytest.raises(ValueError, match="divisible by 2"):
    fedrgb_eval.segmentation_dice(
      alg,
      state.encoder,
      state.aligner,
      jax.random.key(0),
      x,
      y,
      jnp.ones((1, 4), bool),
      x,
      y,
      steps=1,
      batch_size=2,
      learning_rate=1e-3,
      width=6,
    )
