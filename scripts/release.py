"""`make release`: a release built and checked from its one version, and nothing published.

The version is set in one place, `version` in pyproject.toml's [project] table. The rest
follow from it: the distribution's metadata (which `--version` and `portcullis_build_info`
read), the names of the sdist and the wheel, the image's tag and its
`org.opencontainers.image.version` label (the VERSION build argument), and the section of
CHANGELOG.md a release needs.

    1. the version, a final PEP 440 release (no dev, pre or local part);
    2. CHANGELOG.md has a section headed with it and dated (`## 1.2.3 - 2026-12-02`), not
       one still marked unreleased;
    3. the sdist, then the wheel from the sdist (so the sdist is shown to be complete), built
       into dist/ with `python -m build`;
    4. both carry the version, the wheel both programs and the package data (templates,
       static files, migrations);
    5. what to publish, printed: the files with their SHA-256, the tag, the image.

    python3 scripts/release.py                 # steps 1 to 5
    python3 scripts/release.py --version-only  # the version, for the Makefile
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTION = "portcullis"
IMAGE = "portcullis"
SCRIPTS = ("portcullis-gateway", "portcullis-authserver")
# What the wheel must hold besides the code: pages, styles and each backend's migrations.
PACKAGE_DATA = (
    "authserver/templates/base.html",
    "authserver/static/style.css",
    "authserver/store/migrations/sqlite/001_initial.sql",
    "authserver/store/migrations/postgres/001_initial.sql",
    "gateway/py.typed",
)
_HEADING = re.compile(r"^## (?P<version>\S+)(?P<rest>.*)$", re.MULTILINE)
_DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")


class ReleaseError(Exception):
    """A check failed: the message says which, and what to do."""


@dataclass(frozen=True)
class Artifacts:
    sdist: Path
    wheel: Path


def declared_version(root: Path) -> str:
    """pyproject.toml's version, as written (the standard library alone: `make image`)."""
    return str(tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"])


def project_version(root: Path) -> str:
    """Step 1: pyproject.toml's version, which must be a final release."""
    from packaging.version import InvalidVersion, Version

    text = declared_version(root)
    try:
        parsed = Version(text)
    except InvalidVersion:
        raise ReleaseError(f"pyproject.toml: version {text!r} is not a PEP 440 version") from None
    if parsed.is_devrelease or parsed.is_prerelease or parsed.local or str(parsed) != text:
        raise ReleaseError(
            f"pyproject.toml: version {text!r} is not a final release in its normal form"
            f" (such as {parsed.base_version})"
        )
    return text


def changelog_section(root: Path, version: str) -> str:
    """Step 2: the text of CHANGELOG.md's section for `version`, which must be dated."""
    text = (root / "CHANGELOG.md").read_text()
    headings = list(_HEADING.finditer(text))
    for index, heading in enumerate(headings):
        if heading.group("version") != version:
            continue
        rest = heading.group("rest")
        if "unreleased" in rest.lower():
            raise ReleaseError(
                f"CHANGELOG.md: the {version} section is still marked unreleased:"
                f" head it `## {version} - YYYY-MM-DD` with the release's date"
            )
        if not _DATE.search(rest):
            raise ReleaseError(
                f"CHANGELOG.md: the {version} section has no date: head it"
                f" `## {version} - YYYY-MM-DD`"
            )
        end = headings[index + 1].start() if index + 1 < len(headings) else len(text)
        body = text[heading.end() : end].strip()
        if not body:
            raise ReleaseError(f"CHANGELOG.md: the {version} section is empty")
        return body
    raise ReleaseError(
        f"CHANGELOG.md has no section for {version}: add `## {version} - YYYY-MM-DD` with what"
        " changed and how to upgrade"
    )


def build(root: Path, outdir: Path, *, isolated: bool) -> Artifacts:
    """Step 3: the sdist, then the wheel built from it."""
    version = project_version(root)
    sdist = outdir / f"{DISTRIBUTION}-{version}.tar.gz"
    wheel = outdir / f"{DISTRIBUTION}-{version}-py3-none-any.whl"
    for stale in (sdist, wheel):
        stale.unlink(missing_ok=True)
    command = [sys.executable, "-m", "build", "--outdir", str(outdir)]
    if not isolated:
        # With the build requirements already installed here, as on a machine offline.
        command.append("--no-isolation")
    result = subprocess.run(  # noqa: S603  (our own interpreter and paths)
        [*command, str(root)], capture_output=True, text=True, check=False, timeout=600
    )
    if result.returncode != 0:
        raise ReleaseError(f"python -m build failed:\n{result.stdout[-3000:]}{result.stderr}")
    for built in (sdist, wheel):
        if not built.is_file():
            raise ReleaseError(f"python -m build did not make {built.name}")
    return Artifacts(sdist, wheel)


def _metadata_version(text: str, where: str) -> str:
    found = re.search(r"^Version: (\S+)$", text, re.MULTILINE)
    if found is None:
        raise ReleaseError(f"{where} has no Version field")
    return found.group(1)


def verify(artifacts: Artifacts, version: str) -> None:
    """Step 4: what was built says the version and holds what the programs need."""
    with zipfile.ZipFile(artifacts.wheel) as wheel:
        names = set(wheel.namelist())
        info = f"{DISTRIBUTION}-{version}.dist-info"
        if f"{info}/METADATA" not in names:
            raise ReleaseError(f"{artifacts.wheel.name} has no {info}/METADATA")
        said = _metadata_version(wheel.read(f"{info}/METADATA").decode(), "the wheel's METADATA")
        entry_points = wheel.read(f"{info}/entry_points.txt").decode()
    if said != version:
        raise ReleaseError(f"{artifacts.wheel.name} says version {said}, not {version}")
    for script in SCRIPTS:
        if not re.search(rf"^{script} = ", entry_points, re.MULTILINE):
            raise ReleaseError(f"{artifacts.wheel.name} does not install {script}")
    missing = [name for name in PACKAGE_DATA if name not in names]
    if missing:
        raise ReleaseError(f"{artifacts.wheel.name} lacks {', '.join(missing)}")
    with tarfile.open(artifacts.sdist) as sdist:
        member = sdist.extractfile(f"{DISTRIBUTION}-{version}/PKG-INFO")
        if member is None:
            raise ReleaseError(f"{artifacts.sdist.name} has no PKG-INFO")
        said = _metadata_version(member.read().decode(), "the sdist's PKG-INFO")
    if said != version:
        raise ReleaseError(f"{artifacts.sdist.name} says version {said}, not {version}")


def image_tag(version: str) -> str:
    return f"{IMAGE}:{version}"


def instructions(artifacts: Artifacts, version: str, root: Path) -> str:
    """Step 5: what to publish, and how; none of it done here."""
    files = [artifacts.sdist, artifacts.wheel]
    listed = "\n".join(
        f"  {path.relative_to(root) if path.is_relative_to(root) else path}"
        f"  sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"
        for path in files
    )
    paths = " ".join(str(p.relative_to(root) if p.is_relative_to(root) else p) for p in files)
    tag = image_tag(version)
    return f"""Portcullis {version}: built and checked; nothing was published.

Files:
{listed}

To publish, in this order:
  git tag -a v{version} -m "Portcullis {version}" && git push origin v{version}
  python -m twine upload {paths}
  docker build --build-arg VERSION={version} -t {tag} . && docker tag {tag} REGISTRY/{tag}
  docker push REGISTRY/{tag}
Release notes: the {version} section of CHANGELOG.md."""


def release(root: Path, outdir: Path, *, isolated: bool = True) -> str:
    """Steps 1 to 5; the text to print."""
    version = project_version(root)
    changelog_section(root, version)
    artifacts = build(root, outdir, isolated=isolated)
    verify(artifacts, version)
    return instructions(artifacts, version, root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the source tree")
    parser.add_argument("--outdir", type=Path, help="where to build (default: ROOT/dist)")
    parser.add_argument(
        "--no-isolation",
        action="store_true",
        help="build with the setuptools installed here instead of a fresh one from the index",
    )
    parser.add_argument("--version-only", action="store_true", help="print the version, exit")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        if args.version_only:
            print(declared_version(root))
            return 0
        outdir = (args.outdir or root / "dist").resolve()
        print(release(root, outdir, isolated=not args.no_isolation))
    except ReleaseError as exc:
        print(f"release: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
