"""Run the fuzz targets (fuzz/targets.py) with atheris, coverage-guided.

    python fuzz/run.py TARGET [libFuzzer options] [CORPUS_DIR ...]
    python fuzz/run.py --all [--seconds N] [--runs N] [--out DIR]

``TARGET`` runs in this process, its ztunnel modules instrumented for coverage; with no corpus
directory given it uses ``fuzz/corpus/TARGET`` (read-only: new inputs go to a directory of
``--out``, default a temporary one, so the committed corpora change only by hand). ``--all``
runs every target in turn, each for ``--seconds`` (default 60) or ``--runs`` inputs, and fails
if any target found a crash (the input is kept in ``--out`` as ``crash-*``). A crash found
becomes a unit test in the module's test file, and its input joins the corpus.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fuzz" / "corpus"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def run_one(name: str, args: list[str]) -> None:
    import atheris

    with atheris.instrument_imports(include=["ztunnel"]):
        from fuzz.targets import TARGETS
    target = TARGETS[name]
    if not any(not a.startswith("-") for a in args):
        out = tempfile.mkdtemp(prefix=f"fuzz-{name}-")
        args = [*args, out, str(CORPUS / name)]
    # argv[0] is how libFuzzer re-runs itself (-merge, -fork): through a shell, so this works.
    atheris.Setup([f"{sys.executable} {Path(__file__).resolve()} {name}", *args], target)
    atheris.Fuzz()


def run_all(argv: list[str]) -> int:
    import argparse

    from fuzz.targets import TARGETS

    ap = argparse.ArgumentParser(prog="python fuzz/run.py --all")
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--runs", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--targets", default=",".join(TARGETS))
    ns = ap.parse_args(argv)
    out = Path(ns.out or tempfile.mkdtemp(prefix="fuzz-"))
    failed = []
    for name in ns.targets.split(","):
        work = out / name
        work.mkdir(parents=True, exist_ok=True)
        limit = [f"-runs={ns.runs}"] if ns.runs else []
        cmd = [
            sys.executable,
            str(Path(__file__)),
            name,
            f"-max_total_time={ns.seconds}",
            *limit,
            f"-artifact_prefix={work}/",
            "-rss_limit_mb=2048",
            "-timeout=10",
            str(work),
            str(CORPUS / name),
        ]
        print(f"== {name}: {' '.join(cmd[2:])}", flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, check=False)
        if proc.returncode != 0:
            failed.append(name)
    if failed:
        print(f"fuzz: crashes in {', '.join(failed)}; inputs under {out}", file=sys.stderr)
        return 1
    print(f"fuzz: no crash; new inputs under {out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--all":
        sys.exit(run_all(sys.argv[1:]))
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    run_one(sys.argv[1], sys.argv[2:])
