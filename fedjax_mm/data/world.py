"""A procedurally generated multimodal world: images, masks, captions, labels.

Real multimodal datasets (CIFAR, COCO, Flickr30K, AG News) cannot be fetched on
every machine, so the default benchmark runs on this world. Every sample is one
latent *scene*, and every modality and task is a deterministic view of it, so
tasks share structure and federated collaboration between clients that hold
different tasks or modalities can genuinely help.

The scene
---------
A scene holds ``1..max_objects`` objects in slots ``0..num_objects - 1`` (slots
past ``num_objects`` are absent). Each object has

* a **shape**, one of ``NUM_SHAPES = 10`` (`SHAPE_NAMES`: circle, square,
  triangle, diamond, plus, cross, ring, frame, hourglass, ellipse);
* a **colour**, one of ``NUM_COLORS = 10`` (`COLOR_NAMES`), rendered as an RGB
  prototype (`COLOR_PROTOTYPES`) plus a per-object jitter;
* a **size**, one of small / medium / large, i.e. a radius of
  ``SIZE_FRACTIONS[size] * image_size`` pixels;
* a **position**: a continuous centre that keeps the object inside the image,
  and the coarse 3x3 **region** of that centre (`REGION_NAMES`, e.g. "top
  left").

Shape, colour and size are drawn independently and uniformly, so every colour
appears on every shape. The scene also has a background **texture** (value
noise, stripes, gradient or checkerboard, `TEXTURE_NAMES`) mixing two random
colours; the pair is chosen so that every background colour is at least
``0.3`` (Euclidean RGB distance) from the colour of every object in the scene,
so objects never melt into the background. Positions are re-drawn until at
least ``min_visible_fraction`` of every object's pixels stay visible, so no
object is (nearly) fully occluded.

The views
---------
* ``image`` ``float32 [n, S, S, 3]`` in ``[0, 1]``: the background, then the
  objects painted in slot order (later slots occlude earlier ones) with flat
  colours and hard edges, then uniform pixel noise (independent per pixel and
  channel, standard deviation ``pixel_noise``), clipped to ``[0, 1]``.
* ``mask`` ``int32 [n, S, S]``: semantic segmentation, ``0`` = background,
  ``1 + shape`` of the object visible at that pixel (``NUM_SEG_CLASSES = 11``).
  It covers exactly the pixels painted by objects, after occlusion.
* ``caption`` ``int32 [n, C, L]``: ``C`` captions per image, token ids into
  `VOCAB`, left-aligned and right-padded with ``0`` (``"<pad>"``). No BOS/EOS
  token is emitted; id ``1`` (``"<cls>"``) is reserved for models that prepend
  a classification token. Captions come from nine templates (`decode` shows
  them), with synonyms for sizes, regions, textures and frame words. Every
  mentioned object is named by its colour word immediately followed by its
  shape word, optionally preceded by a size word; the **primary** object is
  always the first object mentioned; only the primary gets a region phrase; a
  count word ("two objects") is always the true count; a texture word is always
  the true texture. Other objects are mentioned in slot order, and some
  templates mention only the primary.

Labels (all derived from the latent scene; the *primary* object is the one with
the largest size category, ties broken by the lowest slot):

* ``label10`` ``int32 [n]``: shape of the primary object (10 classes).
* ``label100`` ``int32 [n]``: ``10 * shape + colour`` of the primary (100).
* ``multilabel`` ``float32 [n, 10]``: multi-hot of the shapes present. Since no
  object is fully occluded this equals the set of non-background classes in
  ``mask``.
* ``caption_label`` ``int32 [n]``: colour of the primary object (10 classes).
  Captions name several colours at template-dependent positions, so a text
  model must find the colour of the first-mentioned object; no fixed token
  position and no single word decides it.
* ``retrieval_label`` ``int32 [n]``: label of a pair for supervised cross-modal
  retrieval, ``= label10`` (the primary shape, visible in the image and named
  in every caption).

Latents, also returned: ``shapes``, ``colors``, ``sizes``, ``regions`` ``int32
[n, M]`` (``-1`` for absent slots), ``positions`` ``float32 [n, M, 2]`` (the
``(x, y)`` centre divided by ``S``, ``x`` rightwards, ``y`` downwards, ``-1``
for absent slots), ``num_objects``, ``primary`` (slot of the primary) and
``texture`` ``int32 [n]``.

The public (shifted) distribution
---------------------------------
``generate(..., shift=s)`` with ``s`` in ``[0, 1]`` interpolates from the
private distribution (``s = 0``) to the public one (``s = 1``, `PUBLIC_SHIFT`):

* texture probabilities go from ``(noise .40, stripes .30, gradient .25,
  checker .05)`` to ``(.10, .20, .10, .60)``;
* the object count distribution ``P(k) ∝ exp(-λ (k - 1))`` goes from
  ``λ = 0.6`` (mostly one object) to ``λ = -0.6`` (mostly ``max_objects``);
* colour jitter and pixel noise are multiplied by ``1 + s``.

Shapes, colours and sizes stay uniform, so the label sets are the same.

Design notes
------------
Everything is numpy and vectorised over samples; the only Python loops run over
object slots, shape types, textures, caption templates, captions and chunks of
1,024 samples (pixels are rendered chunk by chunk, channel-planar, to stay in
cache: 20,000 samples take about 3 s on two CPU cores). The seed is split with
``np.random.SeedSequence`` into independent streams (latents, positions,
colours, backgrounds, pixel noise, captions), so changing e.g. ``pixel_noise``
leaves every other array unchanged; this is how the tests check the mask
against the rendered pixels (``with_layers=True`` also returns the noise-free
background and the per-pixel visible slot).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence

import numpy as np

# ---------------------------------------------------------------------------
# Attribute tables.
# ---------------------------------------------------------------------------

SHAPE_NAMES: tuple[str, ...] = (
  "circle",
  "square",
  "triangle",
  "diamond",
  "plus",
  "cross",
  "ring",
  "frame",
  "hourglass",
  "ellipse",
)
COLOR_NAMES: tuple[str, ...] = (
  "red",
  "green",
  "blue",
  "yellow",
  "cyan",
  "magenta",
  "orange",
  "purple",
  "white",
  "black",
)
# RGB prototypes, row i is COLOR_NAMES[i]; pairwise distances are >= 0.4.
COLOR_PROTOTYPES = np.array(
  [
    [0.90, 0.10, 0.10],
    [0.10, 0.70, 0.15],
    [0.15, 0.25, 0.95],
    [0.95, 0.90, 0.10],
    [0.10, 0.85, 0.90],
    [0.90, 0.15, 0.85],
    [1.00, 0.55, 0.05],
    [0.45, 0.10, 0.55],
    [0.97, 0.97, 0.97],
    [0.04, 0.04, 0.04],
  ],
  dtype=np.float32,
)
SIZE_NAMES: tuple[str, ...] = ("small", "medium", "large")
# Object radius (half extent) as a fraction of the image size: 4.5 / 6.4 / 8.6
# pixels at 32x32.
SIZE_FRACTIONS = np.array([0.14, 0.20, 0.27], dtype=np.float32)
REGION_NAMES: tuple[str, ...] = (
  "top left",
  "top",
  "top right",
  "left",
  "center",
  "right",
  "bottom left",
  "bottom",
  "bottom right",
)
TEXTURE_NAMES: tuple[str, ...] = ("noise", "stripes", "gradient", "checker")

NUM_SHAPES = len(SHAPE_NAMES)
NUM_COLORS = len(COLOR_NAMES)
NUM_SIZES = len(SIZE_NAMES)
NUM_REGIONS = len(REGION_NAMES)
NUM_TEXTURES = len(TEXTURE_NAMES)
NUM_SEG_CLASSES = NUM_SHAPES + 1
PUBLIC_SHIFT = 1.0

_TEXTURE_PROBS_PRIVATE = np.array([0.40, 0.30, 0.25, 0.05])
_TEXTURE_PROBS_PUBLIC = np.array([0.10, 0.20, 0.10, 0.60])
_COUNT_DECAY = 0.6
_MIN_BACKGROUND_DISTANCE = 0.3
_NUM_BACKGROUND_CANDIDATES = 24
_NOISE_GRID = 5
_MAX_PLACEMENT_ROUNDS = 200
_CHUNK = 1024  # samples rendered at a time

# ---------------------------------------------------------------------------
# Vocabulary.
# ---------------------------------------------------------------------------

# Synonyms; the first entry is the canonical word.
_SIZE_SYNONYMS = (("small", "little", "tiny"), ("medium", "medium-sized"), ("large", "big", "huge"))
_REGION_SYNONYMS = (
  ("top left", "upper left"),
  ("top", "top center"),
  ("top right", "upper right"),
  ("left", "middle left"),
  ("center", "middle"),
  ("right", "middle right"),
  ("bottom left", "lower left"),
  ("bottom", "bottom center"),
  ("bottom right", "lower right"),
)
_TEXTURE_SYNONYMS = (("noisy", "speckled"), ("striped",), ("smooth", "shaded"), ("checkered",))
_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_FUNCTION_WORDS = (
  "a",
  "an",
  "the",
  "there",
  "is",
  "are",
  "and",
  "at",
  "in",
  "on",
  "of",
  "with",
  "shows",
  "image",
  "picture",
  "photo",
  "object",
  "objects",
  "largest",
  "biggest",
  "background",
  ":",
  ",",
)


def _build_vocab() -> tuple[str, ...]:
  words = ["<pad>", "<cls>", *_FUNCTION_WORDS, *SHAPE_NAMES, *COLOR_NAMES]
  for group in (_SIZE_SYNONYMS, _REGION_SYNONYMS, _TEXTURE_SYNONYMS):
    for synonyms in group:
      for phrase in synonyms:
        words.extend(phrase.split())
  words.extend(_NUMBER_WORDS)
  return tuple(dict.fromkeys(words))


VOCAB: tuple[str, ...] = _build_vocab()
VOCAB_SIZE = len(VOCAB)
PAD_ID = 0
CLS_ID = 1
WORD_TO_ID: Mapping[str, int] = types.MappingProxyType({w: i for i, w in enumerate(VOCAB)})


def word_to_id(word: str) -> int:
  """Returns the token id of ``word`` (a `VOCAB` entry); raises KeyError else."""
  try:
    return WORD_TO_ID[word]
  except KeyError:
    raise KeyError(f"{word!r} is not in the world vocabulary.") from None


def encode(text: str, length: int | None = None) -> np.ndarray:
  """Tokenises a space-separated sentence of `VOCAB` words.

  Args:
    text: words separated by single spaces, e.g. ``"a red circle"``.
    length: if given, right-pad with ``0`` to this length (error if longer).

  Returns:
    ``int32 [len(words)]`` or ``int32 [length]`` token ids.
  """
  ids = np.array([word_to_id(w) for w in text.split()], dtype=np.int32)
  if length is None:
    return ids
  if ids.size > length:
    raise ValueError(f"{text!r} has {ids.size} tokens, more than length={length}.")
  return np.pad(ids, (0, length - ids.size))


def decode(tokens: np.ndarray | Sequence[int]) -> str | list:
  """Turns token ids back into text, dropping padding (id 0).

  Args:
    tokens: ``int [L]`` ids, or any ``[..., L]`` array of them.

  Returns:
    The space-joined words for ``[L]`` input; nested lists of strings for
    higher-rank input (one string per trailing row).
  """
  tokens = np.asarray(tokens)
  if tokens.ndim > 1:
    return [decode(row) for row in tokens]
  return " ".join(VOCAB[t] for t in tokens.tolist() if t != PAD_ID)


def _ids(words: Sequence[str]) -> np.ndarray:
  return np.array([WORD_TO_ID[w] for w in words], dtype=np.int32)


def _synonym_table(groups: Sequence[Sequence[str]], words_per_phrase: int) -> np.ndarray:
  """``int32 [len(groups), max_synonyms, words_per_phrase]``, zero padded.

  Groups with fewer synonyms repeat their first synonym, so drawing a column
  uniformly from ``[0, num_synonyms)`` (see `_pick`) is all a caller needs.
  """
  max_syn = max(len(g) for g in groups)
  table = np.zeros((len(groups), max_syn, words_per_phrase), dtype=np.int32)
  for i, group in enumerate(groups):
    for j in range(max_syn):
      words = group[j] if j < len(group) else group[0]
      ids = _ids(words.split())
      table[i, j, : ids.size] = ids
  return table


_SHAPE_TOK = _ids(SHAPE_NAMES)
_COLOR_TOK = _ids(COLOR_NAMES)
_NUMBER_TOK = _ids(_NUMBER_WORDS)
_SIZE_TOK = _synonym_table(_SIZE_SYNONYMS, 1)[..., 0]  # [3, 3]
_SIZE_NSYN = np.array([len(g) for g in _SIZE_SYNONYMS])
_REGION_TOK = _synonym_table(_REGION_SYNONYMS, 2)  # [9, 2, 2]
_REGION_NSYN = np.array([len(g) for g in _REGION_SYNONYMS])
_TEXTURE_TOK = _synonym_table(_TEXTURE_SYNONYMS, 1)[..., 0]  # [4, 2]
_TEXTURE_NSYN = np.array([len(g) for g in _TEXTURE_SYNONYMS])
_STARTS_WITH_VOWEL = np.array([w[0] in "aeiou" for w in VOCAB])
_W = {w: WORD_TO_ID[w] for w in _FUNCTION_WORDS}
# The shortest template ("a large red circle at the top left") needs 8 tokens.
_MIN_CAPTION_LEN = 8


# ---------------------------------------------------------------------------
# Configuration.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorldConfig:
  """Static settings of the world (the seed and ``shift`` are arguments).

  Attributes:
    image_size: side ``S`` of the square RGB images.
    max_objects: most objects per scene, ``M`` (1 to 9).
    captions_per_image: captions per image, ``C``.
    max_caption_len: caption length ``L`` in tokens (at least 8); templates too
      long for ``L`` fall back to "a SIZE COLOUR SHAPE at the REGION".
    pixel_noise: standard deviation of the uniform pixel noise (private).
    color_jitter: standard deviation of the per-channel object colour jitter
      (private), truncated at two standard deviations.
    min_visible_fraction: least fraction of an object's pixels that must stay
      visible after occlusion.
  """

  image_size: int = 32
  max_objects: int = 3
  captions_per_image: int = 5
  max_caption_len: int = 16
  pixel_noise: float = 0.03
  color_jitter: float = 0.04
  min_visible_fraction: float = 0.4

  def __post_init__(self):
    if self.image_size < 16:
      raise ValueError(f"image_size must be >= 16, got {self.image_size}.")
    if not 1 <= self.max_objects <= 9:
      raise ValueError(f"max_objects must be in [1, 9], got {self.max_objects}.")
    if self.captions_per_image < 1:
      raise ValueError(f"captions_per_image must be >= 1, got {self.captions_per_image}.")
    if self.max_caption_len < _MIN_CAPTION_LEN:
      raise ValueError(
        f"max_caption_len must be >= {_MIN_CAPTION_LEN}, got {self.max_caption_len}."
      )
    if not 0.0 <= self.min_visible_fraction < 1.0:
      raise ValueError(f"min_visible_fraction must be in [0, 1), got {self.min_visible_fraction}.")


# ---------------------------------------------------------------------------
# Shapes. Each takes pixel offsets ``dx, dy`` (float32 [m, S, S], pixel centre
# minus object centre, y downwards) and radii ``r`` (float32 [m, 1, 1]) and
# returns the bool [m, S, S] pixels the shape covers.
# ---------------------------------------------------------------------------


def _circle(dx, dy, r):
  return dx * dx + dy * dy <= r * r


def _square(dx, dy, r):
  return np.maximum(np.abs(dx), np.abs(dy)) <= 0.85 * r


def _triangle(dx, dy, r):
  # Apex up at dy = -r, base of half-width r at dy = 0.8 r.
  return (dy >= -r) & (dy <= 0.8 * r) & (np.abs(dx) <= (dy + r) / 1.8)


def _diamond(dx, dy, r):
  return np.abs(dx) + np.abs(dy) <= r


def _plus(dx, dy, r):
  ax, ay = np.abs(dx), np.abs(dy)
  w = 0.3 * r
  return ((ax <= w) & (ay <= r)) | ((ay <= w) & (ax <= r))


def _cross(dx, dy, r):
  ax, ay = np.abs(dx), np.abs(dy)
  return (np.abs(ax - ay) <= 0.45 * r) & (np.maximum(ax, ay) <= 0.8 * r)


def _ring(dx, dy, r):
  d2 = dx * dx + dy * dy
  return (d2 <= r * r) & (d2 >= (0.55 * r) ** 2)


def _frame(dx, dy, r):
  m = np.maximum(np.abs(dx), np.abs(dy))
  return (m <= 0.85 * r) & (m >= 0.45 * r)


def _hourglass(dx, dy, r):
  ay = np.abs(dy)
  return (np.abs(dx) <= 0.9 * ay + 0.5) & (ay <= 0.9 * r)


def _ellipse(dx, dy, r):
  return (dx / r) ** 2 + (dy / (0.5 * r)) ** 2 <= 1.0


_SHAPE_FNS: tuple[Callable[..., np.ndarray], ...] = (
  _circle,
  _square,
  _triangle,
  _diamond,
  _plus,
  _cross,
  _ring,
  _frame,
  _hourglass,
  _ellipse,
)
assert len(_SHAPE_FNS) == NUM_SHAPES


def rasterize(shapes: np.ndarray, centers: np.ndarray, radii: np.ndarray, size: int) -> np.ndarray:
  """Pixels covered by single objects (no occlusion).

  A pixel ``(row i, col j)`` is covered when its centre ``(j + .5, i + .5)``
  lies inside the shape.

  Args:
    shapes: ``int [m]`` shape ids; negative ids (absent objects) cover nothing.
    centers: ``float [m, 2]`` centres ``(x, y)`` in pixels.
    radii: ``float [m]`` radii in pixels.
    size: image side ``S``.

  Returns:
    ``bool [m, S, S]`` coverage.
  """
  shapes = np.asarray(shapes)
  out = np.zeros((shapes.shape[0], size, size), dtype=bool)
  grid = np.arange(size, dtype=np.float32) + 0.5
  for s, fn in enumerate(_SHAPE_FNS):
    (idx,) = np.nonzero(shapes == s)
    if idx.size == 0:
      continue
    cx = centers[idx, 0].astype(np.float32)[:, None, None]
    cy = centers[idx, 1].astype(np.float32)[:, None, None]
    dx = grid[None, None, :] - cx
    dy = grid[None, :, None] - cy
    r = radii[idx].astype(np.float32)[:, None, None]
    out[idx] = fn(dx, dy, r)
  return out


# ---------------------------------------------------------------------------
# Scene sampling and rendering.
# ---------------------------------------------------------------------------


def _sample_positions(rng, radii, present, size):
  """Centres ``float32 [m, M, 2]`` (pixels) keeping objects inside the image."""
  u = rng.random(radii.shape + (2,), dtype=np.float32)
  r = radii[..., None]
  centers = r + u * (size - 2.0 * r)
  return np.where(present[..., None], centers, 0.0).astype(np.float32)


def _coverage(shapes, centers, radii, size):
  """Per-slot coverage ``bool [m, M, S, S]`` of scenes."""
  m, slots = shapes.shape
  cov = rasterize(shapes.reshape(-1), centers.reshape(-1, 2), radii.reshape(-1), size).reshape(
    m, slots, size, size
  )
  return cov


def _visible_slot(cov):
  """Index ``int32 [m, S, S]`` of the topmost covering slot, -1 for none."""
  m, slots = cov.shape[:2]
  instance = np.full((m,) + cov.shape[2:], -1, dtype=np.int32)
  for j in range(slots):
    instance[cov[:, j]] = j
  return instance


def _visible_ok(cov, instance, present, min_fraction):
  """``bool [m]``: every present object keeps ``min_fraction`` of its pixels."""
  slots = cov.shape[1]
  area = cov.reshape(cov.shape[0], slots, -1).sum(-1)
  flat = instance.reshape(instance.shape[0], -1)
  visible = np.stack([(flat == j).sum(-1) for j in range(slots)], axis=1)
  ok = (visible >= min_fraction * area) & (visible > 0)
  return np.all(ok | ~present, axis=1)


def _segment_distance(c1, c2, p):
  """Distance from points ``p [..., 3]`` to segments ``[c1, c2]`` ``[..., 3]``.

  Written channel by channel: numpy is slow on a size-3 innermost axis.
  """
  v = [c2[..., i] - c1[..., i] for i in range(3)]
  w = [p[..., i] - c1[..., i] for i in range(3)]
  vv = np.maximum(sum(a * a for a in v), 1e-12)
  t = np.clip(sum(a * b for a, b in zip(w, v, strict=True)) / vv, 0.0, 1.0)
  return np.sqrt(sum((a - t * b) ** 2 for a, b in zip(w, v, strict=True)))


def _background_colors(rng, object_colors, present):
  """Pairs of background colours ``(c1, c2)``, each ``float32 [n, 3]``.

  Among ``_NUM_BACKGROUND_CANDIDATES`` random pairs per scene, picks the first
  whose colour segment (every mixture the texture can produce) stays
  ``_MIN_BACKGROUND_DISTANCE`` away from all object colours, or the farthest
  pair when none does.
  """
  n = object_colors.shape[0]
  k = _NUM_BACKGROUND_CANDIDATES
  c1 = rng.random((n, k, 3), dtype=np.float32)
  direction = rng.standard_normal((n, k, 3), dtype=np.float32)
  direction /= np.maximum(np.linalg.norm(direction, axis=-1, keepdims=True), 1e-6)
  magnitude = rng.uniform(0.15, 0.6, size=(n, k, 1)).astype(np.float32)
  c2 = np.clip(c1 + magnitude * direction, 0.0, 1.0)
  dist = _segment_distance(c1[:, :, None], c2[:, :, None], object_colors[:, None])  # [n, k, M]
  dist = np.where(present[:, None], dist, np.inf).min(-1)  # [n, k]
  valid = dist >= _MIN_BACKGROUND_DISTANCE
  pick = np.where(valid.any(1), valid.argmax(1), dist.argmax(1))
  rows = np.arange(n)
  return c1[rows, pick], c2[rows, pick]


def _texture_params(rng, n):
  """Random texture parameters for ``n`` scenes, drawn whatever the texture.

  Drawing every parameter for every scene keeps the stream independent of the
  texture mix.
  """
  return {
    "grid": rng.random((n, _NOISE_GRID, _NOISE_GRID), dtype=np.float32),
    "angle": rng.uniform(0.0, 2.0 * np.pi, size=n).astype(np.float32),
    "freq": rng.uniform(2.0, 5.0, size=n).astype(np.float32),
    "phase": rng.uniform(0.0, 2.0 * np.pi, size=n).astype(np.float32),
    "period": rng.integers(3, 9, size=n),
    "offset": rng.integers(0, 8, size=(n, 2)),
  }


def _texture_field(texture, params, size):
  """Mixing weights ``float32 [m, S, S]`` in ``[0, 1]`` of the textures.

  Args:
    texture: ``int [m]`` texture ids.
    params: `_texture_params` of the same ``m`` scenes.
    size: image side ``S``.
  """
  n = texture.shape[0]
  g = np.arange(size, dtype=np.float32) + 0.5
  xx, yy = g[None, None, :], g[None, :, None]
  field = np.empty((n, size, size), dtype=np.float32)

  (idx,) = np.nonzero(texture == 0)  # Value noise: bilinear upsampling of a grid.
  u = np.clip(g / size * (_NOISE_GRID - 1), 0, _NOISE_GRID - 1)
  lo = np.minimum(np.floor(u).astype(int), _NOISE_GRID - 2)
  interp = np.zeros((size, _NOISE_GRID), dtype=np.float32)
  interp[np.arange(size), lo] = 1.0 - (u - lo)
  interp[np.arange(size), lo + 1] = u - lo
  field[idx] = np.matmul(np.matmul(interp, params["grid"][idx]), interp.T)

  (idx,) = np.nonzero(texture == 1)  # Stripes: a square wave along a direction.
  angle = params["angle"][idx, None, None]
  proj = (xx * np.cos(angle) + yy * np.sin(angle)) / size
  wave = np.sin(
    2 * np.pi * params["freq"][idx, None, None] * proj + params["phase"][idx, None, None]
  )
  field[idx] = wave > 0

  (idx,) = np.nonzero(texture == 2)  # Linear gradient along a direction.
  angle = params["angle"][idx, None, None]
  proj = xx * np.cos(angle) + yy * np.sin(angle)
  lo_, hi_ = proj.min((1, 2), keepdims=True), proj.max((1, 2), keepdims=True)
  field[idx] = (proj - lo_) / np.maximum(hi_ - lo_, 1e-6)

  (idx,) = np.nonzero(texture == 3)  # Checkerboard.
  period = params["period"][idx, None, None]
  cx = np.floor((xx + params["offset"][idx, 0, None, None]) / period)
  cy = np.floor((yy + params["offset"][idx, 1, None, None]) / period)
  field[idx] = (cx + cy) % 2
  return field


def _place(rng, shapes, radii, present, size, min_fraction):
  """Draws centres until every object keeps ``min_fraction`` of its pixels.

  Args:
    rng: the positions stream.
    shapes, radii, present: ``[m, M]`` attributes of ``m`` scenes.
    size: image side ``S``.
    min_fraction: least visible fraction of each present object.

  Returns:
    ``(centers, instance)``: ``float32 [m, M, 2]`` centres in pixels and the
    ``int32 [m, S, S]`` topmost slot per pixel (-1 for background).
  """
  centers = _sample_positions(rng, radii, present, size)
  cov = _coverage(shapes, centers, radii, size)
  instance = _visible_slot(cov)
  (bad,) = np.nonzero(~_visible_ok(cov, instance, present, min_fraction))
  for _ in range(_MAX_PLACEMENT_ROUNDS):
    if bad.size == 0:
      return centers, instance
    centers[bad] = _sample_positions(rng, radii[bad], present[bad], size)
    cov_b = _coverage(shapes[bad], centers[bad], radii[bad], size)
    inst_b = _visible_slot(cov_b)
    instance[bad] = inst_b
    bad = bad[~_visible_ok(cov_b, inst_b, present[bad], min_fraction)]
  raise RuntimeError(
    f"Could not place {shapes.shape[1]} objects with min_visible_fraction={min_fraction} "
    f"in {size}x{size} images; lower one of them."
  )


def _regions(positions, present):
  col = np.minimum((positions[..., 0] * 3).astype(np.int32), 2)
  row = np.minimum((positions[..., 1] * 3).astype(np.int32), 2)
  return np.where(present, 3 * row + col, -1).astype(np.int32)


# ---------------------------------------------------------------------------
# Captions.
# ---------------------------------------------------------------------------


def _pick(rng, table, nsyn, idx):
  """Draws one synonym per entry: ``table[idx, k]`` with ``k < nsyn[idx]``."""
  k = (rng.random(idx.shape) * nsyn[idx]).astype(np.int64)
  return table[idx, k]


def _cols(*parts) -> np.ndarray:
  """Concatenates ``[n]`` / ``[n, k]`` token columns into ``[n, W]``."""
  return np.concatenate([p[:, None] if p.ndim == 1 else p for p in parts], axis=1)


class _CaptionContext:
  """Per-caption token pieces for every sample (synonyms already drawn)."""

  def __init__(self, rng, scene):
    n, slots = scene["shapes"].shape
    self.n = n
    present = scene["shapes"] >= 0
    safe = lambda a: np.where(present, a, 0)
    shape_tok = np.where(present, _SHAPE_TOK[safe(scene["shapes"])], 0)
    color_tok = np.where(present, _COLOR_TOK[safe(scene["colors"])], 0)
    size_tok = np.where(present, _pick(rng, _SIZE_TOK, _SIZE_NSYN, safe(scene["sizes"])), 0)
    use_size = rng.random((n, slots)) < 0.5
    primary = scene["primary"]
    # Slot order with the primary first; present slots come before absent ones.
    order = np.argsort(np.arange(slots)[None] != primary[:, None], axis=1, kind="stable")
    rows = np.arange(n)[:, None]
    self.shape = shape_tok[rows, order]
    self.color = color_tok[rows, order]
    self.size = size_tok[rows, order]
    self.use_size = use_size[rows, order]
    self.present = present[rows, order]
    self.num_objects = scene["num_objects"]
    region = scene["regions"][np.arange(n), primary]
    self.region = _pick(rng, _REGION_TOK, _REGION_NSYN, region)  # [n, 2]
    self.texture = _pick(rng, _TEXTURE_TOK, _TEXTURE_NSYN, scene["texture"])
    self.frame_u = rng.random(n)  # picks among frame-word synonyms
    self.prep = np.where(rng.random(n) < 0.5, _W["at"], _W["in"])

  def const(self, word: str, where: np.ndarray | None = None) -> np.ndarray:
    tok = np.full(self.n, WORD_TO_ID[word], dtype=np.int32)
    return tok if where is None else np.where(where, tok, 0)

  def choose(self, *words: str) -> np.ndarray:
    return _ids(words)[(self.frame_u * len(words)).astype(np.int64)]

  def obj(self, k: int, size: str = "opt") -> np.ndarray:
    """``[n, 4]``: "a [SIZE] COLOUR SHAPE" of the k-th mentioned object."""
    present = self.present[:, k]
    if size == "always":
      size_tok = self.size[:, k]
    elif size == "never":
      size_tok = np.zeros(self.n, dtype=np.int32)
    else:
      size_tok = np.where(self.use_size[:, k], self.size[:, k], 0)
    return _cols(self.const("a", present), size_tok, self.color[:, k], self.shape[:, k])

  def where_region(self) -> np.ndarray:
    """``[n, 4]``: "at|in the REGION"."""
    return _cols(self.prep, self.const("the"), self.region)

  def others(self, first: str) -> np.ndarray:
    """All non-primary objects: "FIRST a C S , a C S and a C S" (no sizes)."""
    slots = self.present.shape[1]
    n_others = self.num_objects - 1
    parts = []
    for k in range(1, slots):
      last = k == n_others
      conn = np.where(last, _W["and"], _W[","]) if k > 1 else self.const(first)
      parts.append(np.where(self.present[:, k], conn, 0))
      parts.append(self.obj(k, size="never"))
    if not parts:
      return np.zeros((self.n, 0), dtype=np.int32)
    return _cols(*parts)


def _t_simple(c: _CaptionContext) -> np.ndarray:
  # "a large red circle at the top left" -- also the fallback template.
  return _cols(c.obj(0, "always"), c.where_region())


def _t_there_is(c):
  # "there is a red circle in the middle"
  return _cols(c.const("there"), c.const("is"), c.obj(0), c.where_region())


def _t_region_first(c):
  # "at the upper left there is a big red circle"
  return _cols(c.where_region(), c.const("there"), c.const("is"), c.obj(0))


def _t_count(c):
  # "three objects : a red circle , a blue square and a green ring"
  num = _NUMBER_TOK[c.num_objects]
  noun = np.where(c.num_objects == 1, _W["object"], _W["objects"])
  slots = c.present.shape[1]
  parts = [num, noun, c.const(":"), c.obj(0)]
  if slots > 1:
    # The first other object gets "and" when it is the last, "," otherwise.
    others = c.others(first=",")
    first_conn = np.where(c.num_objects == 2, _W["and"], _W[","])
    others[:, 0] = np.where(c.present[:, 1], first_conn, 0)
    parts.append(others)
  return _cols(*parts)


def _t_shows(c):
  # "the photo shows a tiny red circle and a blue square"
  parts = [c.const("the"), c.choose("image", "picture", "photo"), c.const("shows"), c.obj(0)]
  if c.present.shape[1] > 1:
    parts += [c.const("and", c.present[:, 1]), c.obj(1)]
  return _cols(*parts)


def _t_texture(c):
  # "a red circle on a striped background"
  return _cols(c.obj(0), c.const("on"), c.const("a"), c.texture, c.const("background"))


def _t_largest(c):
  # "the biggest object is a red circle"
  frame = [c.const("the"), c.choose("largest", "biggest"), c.const("object"), c.const("is")]
  return _cols(*frame, c.obj(0, "never"))


def _t_region_and(c):
  # "a red circle at the top and a small blue square"
  parts = [c.obj(0), c.where_region()]
  if c.present.shape[1] > 1:
    parts += [c.const("and", c.present[:, 1]), c.obj(1)]
  return _cols(*parts)


def _t_with(c):
  # "a picture of a red circle with a blue square and a green ring"
  parts = [c.const("a"), c.choose("picture", "photo", "image"), c.const("of"), c.obj(0)]
  if c.present.shape[1] > 1:
    parts.append(c.others(first="with"))
  return _cols(*parts)


_TEMPLATES = (
  _t_simple,
  _t_there_is,
  _t_region_first,
  _t_count,
  _t_shows,
  _t_texture,
  _t_largest,
  _t_region_and,
  _t_with,
)


def _compact(tokens: np.ndarray) -> np.ndarray:
  """Moves the zeros (omitted words) of each row to the end, keeping order.

  Also turns the article "a" into "an" before a vowel-initial word.
  """
  keep = tokens != 0
  rows, _ = np.nonzero(keep)
  dest = np.cumsum(keep, axis=1) - 1
  out = np.zeros_like(tokens)
  out[rows, dest[keep]] = tokens[keep]
  an = np.zeros_like(keep)
  an[:, :-1] = (out[:, :-1] == _W["a"]) & _STARTS_WITH_VOWEL[out[:, 1:]]
  return np.where(an, _W["an"], out).astype(np.int32)


def _captions(rng, scene, config: WorldConfig) -> np.ndarray:
  """Captions ``int32 [n, C, L]`` (see the module docstring)."""
  n = scene["shapes"].shape[0]
  length = config.max_caption_len
  out = np.zeros((n, config.captions_per_image, length), dtype=np.int32)
  rows = np.arange(n)
  for c in range(config.captions_per_image):
    ctx = _CaptionContext(rng, scene)
    built = [t(ctx) for t in _TEMPLATES]  # [n, W_t] each, zeros for omitted words
    width = max(length, max(b.shape[1] for b in built))
    stacked = np.stack([np.pad(b, ((0, 0), (0, width - b.shape[1]))) for b in built])
    lengths = (stacked != 0).sum(-1)  # [T, n]
    choice = rng.integers(0, len(_TEMPLATES), size=n)
    choice = np.where(lengths[choice, rows] <= length, choice, 0)
    out[:, c] = _compact(stacked[choice, rows])[:, :length]
  return out


# ---------------------------------------------------------------------------
# Public entry point.
# ---------------------------------------------------------------------------


def generate(
  seed: int,
  num: int,
  *,
  config: WorldConfig = WorldConfig(),
  shift: float = 0.0,
  with_layers: bool = False,
) -> dict[str, np.ndarray]:
  """Generates ``num`` samples of the world (see the module docstring).

  Deterministic: the same ``(seed, num, config, shift)`` gives identical
  arrays. Use ``shift=PUBLIC_SHIFT`` (and a different seed) for the public set.

  Args:
    seed: non-negative integer seed.
    num: number of samples ``n``.
    config: static settings; ``S = config.image_size``, ``M =
      config.max_objects``, ``C = config.captions_per_image``, ``L =
      config.max_caption_len``.
    shift: in ``[0, 1]``; 0 is the private distribution, 1 the public one.
    with_layers: also return the render layers: ``background`` ``float32 [n,
      S, S, 3]`` (noise-free background), ``instance`` ``int32 [n, S, S]``
      (visible slot per pixel, -1 for background) and ``object_colors``
      ``float32 [n, M, 3]`` (jittered RGB, 0 for absent slots).

  Returns:
    A dict of arrays with leading axis ``n``: ``image`` ``float32 [n, S, S,
    3]``, ``mask`` ``int32 [n, S, S]``, ``caption`` ``int32 [n, C, L]``,
    ``label10``, ``label100``, ``caption_label``, ``retrieval_label``,
    ``num_objects``, ``primary``, ``texture`` ``int32 [n]``, ``multilabel``
    ``float32 [n, 10]``, ``shapes``, ``colors``, ``sizes``, ``regions`` ``int32
    [n, M]``, ``positions`` ``float32 [n, M, 2]``, plus the layers above when
    asked for.
  """
  if num < 0:
    raise ValueError(f"num must be >= 0, got {num}.")
  if not 0.0 <= shift <= 1.0:
    raise ValueError(f"shift must be in [0, 1], got {shift}.")
  size, slots = config.image_size, config.max_objects
  streams = np.random.SeedSequence(seed).spawn(6)
  rng_latent, rng_pos, rng_color, rng_bg, rng_noise, rng_text = (
    np.random.default_rng(s) for s in streams
  )

  # Latent attributes.
  decay = _COUNT_DECAY * (1.0 - 2.0 * shift)
  count_p = np.exp(-decay * np.arange(slots))
  num_objects = 1 + rng_latent.choice(slots, size=num, p=count_p / count_p.sum())
  present = np.arange(slots)[None] < num_objects[:, None]
  shapes = np.where(present, rng_latent.integers(0, NUM_SHAPES, (num, slots)), -1)
  colors = np.where(present, rng_latent.integers(0, NUM_COLORS, (num, slots)), -1)
  sizes = np.where(present, rng_latent.integers(0, NUM_SIZES, (num, slots)), -1)
  tex_p = (1.0 - shift) * _TEXTURE_PROBS_PRIVATE + shift * _TEXTURE_PROBS_PUBLIC
  texture = rng_latent.choice(NUM_TEXTURES, size=num, p=tex_p)
  primary = np.argmax(sizes, axis=1)  # first maximum: ties go to the lowest slot
  rows = np.arange(num)

  # Colours and background colour pairs (small arrays, drawn for all samples).
  jitter_std = config.color_jitter * (1.0 + shift)
  jitter = rng_color.standard_normal((num, slots, 3), dtype=np.float32) * jitter_std
  jitter = np.clip(jitter, -2 * jitter_std, 2 * jitter_std)
  object_colors = np.clip(COLOR_PROTOTYPES[np.maximum(colors, 0)] + jitter, 0.0, 1.0)
  object_colors = np.where(present[..., None], object_colors, 0.0).astype(np.float32)
  c1, c2 = _background_colors(rng_bg, object_colors, present)
  tex_params = _texture_params(rng_bg, num)
  radii = np.where(present, SIZE_FRACTIONS[np.maximum(sizes, 0)] * size, 0.0).astype(np.float32)

  # Placement and pixels, in chunks of samples so that the working set stays in
  # cache (the streams are consumed chunk by chunk, in order).
  noise_std = config.pixel_noise * (1.0 + shift)
  centers = np.zeros((num, slots, 2), dtype=np.float32)
  image = np.empty((num, size, size, 3), dtype=np.float32)
  mask = np.empty((num, size, size), dtype=np.int32)
  if with_layers:
    background_all = np.empty((num, size, size, 3), dtype=np.float32)
    instance_all = np.empty((num, size, size), dtype=np.int32)
  for start in range(0, num, _CHUNK):
    sl = slice(start, min(start + _CHUNK, num))
    centers[sl], instance = _place(
      rng_pos, shapes[sl], radii[sl], present[sl], size, config.min_visible_fraction
    )
    field = _texture_field(texture[sl], {k: v[sl] for k, v in tex_params.items()}, size)
    # Channel-planar [m, 3, S, S] while painting: numpy is slow on a size-3
    # innermost axis.
    background = c1[sl, :, None, None] + field[:, None] * (c2 - c1)[sl, :, None, None]
    img = background.copy()
    chunk_mask = np.zeros(instance.shape, dtype=np.int32)
    for j in range(slots):  # each pixel shows its topmost slot (`_visible_slot`)
      on = instance == j
      np.copyto(img, object_colors[sl, j, :, None, None], where=on[:, None])
      np.copyto(chunk_mask, shapes[sl, j, None, None] + 1, where=on)
    # Uniform pixel noise of standard deviation noise_std (a Gaussian costs 4x).
    noise = rng_noise.random(img.shape, dtype=np.float32)
    noise -= 0.5
    noise *= np.float32(noise_std * np.sqrt(12.0))
    img += noise
    np.clip(img, 0.0, 1.0, out=img)
    image[sl] = img.transpose(0, 2, 3, 1)
    mask[sl] = chunk_mask
    if with_layers:
      background_all[sl] = background.transpose(0, 2, 3, 1)
      instance_all[sl] = instance
  positions = np.where(present[..., None], centers / size, -1.0).astype(np.float32)

  # Labels.
  p_shape, p_color = shapes[rows, primary], colors[rows, primary]
  multilabel = np.zeros((num, NUM_SHAPES), dtype=np.float32)
  multilabel[np.repeat(rows, slots)[present.reshape(-1)], shapes[present]] = 1.0
  scene = {
    "shapes": shapes.astype(np.int32),
    "colors": colors.astype(np.int32),
    "sizes": sizes.astype(np.int32),
    "regions": _regions(positions, present),
    "positions": positions,
    "num_objects": num_objects.astype(np.int32),
    "primary": primary.astype(np.int32),
    "texture": texture.astype(np.int32),
  }
  out = {
    "image": image,
    "mask": mask,
    "caption": _captions(rng_text, scene, config),
    "label10": p_shape.astype(np.int32),
    "label100": (NUM_COLORS * p_shape + p_color).astype(np.int32),
    "multilabel": multilabel,
    "caption_label": p_color.astype(np.int32),
    "retrieval_label": p_shape.astype(np.int32),
    **scene,
  }
  if with_layers:
    out["background"] = background_all
    out["instance"] = instance_all
    out["object_colors"] = object_colors
  return out
