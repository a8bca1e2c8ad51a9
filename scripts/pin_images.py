"""Pin the base images by digest: every FROM of the Dockerfiles, and the third-party images
the Compose example runs, written as `name:tag@sha256:digest`, so that a build or a
`docker compose up` gets the bytes that were reviewed, and the tag still says what they are.

Run again (`make pin-images`) to move each tag's pin to what the registry serves for it now.
The digest is that of the manifest the registry answers for the tag, read with skopeo (no
container engine or daemon needed; Debian's `skopeo` package): for a multi-platform image
that is its index, so the pin holds on every platform. Nothing is written unless every
image resolved.

    python3 scripts/pin_images.py            # resolve and rewrite the files
    python3 scripts/pin_images.py --check    # list the references and whether each is pinned
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = ("Dockerfile", "examples/compose/legacy-api.Dockerfile")
COMPOSE_FILES = (
    "examples/compose/compose.yaml",
    "examples/compose/compose.scaled.yaml",
    "examples/compose/compose.replicated.yaml",
)
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
# `FROM [--platform=…] name:tag[@sha256:…] [AS stage]`, and Compose's `image: name:tag[@…]`.
# Images of our own (portcullis, the example API, ${PORTCULLIS_IMAGE:-…}) have no registry
# tag to pin and are left alone: they carry no `:tag` or are interpolated.
_REF = r"(?P<ref>[a-z0-9][\w./-]*:[\w.-]+)(?:@(?P<digest>sha256:[0-9a-f]{64}))?"
_FROM = re.compile(
    r"^(?P<head>FROM\s+(?:--\S+\s+)*)" + _REF + r"(?P<tail>(?:\s|$).*)$",
    re.IGNORECASE | re.MULTILINE,
)
_IMAGE = re.compile(r"^(?P<head>\s*image:\s*)" + _REF + r"(?P<tail>\s*(?:#.*)?)$", re.MULTILINE)

Resolve = Callable[[str], str]


def _pattern(path: str) -> re.Pattern[str]:
    return _FROM if path.endswith("Dockerfile") else _IMAGE


def references(text: str, pattern: re.Pattern[str]) -> list[tuple[str, str | None]]:
    """(name:tag, its digest or None) of each image the text names."""
    return [(match.group("ref"), match.group("digest")) for match in pattern.finditer(text)]


def pin(text: str, pattern: re.Pattern[str], digests: Mapping[str, str]) -> str:
    """The text with each image reference pinned to `digests[name:tag]`."""

    def replace(match: re.Match[str]) -> str:
        digest = digests[match.group("ref")]
        if not DIGEST.fullmatch(digest):
            raise ValueError(f"{match.group('ref')}: {digest!r} is not a sha256 digest")
        return f"{match.group('head')}{match.group('ref')}@{digest}{match.group('tail')}"

    return pattern.sub(replace, text)


def registry_reference(ref: str) -> str:
    """A Docker Hub short name in full, as skopeo wants it."""
    name = ref.split(":", 1)[0]
    first = name.split("/", 1)[0]
    if "." in first or ":" in first or first == "localhost":
        return ref  # another registry already named
    return f"docker.io/{ref}" if "/" in name else f"docker.io/library/{ref}"


def skopeo_resolver(skopeo: str) -> Resolve:
    """The digest of the manifest the registry serves for a reference, through the skopeo
    at `skopeo`: sha256 of the manifest's raw bytes, which is what `@sha256:` names."""

    def resolve(ref: str) -> str:
        # The reference comes from our own files and is matched by _REF above.
        raw = subprocess.run(  # noqa: S603
            [skopeo, "inspect", "--raw", f"docker://{registry_reference(ref)}"],
            capture_output=True,
            check=False,
            timeout=120,
        )
        if raw.returncode != 0:
            raise RuntimeError(f"{ref}: {raw.stderr.decode(errors='replace').strip()}")
        return "sha256:" + hashlib.sha256(raw.stdout).hexdigest()

    return resolve


def files(root: Path) -> Iterable[tuple[Path, re.Pattern[str]]]:
    for name in (*DOCKERFILES, *COMPOSE_FILES):
        yield root / name, _pattern(name)


def refresh(root: Path, resolve: Resolve) -> dict[str, str]:
    """Resolve every reference once, then rewrite the files; nothing is written when one
    does not resolve."""
    texts = {path: (path.read_text(), pattern) for path, pattern in files(root)}
    wanted = sorted({ref for text, p in texts.values() for ref, _ in references(text, p)})
    digests = {ref: resolve(ref) for ref in wanted}
    for path, (text, pattern) in texts.items():
        pinned = pin(text, pattern, digests)
        if pinned != text:
            path.write_text(pinned)
    return digests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="list the references, change none")
    args = parser.parse_args(argv)
    if args.check:
        unpinned = 0
        for path, pattern in files(ROOT):
            for ref, digest in references(path.read_text(), pattern):
                print(f"{path.relative_to(ROOT)}: {ref} {digest or 'NOT PINNED'}")
                unpinned += digest is None
        return 1 if unpinned else 0
    skopeo = shutil.which("skopeo")
    if skopeo is None:
        print("pin-images needs skopeo (apt-get install skopeo)", file=sys.stderr)
        return 1
    try:
        digests = refresh(ROOT, skopeo_resolver(skopeo))
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"nothing pinned: {exc}", file=sys.stderr)
        return 1
    for ref, digest in digests.items():
        print(f"{ref}@{digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
