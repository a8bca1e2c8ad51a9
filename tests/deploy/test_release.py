"""`make release` (scripts/release.py) and the one place the version is set, checked without
the network: the version comes from pyproject.toml alone and every command prints it; a
release whose version has no dated section in CHANGELOG.md, or is not a final release, is
refused before anything is built; a release builds the sdist and, from it, the wheel, both
carrying the version (one no file of the tree spells), and prints what to publish.

The builds use the setuptools installed here (`--no-isolation`), as on a machine offline.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from scripts import release
from tests.deploy.dockerfile import ROOT, parse

VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
# A version no file of the tree holds: what is built from it can only have been derived.
ELSEWHERE = "9.8.7"
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md")
PACKAGES = ("portcullis", "gateway", "authserver")


def source_tree(destination: Path, version: str, heading: str | None) -> Path:
    """What a release is built from, with `version` in pyproject.toml and the changelog's
    section for it headed `heading` (None: no section)."""
    destination.mkdir()
    for name in SOURCES:
        shutil.copy(ROOT / name, destination / name)
    for package in PACKAGES:
        shutil.copytree(
            ROOT / package,
            destination / package,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
    pyproject = destination / "pyproject.toml"
    text = pyproject.read_text()
    pyproject.write_text(
        re.sub(r'^version = ".*"$', f'version = "{version}"', text, count=1, flags=re.M)
    )
    changelog = destination / "CHANGELOG.md"
    # The section being made now stands aside; the test gives its own.
    sections = re.sub(
        r"^## (?!0\.1\.0).*$", "## earlier", changelog.read_text(), count=1, flags=re.M
    )
    if heading is not None:
        sections = sections.replace("## earlier", heading, 1)
    changelog.write_text(sections)
    return destination


def run_release(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "release.py"), "--root", str(root), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PIP_NO_INDEX": "1"},
    )


# ---------------------------------------------------------------------------- one version


def test_the_version_is_written_in_pyproject_toml_alone():
    for path in (
        ROOT / "portcullis" / "version.py",
        ROOT / "Dockerfile",
        ROOT / "Makefile",
        ROOT / "scripts" / "release.py",
    ):
        assert VERSION not in path.read_text(), path
    # The image's label is the build argument `make image` and the release pass.
    final = parse()[-1]
    assert 'org.opencontainers.image.version="${VERSION}"' in final.one("LABEL").args
    assert final.one("ARG").args == "VERSION=unknown"
    makefile = (ROOT / "Makefile").read_text()
    assert "--build-arg VERSION=$$($(PYTHON) scripts/release.py --version-only)" in makefile


@pytest.mark.parametrize("program", ["gateway", "authserver"])
def test_every_command_prints_pyprojects_version(program: str):
    result = subprocess.run(
        [sys.executable, "-m", program, "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode, result.stderr) == (0, "")
    # The installed metadata is pyproject.toml's (make reinstalls when the file changes).
    assert result.stdout == f"portcullis-{program} {VERSION}\n"


def test_the_changelog_has_a_section_for_the_version_being_made():
    try:
        release.changelog_section(ROOT, VERSION)
    except release.ReleaseError as exc:
        # Between releases the section exists and says it is not released yet.
        assert "still marked unreleased" in str(exc)


def test_the_version_only_answer_is_pyprojects():
    result = run_release(ROOT, "--version-only")
    assert (result.returncode, result.stdout) == (0, f"{VERSION}\n")


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("heading", "message"),
    [
        (None, f"CHANGELOG.md has no section for {ELSEWHERE}"),
        (f"## {ELSEWHERE} (unreleased)", "still marked unreleased"),
        (f"## {ELSEWHERE}", "has no date"),
    ],
    ids=["no-section", "unreleased", "undated"],
)
def test_a_release_whose_changelog_lacks_a_dated_section_is_refused_before_building(
    tmp_path: Path, heading: str | None, message: str
):
    root = source_tree(tmp_path / "src", ELSEWHERE, heading)
    result = run_release(root, "--no-isolation")
    assert result.returncode == 1
    assert message in result.stderr
    assert result.stdout == ""
    assert not (root / "dist").exists()  # nothing was built


def test_an_empty_section_is_refused(tmp_path: Path):
    root = source_tree(tmp_path / "src", ELSEWHERE, None)
    changelog = root / "CHANGELOG.md"
    changelog.write_text(
        changelog.read_text().replace("## 0.1.0", f"## {ELSEWHERE} - 2026-12-02\n\n## 0.1.0", 1)
    )
    with pytest.raises(release.ReleaseError, match="is empty"):
        release.changelog_section(root, ELSEWHERE)


@pytest.mark.parametrize("version", ["9.8.7.dev1", "9.8.7rc1", "9.8.7+local", "09.8.7"])
def test_a_version_that_is_not_a_final_release_is_refused(tmp_path: Path, version: str):
    root = source_tree(tmp_path / "src", version, f"## {version} - 2026-12-02")
    result = run_release(root, "--no-isolation")
    assert result.returncode == 1
    assert "is not a final release" in result.stderr or "not a PEP 440" in result.stderr


# ---------------------------------------------------------------------------- a release


@pytest.fixture(scope="module")
def built(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    root = source_tree(tmp_path_factory.mktemp("release") / "src", ELSEWHERE, None)
    changelog = root / "CHANGELOG.md"
    changelog.write_text(
        changelog.read_text().replace(
            "## earlier", f"## {ELSEWHERE} - 2026-12-02\n\n### Added\n- Everything.\n\n## earlier"
        )
    )
    result = run_release(root, "--no-isolation")
    assert result.returncode == 0, result.stdout + result.stderr
    return root, result


def test_a_release_builds_the_sdist_and_the_wheel_of_its_version(built):
    root, _ = built
    assert sorted(p.name for p in (root / "dist").iterdir()) == [
        f"portcullis-{ELSEWHERE}-py3-none-any.whl",
        f"portcullis-{ELSEWHERE}.tar.gz",
    ]
    with zipfile.ZipFile(root / "dist" / f"portcullis-{ELSEWHERE}-py3-none-any.whl") as wheel:
        metadata = wheel.read(f"portcullis-{ELSEWHERE}.dist-info/METADATA").decode()
        names = wheel.namelist()
    assert f"\nVersion: {ELSEWHERE}\n" in metadata
    assert "authserver/store/migrations/postgres/001_initial.sql" in names
    assert not [name for name in names if name.startswith("tests/")]


def test_a_release_prints_what_to_publish_and_publishes_nothing(built):
    root, result = built
    out = result.stdout
    assert out.startswith(f"Portcullis {ELSEWHERE}: built and checked; nothing was published.")
    for path in sorted((root / "dist").iterdir()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert f"dist/{path.name}  sha256:{digest}" in out
    assert f"git tag -a v{ELSEWHERE} " in out
    assert f"twine upload dist/portcullis-{ELSEWHERE}.tar.gz " in out
    assert f"docker build --build-arg VERSION={ELSEWHERE} -t portcullis:{ELSEWHERE} ." in out


def test_a_wheel_that_says_another_version_is_refused(built):
    root, _ = built
    artifacts = release.Artifacts(
        root / "dist" / f"portcullis-{ELSEWHERE}.tar.gz",
        root / "dist" / f"portcullis-{ELSEWHERE}-py3-none-any.whl",
    )
    release.verify(artifacts, ELSEWHERE)
    other = root / "dist" / "portcullis-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(artifacts.wheel) as source, zipfile.ZipFile(other, "w") as copy:
        for item in source.infolist():
            name = item.filename.replace(
                f"portcullis-{ELSEWHERE}.dist-info", "portcullis-1.0.0.dist-info"
            )
            copy.writestr(name, source.read(item))
    with pytest.raises(release.ReleaseError, match=f"says version {ELSEWHERE}, not 1.0.0"):
        release.verify(release.Artifacts(artifacts.sdist, other), "1.0.0")
    other.unlink()


def test_make_release_runs_the_script_after_installing_the_build_tool():
    makefile = (ROOT / "Makefile").read_text()
    target = makefile[makefile.index("\nrelease:") :].split("\n\n")[0].splitlines()
    assert target[1] == "release: $(DEV_STAMP)"
    assert target[2].strip() == "$(PY) -m pip install --quiet 'build>=1.2'"
    assert target[3].strip() == "$(PY) scripts/release.py"
