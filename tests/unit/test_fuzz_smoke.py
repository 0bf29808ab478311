"""The fuzz targets (fuzz/targets.py) in CI: every committed corpus input replayed in process,
then a short coverage-guided atheris run per target (a few thousand mutated inputs, bounded in
time, in a subprocess: libFuzzer ends its process). ``make fuzz`` runs the same targets longer.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fuzz.targets import TARGETS  # noqa: E402

CORPUS = ROOT / "fuzz" / "corpus"
RUNS = 3000
SECONDS = 5


def test_every_target_has_a_corpus() -> None:
    for name in TARGETS:
        assert list((CORPUS / name).iterdir()), name


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_corpus_replays_cleanly(name: str) -> None:
    for path in sorted((CORPUS / name).iterdir()):
        TARGETS[name](path.read_bytes())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_short_atheris_run(name: str) -> None:
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run(
            [
                # libFuzzer's -rss_limit_mb reads the peak RSS (ru_maxrss), and Linux keeps a
                # process's peak across execve: a fuzzer started straight from this pytest, whose
                # own peak may pass 2 GiB after the netns suite, reports out-of-memory at once.
                # A shell that forks the fuzzer (not exec) gives it a fresh peak of its own.
                "sh",
                "-c",
                '"$@"; exit $?',
                "sh",
                sys.executable,
                str(ROOT / "fuzz" / "run.py"),
                name,
                f"-runs={RUNS}",
                f"-max_total_time={SECONDS}",
                f"-artifact_prefix={out}/",
                "-rss_limit_mb=2048",
                "-timeout=10",
                out,
                str(CORPUS / name),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=55,
            check=False,
        )
        crashes = [p.name for p in Path(out).glob("crash-*")]
        assert proc.returncode == 0 and not crashes, (crashes, proc.stderr[-3000:])
        assert "Done" in proc.stderr, proc.stderr[-2000:]
