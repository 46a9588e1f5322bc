"""Every package the library and its experiments import is one that installing them brings.

``pip install -e .`` installs ``install_requires``: an import of anything else
fails on a user's fresh machine while the test environment, with its extras,
hides it (RCSR's runner imported scikit-learn, then only in the test extra).
"""

import ast
import configparser
import importlib.metadata
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIRST_PARTY = {"fedjax_mm", "experiments"}
#: Imported only where an optional extra is installed, which the code says when it is missing.
EXTRAS = {"tensorflow_datasets": "tfds", "torch": "peers", "flwr": "peers"}


def _name(requirement: str) -> str:
  """The normalised distribution name of a requirement line (PEP 503)."""
  return re.sub(
    r"[-_.]+", "-", re.split(r"[\s<>=!~;\[]", requirement.strip(), maxsplit=1)[0]
  ).lower()


def _requirements(text: str) -> set[str]:
  return {
    _name(line) for line in text.splitlines() if line.strip() and not line.strip().startswith("#")
  }


def _setup():
  config = configparser.ConfigParser()
  config.read(ROOT / "setup.cfg")
  extras = {k: _requirements(v) for k, v in config["options.extras_require"].items()}
  return _requirements(config["options"]["install_requires"]), extras


def _imports():
  """{top-level module: [files importing it]} over fedjax_mm/ and experiments/."""
  found = {}
  for folder in FIRST_PARTY:
    for path in sorted((ROOT / folder).rglob("*.py")):
      for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
          names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
          names = [node.module]
        else:
          continue
        for name in names:
          top = name.split(".")[0]
          if top not in sys.stdlib_module_names and top not in FIRST_PARTY and top != "__future__":
            found.setdefault(top, []).append(str(path.relative_to(ROOT)))
  return found


def test_every_import_is_installed_by_the_install_or_its_documented_extra():
  required, extras = _setup()
  # What the pinned requirements bring with them (pillow through matplotlib, etils through
  # orbax-checkpoint): installed whenever the project is.
  brought = set()
  for name in required:
    for line in importlib.metadata.requires(name) or ():
      if "extra ==" not in line:
        brought.add(_name(line))
  distributions = importlib.metadata.packages_distributions()
  imports = _imports()
  assert {"jax", "flax", "optax", "orbax", "sklearn"} <= set(imports)  # the walk finds them
  missing = {}
  for module, files in imports.items():
    if module in EXTRAS:
      assert _name(module.replace("_", "-")) in extras[EXTRAS[module]], (module, EXTRAS[module])
      continue
    names = {_name(d) for d in distributions.get(module, [module])}
    if not names & (required | brought):
      missing[module] = (sorted(names), files[:3])
  assert not missing, f"imported but not installed by `pip install -e .`: {missing}"


def _pins() -> dict[str, str]:
  pins = {}
  for line in (ROOT / "constraints.txt").read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
      name, version = line.split("==")
      pins[_name(name)] = version
  return pins


def test_constraints_pin_every_requirement_within_its_range():
  """``constraints.txt`` is the tested set: one version for every requirement of the install and
  of the test and docs extras, each inside the range ``setup.cfg`` gives."""
  from packaging.requirements import Requirement

  config = configparser.ConfigParser()
  config.read(ROOT / "setup.cfg")
  sections = [config["options"]["install_requires"]]
  sections += [config["options.extras_require"][extra] for extra in ("test", "docs")]
  pins = _pins()
  checked = 0
  for section in sections:
    for line in section.splitlines():
      line = line.strip()
      if not line or line.startswith("#"):
        continue
      requirement = Requirement(line)
      name = _name(requirement.name)
      assert name in pins, f"{name} has no pin in constraints.txt"
      assert requirement.specifier.contains(pins[name]), (
        name,
        str(requirement.specifier),
        pins[name],
      )
      checked += 1
  assert checked >= 20  # the parse found the requirements


def test_experiments_is_a_folder_not_an_installed_package():
  config = configparser.ConfigParser()
  config.read(ROOT / "setup.cfg")
  included = config["options.packages.find"]["include"].split()
  assert included == ["fedjax_mm", "fedjax_mm.*"]
  assert (ROOT / "experiments" / "main.py").exists()
