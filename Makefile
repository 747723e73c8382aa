# The README's commands. Every target works on a fresh machine: `setup` makes the project's own
# virtual environment (.venv) from $(PYTHON) and installs into it; every target then runs from it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# 1 when the user named the interpreter (make test PYTHON=python3.12): a .venv made from another is made again.
PYTHON_CHOSEN := $(if $(filter command line environment,$(origin PYTHON)),1,0)
# The torch setup installs where none is in .venv (PyPI's Linux build carries CUDA; add PyTorch's cpu or cuXXX
# index for another): make setup TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0
CH ?= ch01
PORT ?= 8000
PROFILE ?= auto
FROM ?= ch01
TO ?= ch02
PYTEST_ARGS ?=
# Interleaved rounds of the climb; each chapter keeps its median run (a shared machine is noisy).
REPEAT ?= 3
# Other weights for `climb` and `serve`: WEIGHTS=smollm2 (the packaged SmolLM2-135M-Instruct), a .gguf file, a
# Hugging Face directory. Empty: each profile's own (the embedded tiny model on a CPU).
WEIGHTS ?=
WEIGHTS_FLAG := $(if $(WEIGHTS),--weights $(WEIGHTS))

# Chapter 9's image (make image): a name a registry can hold, tagged with the project's version; CONTAINER=podman works too.
IMAGE ?= ghcr.io/serving-from-scratch/serving-from-scratch
CONTAINER ?= docker
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)

.PHONY: setup browser climb test test-cpus test-slow serve diff model bench reference ceiling notebooks student grade image

setup:
	@bash scripts/setup_venv.sh "$(PYTHON)" "$(VENV)" "$(TORCH_SPEC)" $(PYTHON_CHOSEN)
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || $(MAKE) --no-print-directory browser

# The live page's browser test (tests/test_live_page.py) drives the distribution's Chromium; it needs
# root and apt-get to install it here, and skips with the reason where it cannot (CI fails instead).
browser:
	@if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		echo "installing the distribution's chromium and chromium-driver with apt-get (as root), for the live page's browser test"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; \
	else echo "chromium and chromedriver are missing and cannot be installed here (root and apt-get needed): the browser test will skip"; fi

# The main job: every chapter under load, the table and the plots.
climb: setup
	$(PY) -m benchmarks climb --profile $(PROFILE) --repeat $(REPEAT) $(WEIGHTS_FLAG)

# Then the CPU-capability pass on its numeric core, as the capability below this machine's best would run it (an
# AVX-512 machine runs what an AVX2 laptop's torch, oneDNN and MKL would; scripts/test_cpus.sh).
test: setup
	$(PY) -m pytest $(PYTEST_ARGS)
	@CPU_CAPABILITIES=below bash scripts/test_cpus.sh $(PY) $(CPU_PASS_TESTS)

# The numerically sensitive tests (oracles, equivalence, sampling, the engine and attention rules, the
# prefix cache) once per CPU capability this machine can stand in for (scripts/test_cpus.sh).
NUMERIC_TESTS ?= tests/test_model.py tests/test_equivalence.py tests/test_ch03_batched_generation.py \
	tests/test_ch05_engines.py tests/test_ch08_sampling.py tests/test_ch08_prefix_caching.py \
	tests/test_ch08_scheduler.py tests/test_ch08_server.py
CPU_PASS_TESTS ?= tests/test_model.py tests/test_equivalence.py tests/test_ch05_engines.py tests/test_ch08_sampling.py
test-cpus: setup
	@bash scripts/test_cpus.sh $(PY) $(NUMERIC_TESTS) $(PYTEST_ARGS)

test-slow: setup
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

# Any chapter folder, chapter 9 included (measured by its own recorders, not in the climb): CH=ch09 runs chapters/ch09_*.
# Chapter 9 starts as its README's example does: two replicas on half a core each, one torch thread each.
SERVE_ARGS_ch09 = --num-replicas 2 --replica-cpus 0.5 --torch-threads 1
serve: setup
	@test -d chapters/$(CH)_* || { echo "no chapter $(CH): see chapters/"; exit 2; }
	$(PY) -m chapters.$$(basename chapters/$(CH)_*) --port $(PORT) $(SERVE_ARGS_$(CH)) $(WEIGHTS_FLAG)

# Record reference results (commit benchmarks/reference/ afterwards) and refill the READMEs' result blocks.
reference: setup
	$(PY) -m benchmarks climb --profile $(PROFILE) --ceiling --repeat $(REPEAT) --save-reference
	$(PY) -m benchmarks readme

ceiling: setup
	$(PY) -m benchmarks ceiling --profile $(PROFILE)

# Re-execute every notebook in place against benchmarks/reference/ (commit them executed, so they render).
# RESULTS=benchmarks/results/cpu plots your own run instead (then do not commit them).
notebooks: setup
	$(PY) -m benchmarks.notebooks $(if $(RESULTS),--results-dir $(RESULTS))

bench: setup
	$(PY) -m benchmarks run --chapter $(CH) --profile $(PROFILE)

# What chapter TO adds over chapter FROM: only the lesson.
diff: setup
	@$(PY) -m chapters.diff $(FROM) $(TO)

# Retrain the embedded default model (deterministic, about 15 minutes on 2 cores).
model: setup
	$(PY) -m shared.train_default

# Exercises (exercises/README.md). CH=ch03 or CH=all; OUT defaults to <repo>-student-<CH> beside the repository.
OUT ?=
TREE ?= .
student: setup
	$(PY) -m exercises student $(if $(filter all,$(CH)),--all,--chapter $(CH)) $(if $(OUT),--out $(OUT))

# Grade a tree (default: this one) for chapter CH, or every chapter with CH=all.
grade: setup
	$(PY) -m exercises grade --tree $(TREE) $(if $(filter all,$(CH)),,--chapter $(CH))

# Chapter 9's image (chapters/ch09_scale_out/Dockerfile); push it to your registry and name it in deploy/rayservice.yaml.
image:
	@command -v $(CONTAINER) >/dev/null || { echo "make image needs a container engine: install Docker, or Podman and run make image CONTAINER=podman" >&2; exit 2; }
	@$(CONTAINER) info >/dev/null 2>&1 || { echo "make image: $(CONTAINER) is installed but its engine does not answer ($(CONTAINER) info fails): start it, or name another with CONTAINER=" >&2; exit 2; }
	$(CONTAINER) build -f chapters/ch09_scale_out/Dockerfile -t $(IMAGE):$(VERSION) .
