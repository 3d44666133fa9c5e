"""The installed dependencies are the ones the suite was verified with.

When a new transformers (or torch) lies outside the verified range, this file fails with one plain
message, instead of the change surfacing as many puzzling failures elsewhere.
"""

from __future__ import annotations

from importlib.metadata import requires, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

CONSTRAINTS = Path(__file__).resolve().parent.parent / "constraints.txt"


def declared(name: str) -> Requirement:
    """caddtree's requirement on ``name``, as pyproject.toml declares it (installed metadata)."""
    for line in requires("caddtree") or ():
        requirement = Requirement(line)
        if requirement.name == name and requirement.marker is None:
            return requirement
    raise AssertionError(f"caddtree does not declare a dependency on {name}")


def pinned(name: str) -> Version:
    """The version of ``name`` that constraints.txt pins."""
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and Requirement(line).name.lower() == name.lower():
            (spec,) = Requirement(line).specifier
            return Version(spec.version)
    raise AssertionError(f"constraints.txt pins no version of {name}")


@pytest.mark.parametrize("name", ["transformers", "torch"])
def test_installed_version_is_in_the_verified_range(name: str) -> None:
    installed = Version(version(name))
    allowed = declared(name).specifier
    assert allowed.contains(installed, prereleases=True), (
        f"{name} {installed} is installed, but caddtree is verified with {name}{allowed} "
        f"(constraints.txt pins {pinned(name)}). Run `bash scripts/test.sh` with {installed}, "
        "fix what breaks, then move the pin in constraints.txt and the range in pyproject.toml "
        "in a commit of their own"
    )


def test_transformers_cap_is_the_minor_after_the_pinned_one() -> None:
    pin = pinned("transformers")
    caps = [Version(s.version) for s in declared("transformers").specifier if s.operator == "<"]
    expected = Version(f"{pin.major}.{pin.minor + 1}")
    assert caps == [expected], (
        f"constraints.txt verifies transformers {pin}, so pyproject.toml should cap it at "
        f"<{expected} (the first minor release not yet run), not {[str(c) for c in caps]}"
    )


@pytest.mark.parametrize("name", ["transformers", "torch", "safetensors", "numpy"])
def test_pins_satisfy_the_declared_ranges(name: str) -> None:
    pin = pinned(name)
    assert declared(name).specifier.contains(pin, prereleases=True), (
        f"constraints.txt pins {name} {pin}, outside pyproject.toml's {declared(name).specifier}"
    )
