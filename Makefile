.PHONY: bench bench-full test sandbox

# Quick benchmark suite, as root (network namespaces; about 3 minutes): direct, ztunnel TCP,
# ztunnel HBONE, HAProxy (splice) and a stunnel mTLS pair side by side in one run.
# Results: benchmarks/results/suite.{json,md,*.png}
bench:
	bash scripts/install-deps.sh
	python3 -m pip install -q --disable-pip-version-check matplotlib
	python3 benchmarks/suite.py --quick

bench-full:
	bash scripts/install-deps.sh
	python3 -m pip install -q --disable-pip-version-check matplotlib
	python3 benchmarks/suite.py

test:
	bash scripts/test.sh

sandbox:
	bash scripts/sandbox.sh
