# `make test` and `make demo` set up .venv (Python 3.12) on first use, then run.
PYTHON ?= $(shell command -v python3.12 2>/dev/null || echo $(HOME)/.pyenv/versions/3.12.1/bin/python)
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: test demo venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 tests

demo: $(STAMP)
	$(VENV)/bin/jquant demo

clean:
	rm -rf $(VENV) .pytest_cache
