"""The import rules of the design: which package may import which.

- portcullis (the shared kernel) imports neither gateway nor authserver, and its pure
  standards code (jose, dpop) the standard library, cryptography, PyJWT and orjson alone:
  no aiohttp, nothing with I/O;
- the standards code is the kernel's alone: no module of either service defines its own RFC
  7638 thumbprint, `ath` or `htu` comparison (by the names such code goes by, or by the
  members a thumbprint covers);
- gateway and authserver never import each other;
- the gateway's pure modules (rules, policy, bearer, principal) reach no aiohttp, even
  through other modules of the package, so they are tested without a server;
- the gateway is layered as docs/architecture.md draws it: app and the command line →
  settings, adapter and the commands that read a configuration whole → forward, extauthz →
  steps/ → verifiers/ → ops/, transport/ → core/. A module imports only from its own layer
  or those below, even for type checking; the page draws every module, each in its layer;
  `steps.pipeline → {core.rules, core.policy, steps.ratelimit}`, the request path knows
  nothing of forwarding (its last step is given to it), verifiers nothing of the path they
  serve, and nothing imports the composition root but the command line that runs it.
- the gateway's running code reads records (core/records.py), not the configuration file's
  shape: only the adapter that builds them, the composition root and the commands that read
  a configuration whole (`check`'s memory bound, `explain`) import the settings at all;
- no module of the gateway or the kernel reaches itself through its imports, not even
  through imports made only for type checking (settings.py reads rules.py, never back);
- the authserver is layered: app (the composition root) → settings → endpoints, the admin
  API, CORS, revocation events → grants → tokens, client authentication, sessions, DPoP
  proofs, resource tokens → key ring, store protocol, registry, metrics → declarations of
  clients and users, password hashing, clock, audit events → the access log's request state
  → protocol.
  A module imports only from its own layer or those below; `protocol/` imports the standard
  library alone; only app.py names a concrete store;
- the authserver's settings are read where it is composed (app.py, the command line):
  nothing below imports them, even for type checking; the admin API imports no endpoint
  module (the token check both use is resource_tokens.py); the store reaches neither the
  settings nor the grants nor the endpoints.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PURE_GATEWAY_MODULES = (
    "gateway.core.rules",
    "gateway.core.policy",
    "gateway.core.bearer",
    "gateway.core.principal",
    "gateway.core.dpop",
    "gateway.core.records",
)
# The kernel's pure standards code, which both services call on their request paths, and the
# libraries it may use beside the standard library: cryptographic primitives, PyJWT's JWK
# loaders, and the JSON parser both services read tokens with.
PURE_KERNEL_MODULES = ("portcullis.jose", "portcullis.dpop")
KERNEL_LIBRARIES = frozenset({"cryptography", "jwt", "orjson"})


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _runtime_imports(path: Path, *, typing: bool = False) -> set[str]:
    """Modules imported at run time (imports under `if TYPE_CHECKING:` count only with
    `typing`)."""
    tree = ast.parse(path.read_text(), str(path))
    package = (
        _module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module_name(path)
    )
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if (
                isinstance(child, ast.If)
                and "TYPE_CHECKING" in ast.unparse(child.test)
                and not typing
            ):
                for orelse in child.orelse:
                    visit(orelse)
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    prefix = ".".join(base + ([child.module] if child.module else []))
                else:
                    prefix = child.module or ""
                found.add(prefix)
                found.update(f"{prefix}.{alias.name}" for alias in child.names)
            visit(child)

    visit(tree)
    return found


def _graph(*, typing: bool = False) -> dict[str, set[str]]:
    graph = {}
    for package in ("portcullis", "gateway", "authserver"):
        for path in (ROOT / package).rglob("*.py"):
            graph[_module_name(path)] = _runtime_imports(path, typing=typing)
    return graph


GRAPH = _graph()
TYPED_GRAPH = _graph(typing=True)


def _closure(module: str) -> set[str]:
    seen: set[str] = set()
    todo = [module]
    while todo:
        current = todo.pop()
        for imported in GRAPH.get(current, ()):
            if imported not in seen:
                seen.add(imported)
                todo.append(imported)
    return seen


def _top(names: set[str]) -> set[str]:
    return {name.split(".")[0] for name in names}


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("portcullis")))
def test_shared_kernel_imports_neither_service(module):
    assert not _top(GRAPH[module]) & {"gateway", "authserver"}


@pytest.mark.parametrize("module", PURE_KERNEL_MODULES)
def test_pure_kernel_modules_reach_the_standard_library_and_the_jose_libraries_only(module):
    assert module in GRAPH
    outside = {
        name
        for name in _closure(module)
        if name.split(".")[0] not in sys.stdlib_module_names | KERNEL_LIBRARIES
        and not any(_under(name, pure) for pure in PURE_KERNEL_MODULES)
    }
    assert not outside, f"{module} reaches {sorted(outside)}"
    assert "aiohttp" not in _top(_closure(module))


def test_the_kernel_scan_sees_what_the_standards_code_imports():
    # portcullis.dpop reaches portcullis.jose, and both a library: the rule above is not
    # vacuous, and a pure module of the kernel may import another.
    assert "portcullis.jose" in _closure("portcullis.dpop")
    assert {"jwt", "cryptography", "orjson"} <= _top(_closure("portcullis.dpop"))


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("gateway")))
def test_gateway_never_imports_authserver(module):
    assert "authserver" not in _top(GRAPH[module])


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("authserver")))
def test_authserver_never_imports_gateway(module):
    assert "gateway" not in _top(GRAPH[module])


@pytest.mark.parametrize("module", PURE_GATEWAY_MODULES)
def test_pure_gateway_modules_reach_no_aiohttp(module):
    assert module in GRAPH
    assert "aiohttp" not in _top(_closure(module))


def test_the_import_scan_sees_imports_through_other_modules():
    # gateway.app imports aiohttp itself and through forward: the scan must see both ways,
    # or the purity checks above could pass vacuously.
    assert "aiohttp" in _top(GRAPH["gateway.forward"])
    assert "gateway.forward" in _closure("gateway.app")
    assert "aiohttp" in _top(_closure("gateway.explain"))


def _gateway_modules(under: str) -> list[str]:
    return sorted(m for m in GRAPH if m == under or m.startswith(under + "."))


def _gateway_imports(module: str) -> set[str]:
    """The gateway modules `module` imports directly (names of objects mapped to modules)."""
    return {name for name in GRAPH[module] if name in GRAPH and name.startswith("gateway.")}


@pytest.mark.parametrize(
    "module", sorted(m for m in GRAPH if m.startswith("gateway") and m != "gateway.__main__")
)
def test_nothing_in_the_gateway_imports_its_composition_root(module):
    assert "gateway.app" not in _gateway_imports(module)


# What the request path, the verifiers and the step modules must never reach, even
# through other modules.
_FORBIDDEN = {
    "gateway.steps.pipeline": {"gateway.app", "gateway.forward", "gateway.extauthz"},
    "gateway.extauthz": {"gateway.app"},
    "gateway.verifiers": {
        "gateway.app",
        "gateway.steps.pipeline",
        "gateway.forward",
        "gateway.steps.ratelimit",
        "gateway.core.policy",
    },
    "gateway.steps.ratelimit": {"gateway.app", "gateway.steps.pipeline", "gateway.verifiers"},
    "gateway.core.policy": {"gateway.app", "gateway.steps.pipeline", "gateway.verifiers"},
    "gateway.forward": {"gateway.app", "gateway.steps.pipeline", "gateway.verifiers"},
    "gateway.core.dpop": {
        "gateway.app",
        "gateway.steps.pipeline",
        "gateway.verifiers",
        "gateway.settings",
    },
}


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        (module, forbidden)
        for package, forbidden in sorted(_FORBIDDEN.items())
        for module in _gateway_modules(package)
    ],
)
def test_gateway_layers_import_only_downwards(module, forbidden):
    reached = {name for name in _closure(module) if name in GRAPH}
    assert not reached & forbidden


def test_the_composition_root_builds_the_pipeline_and_the_forwarder():
    assert {"gateway.steps.pipeline", "gateway.forward"} <= _gateway_imports("gateway.app")
    assert "gateway.verifiers.dispatch" in _closure("gateway.steps.pipeline") | _gateway_imports(
        "gateway.app"
    )
    assert {
        "gateway.core.rules",
        "gateway.core.policy",
        "gateway.steps.ratelimit",
    } <= _gateway_imports("gateway.steps.pipeline")


# The gateway's layers, top to bottom, as docs/architecture.md draws them; a module belongs to
# the first entry it falls under and imports (even for type checking) only from its own layer
# or those below.
GATEWAY_LAYERS: tuple[tuple[str, ...], ...] = (
    ("gateway.__main__", "gateway.app"),
    ("gateway.adapter", "gateway.settings", "gateway.explain", "gateway.memory"),
    ("gateway.extauthz", "gateway.forward"),
    ("gateway.steps",),
    ("gateway.verifiers",),
    ("gateway.ops", "gateway.transport"),
    ("gateway.core",),
)
GATEWAY_MODULES = sorted(m for m in GRAPH if m.startswith("gateway."))


def _layer_of(module: str, layers: tuple[tuple[str, ...], ...]) -> int | None:
    for index, members in enumerate(layers):
        if any(_under(module, member) for member in members):
            return index
    return None


def _upward(
    module: str, layers: tuple[tuple[str, ...], ...], graph: dict[str, set[str]]
) -> set[str]:
    """The modules of its own service `module` imports (in `graph`) from a layer above."""
    layer = _layer_of(module, layers)
    assert layer is not None, f"{module} has no layer"
    own = module.split(".")[0] + "."
    imported = {n for n in graph[module] if n in GRAPH and n.startswith(own) and n != module}
    return {name for name in imported if (_layer_of(name, layers) or 0) < layer}


def _gateway_layer(module: str) -> int | None:
    return _layer_of(module, GATEWAY_LAYERS)


@pytest.mark.parametrize("module", GATEWAY_MODULES)
def test_every_gateway_module_has_a_layer(module):
    assert _gateway_layer(module) is not None


@pytest.mark.parametrize("module", GATEWAY_MODULES)
def test_gateway_modules_import_only_their_own_layer_or_those_below(module):
    upward = _upward(module, GATEWAY_LAYERS, TYPED_GRAPH)
    assert not upward, f"{module} imports from a layer above it: {sorted(upward)}"


def test_the_gateway_layer_scan_sees_imports_across_layers():
    # The request path reaches down through every layer below it: the rule is not vacuous.
    reached = _closure("gateway.steps.pipeline")
    assert {"gateway.verifiers.cache", "gateway.ops.metrics", "gateway.transport.clientcert"} <= (
        reached
    )
    assert "gateway.core.records" in reached
    assert _gateway_layer("gateway.steps.pipeline") < _gateway_layer("gateway.core.records")


ARCHITECTURE_PAGE = ROOT / "docs" / "architecture.md"


def _drawn_layout() -> dict[str, int]:
    """The modules the architecture page's layout block draws, each with its layer."""
    block = ARCHITECTURE_PAGE.read_text().split("<!-- layout -->")[1]
    drawn: dict[str, int] = {}
    layer, package = -1, ""
    for line in block.splitlines():
        if row := re.match(r"^(\d+)\s+(gateway/\S*)\s+(.*)$", line):
            layer, package, rest = int(row[1]), row[2].rstrip("/").replace("/", "."), row[3]
        elif more := re.match(r"^\s+(\S+\.py\b.*)$", line):
            rest = more[1]
        else:
            continue
        for word in rest.split():
            if not word.endswith(".py"):
                break
            drawn[f"{package}.{word[:-3]}"] = layer
    return drawn


def _gateway_files() -> set[str]:
    return {
        _module_name(path)
        for path in (ROOT / "gateway").rglob("*.py")
        if path.name != "__init__.py"
    }


def test_the_architecture_page_draws_every_gateway_module_and_nothing_else():
    drawn, actual = set(_drawn_layout()), _gateway_files()
    assert drawn == actual, (
        f"missing from the page: {sorted(actual - drawn)}; "
        f"on the page but not in the tree: {sorted(drawn - actual)}"
    )


def test_the_architecture_page_draws_each_module_in_its_layer():
    drawn = _drawn_layout()
    assert sorted(set(drawn.values())) == list(range(len(GATEWAY_LAYERS)))
    misplaced = {m: n for m, n in drawn.items() if _gateway_layer(m) != n}
    assert not misplaced, f"drawn in another layer than the test's: {misplaced}"


def _cycle_through(module: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A chain of imports from `module` back to itself, if there is one."""
    paths = {module: [module]}
    todo = [module]
    while todo:
        current = todo.pop()
        for imported in sorted(graph.get(current, ()) & graph.keys()):
            if imported == module:
                return [*paths[current], module]
            if imported not in paths:
                paths[imported] = [*paths[current], imported]
                todo.append(imported)
    return None


@pytest.mark.parametrize(
    "module", sorted(m for m in TYPED_GRAPH if m.startswith(("gateway", "portcullis")))
)
def test_no_module_imports_itself_through_others_even_for_type_checking(module):
    own = {m: {i for i in TYPED_GRAPH[m] if i != m} for m in TYPED_GRAPH}
    assert _cycle_through(module, own) is None


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert _cycle_through("a", graph) == ["a", "b", "c", "a"]
    assert _cycle_through("d", graph) is None


# The authserver's layers, top to bottom; a module belongs to the first entry it falls under.
AUTHSERVER_LAYERS: tuple[tuple[str, ...], ...] = (
    ("authserver.__main__", "authserver.app"),
    ("authserver.settings",),
    (
        "authserver.endpoints",
        "authserver.admin",
        "authserver.cors",
        "authserver.events",
        "authserver.registration",
        "authserver.metadata_documents",
        "authserver.federation",
    ),
    ("authserver.grants",),
    (
        "authserver.tokens",
        "authserver.clients",
        "authserver.sessions",
        "authserver.factors",
        "authserver.passkeys",
        "authserver.dpop",
        "authserver.resource_tokens",
    ),
    (
        "authserver.keys",
        "authserver.federation_keys",
        "authserver.stored_keys",
        "authserver.store",
        "authserver.registry",
        "authserver.metrics",
    ),
    ("authserver.declarations", "authserver.users", "authserver.clock", "authserver.audit"),
    ("authserver.accesslog",),
    ("authserver.protocol",),
)
AUTHSERVER_MODULES = sorted(m for m in GRAPH if m.startswith("authserver."))


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _layer(module: str) -> int | None:
    return _layer_of(module, AUTHSERVER_LAYERS)


@pytest.mark.parametrize("module", AUTHSERVER_MODULES)
def test_every_authserver_module_has_a_layer(module):
    assert _layer(module) is not None


@pytest.mark.parametrize("module", AUTHSERVER_MODULES)
def test_authserver_modules_import_only_their_own_layer_or_those_below(module):
    upward = _upward(module, AUTHSERVER_LAYERS, GRAPH)
    assert not upward, f"{module} imports from a layer above it: {sorted(upward)}"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if _under(m, "authserver.protocol")))
def test_authserver_protocol_imports_the_standard_library_only(module):
    outside = {
        name
        for name in GRAPH[module]
        if not _under(name, "authserver.protocol")
        and name.split(".")[0] not in sys.stdlib_module_names
    }
    assert not outside, f"{module} imports {sorted(outside)}"


@pytest.mark.parametrize("module", AUTHSERVER_MODULES)
def test_only_the_composition_root_names_a_concrete_store(module):
    if module == "authserver.app" or _under(module, "authserver.store"):
        return
    concrete = {
        name
        for name in GRAPH[module]
        if name in ("authserver.store", "authserver.store.open_store")
        or (_under(name, "authserver.store") and not _under(name, "authserver.store.base"))
    }
    assert not concrete, f"{module} names a concrete store: {sorted(concrete)}"


def test_nothing_but_the_command_line_imports_the_composition_root():
    importers = {m for m in GRAPH if "authserver.app" in GRAPH[m]}
    assert importers == {"authserver.__main__"}


# Where the authserver's configuration file is read as such: the settings themselves, the
# composition root and the command line. Everything below them is given values and records
# of its own (store.base.PoolLimits, grants.issuance.RefreshLifetimes, ...).
_READING_AUTHSERVER_SETTINGS = {"authserver.settings", "authserver.app", "authserver.__main__"}


@pytest.mark.parametrize(
    "module",
    sorted(
        m for m in TYPED_GRAPH if _under(m, "authserver") and m not in _READING_AUTHSERVER_SETTINGS
    ),
)
def test_below_the_authservers_composition_root_nothing_imports_the_settings(module):
    named = {name for name in TYPED_GRAPH[module] if _under(name, "authserver.settings")}
    assert not named, f"{module} imports {sorted(named)}: give it values or a record of its own"


def _reached_in(module: str, packages: tuple[str, ...]) -> set[str]:
    return {name for name in _closure(module) if any(_under(name, p) for p in packages)}


@pytest.mark.parametrize("module", sorted(m for m in TYPED_GRAPH if _under(m, "authserver.admin")))
def test_the_admin_api_imports_no_endpoint_module(module):
    # What both need (the resource-token check, the revocations) lives outside endpoints/.
    named = {name for name in TYPED_GRAPH[module] if _under(name, "authserver.endpoints")}
    assert not named, f"{module} imports {sorted(named)}"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if _under(m, "authserver.store")))
def test_the_store_reaches_neither_the_settings_nor_the_grants_nor_the_endpoints(module):
    reached = _reached_in(
        module, ("authserver.settings", "authserver.grants", "authserver.endpoints")
    )
    assert not reached, f"{module} reaches {sorted(reached)}"


def test_the_settings_and_token_check_scans_see_what_they_check():
    # The composition root and the command line do read the settings, the admin API and
    # userinfo share the resource-token check, and the store reaches its records and the
    # lifecycle tables: the three rules above are not vacuous.
    assert "authserver.settings" in TYPED_GRAPH["authserver.app"]
    assert "authserver.settings" in TYPED_GRAPH["authserver.__main__"]
    assert "authserver.resource_tokens" in _closure("authserver.admin.access")
    assert "authserver.resource_tokens" in _closure("authserver.endpoints.userinfo")
    assert {"authserver.store.base", "authserver.protocol.lifecycle"} <= _closure(
        "authserver.store.sqlite"
    )


def test_the_authserver_scan_sees_the_layers_it_checks():
    # The token endpoint reaches the grants, the store protocol and the lifecycle tables;
    # the store package names its SQLite backend: the rules above are not vacuous.
    reached = _closure("authserver.endpoints.token")
    assert {"authserver.grants.base", "authserver.store.base"} <= reached
    assert "authserver.protocol.lifecycle" in reached
    assert "authserver.store.sqlite" in GRAPH["authserver.store"]
    assert "authserver.store" in GRAPH["authserver.app"]


# The settings sections the records replace, and the modules that may still name them.
_SETTINGS_WITH_RECORDS = {
    f"gateway.settings.{name}"
    for name in ("IssuerSettings", "IntrospectionSettings", "RouteSettings", "ScopeRule")
}
_NAMING_SETTINGS_WITH_RECORDS = {"gateway.settings", "gateway.adapter", "gateway.app"}


@pytest.mark.parametrize(
    "module",
    sorted(
        m for m in TYPED_GRAPH if _under(m, "gateway") and m not in _NAMING_SETTINGS_WITH_RECORDS
    ),
)
def test_only_the_adapter_and_the_composition_root_name_issuer_and_route_settings(module):
    named = TYPED_GRAPH[module] & _SETTINGS_WITH_RECORDS
    assert not named, f"{module} imports {sorted(named)}: take gateway.core.records instead"


@pytest.mark.parametrize("module", PURE_GATEWAY_MODULES)
def test_records_and_pure_modules_import_no_settings_at_run_time(module):
    reached = {name for name in _closure(module) if _under(name, "gateway.settings")}
    assert not reached


# The modules that read the configuration file's shape: the settings themselves, the adapter
# that turns them into records, the composition root, and the commands that read a
# configuration whole (the CLI, `check`'s memory bound, `explain`).
_READING_SETTINGS = {
    "gateway.settings",
    "gateway.adapter",
    "gateway.app",
    "gateway.__main__",
    "gateway.memory",
    "gateway.explain",
}


@pytest.mark.parametrize(
    "module", sorted(m for m in TYPED_GRAPH if _under(m, "gateway") and m not in _READING_SETTINGS)
)
def test_below_the_composition_root_nothing_imports_the_settings(module):
    named = {name for name in TYPED_GRAPH[module] if _under(name, "gateway.settings")}
    assert not named, f"{module} imports {sorted(named)}: give it a record (gateway.core.records)"


def test_the_settings_scan_sees_the_adapter_name_them():
    assert TYPED_GRAPH["gateway.adapter"] >= _SETTINGS_WITH_RECORDS
    assert "gateway.core.records" in GRAPH["gateway.adapter"]
    assert "gateway.adapter" in _gateway_imports("gateway.app")


# ---------------------------------------------------------------------------- one standard

# What code implementing RFC 7638 thumbprints, RFC 9449 `ath` or the comparison of `htu`
# (RFC 9449 §4.3 item 9, RFC 3986 §6) is called, as a function, class or constant.
_STANDARDS_NAMES = re.compile(
    r"thumbprint|(^|_)ath(_|$)|access_token_hash|htu|dot_segments|"
    r"normali[sz]ed?_ur[il]|percent_normali[sz]|same_resource",
    re.IGNORECASE,
)
# RFC 7638 §3.2: the members a thumbprint covers, per key type; only a thumbprint lists them.
_THUMBPRINT_MEMBERS = (
    frozenset({"crv", "kty", "x", "y"}),
    frozenset({"e", "kty", "n"}),
    frozenset({"crv", "kty", "x"}),
)


def _standards_code(source: str) -> set[str]:
    """What in `source` implements the kernel's standards: definitions named like them, and
    the member lists of a thumbprint."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names = [node.name]
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            members = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if len(members) == len(node.elts) and frozenset(members) in _THUMBPRINT_MEMBERS:
                found.add(f"line {node.lineno}: the members of an RFC 7638 thumbprint")
            continue
        else:
            continue
        found.update(
            f"line {node.lineno}: {name}" for name in names if _STANDARDS_NAMES.search(name)
        )
    return found


SERVICE_FILES = sorted(
    path for package in ("gateway", "authserver") for path in (ROOT / package).rglob("*.py")
)


@pytest.mark.parametrize("path", SERVICE_FILES, ids=lambda path: _module_name(path))
def test_neither_service_implements_thumbprints_ath_or_htu_comparison_itself(path):
    found = _standards_code(path.read_text())
    assert not found, (
        f"{_module_name(path)}: {sorted(found)}: use portcullis.jose / portcullis.dpop"
    )


def test_the_standards_scan_finds_the_kernels_own_code():
    # The scan is not vacuous: it finds what the kernel defines, and a copy of it.
    kernel = _standards_code((ROOT / "portcullis" / "jose.py").read_text())
    kernel |= _standards_code((ROOT / "portcullis" / "dpop.py").read_text())
    named = {entry.split(": ", 1)[1] for entry in kernel}
    assert {"thumbprint", "access_token_hash", "same_resource", "remove_dot_segments"} <= named
    assert "the members of an RFC 7638 thumbprint" in named
    copy = """
def jwk_thumbprint(jwk):
    members = {"kty": jwk["kty"], "n": jwk["n"], "e": jwk["e"]}
    return hashlib.sha256(json.dumps(members, sort_keys=True).encode())

class Checker:
    def _normalized_url(self, url): ...
    async def ath_of(self, token): ...

REQUIRED = ("crv", "kty", "x")
"""
    assert {entry.split(": ", 1)[1] for entry in _standards_code(copy)} == {
        "jwk_thumbprint",
        "_normalized_url",
        "ath_of",
        "the members of an RFC 7638 thumbprint",
    }
