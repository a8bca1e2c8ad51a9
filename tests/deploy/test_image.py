"""The image's final stage, reproduced without a container engine, and run.

The builder stage's steps build the wheels (the pinned dependencies from constraints.txt,
then Portcullis from the files the Dockerfile copies, filtered by .dockerignore); the final
stage's step installs them into a fresh virtual environment without pip, from those wheels
only. Then both programs start as the image starts them: as its numeric user, with the
image's environment, the Compose example's commands, environment and config files, from a
directory standing in for /etc/portcullis and one for the /var/lib/portcullis volume (ports
moved so that nothing here binds the machine's public addresses or a fixed port). The
Dockerfile's own HEALTHCHECK command is run against both, a token is issued and used through
the gateway, and the stop signal drains them.

The replicated example's authorization server (compose.replicated.yaml over compose.yaml)
starts the same way on PostgreSQL: a private cluster of the test's own (initdb/pg_ctl on a
free port, tests/faults_support.py) with the role, password and database the example's
postgres service is given, so that the image is shown to carry the driver its examples use.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from base64 import b64encode
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import jwt
import pytest
from packaging.utils import canonicalize_name

from tests.deploy import compose
from tests.deploy.dockerfile import ROOT, Ignore, parse, pinned_version, pins
from tests.faults_support import PrivatePostgres
from tests.support import reserve_port

pytestmark = pytest.mark.slow

MACHINE_SECRET = "image-smoke-test-machine-secret-0123456789"
# The compose example's addresses inside its containers, moved to free loopback ports here.
GATEWAY_PORT, ADMIN_PORT, API_PORT, AUTH_PORT = "8080", "9901", "8081", "9000"
AUTH_ADMIN_PORT = "9902"  # the authorization server's admin listener, by default
# The one place the version is set; the installed distribution must say the same.
PYPROJECT_VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
POSTGRES_HOST, POSTGRES_PORT = "postgres", "5432"  # the replicated example's database service
NETWORK_ERRORS = (
    "Failed to establish a new connection",
    "Network is unreachable",
    "Temporary failure in name resolution",
    "Could not fetch URL",
    "ConnectTimeoutError",
)


def tool_missing(reason: str) -> None:
    """Skip with the reason, except on CI where the image smoke test must run."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: the image smoke test must run)")
    pytest.skip(reason)


# ---------------------------------------------------------------------------- the build


@dataclass(frozen=True)
class Image:
    """The final stage's file system, as far as Portcullis is concerned."""

    root: Path  # stands for /
    uid: int | None  # the image's user when this machine can switch to it, else None
    env: dict[str, str]  # the image's ENV, paths moved under root

    @property
    def venv(self) -> Path:
        return self.root / "opt" / "portcullis"

    @property
    def etc(self) -> Path:
        return self.root / "etc" / "portcullis"

    @property
    def state(self) -> Path:
        return self.root / "var" / "lib" / "portcullis"

    def path(self, container_path: str) -> str:
        """A path of the image, under root here."""
        for prefix in ("/etc/portcullis", "/var/lib/portcullis", "/opt/portcullis"):
            if container_path.startswith(prefix):
                return str(self.root) + container_path
        return container_path


def build_env() -> dict[str, str]:
    """pip as in a clean build: this machine's pip configuration (extra indexes, local
    wheel directories, constraints) left out."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_REQUIREMENT")
    }
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def run_step(command: list[str], cwd: Path, what: str) -> None:
    result = subprocess.run(
        command, cwd=cwd, env=build_env(), capture_output=True, text=True, timeout=600
    )
    if result.returncode == 0:
        return
    output = result.stdout + result.stderr
    if any(marker in output for marker in NETWORK_ERRORS):
        tool_missing(f"{what}: the package index is unreachable\n{output[-2000:]}")
    pytest.fail(f"{what} failed:\n{output[-4000:]}")


def copy_context(destination: Path) -> None:
    """The builder's COPY sources, as the build context has them (.dockerignore applied)."""
    ignore = Ignore.read()
    for instruction in parse()[0].all("COPY"):
        for source in instruction.args.split()[:-1]:
            source = source.removeprefix("./")
            origin = ROOT / source
            files = [origin] if origin.is_file() else sorted(origin.rglob("*"))
            for path in files:
                relative = path.relative_to(ROOT).as_posix()
                if path.is_file() and not ignore.excludes(relative):
                    (destination / relative).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, destination / relative)


def image_user() -> tuple[int, int]:
    uid, gid = parse()[-1].one("USER").args.split(":")
    return int(uid), int(gid)


def installed_requirement() -> str:
    """What the final stage's pip installs: Portcullis with the extras the image carries."""
    (install,) = parse()[-1].all("RUN")
    (requirement,) = re.findall(r"--constraint \S+ '(portcullis\[[a-z,]+\])'", install.args)
    return requirement


def can_switch_user() -> bool:
    return os.geteuid() == 0 and shutil.which("setpriv") is not None


@pytest.fixture(scope="module")
def image() -> Iterator[Image]:
    root = Path(tempfile.mkdtemp(prefix="portcullis-image-"))
    root.chmod(0o755)  # the image's user walks through it
    try:
        yield build(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def build(root: Path) -> Image:
    pip = [sys.executable, "-m", "pip"]
    context, wheels = root / "src", root / "wheels"
    context.mkdir()
    copy_context(context)
    # The builder stage.
    run_step(
        [
            *pip,
            *("wheel", "--quiet", "--no-deps", "--wheel-dir", str(wheels)),
            *("--requirement", "constraints.txt"),
        ],
        context,
        "building the pinned dependencies' wheels",
    )
    run_step(
        [*pip, "wheel", "--quiet", "--no-deps", "--wheel-dir", str(wheels), "."],
        context,
        "building Portcullis's wheel",
    )
    shutil.copy(context / "constraints.txt", wheels)
    # The final stage.
    venv = root / "opt" / "portcullis"
    run_step([sys.executable, "-m", "venv", "--without-pip", str(venv)], root, "creating the venv")
    run_step(
        [
            *pip,
            *("--python", str(venv / "bin" / "python"), "install", "--quiet", "--no-index"),
            *("--find-links", str(wheels), "--constraint", str(wheels / "constraints.txt")),
            installed_requirement(),
        ],
        root,
        "installing from the wheels only",
    )
    etc, state = root / "etc" / "portcullis", root / "var" / "lib" / "portcullis"
    etc.mkdir(parents=True)
    state.mkdir(parents=True)
    state.chmod(0o700)
    # As in the image: the code is root's and readable by everyone, whatever the umask here.
    for directory, _, files in os.walk(root / "opt"):
        Path(directory).chmod(0o755)
        for name in files:
            path = Path(directory, name)
            if not path.is_symlink():
                path.chmod(path.stat().st_mode | 0o444)
    uid = None
    if can_switch_user():
        uid, gid = image_user()
        for path in (root / "var", root / "var" / "lib"):
            path.chmod(0o755)
        os.chown(state, uid, gid)
    final = parse()[-1]
    env = {
        name: value.replace("/opt/portcullis", str(venv)).replace("$PATH", os.defpath)
        for name, value in final.env().items()
    }
    return Image(root, uid, env)


# ---------------------------------------------------------------------------- running


def compose_env() -> dict[str, str]:
    """What .env gives Compose: the required secret."""
    return {"MACHINE_CLIENT_SECRET": MACHINE_SECRET}


@dataclass
class Ports:
    gateway: int
    admin: int
    api: int
    auth: int
    auth_admin: int
    postgres: int | None = None  # the replicated example's database

    @classmethod
    def reserve(cls, postgres: int | None = None) -> Ports:
        return cls(*(reserve_port() for _ in range(5)), postgres=postgres)

    def move(self, text: str) -> str:
        """Container addresses to this machine's free loopback ports."""
        if self.postgres is not None:
            text = text.replace(
                f"@{POSTGRES_HOST}:{POSTGRES_PORT}/", f"@127.0.0.1:{self.postgres}/"
            )
        for old, new in (
            (f"0.0.0.0:{GATEWAY_PORT}", f"127.0.0.1:{self.gateway}"),
            (f"127.0.0.1:{ADMIN_PORT}", f"127.0.0.1:{self.admin}"),
            (f"127.0.0.1:{AUTH_ADMIN_PORT}", f"127.0.0.1:{self.auth_admin}"),
            (f"127.0.0.1:{API_PORT}", f"127.0.0.1:{self.api}"),
            (f"0.0.0.0:{AUTH_PORT}", f"127.0.0.1:{self.auth}"),
            (f"127.0.0.1:{AUTH_PORT}", f"127.0.0.1:{self.auth}"),
            (f"localhost:{AUTH_PORT}", f"localhost:{self.auth}"),
            (f"authserver:{AUTH_PORT}", f"127.0.0.1:{self.auth}"),
        ):
            text = text.replace(old, new)
        return text


def install_config(image: Image, source: Path, target: str, ports: Ports) -> None:
    """A mounted config file: read-only, root's, with its container addresses moved (the
    authorization server's admin listener too, which the examples leave at its default)."""
    text = source.read_text()
    if target.endswith("/authserver.yaml") and not re.search(r"^admin_listen:", text, re.M):
        # Its default, 127.0.0.1:9902, moved like the addresses the file names.
        text = text.rstrip("\n") + f'\nadmin_listen: "127.0.0.1:{ports.auth_admin}"\n'
    moved = ports.move(text).replace("/var/lib/portcullis", str(image.state))
    destination = Path(image.path(target))
    destination.write_text(moved)
    destination.chmod(0o444)


@dataclass
class Program:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def pid(self) -> int:
        return self.process.pid


def container_env(image: Image, service: Mapping[str, Any], ports: Ports) -> dict[str, str]:
    """The image's ENV, then the service's environment; container addresses moved."""
    env = {**image.env, **compose.environment(service)}
    return {name: ports.move(value) for name, value in env.items()}


def start(image: Image, name: str, service: Mapping[str, Any], ports: Ports) -> Program:
    """A Compose service's command, with the image's and the service's environment."""
    env = {"HOME": "/nonexistent", **container_env(image, service, ports)}
    command = [image.path(word) for word in service["command"]]
    command[0] = str(image.venv / "bin" / command[0])  # found on the image's PATH
    if image.uid is not None:
        uid, gid = image_user()
        command = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *command]
    log_path = image.root / f"{name}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, cwd=image.state, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    return Program(name, process, log_path)


def health_check(image: Image, service: Mapping[str, Any], ports: Ports) -> int:
    """The Dockerfile's HEALTHCHECK command, in the program's environment: its exit status."""
    env = container_env(image, service, ports)
    command = parse()[-1].one("HEALTHCHECK").exec_form()
    command[0] = str(image.venv / "bin" / command[0])
    return subprocess.run(command, env=env, capture_output=True, timeout=10).returncode


def wait_healthy(image: Image, program: Program, service: Mapping[str, Any], ports: Ports) -> None:
    deadline = time.monotonic() + 30
    while health_check(image, service, ports) != 0:
        assert program.process.poll() is None, f"{program.name} exited:\n{program.log()}"
        assert time.monotonic() < deadline, f"{program.name} never healthy:\n{program.log()}"
        time.sleep(0.2)


def http(
    url: str, *, data: bytes | None = None, headers: Mapping[str, str] | None = None
) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=data, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


@dataclass
class Running:
    image: Image
    ports: Ports
    auth: Program
    gateway: Program
    services: dict[str, Any]

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.gateway}"

    @property
    def auth_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.auth}"


def stop(program: Program, grace: float) -> int | None:
    if program.process.poll() is None:
        program.process.send_signal(signal.SIGTERM)
        try:
            program.process.wait(grace)
        except subprocess.TimeoutExpired:
            program.process.kill()
            program.process.wait()
            return None
    return program.process.returncode


def fresh(image: Image) -> None:
    """An empty state volume and no mounted config: what a new container starts with."""
    for leftover in list(image.state.iterdir()) + list(image.etc.iterdir()):
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()


def mount_configs(image: Image, service: Mapping[str, Any], ports: Ports) -> None:
    for target, (source, _) in compose.mounts(service).items():
        if target.startswith("/etc/portcullis/"):
            install_config(image, compose.config_file(source), target, ports)


@pytest.fixture
def running(image: Image) -> Iterator[Running]:
    """Both programs and the example API, on fresh state."""
    fresh(image)
    services = compose.load(compose.BASE, env=compose_env())["services"]
    ports = Ports.reserve()
    for name in ("gateway", "authserver"):
        mount_configs(image, services[name], ports)
    api = subprocess.Popen(
        [
            *(sys.executable, "-m", "examples.legacy_api"),
            *("--host", "127.0.0.1", "--port", str(ports.api)),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    programs: list[Program] = []
    try:
        auth = start(image, "authserver", services["authserver"], ports)
        programs.append(auth)
        wait_healthy(image, auth, services["authserver"], ports)
        gateway = start(image, "gateway", services["gateway"], ports)
        programs.append(gateway)
        wait_healthy(image, gateway, services["gateway"], ports)
        yield Running(image, ports, auth, gateway, services)
    finally:
        for program in programs:
            stop(program, 30)
        api.terminate()
        api.wait(10)


MACHINE_CREDENTIALS = {
    "Authorization": "Basic " + b64encode(f"orders-machine:{MACHINE_SECRET}".encode()).decode(),
    "Content-Type": "application/x-www-form-urlencoded",
}


def machine_token(auth_url: str) -> str:
    """A client_credentials token of the examples' machine client."""
    status, body = http(
        auth_url + "/token",
        data=b"grant_type=client_credentials&scope=orders%3Aread",
        headers=MACHINE_CREDENTIALS,
    )
    assert status == 200, body
    return str(body["access_token"])


# ---------------------------------------------------------------------------- PostgreSQL


@dataclass
class Replicated:
    """The replicated example's authorization server and its database."""

    image: Image
    ports: Ports
    auth: Program
    service: dict[str, Any]
    database: str  # the URL the server is given, on this machine's port

    @property
    def auth_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.auth}"

    def query(self, sql: str, *args: object) -> list[asyncpg.Record]:
        async def fetch() -> list[asyncpg.Record]:
            connection = await asyncpg.connect(self.database)
            try:
                return list(await connection.fetch(sql, *args))
            finally:
                await connection.close()

        return asyncio.run(fetch())


def create_example_database(server: PrivatePostgres, service: Mapping[str, Any]) -> None:
    """What the postgres image does with its service's environment: the role with its
    password, and its database."""
    env = compose.environment(service)
    user, database, password = env["POSTGRES_USER"], env["POSTGRES_DB"], env["POSTGRES_PASSWORD"]
    assert re.fullmatch(r"[a-z_]+", user + database) and re.fullmatch(r"[0-9a-f]+", password)

    async def create() -> None:
        connection = await asyncpg.connect(server.url)
        try:
            # DDL takes no parameters: the names and the password are checked above.
            await connection.execute(f"CREATE ROLE {user} LOGIN PASSWORD '{password}'")
            await connection.execute(f"CREATE DATABASE {database} OWNER {user}")
        finally:
            await connection.close()

    asyncio.run(create())


@pytest.fixture
def replicated(image: Image) -> Iterator[Replicated]:
    """The replicated example's authorization server on a PostgreSQL of the test's own,
    with the secrets its .env would give."""
    fresh(image)
    env = {
        **compose_env(),
        "POSTGRES_PASSWORD": secrets.token_hex(24),
        "PORTCULLIS_KEY_SECRET": b64encode(secrets.token_bytes(32)).decode(),
    }
    services = compose.load(compose.BASE, compose.REPLICATED, env=env)["services"]
    service = services["authserver"]
    with PrivatePostgres(password=env["POSTGRES_PASSWORD"]) as server:
        server.start()
        create_example_database(server, services["postgres"])
        ports = Ports.reserve(postgres=server.port)
        mount_configs(image, service, ports)
        config = Path(image.path("/etc/portcullis/authserver.yaml")).read_text()
        (storage,) = re.findall(r'^storage: "(.*)"$', config, re.M)
        database = compose.interpolate(storage, compose.environment(service))
        auth = start(image, "authserver", service, ports)
        try:
            wait_healthy(image, auth, service, ports)
            yield Replicated(image, ports, auth, service, database)
        finally:
            stop(auth, 30)


# ---------------------------------------------------------------------------- tests


def test_the_image_holds_exactly_the_pinned_dependencies_and_no_build_tool(image):
    listing = subprocess.run(
        [
            str(image.venv / "bin" / "python"),
            "-c",
            "import importlib.metadata as m, json; "
            "print(json.dumps([[d.metadata['Name'], d.version] for d in m.distributions()]))",
        ],
        env={"PATH": os.defpath},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    installed = {canonicalize_name(name): version for name, version in json.loads(listing.stdout)}
    expected = {
        name: pinned_version(requirement)
        for name, requirement in pins().items()
        if requirement.marker is None or requirement.marker.evaluate()
    }
    assert installed.pop("portcullis") == PYPROJECT_VERSION
    assert installed == expected
    for tool in ("pip", "setuptools", "wheel"):
        assert tool not in installed
    bin_dir = image.venv / "bin"
    assert (bin_dir / "portcullis-gateway").is_file()
    assert (bin_dir / "portcullis-authserver").is_file()
    assert not list(bin_dir.glob("pip*"))


def test_both_programs_start_from_etc_portcullis_pass_the_health_check_and_pass_a_token(running):
    # Both answered the image's HEALTHCHECK (the fixture waited for it): the gateway its
    # /readyz by default, the authorization server the /readyz its service sets.
    assert compose.environment(running.services["authserver"])["PORTCULLIS_HEALTH_URL"] == (
        f"http://127.0.0.1:{AUTH_ADMIN_PORT}/readyz"
    )
    status, discovery = http(running.auth_url + "/.well-known/openid-configuration")
    assert status == 200
    assert discovery["issuer"] == f"http://localhost:{running.ports.auth}"

    status, body = http(running.gateway_url + "/orders")
    assert status == 401, body
    token = machine_token(running.auth_url)
    status, body = http(running.gateway_url + "/me", headers={"Authorization": f"Bearer {token}"})
    assert status == 200, running.gateway.log()
    assert body["subject"] == "orders-machine"
    assert body["scopes"] == ["orders:read"]
    status, body = http(
        running.gateway_url + "/orders?limit=1", headers={"Authorization": f"Bearer {token}"}
    )
    assert (status, body["data"]) == (200, [])


def test_the_programs_run_as_the_images_user_and_write_only_to_the_state_volume(running):
    if running.image.uid is None:
        tool_missing("switching to the image's user needs root and setpriv")
    uid, gid = image_user()
    for program in (running.auth, running.gateway):
        status = Path(f"/proc/{program.pid}/status").read_text()
        uids = next(line for line in status.splitlines() if line.startswith("Uid:"))
        gids = next(line for line in status.splitlines() if line.startswith("Gid:"))
        assert uids.split()[1:] == [str(uid)] * 4, program.name
        assert gids.split()[1:] == [str(gid)] * 4, program.name
    machine_token(running.auth_url)  # something to store
    state = running.image.state
    written = {p.relative_to(state).as_posix() for p in state.rglob("*")}
    assert "authserver.db" in written and "keys" in written
    assert all(p.stat().st_uid == uid for p in state.rglob("*"))
    # Nothing new beside the mounted configs.
    assert sorted(p.name for p in running.image.etc.iterdir()) == [
        "authserver.yaml",
        "gateway.yaml",
    ]


def test_the_stop_signal_drains_and_stops_both_programs(running):
    signal_name = parse()[-1].one("STOPSIGNAL").args
    assert signal_name == "SIGTERM"
    token = machine_token(running.auth_url)
    for program in (running.gateway, running.auth):
        program.process.send_signal(getattr(signal, signal_name))
        with contextlib.suppress(subprocess.TimeoutExpired):
            program.process.wait(30)
        assert program.process.returncode == 0, program.log()
        lines = [json.loads(line) for line in program.log().splitlines() if line.startswith("{")]
        messages = [line["message"] for line in lines]
        assert "draining" in messages and messages[-1] == "stopped", messages
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(running.gateway_url + "/me", timeout=5)
    assert token  # issued before the stop


def test_the_replicated_examples_authserver_runs_on_postgresql_and_keeps_its_state_there(
    replicated,
):
    # It answered the image's HEALTHCHECK (the fixture waited for it) at the address its
    # service sets, so it opened the database and applied its migrations.
    assert compose.environment(replicated.service)["PORTCULLIS_HEALTH_URL"] == (
        f"http://127.0.0.1:{AUTH_ADMIN_PORT}/readyz"
    )
    assert replicated.database.startswith("postgresql://portcullis:")
    status, discovery = http(replicated.auth_url + "/.well-known/openid-configuration")
    assert status == 200
    assert discovery["issuer"] == f"http://localhost:{replicated.ports.auth}"

    token = machine_token(replicated.auth_url)
    claims = jwt.decode(token, options={"verify_signature": False})
    assert (claims["client_id"], claims["scope"]) == ("orders-machine", "orders:read")
    # Signed by a key of the ring the replicas share: in the database, sealed.
    kid = jwt.get_unverified_header(token)["kid"]
    (key,) = replicated.query(
        "SELECT alg, state, sealed_private_key FROM signing_keys WHERE kid = $1", kid
    )
    assert (key["alg"], key["state"]) == ("ES256", "active")
    assert b"PRIVATE KEY" not in key["sealed_private_key"]
    # Its revocation is a row every replica reads.
    status, _ = http(
        replicated.auth_url + "/revoke",
        data=f"token={token}&token_type_hint=access_token".encode(),
        headers=MACHINE_CREDENTIALS,
    )
    assert status == 200, replicated.auth.log()
    (revoked,) = replicated.query("SELECT revoked FROM access_tokens WHERE jti = $1", claims["jti"])
    assert revoked["revoked"] is True
    # Nothing on the state volume: a replica's state is all in the database.
    assert list(replicated.image.state.iterdir()) == []
    assert stop(replicated.auth, 30) == 0, replicated.auth.log()
