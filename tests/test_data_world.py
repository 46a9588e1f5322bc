"""Tests of the procedurally generated world (fedjax_mm.data.world)."""

import dataclasses

import numpy as np
import pytest

from fedjax_mm import data
from fedjax_mm.data import world

N = 300
NOISELESS = world.WorldConfig(pixel_noise=0.0)

# Written out here rather than read from the module, so the caption checks are
# independent of the generator's own tables.
SIZE_WORDS = {
  "small": 0,
  "little": 0,
  "tiny": 0,
  "medium": 1,
  "medium-sized": 1,
  "large": 2,
  "big": 2,
  "huge": 2,
}
REGION_PHRASES = {
  0: {"top left", "upper left"},
  1: {"top", "top center"},
  2: {"top right", "upper right"},
  3: {"left", "middle left"},
  4: {"center", "middle"},
  5: {"right", "middle right"},
  6: {"bottom left", "lower left"},
  7: {"bottom", "bottom center"},
  8: {"bottom right", "lower right"},
}
REGION_WORDS = {w for phrases in REGION_PHRASES.values() for p in phrases for w in p.split()}
TEXTURE_WORDS = {
  0: {"noisy", "speckled"},
  1: {"striped"},
  2: {"smooth", "shaded"},
  3: {"checkered"},
}
NUMBERS = {"one": 1, "two": 2, "three": 3}


@pytest.fixture(scope="module")
def private():
  return world.generate(0, N)


@pytest.fixture(scope="module")
def layered():
  return world.generate(0, N, config=NOISELESS, with_layers=True)


def test_shapes_dtypes_and_ranges(private):
  cfg = world.WorldConfig()
  s, m, c, l = cfg.image_size, cfg.max_objects, cfg.captions_per_image, cfg.max_caption_len
  expected = {
    "image": ((N, s, s, 3), np.float32),
    "mask": ((N, s, s), np.int32),
    "caption": ((N, c, l), np.int32),
    "label10": ((N,), np.int32),
    "label100": ((N,), np.int32),
    "multilabel": ((N, world.NUM_SHAPES), np.float32),
    "caption_label": ((N,), np.int32),
    "retrieval_label": ((N,), np.int32),
    "shapes": ((N, m), np.int32),
    "colors": ((N, m), np.int32),
    "sizes": ((N, m), np.int32),
    "regions": ((N, m), np.int32),
    "positions": ((N, m, 2), np.float32),
    "num_objects": ((N,), np.int32),
    "primary": ((N,), np.int32),
    "texture": ((N,), np.int32),
  }
  assert set(private) == set(expected)
  for key, (shape, dtype) in expected.items():
    assert private[key].shape == shape, key
    assert private[key].dtype == dtype, key
  assert private["image"].min() >= 0.0 and private["image"].max() <= 1.0
  assert private["mask"].min() >= 0 and private["mask"].max() < world.NUM_SEG_CLASSES
  assert private["caption"].min() >= 0 and private["caption"].max() < world.VOCAB_SIZE
  assert set(np.unique(private["num_objects"])) == {1, 2, 3}
  assert set(np.unique(private["label100"])) <= set(range(100))


def test_deterministic_by_seed(private):
  again = world.generate(0, N)
  other = world.generate(1, N)
  for key in private:
    np.testing.assert_array_equal(private[key], again[key], err_msg=key)
  for key in ("image", "mask", "caption", "shapes", "colors", "positions"):
    assert not np.array_equal(private[key], other[key]), key


def test_noise_stream_is_independent(private, layered):
  # Switching the pixel noise off changes nothing but the pixels, and those by
  # at most the uniform noise's half-width sqrt(3) * sigma.
  for key in private:
    if key != "image":
      np.testing.assert_array_equal(private[key], layered[key], err_msg=key)
  half_width = np.sqrt(3.0) * world.WorldConfig().pixel_noise
  diff = np.abs(private["image"] - layered["image"])
  assert 0 < diff.max() <= half_width + 1e-6


def test_mask_covers_exactly_the_painted_pixels(layered):
  painted = np.any(layered["image"] != layered["background"], axis=-1)
  np.testing.assert_array_equal(layered["mask"] != 0, painted)
  # Every painted pixel has the colour of an object of the mask's shape.
  inst = layered["instance"]
  rows = np.arange(N)[:, None, None]
  slot = np.maximum(inst, 0)
  on = inst >= 0
  np.testing.assert_array_equal(layered["image"][on], layered["object_colors"][rows, slot][on])
  np.testing.assert_array_equal(layered["mask"][on], layered["shapes"][rows, slot][on] + 1)


def test_later_objects_occlude_earlier_ones(layered):
  s = NOISELESS.image_size
  present = layered["shapes"] >= 0
  radii = np.where(present, world.SIZE_FRACTIONS[np.maximum(layered["sizes"], 0)] * s, 0)
  expected = np.full((N, s, s), -1)
  for j in range(NOISELESS.max_objects):
    cov = data.rasterize(layered["shapes"][:, j], layered["positions"][:, j] * s, radii[:, j], s)
    expected[cov] = j
  np.testing.assert_array_equal(layered["instance"], expected)
  assert np.any(expected[:, None] == np.arange(1, 3)[None, :, None, None])  # overlaps happen


def test_circles_and_squares_match_an_independent_raster():
  cfg = world.WorldConfig(max_objects=1, pixel_noise=0.0)
  d = world.generate(5, 400, config=cfg)
  s = cfg.image_size
  centre = np.arange(s) + 0.5
  dx = centre[None, None, :] - d["positions"][:, 0, 0, None, None] * s
  dy = centre[None, :, None] - d["positions"][:, 0, 1, None, None] * s
  r = np.array([0.14, 0.20, 0.27])[d["sizes"][:, 0]][:, None, None] * s
  circle = d["shapes"][:, 0] == data.SHAPE_NAMES.index("circle")
  square = d["shapes"][:, 0] == data.SHAPE_NAMES.index("square")
  assert circle.sum() > 10 and square.sum() > 10
  np.testing.assert_array_equal(d["mask"][circle] != 0, (dx**2 + dy**2 <= r**2)[circle])
  np.testing.assert_array_equal(
    d["mask"][square] != 0, (np.maximum(np.abs(dx), np.abs(dy)) <= 0.85 * r)[square]
  )


def test_objects_stay_inside_and_visible(layered):
  s = NOISELESS.image_size
  present = layered["shapes"] >= 0
  r = world.SIZE_FRACTIONS[np.maximum(layered["sizes"], 0)]
  pos = layered["positions"]
  inside = (pos >= r[..., None] - 1e-6) & (pos <= 1 - r[..., None] + 1e-6)
  assert np.all(inside[present])
  assert np.all(pos[~present] == -1)
  for j in range(NOISELESS.max_objects):
    area = data.rasterize(layered["shapes"][:, j], pos[:, j] * s, r[:, j] * s, s).sum((1, 2))
    visible = (layered["instance"] == j).sum((1, 2))
    ok = visible >= NOISELESS.min_visible_fraction * area
    assert np.all(ok[present[:, j]])
    assert np.all(visible[present[:, j]] > 0)


def test_background_keeps_away_from_object_colours(layered):
  bg = layered["background"].reshape(N, -1, 1, 3)
  cols = layered["object_colors"][:, None]
  dist = np.linalg.norm(bg - cols, axis=-1)  # [N, S*S, M]
  present = (layered["shapes"] >= 0)[:, None]
  assert np.where(present, dist, np.inf).min() >= 0.3 - 1e-5


def test_labels_follow_the_latent_scene(private):
  shapes, colors, sizes = private["shapes"], private["colors"], private["sizes"]
  rows = np.arange(N)
  present = shapes >= 0
  np.testing.assert_array_equal(present.sum(1), private["num_objects"])
  np.testing.assert_array_equal(present, np.arange(3)[None] < private["num_objects"][:, None])
  for i in range(N):  # primary: the largest size, ties to the lowest slot
    n_i = private["num_objects"][i]
    assert private["primary"][i] == list(sizes[i, :n_i]).index(max(sizes[i, :n_i]))
  p = private["primary"]
  np.testing.assert_array_equal(private["label10"], shapes[rows, p])
  np.testing.assert_array_equal(private["label100"], 10 * shapes[rows, p] + colors[rows, p])
  np.testing.assert_array_equal(private["caption_label"], colors[rows, p])
  np.testing.assert_array_equal(private["retrieval_label"], private["label10"])
  for i in range(N):
    expected = np.zeros(world.NUM_SHAPES)
    expected[shapes[i, present[i]]] = 1
    np.testing.assert_array_equal(private["multilabel"][i], expected)
    # No object is fully occluded, so the mask shows every present shape.
    seg = set(np.unique(private["mask"][i])) - {0}
    assert seg == {int(k) + 1 for k in shapes[i, present[i]]}
  # Regions are the 3x3 cell of the centre.
  cell = np.minimum((private["positions"] * 3).astype(int), 2)
  np.testing.assert_array_equal(
    private["regions"][present], (3 * cell[..., 1] + cell[..., 0])[present]
  )
  # Attributes are independent of one another: every colour on many shapes.
  assert len(np.unique(private["label100"])) > 80


def _mentions(words):
  """(shape, colour, size or None, position) for every "[SIZE] COLOUR SHAPE"."""
  out = []
  for i, w in enumerate(words):
    if w in world.SHAPE_NAMES:
      assert i >= 1 and words[i - 1] in world.COLOR_NAMES, words
      size = SIZE_WORDS.get(words[i - 2]) if i >= 2 else None
      out.append((world.SHAPE_NAMES.index(w), world.COLOR_NAMES.index(words[i - 1]), size, i))
  return out


def test_captions_name_what_the_labels_say(private):
  cfg = world.WorldConfig()
  templates_seen = set()
  for i in range(N):
    n_i = private["num_objects"][i]
    objects = {
      (int(private["shapes"][i, j]), int(private["colors"][i, j]), int(private["sizes"][i, j]))
      for j in range(n_i)
    }
    p = private["primary"][i]
    primary = (private["shapes"][i, p], private["colors"][i, p], private["sizes"][i, p])
    for tokens in private["caption"][i]:
      length = int((tokens != 0).sum())
      assert np.all(tokens[:length] != 0) and np.all(tokens[length:] == 0)
      assert length <= cfg.max_caption_len
      words = world.decode(tokens).split()
      templates_seen.add(" ".join(w for w in words[:2]))
      mentions = _mentions(words)
      assert 1 <= len(mentions) <= n_i, words
      # The primary comes first, with its shape and colour (and size if said).
      shape, colour, size, _ = mentions[0]
      assert (shape, colour) == (primary[0], primary[1]), words
      assert size is None or size == primary[2], words
      assert private["caption_label"][i] == colour
      for shape, colour, size, _ in mentions:
        assert any(
          (s, c) == (shape, colour) and (size is None or z == size) for s, c, z in objects
        ), words
      # Counts, regions and textures are true when said.
      for a, b in zip(words, words[1:], strict=False):
        if b in ("object", "objects") and a in NUMBERS:
          assert NUMBERS[a] == n_i, words
        if b == "background":
          assert a in TEXTURE_WORDS[int(private["texture"][i])], words
      for k, w in enumerate(words[:-1]):
        if w in ("at", "in") and words[k + 1] == "the":
          phrase = []
          for x in words[k + 2 :]:
            if x not in REGION_WORDS:
              break
            phrase.append(x)
          assert " ".join(phrase) in REGION_PHRASES[int(private["regions"][i, p])], words
  assert len(templates_seen) >= 8  # the frames vary


def test_caption_label_needs_more_than_one_position(private):
  # The primary colour word sits at many different token positions.
  positions = set()
  for i in range(N):
    for tokens in private["caption"][i]:
      positions.add(_mentions(world.decode(tokens).split())[0][3] - 1)
  assert len(positions) >= 5


def test_articles_agree():
  d = world.generate(2, 400)
  for caption in np.asarray(world.decode(d["caption"])).reshape(-1):
    words = caption.split()
    for a, b in zip(words, words[1:], strict=False):
      if a in ("a", "an"):
        assert (a == "an") == (b[0] in "aeiou"), caption


def test_vocab_encode_decode():
  assert len(set(world.VOCAB)) == world.VOCAB_SIZE
  assert world.VOCAB[world.PAD_ID] == "<pad>" and world.VOCAB[world.CLS_ID] == "<cls>"
  text = "there is a big red circle at the top left"
  tokens = world.encode(text, length=16)
  assert tokens.shape == (16,) and tokens[-1] == 0
  assert world.decode(tokens) == text
  assert world.word_to_id("circle") == world.WORD_TO_ID["circle"]
  with pytest.raises(KeyError):
    world.word_to_id("dodecahedron")
  with pytest.raises(ValueError):
    world.encode(text, length=3)


def test_public_set_is_shifted():
  n = 3000
  private = world.generate(10, n, with_layers=True)
  public = world.generate(11, n, shift=world.PUBLIC_SHIFT, with_layers=True)
  checker = world.TEXTURE_NAMES.index("checker")
  assert (private["texture"] == checker).mean() < 0.1
  assert (public["texture"] == checker).mean() > 0.5
  assert private["num_objects"].mean() < 1.8 < 2.2 < public["num_objects"].mean()

  def jitter(d):
    present = d["shapes"] >= 0
    proto = world.COLOR_PROTOTYPES[np.maximum(d["colors"], 0)]
    return np.abs(d["object_colors"] - proto)[present].mean()

  assert jitter(public) > 1.5 * jitter(private)
  # The label distributions are unchanged: primary shapes stay near uniform.
  for d in (private, public):
    freq = np.bincount(d["label10"], minlength=10) / n
    assert freq.min() > 0.06 and freq.max() < 0.14


def test_config_variants_and_validation():
  cfg = world.WorldConfig(image_size=24, max_objects=2, captions_per_image=2, max_caption_len=12)
  d = world.generate(0, 50, config=cfg)
  assert d["image"].shape == (50, 24, 24, 3)
  assert d["caption"].shape == (50, 2, 12)
  assert d["shapes"].shape == (50, 2)
  assert world.generate(0, 0)["image"].shape == (0, 32, 32, 3)
  with pytest.raises(ValueError):
    world.WorldConfig(max_caption_len=5)
  with pytest.raises(ValueError):
    world.generate(0, 10, shift=1.5)
  assert dataclasses.replace(cfg, pixel_noise=0.1).pixel_noise == 0.1
