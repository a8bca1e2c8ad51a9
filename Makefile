# Every target sets up what it needs by itself on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# One stamp per extra installed into the venv (pyproject.toml): `dev` for `make demo`, `dev`
# and `mcp` for `make mcp-demo`, `docs` for `make docs`, `test` (which holds them all) for
# the rest. Installing test stamps them all, so a demo after the tests installs nothing.
DEV_STAMP := $(VENV)/.installed-dev
MCP_STAMP := $(VENV)/.installed-mcp
DOCS_STAMP := $(VENV)/.installed-docs
TEST_STAMP := $(VENV)/.installed-test
MCP_EXTRAS := dev,mcp

.PHONY: test test-fast lint bench bench-instructions demo mcp-demo clean constraints image schema \
	docs reference
.PHONY: pin-images release

define install_extra
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(1)]'
endef

$(DEV_STAMP): pyproject.toml
	$(call install_extra,dev)
	touch $(DEV_STAMP)

$(MCP_STAMP): pyproject.toml
	$(call install_extra,$(MCP_EXTRAS))
	touch $(MCP_STAMP) $(DEV_STAMP)

$(DOCS_STAMP): pyproject.toml
	$(call install_extra,docs)
	touch $(DOCS_STAMP)

$(TEST_STAMP): pyproject.toml
	$(call install_extra,test)
	touch $(TEST_STAMP) $(DEV_STAMP) $(MCP_STAMP) $(DOCS_STAMP)

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/hadolint --no-color --failure-threshold style Dockerfile examples/compose/legacy-api.Dockerfile \
	  examples/compose/mcp-server.Dockerfile

# Browser tests drive Debian's chromium (never a downloaded browser). Installed here when
# missing and we may; otherwise those tests skip with a reason (and fail under CI=true).
CHROMIUM := /usr/bin/chromium

$(CHROMIUM):
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian chromium for the browser tests"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q chromium >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }; \
	else echo "chromium not installed (needs root and apt-get): browser tests will skip"; fi

# The end-to-end DPoP test drives oauth4webapi on Debian's Node.js, the MCP clients test
# the MCP TypeScript SDK, and the federation test signs in through oidc-provider; each test
# installs its package itself (npm ci from the lock file in tests/e2e/dpop_client,
# tests/e2e/mcp_ts_client, tests/e2e/oidc_directory). Node.js and npm are installed here when
# missing and we may; otherwise those tests skip (fail under CI=true).
NPM := /usr/bin/npm

$(NPM):
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian nodejs and npm for the Node.js client tests"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q nodejs npm >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && apt-get install -y -q nodejs npm >/dev/null; }; \
	else echo "npm not installed (needs root and apt-get): the Node.js client tests will skip"; fi

# The nginx tests of the decision listener (examples/forward-auth) run Debian's nginx, installed
# here like chromium (its packaged service is not started: the tests run their own); without
# it they skip with a reason (and fail under CI=true).
NGINX := /usr/sbin/nginx

$(NGINX):
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian nginx-light for the forward-auth tests"; \
	  export DEBIAN_FRONTEND=noninteractive; no_start=; \
	  if [ ! -e /usr/sbin/policy-rc.d ]; then \
	    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; \
	    no_start=/usr/sbin/policy-rc.d; fi; \
	  apt-get install -y -q nginx-light >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && apt-get install -y -q nginx-light >/dev/null; }; \
	  [ -z "$$no_start" ] || rm -f "$$no_start"; \
	else echo "nginx not installed (needs root and apt-get): nginx forward-auth tests will skip"; fi

# One pytest worker per core (pytest-xdist); a test file runs whole in one worker, so its
# module-scoped fixtures (the built image, above all) are made once. Every server a test
# starts listens on a port the OS chose, or on one reserved for that worker. Every property
# runs the examples it declares (the `full` Hypothesis profile, tests/hypothesis_profiles.py).
test: lint $(CHROMIUM) $(NPM) $(NGINX)
	$(VENV)/bin/pytest -q -n auto --dist loadfile --hypothesis-profile full

# The tests marked `fast` (tests/conftest.py: no other process, browser, front proxy,
# database or image build), with a tenth of the examples per property (the `quick` profile):
# under a minute on two cores, for the edit-and-check loop. No lint, and it proves less than
# `make test`, which is the check of a change. pytest rewrites the asserts of every test
# module it collects, a third of the tier's time when done again on each run: its compiled
# modules are kept in __pycache__ even where PYTHONDONTWRITEBYTECODE is set.
test-fast: $(TEST_STAMP)
	PYTHONDONTWRITEBYTECODE= $(VENV)/bin/pytest -q -m fast --hypothesis-profile quick

# JSON Schemas of both configuration files, from the settings declarations (editors validate
# the example files with them; a test fails when they are stale).
schema: $(DEV_STAMP)
	$(PY) -m portcullis.sections gateway.settings:Settings "Portcullis gateway configuration" config/schema/gateway.schema.json
	$(PY) -m portcullis.sections authserver.settings:Settings "Portcullis authorization server configuration" config/schema/authserver.schema.json

# The documentation site (mkdocs.yml, docs/) in site/, strict: a warning fails the build (a
# broken link or anchor, a page left out of the navigation), and so does a generated
# reference page that is stale. Offline: nothing is fetched while it builds.
docs: $(DOCS_STAMP)
	$(PY) docs/generate.py --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The generated reference pages (docs/reference/): the configuration of both files from the
# settings declarations, the command lines from their parsers, the admin API from its
# OpenAPI document. A test fails when the committed pages are stale.
reference: $(DOCS_STAMP)
	$(PY) docs/generate.py

bench: $(TEST_STAMP)
	bash bench/run.sh

bench-instructions: $(TEST_STAMP)
	bash bench/instructions.sh

# The demo's processes on 127.0.0.1 (examples/demo.sh), run with the dev extra alone: no
# browser, front proxy or test tool is installed for it. Its logs are kept when it stops
# (DEMO_KEEP_LOGS=0 removes them), in the directory it names.
DEMO_KEEP_LOGS ?= 1

demo: $(DEV_STAMP)
	DEMO_PYTHON=$(abspath $(PY)) DEMO_KEEP_LOGS=$(DEMO_KEEP_LOGS) bash examples/demo.sh

# An MCP server that checks no tokens (examples/mcp), the gateway in front of it and the
# authorization server its clients register with, on 127.0.0.1 until Ctrl-C
# (examples/mcp/demo.sh; examples/mcp/README.md says what an MCP client meets there).
mcp-demo: $(MCP_STAMP)
	MCP_DEMO_PYTHON=$(abspath $(PY)) bash examples/mcp/demo.sh

# The container image's pinned dependencies: pyproject.toml's dependencies and the extras
# the image installs (redis, postgres), resolved for every Python the image may have (3.11
# and later, with markers).
IMAGE_PYTHON := 3.11

constraints: $(DEV_STAMP)
	$(PY) -m pip install --quiet 'uv>=0.4'
	$(VENV)/bin/uv pip compile pyproject.toml --extra redis --extra postgres \
	  --upgrade --quiet --universal --python-version $(IMAGE_PYTHON) --annotation-style line \
	  --custom-compile-command 'make constraints' --output-file constraints.txt

# Needs a container engine; `make test` checks the Dockerfile without one. The image's
# version label is pyproject.toml's version, the one place it is set.
image:
	docker build --build-arg VERSION=$$($(PYTHON) scripts/release.py --version-only) -t portcullis .

# A release of pyproject.toml's version (scripts/release.py): its dated section in
# CHANGELOG.md, the sdist and the wheel built into dist/ and checked, the image's tag; then
# what to publish and how, none of which it does.
release: $(DEV_STAMP)
	$(PY) -m pip install --quiet 'build>=1.2'
	$(PY) scripts/release.py

# The base images by digest (FROM name:tag@sha256:…, and the Compose example's Redis and
# PostgreSQL): each tag resolved again at its registry with skopeo (Debian's package; no
# container engine needed), the files rewritten only when every tag resolved.
# `python3 scripts/pin_images.py --check` lists them without the network.
pin-images:
	$(PYTHON) scripts/pin_images.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info site
