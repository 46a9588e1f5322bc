"""Question-answer pairs about the world's scenes: right, unambiguous, fixed answers, seeded."""

import numpy as np
import pytest

from fedjax_mm import data
from fedjax_mm.data import vqa, world

COUNT_WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def _objects(scene, i):
  """The present objects of scene ``i`` as (slot, shape, colour, size) names."""
  out = []
  for slot in range(scene["shapes"].shape[1]):
    if scene["shapes"][i, slot] >= 0:
      out.append(
        (
          slot,
          world.SHAPE_NAMES[scene["shapes"][i, slot]],
          world.COLOR_NAMES[scene["colors"][i, slot]],
          world.SIZE_NAMES[scene["sizes"][i, slot]],
        )
      )
  return out


def _check(scene, qa):
  """Loops over every question: its argument names exactly one thing and the answer is its."""
  answers = [vqa.ANSWERS[a] for a in qa["answer"]]
  for q, (i, t) in enumerate(zip(qa["image"], qa["type"], strict=True)):
    kind, words, answer = vqa.QUESTION_TYPES[t], world.decode(qa["argument"][q]).split(), answers[q]
    objects = _objects(scene, i)
    assert answer in vqa.TYPE_ANSWERS[kind], (kind, answer)
    if kind == "color":  # "the SHAPE"
      assert words[0] == "the" and len(words) == 2
      match = [o for o in objects if o[1] == words[1]]
      assert len(match) == 1 and answer == match[0][2] and qa["subject"][q] == match[0][0]
    elif kind == "shape":  # "the COLOUR object"
      assert words[0] == "the" and words[2] == "object" and len(words) == 3
      match = [o for o in objects if o[2] == words[1]]
      assert len(match) == 1 and answer == match[0][1] and qa["subject"][q] == match[0][0]
    elif kind == "size":  # "the COLOUR SHAPE"
      match = [o for o in objects if (o[2], o[1]) == (words[1], words[2])]
      assert len(match) == 1 and answer == match[0][3] and qa["subject"][q] == match[0][0]
    elif kind == "count":
      assert words == ["objects"] and answer == COUNT_WORDS[len(objects) - 1]
    elif kind == "exists":  # "a SHAPE" / "an ellipse"
      assert words[0] == ("an" if words[1][0] in "aeiou" else "a")
      has = [o for o in objects if o[1] == words[1]]
      assert answer == ("yes" if has else "no")
      if has:  # the subject is an object of that shape
        assert qa["subject"][q] in [o[0] for o in has]
      else:
        assert qa["subject"][q] == -1
    else:
      assert kind == "texture" and words == ["the", "background"]
      assert answer == world.TEXTURE_NAMES[scene["texture"][i]]


def _askable(scene, i):
  """The types that have exactly one answer in scene ``i``, found by looping."""
  objects = _objects(scene, i)
  shapes = [o[1] for o in objects]
  colors = [o[2] for o in objects]
  pairs = [(o[1], o[2]) for o in objects]
  types = {"count", "exists", "texture"}
  if any(shapes.count(s) == 1 for s in shapes):
    types.add("color")
  if any(colors.count(c) == 1 for c in colors):
    types.add("shape")
  if any(pairs.count(p) == 1 for p in pairs):
    types.add("size")
  return types


@pytest.mark.parametrize("shift,max_objects", [(1.0, 3), (0.0, 3), (1.0, 6)])
def test_every_answer_is_right_and_no_question_is_ambiguous(shift, max_objects):
  config = world.WorldConfig(image_size=16, max_objects=max_objects, min_visible_fraction=0.1)
  scene = world.generate(7, 300, config=config, shift=shift)
  qa = vqa.questions(scene, 3)
  _check(scene, qa)
  # Every scene is asked exactly the types that have one answer in it, in type order.
  for i in range(300):
    asked = [vqa.QUESTION_TYPES[t] for t in qa["type"][qa["image"] == i]]
    assert asked == [t for t in vqa.QUESTION_TYPES if t in _askable(scene, i)]
  assert np.all(np.diff(qa["image"]) >= 0)  # scene-major


def test_repeated_attributes_are_never_asked_about():
  """Two circles: no "what colour is the circle ?"; two red objects: no "... the red object ?"."""
  circle, square, ring = (world.SHAPE_NAMES.index(s) for s in ("circle", "square", "ring"))
  red, green = world.COLOR_NAMES.index("red"), world.COLOR_NAMES.index("green")
  scene = {
    "shapes": np.array([[circle, circle, square]] * 4),
    "colors": np.array([[red, green, red]] * 4),
    "sizes": np.array([[0, 1, 2]] * 4),
    "num_objects": np.array([3] * 4),
    "texture": np.array([0, 1, 2, 3]),
  }
  qa = vqa.questions(scene, 0)
  text = {
    vqa.render(t, a) + " " + vqa.ANSWERS[x]
    for t, a, x in zip(qa["type"], qa["argument"], qa["answer"], strict=True)
  }
  assert "what colour is the square ? red" in text
  assert "what shape is the green object ? circle" in text
  assert not any("the circle ?" in q or "the red object" in q for q in text)
  assert "how many objects are there ? three" in text
  assert "what is the texture of the background ? checker" in text
  _check(scene, qa)
  # A scene whose every shape and colour repeats asks only count, exists and texture.
  twins = {k: v[:1] for k, v in scene.items()} | {
    "shapes": np.array([[ring, ring, -1]]),
    "colors": np.array([[red, red, -1]]),
    "sizes": np.array([[0, 1, -1]]),
    "num_objects": np.array([2]),
  }
  asked = [vqa.QUESTION_TYPES[t] for t in vqa.questions(twins, 0)["type"]]
  assert asked == ["count", "exists", "texture"]


def test_the_answer_vocabulary_is_fixed():
  assert vqa.ANSWERS == (
    *("red", "green", "blue", "yellow", "cyan", "magenta", "orange", "purple", "white", "black"),
    *("circle", "square", "triangle", "diamond", "plus", "cross", "ring", "frame", "hourglass"),
    "ellipse",
    *COUNT_WORDS,
    "yes",
    "no",
    *("noise", "stripes", "gradient", "checker"),
    *("small", "medium", "large"),
  )
  assert vqa.NUM_ANSWERS == len(set(vqa.ANSWERS)) == 38
  assert vqa.ANSWERS == tuple(a for t in vqa.QUESTION_TYPES for a in vqa.TYPE_ANSWERS[t])
  # Whatever the world's settings, answers stay in the one vocabulary and their type's slice.
  for max_objects in (1, 9):
    config = world.WorldConfig(image_size=16, max_objects=max_objects, min_visible_fraction=0.1)
    scene = world.generate(1, 60, config=config, shift=1.0)
    qa = vqa.questions(scene, 1)
    assert qa["answer"].min() >= 0 and qa["answer"].max() < vqa.NUM_ANSWERS
    _check(scene, qa)


@pytest.mark.parametrize("n", [1, 2, 7, 200])
def test_yes_no_is_balanced(n):
  scene = world.generate(2, n, config=world.WorldConfig(image_size=16), shift=1.0)
  qa = vqa.questions(scene, 5, types=("exists",))
  yes = int((qa["answer"] == vqa.ANSWER_TO_ID["yes"]).sum())
  no = int((qa["answer"] == vqa.ANSWER_TO_ID["no"]).sum())
  assert yes + no == n and yes - no in (0, 1)


def test_deterministic_by_seed_and_types_draw_independently():
  scene = world.generate(4, 100, config=world.WorldConfig(image_size=16), shift=1.0)
  a, b, c = vqa.questions(scene, 11), vqa.questions(scene, 11), vqa.questions(scene, 12)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
    assert a[k].dtype == np.int32
  assert any(not np.array_equal(a[k], c[k]) for k in ("argument", "answer"))
  # Asking fewer types leaves the others' questions as they were.
  few = vqa.questions(scene, 11, types=("shape", "exists"))
  keep = np.isin(a["type"], [vqa.QUESTION_TYPES.index(t) for t in ("shape", "exists")])
  for k in few:
    np.testing.assert_array_equal(few[k], a[k][keep])
  with pytest.raises(ValueError, match="types must be distinct names"):
    vqa.questions(scene, 0, types=("colour",))


def test_arguments_are_world_words_the_captions_use():
  scene = world.generate(3, 50, config=world.WorldConfig(image_size=16), shift=1.0)
  qa = vqa.questions(scene, 0)
  assert qa["argument"].shape[1] == vqa.ARGUMENT_LEN
  captions = set(" ".join(world.decode(scene["caption"].reshape(-1, 16))).split())
  words = set(" ".join(world.decode(qa["argument"])).split())
  assert words <= set(world.VOCAB) and words - captions <= {"objects", "object", "the"}
  for argument in qa["argument"]:  # world.encode's ids for the decoded phrase
    np.testing.assert_array_equal(world.encode(world.decode(argument), vqa.ARGUMENT_LEN), argument)
  # The question words are not the world's (they reach the head as the type).
  assert not {"what", "colour", "how", "many", "yes", "no"} & set(world.VOCAB)
  # Right-padded: no token after a pad.
  padded = qa["argument"] == data.PAD_ID
  assert np.all(padded[:, :-1] <= padded[:, 1:])
