"""The base images named by digest, and `make pin-images`, which refreshes the pins
(scripts/pin_images.py), checked without a registry: every reference names a tag and any pin
is a sha256 digest; pinning rewrites each FROM and Compose image in place, keeping its tag
and stage name, moves an old pin, leaves our own images alone, writes nothing when one tag
does not resolve, and gives Dockerfiles that hadolint and the build test still read.

The registry's answer is stood for by a resolver giving each tag a digest of its own; what
the registry is asked (skopeo inspect --raw, the digest of the manifest's bytes) needs the
registry's network, which this machine may not have.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from scripts import pin_images
from tests.deploy.dockerfile import ROOT, parse
from tests.deploy.test_dockerfile import hadolint


def digest_of(ref: str, generation: str = "") -> str:
    return "sha256:" + hashlib.sha256(f"{generation}{ref}".encode()).hexdigest()


def all_references(root: Path = ROOT) -> list[tuple[str, str, str | None]]:
    return [
        (str(path.relative_to(root)), ref, digest)
        for path, pattern in pin_images.files(root)
        for ref, digest in pin_images.references(path.read_text(), pattern)
    ]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """The files the pins live in, copied."""
    for path, _ in pin_images.files(ROOT):
        target = tmp_path / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
    return tmp_path


def test_every_base_image_is_named_by_its_tag_and_any_pin_is_a_sha256_digest():
    found = all_references()
    assert {(name, ref) for name, ref, _ in found} == {
        ("Dockerfile", "python:3.11-slim-bookworm"),
        ("examples/compose/legacy-api.Dockerfile", "python:3.11-slim-bookworm"),
        ("examples/compose/compose.scaled.yaml", "redis:7-alpine"),
        ("examples/compose/compose.replicated.yaml", "postgres:16-alpine"),
    }
    for name, ref, digest in found:
        assert digest is None or pin_images.DIGEST.fullmatch(digest), (name, ref)
    # Both stages of the image and the example API's on the same base, pinned alike.
    bases = [s.base for s in parse()] + [s.base for s in parse(ROOT / pin_images.DOCKERFILES[1])]
    assert len(set(bases)) == 1


def test_pinning_writes_each_digest_after_its_tag_and_changes_nothing_else(tree: Path):
    before = {path: path.read_text() for path, _ in pin_images.files(tree)}
    digests = pin_images.refresh(tree, digest_of)
    assert set(digests) == {"python:3.11-slim-bookworm", "redis:7-alpine", "postgres:16-alpine"}
    for name, ref, digest in all_references(tree):
        assert digest == digest_of(ref), (name, ref)
    for path, text in before.items():
        old, new = text.splitlines(), path.read_text().splitlines()
        assert len(old) == len(new)
        for was, now in zip(old, new, strict=True):
            if was != now:
                # The same line with the pin inserted after the tag.
                (ref,) = [r for r in digests if r in was]
                assert now == was.replace(ref, f"{ref}@{digests[ref]}", 1), now
    (builder, final) = parse(tree / "Dockerfile")
    assert builder.name == "builder" and final.name is None
    python = "python:3.11-slim-bookworm"
    assert builder.base == final.base == f"{python}@{digest_of(python)}"


def test_pinning_again_moves_each_pin_to_the_new_digest(tree: Path):
    pin_images.refresh(tree, digest_of)
    pin_images.refresh(tree, lambda ref: digest_of(ref, "later"))
    for name, ref, digest in all_references(tree):
        assert digest == digest_of(ref, "later"), (name, ref)
    assert (tree / "Dockerfile").read_text().count("@sha256:") == 2


def test_nothing_is_written_when_one_tag_does_not_resolve(tree: Path):
    before = {path: path.read_text() for path, _ in pin_images.files(tree)}

    def resolve(ref: str) -> str:
        if ref.startswith("redis:"):
            raise RuntimeError(f"{ref}: the registry did not answer")
        return digest_of(ref)

    with pytest.raises(RuntimeError, match="redis"):
        pin_images.refresh(tree, resolve)
    assert {path: path.read_text() for path in before} == before


def test_a_resolver_answer_that_is_not_a_digest_is_refused(tree: Path):
    with pytest.raises(ValueError, match="not a sha256 digest"):
        pin_images.refresh(tree, lambda ref: "latest")


def test_our_own_images_are_never_pinned(tree: Path):
    pin_images.refresh(tree, digest_of)
    compose = (tree / "examples/compose/compose.yaml").read_text()
    assert "image: ${PORTCULLIS_IMAGE:-portcullis}\n" in compose
    assert "image: portcullis-orders-api\n" in compose


def test_the_pinned_dockerfiles_pass_hadolint(tree: Path):
    pin_images.refresh(tree, digest_of)
    for name in pin_images.DOCKERFILES:
        result = subprocess.run(
            [hadolint(), "--no-color", "--failure-threshold", "style", str(tree / name)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("ref", "asked"),
    [
        ("python:3.11-slim-bookworm", "docker.io/library/python:3.11-slim-bookworm"),
        ("bitnami/redis:7.2", "docker.io/bitnami/redis:7.2"),
        ("ghcr.io/org/tool:1.0", "ghcr.io/org/tool:1.0"),
        ("localhost:5000/base:1", "localhost:5000/base:1"),
    ],
)
def test_short_names_are_asked_of_docker_hub_in_full(ref: str, asked: str):
    assert pin_images.registry_reference(ref) == asked


def test_check_lists_every_reference_and_fails_while_one_is_not_pinned(capsys):
    status = pin_images.main(["--check"])
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == len(all_references())
    unpinned = [line for line in listed if line.endswith("NOT PINNED")]
    assert status == (1 if unpinned else 0)


def test_make_pin_images_runs_the_script():
    makefile = (ROOT / "Makefile").read_text()
    target = makefile[makefile.index("\npin-images:") :]
    assert target.splitlines()[2].strip() == "$(PYTHON) scripts/pin_images.py"
