"""Tests of client partitioning and stacking (fedjax_mm.data.partition, digits)."""

import numpy as np
import pytest

from fedjax_mm import data

LABELS = np.repeat(np.arange(10), 500)  # 5,000 samples, 10 balanced classes


def _check_disjoint(parts, n):
  union = np.concatenate(parts)
  assert len(np.unique(union)) == union.size  # no sample twice
  assert union.min(initial=0) >= 0 and union.max(initial=0) < n
  for p in parts:
    assert np.all(np.diff(p) > 0)  # sorted
  return union


def _max_class_share(parts, labels=LABELS):
  return np.mean([np.bincount(labels[p], minlength=10).max() / p.size for p in parts])


def test_iid_partition():
  parts = data.iid_partition(103, 10, seed=0)
  union = _check_disjoint(parts, 103)
  assert sorted(union.tolist()) == list(range(103))
  assert {p.size for p in parts} == {10, 11}
  parts = data.iid_partition(103, 4, seed=0, samples_per_client=[5, 0, 7, 20])
  _check_disjoint(parts, 103)
  assert [p.size for p in parts] == [5, 0, 7, 20]
  again = data.iid_partition(103, 4, seed=0, samples_per_client=[5, 0, 7, 20])
  other = data.iid_partition(103, 4, seed=1, samples_per_client=[5, 0, 7, 20])
  assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
  assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))
  with pytest.raises(ValueError, match="available"):
    data.iid_partition(10, 3, seed=0, samples_per_client=4)


@pytest.mark.parametrize("alpha", [0.05, 1.0, 100.0])
def test_dirichlet_exact_sizes(alpha):
  sizes = [100, 37, 250, 0, 1, 500]
  parts = data.dirichlet_partition(LABELS, 6, alpha=alpha, seed=3, samples_per_client=sizes)
  _check_disjoint(parts, LABELS.size)
  assert [p.size for p in parts] == sizes


def test_dirichlet_uses_up_classes_and_still_fills_clients():
  # 10 clients x 500 = every sample: later clients must take what is left.
  parts = data.dirichlet_partition(LABELS, 10, alpha=0.1, seed=0, samples_per_client=500)
  union = _check_disjoint(parts, LABELS.size)
  assert union.size == LABELS.size
  with pytest.raises(ValueError, match="available"):
    data.dirichlet_partition(LABELS, 11, alpha=0.1, seed=0, samples_per_client=500)


@pytest.mark.parametrize("samples_per_client", [100, None])
def test_dirichlet_skew_follows_alpha(samples_per_client):
  kw = dict(seed=0, samples_per_client=samples_per_client)
  skewed = data.dirichlet_partition(LABELS, 20, alpha=0.1, **kw)
  uniform = data.dirichlet_partition(LABELS, 20, alpha=100.0, **kw)
  assert _max_class_share(skewed) > 0.6
  assert _max_class_share(uniform) < 0.25
  # Number of classes a client really holds (>= 5% of its samples).
  held = lambda parts: np.mean(
    [(np.bincount(LABELS[p], minlength=10) >= 0.05 * p.size).sum() for p in parts]
  )
  assert held(skewed) < 4.5 and held(uniform) > 9.5


def test_dirichlet_split_all():
  parts = data.dirichlet_partition(LABELS, 7, alpha=0.5, seed=1)
  union = _check_disjoint(parts, LABELS.size)
  assert union.size == LABELS.size
  assert min(p.size for p in parts) > 0
  with pytest.raises(ValueError):
    data.dirichlet_partition(LABELS[:3], 7, alpha=0.5, seed=1)


def test_dirichlet_deterministic_and_label_values_free():
  a = data.dirichlet_partition(LABELS, 5, alpha=0.3, seed=7, samples_per_client=80)
  b = data.dirichlet_partition(LABELS, 5, alpha=0.3, seed=7, samples_per_client=80)
  c = data.dirichlet_partition(LABELS, 5, alpha=0.3, seed=8, samples_per_client=80)
  d = data.dirichlet_partition(7 * LABELS - 3, 5, alpha=0.3, seed=7, samples_per_client=80)
  assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
  assert all(np.array_equal(x, y) for x, y in zip(a, d, strict=True))
  assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
  with pytest.raises(ValueError, match="alpha"):
    data.dirichlet_partition(LABELS, 5, alpha=0.0, seed=0)


def _clients():
  rng = np.random.default_rng(0)
  return [
    {
      "image": rng.random((n, 4, 4, 3), dtype=np.float32) + 0.5,
      "label10": rng.integers(1, 10, n).astype(np.int32),
    }
    for n in (3, 5, 1)
  ]


def test_stack_clients():
  clients = _clients()
  stacked, mask = data.stack_clients(clients)
  assert stacked["image"].shape == (3, 5, 4, 4, 3) and stacked["image"].dtype == np.float32
  assert stacked["label10"].shape == (3, 5) and stacked["label10"].dtype == np.int32
  np.testing.assert_array_equal(mask, np.arange(5)[None] < np.array([3, 5, 1])[:, None])
  for k, c in enumerate(clients):
    n = c["label10"].shape[0]
    for key in c:
      np.testing.assert_array_equal(stacked[key][k, :n], c[key])
      assert np.all(stacked[key][k, n:] == 0)
  stacked, mask = data.stack_clients(clients, pad_to=8)
  assert stacked["image"].shape[:2] == (3, 8) and mask.sum() == 9
  with pytest.raises(ValueError, match="smaller"):
    data.stack_clients(clients, pad_to=4)
  with pytest.raises(ValueError, match="keys"):
    data.stack_clients([clients[0], {"image": clients[1]["image"]}])
  bad = dict(clients[1], label10=clients[1]["label10"].astype(np.int64))
  with pytest.raises(ValueError, match="label10"):
    data.stack_clients([clients[0], bad])


def test_pad_clients():
  stacked, mask = data.stack_clients(_clients())
  padded, pmask, cmask = data.pad_clients(stacked, mask, multiple=4)
  assert padded["image"].shape == (4, 5, 4, 4, 3) and pmask.shape == (4, 5)
  np.testing.assert_array_equal(cmask, [True, True, True, False])
  assert np.all(padded["image"][3] == 0) and not pmask[3].any()
  np.testing.assert_array_equal(padded["image"][:3], stacked["image"])
  np.testing.assert_array_equal(pmask[:3], mask)
  padded, pmask, cmask = data.pad_clients(stacked, mask, multiple=8)
  assert pmask.shape == (8, 5) and cmask.sum() == 3
  padded, pmask, cmask = data.pad_clients(stacked, mask, multiple=3)
  assert pmask.shape == (3, 5) and cmask.all()


def test_take_split_and_modalities():
  d = data.generate(0, 20, config=data.WorldConfig(captions_per_image=2))
  assert data.modalities(d) == ("image", "text")
  image_only = data.drop_modality(d, "text")
  text_only = data.drop_modality(d, "image")
  assert data.modalities(image_only) == ("image",)
  assert data.modalities(text_only) == ("text",)
  assert "caption" not in image_only and "caption_label" not in image_only
  assert "image" not in text_only and "mask" not in text_only
  assert "label10" in image_only and "retrieval_label" in text_only
  with pytest.raises(ValueError):
    data.drop_modality(d, "audio")
  parts = data.iid_partition(20, 3, seed=0)
  clients = data.split_clients(d, parts)
  for p, c in zip(parts, clients, strict=True):
    np.testing.assert_array_equal(c["caption"], d["caption"][p])
    np.testing.assert_array_equal(c["image"], data.take(d, p)["image"])
  stacked, mask = data.stack_clients(clients)
  assert stacked["caption"].shape == (3, 7, 2, 16) and mask.sum() == 20


def test_digits():
  pytest.importorskip("sklearn")
  d = data.load_digits(seed=0)
  assert d["image"].shape == (1797, 8, 8, 1) and d["image"].dtype == np.float32
  assert d["label10"].shape == (1797,) and d["label10"].dtype == np.int32
  assert d["image"].min() == 0.0 and d["image"].max() == 1.0
  np.testing.assert_array_equal(np.unique(d["label10"]), np.arange(10))
  again, other = data.load_digits(seed=0), data.load_digits(seed=1)
  np.testing.assert_array_equal(d["label10"], again["label10"])
  assert not np.array_equal(d["label10"], other["label10"])
  # Same samples, another order.
  assert np.isclose(d["image"].sum(), other["image"].sum())
