"""Every docstring example in the library runs and prints what it shows.

The modules are found by reading the package's sources for ``>>>``, so an
example added to any module is checked without listing it here.
"""

import doctest
import importlib
import pathlib

import pytest

import fedjax_mm

PACKAGE = pathlib.Path(fedjax_mm.__file__).parent


def _modules_with_examples():
  names = []
  for path in sorted(PACKAGE.rglob("*.py")):
    if ">>>" in path.read_text():
      parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
      names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
  return names


MODULES = _modules_with_examples()


def test_the_library_has_examples_to_check():
  # The search above finds the modules the library documents by example.
  assert "fedjax_mm.losses.muscle" in MODULES and len(MODULES) >= 30


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0
  assert result.failed == 0
