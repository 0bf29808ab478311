.PHONY: bench bench-full soak test sandbox fuzz

# Quick benchmark suite, as root (network namespaces; about 3 minutes): direct, ztunnel TCP,
# ztunnel HBONE, HAProxy (splice) and a stunnel mTLS pair side by side in one run.
# Results: benchmarks/results/suite.{json,md,*.png}; then the README's table is regenerated.
bench:
	bash scripts/install-deps.sh
	python3 benchmarks/suite.py --quick
	python3 benchmarks/report.py

bench-full:
	bash scripts/install-deps.sh
	python3 benchmarks/suite.py
	python3 benchmarks/report.py

# Memory soak, as root (about 17 minutes; SOAK_ARGS=--quick: about 8): RSS/PSS of each ztunnel
# under HBONE churn, plaintext churn, 2,000 idle tunnels and xDS workload churn, then at rest.
# Results: benchmarks/results/soak.{json,md}.
soak:
	bash scripts/install-deps.sh
	python3 benchmarks/soak.py $(SOAK_ARGS)

test:
	bash scripts/test.sh

sandbox:
	bash scripts/sandbox.sh

# Coverage-guided fuzzing (atheris) of every parser a peer can reach, FUZZ_SECONDS per target
# (default 60); crashes are kept under FUZZ_OUT. The unit tests run the same targets briefly.
FUZZ_SECONDS ?= 60
FUZZ_OUT ?= /tmp/ztunnel-fuzz
fuzz:
	python3 fuzz/run.py --all --seconds $(FUZZ_SECONDS) --out $(FUZZ_OUT)
