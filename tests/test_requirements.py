"""requirements*.txt (issue 75): every line an exact pin, the pins closed under what each
pinned package needs, and this environment holding exactly the pinned versions, so a new
virtual env next month installs what these tests passed with."""
import re
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from conftest import ROOT

PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.+!-]*)")


def pins(name):
    """{canonical name: version} of one requirements file and the files it includes (-r);
    an unpinned or malformed line fails with its file and line number."""
    out = {}
    for number, line in enumerate((ROOT / name).read_text().splitlines(), 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        if line.startswith("-r "):
            out |= pins(line[3:].strip())
            continue
        match = PIN.fullmatch(line.replace(" ", ""))
        assert match, f"{name}:{number}: '{line}' is not an exact pin (name==version)"
        out[canonicalize_name(match[1])] = match[2]
    return out


def test_every_line_is_an_exact_pin():
    runtime, dev = pins("requirements.txt"), pins("requirements-dev.txt")
    assert {"torch", "numpy", "tiktoken", "sentencepiece", "safetensors", "tqdm"} <= runtime.keys()
    assert {"pytest", "pytest-xdist", "transformers", "tokenizers", "peft"} <= dev.keys() and runtime.items() <= dev.items()


def test_pin_parser_rejects_ranges_and_bare_names(tmp_path, monkeypatch):
    import test_requirements
    for line in ("numpy", "numpy>=2", "numpy==2.*", "numpy~=2.4"):
        (tmp_path / "requirements.txt").write_text(f"# a comment\n{line}  # why\n")
        monkeypatch.setattr(test_requirements, "ROOT", tmp_path)
        try:
            pins("requirements.txt")
        except AssertionError as e:
            assert str(e).startswith(f"requirements.txt:2: '{line}'"), e
        else:
            raise AssertionError(f"{line!r} passed as a pin")


def test_pins_are_installed_and_closed():
    """Each pinned package is installed at its pin (a local label such as +cpu aside), and every
    package it needs on this platform is pinned too: nothing in the environment floats."""
    wanted, wrong, unpinned = pins("requirements-dev.txt"), [], set()
    for name, version in wanted.items():
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            wrong.append(f"{name} not installed (pinned {version})")
            continue
        if Version(dist.version).public != Version(version).public:
            wrong.append(f"{name} {dist.version} installed, pinned {version}")
        for spec in map(Requirement, dist.requires or []):
            if spec.marker is None or spec.marker.evaluate({"extra": ""}):
                if canonicalize_name(spec.name) not in wanted:
                    unpinned.add(f"{spec.name} (needed by {name})")
    assert not wrong, "pip install -r requirements-dev.txt: " + "; ".join(wrong)
    assert not unpinned, "pin these too: " + ", ".join(sorted(unpinned))
