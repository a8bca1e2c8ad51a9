"""Reading a Dockerfile, its .dockerignore and the pinned constraints, as a container engine
and pip would, for tests that run on machines without an engine.

`parse` gives the stages and their instructions (continuation lines joined, comments
dropped); `Ignore` applies .dockerignore rules the way the builder does (the last matching
pattern wins, `!` re-includes, a pattern that matches a directory matches everything under
it); `pins` reads constraints.txt with its environment markers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
CONSTRAINTS = ROOT / "constraints.txt"


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    args: str
    line: int

    def exec_form(self) -> list[str]:
        """The JSON array of an exec-form CMD/ENTRYPOINT (after any options)."""
        text = self.args[self.args.index("[") :]
        value = json.loads(text)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), self
        return value


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def one(self, keyword: str) -> Instruction:
        found = self.all(keyword)
        assert len(found) == 1, f"expected one {keyword} in stage {self.name}, found {found}"
        return found[0]

    def env(self) -> dict[str, str]:
        """ENV key=value pairs (the form this project uses), values unquoted."""
        values: dict[str, str] = {}
        for instruction in self.all("ENV"):
            for key, value in re.findall(r'(\w+)=("[^"]*"|\S+)', instruction.args):
                values[key] = value.strip('"')
        return values


def instructions(path: Path) -> list[Instruction]:
    found: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        # Comments (and parser directives) are dropped, also inside a continued instruction.
        if not stripped or stripped.startswith("#"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        keyword, _, args = " ".join(pending).partition(" ")
        found.append(Instruction(keyword.upper(), args.strip(), start))
        pending = []
    assert not pending, f"{path}: the last instruction ends in a continuation"
    return found


def parse(path: Path = DOCKERFILE) -> list[Stage]:
    stages: list[Stage] = []
    for instruction in instructions(path):
        if instruction.keyword == "FROM":
            words = instruction.args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        else:
            assert stages, f"{path}:{instruction.line}: an instruction before FROM"
            stages[-1].instructions.append(instruction)
    return stages


# ---------------------------------------------------------------------------- .dockerignore


def _pattern(text: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regular expression: `**` any number of directories,
    `*` and `?` within one path segment."""
    out = ""
    i = 0
    while i < len(text):
        if text.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif text.startswith("**", i):
            out += ".*"
            i += 2
        elif text[i] == "*":
            out += "[^/]*"
            i += 1
        elif text[i] == "?":
            out += "[^/]"
            i += 1
        elif text[i] == "[":
            end = text.index("]", i)
            out += text[i : end + 1]
            i = end + 1
        else:
            out += re.escape(text[i])
            i += 1
    return re.compile(out)


@dataclass(frozen=True)
class Ignore:
    rules: tuple[tuple[bool, re.Pattern[str]], ...]  # (exclude?, pattern)

    @classmethod
    def read(cls, path: Path = DOCKERIGNORE) -> Ignore:
        rules = []
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            exclude = not line.startswith("!")
            pattern = line.lstrip("!").strip().strip("/")
            rules.append((exclude, _pattern(pattern)))
        return cls(tuple(rules))

    def excludes(self, path: str) -> bool:
        """Whether `path` (relative, with /) stays out of the build context."""
        parts = path.strip("/").split("/")
        prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        excluded = False
        for exclude, pattern in self.rules:
            if any(pattern.fullmatch(prefix) for prefix in prefixes):
                excluded = exclude
        return excluded


# ---------------------------------------------------------------------------- constraints


def pins(path: Path = CONSTRAINTS) -> dict[str, Requirement]:
    """Every requirement of the file by canonical name; each must pin one version."""
    found: dict[str, Requirement] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        (specifier,) = requirement.specifier
        assert specifier.operator == "==", f"{line}: not pinned with =="
        found[canonicalize_name(requirement.name)] = requirement
    return found


def pinned_version(requirement: Requirement) -> str:
    (specifier,) = requirement.specifier
    return specifier.version


def with_data_volume(text: str, tmp_path: Path) -> str:
    """A config with /var/lib/portcullis, the image's data volume, at a directory that exists."""
    data = tmp_path / "var-lib-portcullis"
    data.mkdir(exist_ok=True)
    return text.replace("/var/lib/portcullis", str(data))
