# Two commands set everything up on a fresh machine with Python 3.11 and make:
#   make demo   build sample databases in both formats, merge them, show the result
#   make test   run the whole test suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
DEMO := demo

.PHONY: demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# One stamp per extra, remade when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[demo]'
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test,demo]'
	touch $@ $(VENV)/.installed

demo: $(VENV)/.installed
	rm -rf $(DEMO) && mkdir -p $(DEMO)
	$(BIN)/python -m fixtures family --seed 7 --machines 2 --conversations 400 --out $(DEMO)
	@for db in $(DEMO)/laptop-1.db $(DEMO)/laptop-2.db; do \
		echo; echo "== dagsync stats $$db"; $(BIN)/dagsync stats $$db || exit 1; \
	done
	@echo; echo "== dagsync merge $(DEMO)/merged.db $(DEMO)/laptop-1.db $(DEMO)/laptop-2.db"
	@$(BIN)/dagsync merge $(DEMO)/merged.db $(DEMO)/laptop-1.db $(DEMO)/laptop-2.db
	@echo; echo "== merging again writes nothing"
	@$(BIN)/dagsync merge $(DEMO)/merged.db $(DEMO)/laptop-1.db $(DEMO)/laptop-2.db
	@echo; echo "== dagsync verify $(DEMO)/merged.db"
	@$(BIN)/dagsync verify $(DEMO)/merged.db
	@echo; echo "== dagsync stats $(DEMO)/merged.db"
	@$(BIN)/dagsync stats $(DEMO)/merged.db
	@echo; echo "== dagsync gc --dry-run: what nothing reaches (none yet)"
	@$(BIN)/dagsync gc $(DEMO)/merged.db --dry-run --json | $(BIN)/python -c 'import json, sys; r = json.load(sys.stdin); print("%d messages reachable, %d unreachable, %d rows would be deleted" % (r["reachable"], r["unreachable"], r["deleted"]))'
	@echo; echo "== dagsync pack --dict, then unpack: each payload stored once, compressed; and back"
	@cp $(DEMO)/merged.db $(DEMO)/packed.db
	@$(BIN)/dagsync pack $(DEMO)/packed.db --dict --vacuum
	@$(BIN)/dagsync verify $(DEMO)/packed.db
	@$(BIN)/dagsync unpack $(DEMO)/packed.db
	@echo; echo "== the llm 0.36 format: two machines' logs.db, merged"
	$(BIN)/python -m fixtures llm $(DEMO)/llm --family --seed 7 --machines 2 --conversations 300
	@$(BIN)/dagsync merge $(DEMO)/llm/merged.db $(DEMO)/llm/machine-1.db $(DEMO)/llm/machine-2.db
	@echo; echo "== dagsync verify $(DEMO)/llm/merged.db"
	@$(BIN)/dagsync verify $(DEMO)/llm/merged.db
	@echo; echo "== dagsync stats $(DEMO)/llm/merged.db"
	@$(BIN)/dagsync stats $(DEMO)/llm/merged.db

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) $(DEMO) .pytest_cache .hypothesis
