# The README's commands. Every target works on a fresh machine: `setup` installs what is missing.
PYTHON ?= python3
# A CPU build by default; GPU users override, e.g. make setup TORCH_SPEC="torch==2.13.0 --index-url ..."
TORCH_SPEC ?= torch==2.13.0
CH ?= ch01
PORT ?= 8000
PROFILE ?= auto
FROM ?= ch01
TO ?= ch02
PYTEST_ARGS ?=
# Interleaved rounds of the climb; each chapter keeps its median run (a shared machine is noisy).
REPEAT ?= 3

.PHONY: setup browser climb test test-slow serve diff model bench reference ceiling notebooks student grade

setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install $(TORCH_SPEC)
	$(PYTHON) -m pip install -q -e ".[dev]"
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || $(MAKE) --no-print-directory browser

# The live page's browser test (tests/test_live_page.py) drives the distribution's Chromium; it needs
# root and apt-get to install it here, and skips with the reason where it cannot (CI fails instead).
browser:
	@if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; \
	else echo "chromium and chromedriver are missing and cannot be installed here (root and apt-get needed): the browser test will skip"; fi

# The main job: every chapter under load, the table and the plots.
climb: setup
	$(PYTHON) -m benchmarks climb --profile $(PROFILE) --repeat $(REPEAT)

test: setup
	$(PYTHON) -m pytest $(PYTEST_ARGS)

test-slow: setup
	$(PYTHON) -m pytest -m slow $(PYTEST_ARGS)

# Any chapter folder, chapter 9 included (measured by its own recorders, not in the climb): CH=ch09 runs chapters/ch09_*.
serve:
	@test -d chapters/$(CH)_* || { echo "no chapter $(CH): see chapters/"; exit 2; }
	$(PYTHON) -m chapters.$$(basename chapters/$(CH)_*) --port $(PORT)

# Record reference results (commit benchmarks/reference/ afterwards) and refill the READMEs' result blocks.
reference: setup
	$(PYTHON) -m benchmarks climb --profile $(PROFILE) --ceiling --repeat $(REPEAT) --save-reference
	$(PYTHON) -m benchmarks readme

ceiling:
	$(PYTHON) -m benchmarks ceiling --profile $(PROFILE)

# Re-execute every notebook in place against benchmarks/reference/ (commit them executed, so they render).
# RESULTS=benchmarks/results/cpu plots your own run instead (then do not commit them).
notebooks:
	$(PYTHON) -m benchmarks.notebooks $(if $(RESULTS),--results-dir $(RESULTS))

bench:
	$(PYTHON) -m benchmarks run --chapter $(CH) --profile $(PROFILE)

# What chapter TO adds over chapter FROM: only the lesson.
diff:
	@$(PYTHON) -m chapters.diff $(FROM) $(TO)

# Retrain the embedded default model (deterministic, about 15 minutes on 2 cores).
model:
	$(PYTHON) -m shared.train_default

# Exercises (exercises/README.md). CH=ch03 or CH=all; OUT defaults to <repo>-student-<CH> beside the repository.
OUT ?=
TREE ?= .
student:
	$(PYTHON) -m exercises student $(if $(filter all,$(CH)),--all,--chapter $(CH)) $(if $(OUT),--out $(OUT))

# Grade a tree (default: this one) for chapter CH, or every chapter with CH=all.
grade:
	$(PYTHON) -m exercises grade --tree $(TREE) $(if $(filter all,$(CH)),,--chapter $(CH))
