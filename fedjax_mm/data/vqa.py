"""Visual question answering on the embedded world: questions with one answer each.

A stand-in for VQA v2 (Goyal et al., CVPR 2017), on which CreamFL (Yu et al.,
ICLR 2023) evaluates its server model in Table 2 ("VQA evaluation", accuracy
over the 3,000 most frequent answers, App. A.2). Here every question is asked
about one scene of :mod:`fedjax_mm.data.world` and answered from the scene's
latents (``shapes``, ``colors``, ``sizes``, ``num_objects``, ``texture``), so
every answer is right by construction and no annotator disagrees.

Question types
--------------
Six templates (:data:`QUESTION_TYPES`, rendered by :func:`render`):

=========  =======================================  ======================  ===========
type       question                                 argument (world words)  answers
=========  =======================================  ======================  ===========
color      what colour is the circle ?              ``the circle``          10 colours
shape      what shape is the red object ?           ``the red object``      10 shapes
count      how many objects are there ?             ``objects``             one .. nine
exists     is there a circle ?                      ``a circle``            yes / no
texture    what is the texture of the background ?  ``the background``      4 textures
size       what size is the red circle ?            ``the red circle``      3 sizes
=========  =======================================  ======================  ===========

Only questions with exactly one answer in their scene are asked: ``color``
names a shape that exactly one object of the scene has, ``shape`` a colour
exactly one object has, ``size`` a (colour, shape) pair exactly one object
has; ``count``, ``exists`` and ``texture`` always have one answer. Each scene
gets at most one question of each type, about an object drawn uniformly among
those the type may ask about. ``exists`` is balanced exactly: of the ``n``
scenes, ``ceil(n / 2)`` (a random half) ask about a shape that is present
(answer yes) and the rest about a shape that is absent (no).

How a question is encoded, and why
----------------------------------
The world's vocabulary (:data:`fedjax_mm.data.world.VOCAB`) has no "what",
"colour", "how", "many", "yes" or "no", and adding them would change the
vocabulary size, hence every text tower's embedding table and every result
already measured. So a question is the pair ``(type, argument)``: the type an
integer in ``[0, 6)``, the argument a short phrase made only of world words
(``"the red object"``) as world token ids (what :func:`fedjax_mm.data.world.encode`
gives).
The argument is what the server's text tower reads (it has seen these words in
captions: "a red circle", "the background", "three objects"); the type, which
carries the interrogative ("what colour", "how many", "is there"), goes to the
answering head as a learnt embedding. :func:`render` turns the pair back into
the English question for people.

Answers come from one fixed vocabulary, :data:`ANSWERS` (38 words: colours,
shapes, counts one to nine, yes / no, textures, sizes), whatever the world's
settings; :data:`TYPE_ANSWERS` gives each type's slice of it.

Deterministic: the same ``(scene, seed)`` gives the same questions; each type
draws from its own stream of ``np.random.SeedSequence(seed)``, so asking fewer
types leaves the others' questions unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fedjax_mm.data import world

__all__ = [
  "ANSWERS",
  "ANSWER_TO_ID",
  "ARGUMENT_LEN",
  "NUM_ANSWERS",
  "NUM_TYPES",
  "QUESTION_TYPES",
  "TEMPLATES",
  "TYPE_ANSWERS",
  "questions",
  "render",
]

QUESTION_TYPES: tuple[str, ...] = ("color", "shape", "count", "exists", "texture", "size")
NUM_TYPES = len(QUESTION_TYPES)
#: The English question of each type; ``{}`` is the decoded argument.
TEMPLATES: Mapping[str, str] = {
  "color": "what colour is {} ?",
  "shape": "what shape is {} ?",
  "count": "how many {} are there ?",
  "exists": "is there {} ?",
  "texture": "what is the texture of {} ?",
  "size": "what size is {} ?",
}

_COUNT_WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
#: Each type's answers, in the order of :data:`ANSWERS`.
TYPE_ANSWERS: Mapping[str, tuple[str, ...]] = {
  "color": world.COLOR_NAMES,
  "shape": world.SHAPE_NAMES,
  "count": _COUNT_WORDS,
  "exists": ("yes", "no"),
  "texture": world.TEXTURE_NAMES,
  "size": world.SIZE_NAMES,
}
#: The fixed answer vocabulary: every type's answers, concatenated in type order.
ANSWERS: tuple[str, ...] = tuple(a for t in QUESTION_TYPES for a in TYPE_ANSWERS[t])
NUM_ANSWERS = len(ANSWERS)
ANSWER_TO_ID: Mapping[str, int] = {a: i for i, a in enumerate(ANSWERS)}
assert len(ANSWER_TO_ID) == NUM_ANSWERS, "answer words must be distinct"
#: Tokens of the longest argument ("the red object").
ARGUMENT_LEN = 3

_OFFSET = {t: ANSWER_TO_ID[TYPE_ANSWERS[t][0]] for t in QUESTION_TYPES}
_SHAPE_TOK = np.array([world.word_to_id(w) for w in world.SHAPE_NAMES], np.int32)
_COLOR_TOK = np.array([world.word_to_id(w) for w in world.COLOR_NAMES], np.int32)
_ARTICLE_TOK = np.array(  # "a" / "an" before each shape word, as the captions write it
  [world.word_to_id("an" if w[0] in "aeiou" else "a") for w in world.SHAPE_NAMES], np.int32
)


def _word(w: str, n: int) -> np.ndarray:
  return np.full(n, world.word_to_id(w), np.int32)


def _argument(*columns: np.ndarray) -> np.ndarray:
  """``int32 [n, ARGUMENT_LEN]``: token columns side by side, right-padded with 0."""
  out = np.stack(columns, axis=1).astype(np.int32)
  return np.pad(out, ((0, 0), (0, ARGUMENT_LEN - out.shape[1])))


def _unique_slots(key: np.ndarray, present: np.ndarray) -> np.ndarray:
  """``bool [n, M]``: present slots whose ``key`` no other present slot of the scene shares."""
  same = (key[:, :, None] == key[:, None, :]) & present[:, None, :]
  return present & (same.sum(-1) == 1)


def _pick(rng: np.random.Generator, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """One candidate per row, uniformly: ``(index [n], any candidate [n])``.

  The random scores are drawn for every row, candidates or not, so a row's
  draw does not depend on the others'.
  """
  scores = np.where(candidates, rng.random(candidates.shape), -1.0)
  return scores.argmax(1), candidates.any(1)


def _color_question(rng, s):
  """ "what colour is the SHAPE ?" about an object whose shape is unique in the scene."""
  slot, valid = _pick(rng, _unique_slots(s["shapes"], s["present"]))
  shape, color = s["shapes"][s["rows"], slot], s["colors"][s["rows"], slot]
  argument = _argument(_word("the", s["n"]), _SHAPE_TOK[np.maximum(shape, 0)])
  return valid, slot, argument, _OFFSET["color"] + color


def _shape_question(rng, s):
  """ "what shape is the COLOUR object ?" about an object whose colour is unique."""
  slot, valid = _pick(rng, _unique_slots(s["colors"], s["present"]))
  shape, color = s["shapes"][s["rows"], slot], s["colors"][s["rows"], slot]
  n = s["n"]
  argument = _argument(_word("the", n), _COLOR_TOK[np.maximum(color, 0)], _word("object", n))
  return valid, slot, argument, _OFFSET["shape"] + shape


def _size_question(rng, s):
  """ "what size is the COLOUR SHAPE ?" about an object whose (colour, shape) is unique."""
  key = s["shapes"] * world.NUM_COLORS + s["colors"]
  slot, valid = _pick(rng, _unique_slots(key, s["present"]))
  rows = s["rows"]
  shape, color, size = s["shapes"][rows, slot], s["colors"][rows, slot], s["sizes"][rows, slot]
  argument = _argument(
    _word("the", s["n"]), _COLOR_TOK[np.maximum(color, 0)], _SHAPE_TOK[np.maximum(shape, 0)]
  )
  return valid, slot, argument, _OFFSET["size"] + size


def _count_question(rng, s):
  """ "how many objects are there ?"."""
  del rng
  n = s["n"]
  answer = _OFFSET["count"] + s["num_objects"] - 1
  return np.ones(n, bool), np.full(n, -1), _argument(_word("objects", n)), answer


def _exists_question(rng, s):
  """ "is there a SHAPE ?", yes for a random half of the scenes (exactly), no for the rest."""
  n = s["n"]
  yes = np.zeros(n, bool)
  yes[rng.permutation(n)[: (n + 1) // 2]] = True
  slot, _ = _pick(rng, s["present"])  # yes: the shape of a random object
  present_shape = np.zeros((n, world.NUM_SHAPES), bool)
  present_shape[np.repeat(s["rows"], s["present"].sum(1)), s["shapes"][s["present"]]] = True
  absent, _ = _pick(rng, ~present_shape)  # no: a random shape no object has
  shape = np.where(yes, s["shapes"][s["rows"], slot], absent)
  argument = _argument(_ARTICLE_TOK[shape], _SHAPE_TOK[shape])
  answer = np.where(yes, ANSWER_TO_ID["yes"], ANSWER_TO_ID["no"])
  # A scene holds at most 9 of the 10 shapes, so some shape is always absent.
  return yes | ~present_shape.all(1), np.where(yes, slot, -1), argument, answer


def _texture_question(rng, s):
  """ "what is the texture of the background ?"."""
  del rng
  n = s["n"]
  argument = _argument(_word("the", n), _word("background", n))
  return np.ones(n, bool), np.full(n, -1), argument, _OFFSET["texture"] + s["texture"]


_BUILDERS = {
  "color": _color_question,
  "shape": _shape_question,
  "count": _count_question,
  "exists": _exists_question,
  "texture": _texture_question,
  "size": _size_question,
}


def questions(
  scene: Mapping[str, np.ndarray], seed: int, *, types: Sequence[str] = QUESTION_TYPES
) -> dict[str, np.ndarray]:
  """Question-answer pairs about ``n`` scenes, at most one of each type per scene.

  Args:
    scene: the latents of :func:`fedjax_mm.data.world.generate` (``shapes``,
      ``colors``, ``sizes`` ``int [n, M]`` with ``-1`` for absent slots,
      ``num_objects``, ``texture`` ``int [n]``); other keys are ignored.
    seed: non-negative seed of the draws (which object, which shape, yes or no).
    types: the question types to ask, a subset of :data:`QUESTION_TYPES`.

  Returns:
    ``Q`` pairs, scene-major (a scene's questions are adjacent, in the order of
    ``types``), each array ``[Q]`` unless said: ``image`` ``int32`` (the scene's
    index in ``scene``), ``type`` ``int32`` (index into
    :data:`QUESTION_TYPES`), ``argument`` ``int32 [Q, ARGUMENT_LEN]`` (world
    token ids, right-padded with 0), ``answer`` ``int32`` (index into
    :data:`ANSWERS`), ``subject`` ``int32`` (the slot asked about; ``-1`` for
    ``count``, ``texture`` and ``exists`` answered no).
  """
  unknown = [t for t in types if t not in QUESTION_TYPES]
  if unknown or len(set(types)) != len(types):
    raise ValueError(f"types must be distinct names of {QUESTION_TYPES}, got {tuple(types)}.")
  shapes = np.asarray(scene["shapes"])
  n = shapes.shape[0]
  s = {
    "n": n,
    "rows": np.arange(n),
    "present": shapes >= 0,
    "shapes": shapes,
    "colors": np.asarray(scene["colors"]),
    "sizes": np.asarray(scene["sizes"]),
    "num_objects": np.asarray(scene["num_objects"]),
    "texture": np.asarray(scene["texture"]),
  }
  streams = np.random.SeedSequence(seed).spawn(NUM_TYPES)
  columns = {"valid": [], "subject": [], "argument": [], "answer": []}
  for t in types:
    rng = np.random.default_rng(streams[QUESTION_TYPES.index(t)])
    for name, value in zip(columns, _BUILDERS[t](rng, s), strict=True):
      columns[name].append(value)
  valid = np.stack(columns["valid"], axis=1)  # [n, T]
  image, k = np.nonzero(valid)  # row-major: scene-major, then type order
  type_ids = np.array([QUESTION_TYPES.index(t) for t in types], np.int32)
  return {
    "image": image.astype(np.int32),
    "type": type_ids[k],
    "argument": np.stack(columns["argument"], axis=1)[image, k],
    "answer": np.stack(columns["answer"], axis=1)[image, k].astype(np.int32),
    "subject": np.stack(columns["subject"], axis=1)[image, k].astype(np.int32),
  }


def render(qtype: int, argument: np.ndarray | Sequence[int]) -> str:
  """The English question of a ``(type, argument)`` pair, e.g. ``"what colour is the circle ?"``."""
  return TEMPLATES[QUESTION_TYPES[int(qtype)]].format(world.decode(argument))
