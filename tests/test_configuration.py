"""The configuration files as users meet them, held to the settings declarations.

- config/schema/*.schema.json (what editors validate with) are the schemas the declarations
  give now: a declaration changed without `make schema` fails here;
- every configuration file in the repository names its schema on its first line, and the
  schema and the loader both accept it (the Kubernetes ConfigMaps' embedded files too, and
  the whole files the docs pages show); every other YAML file there is well-formed;
- the guides' annotated configuration (the YAML blocks of docs/gateway.md and
  docs/authserver.md, with TLS and MCP) shows every key the declarations know, and no key
  they do not: a key added without its documentation fails here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from authserver import settings as authserver_settings
from gateway import settings as gateway_settings
from portcullis import sections
from portcullis.yamlconf import ConfigError
from tests.portcullis import schema_subset

ROOT = Path(__file__).resolve().parent.parent
PLACEHOLDER = re.compile(r"\$\{[A-Z_][A-Z0-9_]*\}")
SCHEMA_LINE = re.compile(r"^# yaml-language-server: \$schema=(\S+)$")
# What the example files leave to their environment, as a deployment would set it; secrets
# are not needed (the files are loaded as `explain` and `keys list` load them).
ENV = {
    "PORTCULLIS_ISSUER": "https://auth.example.com",
    "AUTHSERVER_URL": "http://authserver:9000",
    "MCP_PUBLIC_URL": "https://mcp.example.com",
    # Storage URLs are not secret settings: their variables are read by every command.
    "POSTGRES_PASSWORD": "example",
    "POSTGRES_URL": "postgresql://portcullis:example@postgres:5432/portcullis",
}


@dataclass(frozen=True)
class Deployable:
    name: str  # as in the file names: gateway.yaml, gateway.schema.json
    settings: type
    load_text: Callable[..., Any]
    # (page under docs/, `## ` heading) of each section whose YAML blocks annotate its keys
    guide_sections: tuple[tuple[str, str], ...]

    @property
    def schema_file(self) -> Path:
        return ROOT / "config" / "schema" / f"{self.name}.schema.json"

    def schema(self) -> dict[str, Any]:
        return dict(json.loads(self.schema_file.read_text(encoding="utf-8")))


GATEWAY = Deployable(
    "gateway",
    gateway_settings.Settings,
    gateway_settings.load_text,
    (
        ("gateway.md", "Configuration"),
        ("gateway.md", "Production features"),
        ("operations.md", "TLS"),
    ),
)
AUTHSERVER = Deployable(
    "authserver",
    authserver_settings.Settings,
    authserver_settings.load_text,
    (
        ("authserver.md", "Configuration"),
        ("authserver.md", "Signing in through a company's identity provider"),
        ("mcp.md", "MCP clients of the authorization server"),
        ("operations.md", "TLS"),
    ),
)
DEPLOYABLES = {d.name: d for d in (GATEWAY, AUTHSERVER)}


# ---------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("deployable", DEPLOYABLES.values(), ids=DEPLOYABLES)
def test_the_committed_schema_is_the_one_the_declarations_give(deployable: Deployable) -> None:
    committed = deployable.schema_file.read_text(encoding="utf-8")
    title = json.loads(committed)["title"]
    current = sections.schema_text(deployable.settings, title=title)
    assert committed == current, f"{deployable.schema_file} is stale: run `make schema`"
    schema_subset.check_schema(deployable.schema())


@pytest.mark.parametrize("deployable", DEPLOYABLES.values(), ids=DEPLOYABLES)
def test_every_key_is_declared_with_its_documentation(deployable: Deployable) -> None:
    assert sections.missing_docs(deployable.settings) == []


# ---------------------------------------------------------------------------- example files


@dataclass(frozen=True)
class ConfigFile:
    where: str  # a path, or a path and the ConfigMap key it is embedded under
    deployable: Deployable
    text: str
    path: Path | None  # the file itself, when it is one (not embedded)


# Where configuration files live: every YAML file under these folders is read, and every
# YAML block of the docs pages (docs/*.md) that is titled with a configuration file's name
# (```yaml title="gateway.yaml"), which says it is a whole file and not a fragment.
YAML_FOLDERS = ("config", "examples", "docs")
TITLED_BLOCK = re.compile(
    r'^```yaml title="((?:gateway|authserver)[\w.-]*\.yaml)"\n(.*?)^```', re.MULTILINE | re.DOTALL
)


def yaml_files() -> list[Path]:
    return sorted(
        path
        for folder in YAML_FOLDERS
        for pattern in ("*.yaml", "*.yml")
        for path in (ROOT / folder).rglob(pattern)
        if "node_modules" not in path.parts
    )


def _kind(path: Path, text: str) -> Deployable | None:
    """The deployable a file configures: the schema its first line names or, for a file
    that names none, its name (gateway.yaml, authserver.replicated.yaml), unless it is a
    Kubernetes manifest (the examples' authserver.yaml is one)."""
    named = SCHEMA_LINE.match(text.splitlines()[0]) if text else None
    if named:
        return next(d for d in DEPLOYABLES.values() if named.group(1).endswith(d.schema_file.name))
    kind = path.name.split(".")[0]
    if kind not in DEPLOYABLES:
        return None
    manifest = re.search(r"^apiVersion:", text, flags=re.MULTILINE)
    return None if manifest else DEPLOYABLES[kind]


def config_files() -> Iterator[ConfigFile]:
    """Every gateway and authserver configuration in the repository: the files themselves,
    those embedded in Kubernetes ConfigMaps, and the whole files the docs pages show."""
    for path in yaml_files():
        text = path.read_text(encoding="utf-8")
        where = str(path.relative_to(ROOT))
        deployable = _kind(path, text)
        if deployable is not None:
            yield ConfigFile(where, deployable, text, path)
            continue
        if "kind: ConfigMap" not in text:
            continue  # Compose, front proxies (templates, some of them: see below)
        for document in yaml.safe_load_all(text):
            if isinstance(document, dict) and document.get("kind") == "ConfigMap":
                for key, embedded in document.get("data", {}).items():
                    name = key.removesuffix(".yaml")
                    if name in DEPLOYABLES:
                        yield ConfigFile(f"{where}:{key}", DEPLOYABLES[name], embedded, None)
    for page in sorted((ROOT / "docs").rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        for found in TITLED_BLOCK.finditer(text):
            line = text.count("\n", 0, found.start()) + 2
            where = f"{page.relative_to(ROOT)}:{line}"
            name = found.group(1).split(".")[0]
            yield ConfigFile(where, DEPLOYABLES[name], found.group(2), None)


CONFIG_FILES = list(config_files())


def test_the_example_files_are_all_found() -> None:
    found = {(f.where.split(":")[0], f.deployable.name) for f in CONFIG_FILES}
    assert {
        ("config/gateway.yaml", "gateway"),
        ("config/authserver.yaml", "authserver"),
        ("examples/compose/gateway.yaml", "gateway"),
        ("examples/compose/authserver.yaml", "authserver"),
        ("examples/compose/authserver.replicated.yaml", "authserver"),
        ("examples/compose/gateway.mcp.yaml", "gateway"),
        ("examples/compose/authserver.mcp.yaml", "authserver"),
        ("examples/mcp/gateway.yaml", "gateway"),
        ("examples/mcp/authserver.yaml", "authserver"),
        ("examples/kubernetes/orders.yaml", "gateway"),
        ("examples/kubernetes/authserver.yaml", "authserver"),
        ("examples/kubernetes-replicated/authserver-replicated.yaml", "authserver"),
        ("examples/forward-auth/gateway.yaml", "gateway"),
        ("examples/forward-auth/kubernetes-gateway.yaml", "gateway"),
        ("docs/quick-start.md", "gateway"),
        ("docs/quick-start.md", "authserver"),
    } <= found


def test_every_yaml_file_is_well_formed_and_the_portcullis_ones_are_all_checked() -> None:
    """Every YAML under config/, examples/ and docs/ parses; those that are not Portcullis
    configuration (Compose, Kubernetes, front proxies) are the other tools' to check."""
    checked = {f.where.split(":")[0] for f in CONFIG_FILES}
    others = []
    for path in yaml_files():
        text = path.read_text(encoding="utf-8")
        # The front proxies' files are templates whose `${NAME}` placeholders the tests fill
        # in (tests/examples/forward_auth.py), numbers some of them: any value will do here.
        documents = list(yaml.safe_load_all(PLACEHOLDER.sub("0", text)))
        assert documents, path
        where = str(path.relative_to(ROOT))
        if where not in checked:
            others.append(where)
    # A new Portcullis file that the rules above miss would land here: name it, or give it
    # its schema line.
    assert all(
        name.startswith(("compose.", "envoy", "ingress-nginx", "istio", "traefik", "kustomization"))
        or name.endswith(
            ("authserver.yaml", "orders.yaml", "disruption-budget.yaml", "-ingress.yaml")
        )
        or name == "network-policy.yaml"
        for name in (Path(o).name for o in others)
    ), others


@pytest.mark.parametrize("file", [f for f in CONFIG_FILES if f.path], ids=lambda f: f.where)
def test_each_repository_file_names_its_schema_on_its_first_line(file: ConfigFile) -> None:
    assert file.path is not None
    first = file.text.splitlines()[0]
    named = SCHEMA_LINE.match(first)
    assert named, f"{file.where} starts with {first!r}, not the yaml-language-server line"
    assert (file.path.parent / named.group(1)).resolve() == file.deployable.schema_file


@pytest.mark.parametrize("file", CONFIG_FILES, ids=lambda f: f.where)
def test_the_schema_and_the_loader_both_accept_each_file(file: ConfigFile) -> None:
    assert schema_subset.errors(file.deployable.schema(), yaml.safe_load(file.text)) == []
    file.deployable.load_text(file.text, file.where, ENV, secrets=False)


@pytest.mark.parametrize("given", ["client_secret", "client_secret_file", None])
def test_a_secret_given_as_its_key_file_is_valid_to_schema_and_loader_alike(
    given: str | None, tmp_path: Path
) -> None:
    """`client_secret_file`, the recommended way, is as valid as `client_secret` for an
    issuer's introspection and revocation events; neither is refused by both."""
    secret = tmp_path / "secret"
    secret.write_text("s3cret-s3cret-s3cret-s3cret\n")
    original = next(f for f in CONFIG_FILES if f.where == "config/gateway.yaml")
    data = yaml.safe_load(original.text)
    issuer = data["issuers"][0]
    for section in ("introspection", "revocation_events"):
        issuer[section] = {"client_id": "gateway"}
        if given == "client_secret":
            issuer[section]["client_secret"] = "s3cret-s3cret-s3cret-s3cret"
        elif given == "client_secret_file":
            issuer[section]["client_secret_file"] = str(secret)
    issuer["mode"] = "auto"
    found = schema_subset.errors(GATEWAY.schema(), data)
    if given is None:
        assert any("matches none of anyOf" in p for p in found), found
        with pytest.raises(ConfigError):
            GATEWAY.load_text(yaml.safe_dump(data), "x.yaml", ENV)
    else:
        assert found == []
        GATEWAY.load_text(yaml.safe_dump(data), "x.yaml", ENV)


@pytest.mark.parametrize(
    ("deployable", "key", "value", "problem"),
    [
        (GATEWAY, "workers", 0, "/workers"),
        (GATEWAY, "colour", "red", "/colour: not allowed"),
        (GATEWAY, "upstream", {"url": 5}, "/upstream"),
        (AUTHSERVER, "log_level", "loud", "/log_level"),
        (AUTHSERVER, "keys", {"dir": "k", "algo": "ES256"}, "/keys"),
    ],
    ids=["workers", "unknown", "upstream", "log_level", "keys"],
)
def test_a_mistake_in_an_example_file_is_refused_by_both(
    deployable: Deployable, key: str, value: Any, problem: str
) -> None:
    """The agreement above is not vacuous: what the loader refuses, the schema flags."""
    original = next(f for f in CONFIG_FILES if f.where == f"config/{deployable.name}.yaml")
    data = yaml.safe_load(original.text) | {key: value}
    found = schema_subset.errors(deployable.schema(), data)
    assert any(p.startswith(problem) for p in found), found
    with pytest.raises(ConfigError):
        deployable.load_text(yaml.safe_dump(data), "x.yaml", ENV, secrets=False)


# ---------------------------------------------------------------------------- the guides


def guide_keys(deployable: Deployable) -> set[str]:
    """Key paths (`routes[].cors.allow_origins`) of the YAML blocks in the guides' sections
    that annotate the configuration of `deployable`."""
    chosen = []
    for page, heading in deployable.guide_sections:
        text = (ROOT / "docs" / page).read_text(encoding="utf-8")
        parts = re.split(r"^## ", text, flags=re.MULTILINE)
        chosen += [p for p in parts if p.splitlines()[0].strip() == heading]
    assert len(chosen) == len(deployable.guide_sections), "a guide's section was renamed"
    paths: set[str] = set()
    for part in chosen:
        for block in re.findall(r"^```yaml\n(.*?)^```", part, flags=re.MULTILINE | re.DOTALL):
            _walk(yaml.safe_load(block), "", paths)
    return paths


def _walk(value: Any, path: str, paths: set[str]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            child = f"{path}.{key}" if path else str(key)
            paths.add(child)
            _walk(item, child, paths)
    elif isinstance(value, list):
        for item in value:
            _walk(item, f"{path}[]", paths)


def _is_section(path: str, declared: set[str]) -> bool:
    return any(p.startswith((f"{path}.", f"{path}[].")) for p in declared)


def _inside_a_value(path: str, declared: set[str]) -> bool:
    """Whether `path` lies inside a value with free keys (identity_headers.claims, a client's
    jwks): its nearest declared ancestor is not a section."""
    parent = path
    while "." in parent:
        parent = parent.rpartition(".")[0].removesuffix("[]")
        if parent in declared:
            return not _is_section(parent, declared)
    return False


@pytest.mark.parametrize("deployable", DEPLOYABLES.values(), ids=DEPLOYABLES)
def test_the_guides_show_only_keys_that_exist(deployable: Deployable) -> None:
    declared = {path for path, _, _ in sections.keys(deployable.settings)}
    unknown = sorted(
        path
        for path in guide_keys(deployable)
        if path not in declared and not _inside_a_value(path, declared)
    )
    assert unknown == [], f"the guides show keys the {deployable.name} does not know"


@pytest.mark.parametrize("deployable", DEPLOYABLES.values(), ids=DEPLOYABLES)
def test_the_guides_show_every_key_of_every_section(deployable: Deployable) -> None:
    """Each key of each section is shown at least once, wherever that section is used (the
    `cors` keys under `cors:` serve a route's `cors:` too). `KEY_file` variants are
    documented once for all, beside the `${file:...}` interpolation."""
    declared = {path: (cls, key) for path, cls, key in sections.keys(deployable.settings)}
    shown = {declared[path] for path in guide_keys(deployable) if path in declared}
    missing = {
        f"{cls.__name__}.{key} (as {path})"
        for path, (cls, key) in declared.items()
        if (cls, key) not in shown and not key.endswith("_file")
    }
    assert sorted(missing) == [], f"the guides lack these {deployable.name} keys"
