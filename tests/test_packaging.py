"""What the package claims about itself: the lower bounds of its dependencies are the
versions CI installs in its oldest-versions job (.ci/oldest.txt), and its licence."""
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]


def declared() -> list[Requirement]:
    """The dependencies and the test extra, from pyproject.toml."""
    text = (REPO / "pyproject.toml").read_text()
    lists = [re.search(r"^dependencies = \[(.*?)\]", text, re.S | re.M)[1],
             re.search(r"^test = \[(.*?)\]", text, re.M)[1]]
    return [Requirement(r) for part in lists for r in re.findall(r'"([^"]+)"', part)]


def test_oldest_pins_each_dependency_at_its_lower_bound():
    pins = {}
    for line in (REPO / ".ci" / "oldest.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower()] = Version(version)
    for req in declared():
        lower = [Version(s.version) for s in req.specifier if s.operator == ">="]
        assert len(lower) == 1, f"{req}: one lower bound (>=) per dependency"
        assert pins.get(req.name.lower()) == lower[0], \
            f"{req}: .ci/oldest.txt pins {pins.get(req.name.lower())}, not {lower[0]}"
    assert set(pins) == {r.name.lower() for r in declared()}


def test_the_licence_file_matches_pyproject():
    assert 'license = { text = "MIT" }' in (REPO / "pyproject.toml").read_text()
    licence = (REPO / "LICENSE").read_text()
    assert licence.startswith("MIT License") and "Copyright (c) 2026 the ggwgpu authors" in licence
