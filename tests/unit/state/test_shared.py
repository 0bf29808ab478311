"""The shared state store's mechanics: a reader in another process sees the writer's commits,
however big; stores of writers that are gone are removed, live ones kept."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ztunnel.state.shared import OWNER, PREFIX, SharedStore, remove_stale
from ztunnel.state.store import State
from ztunnel.testing import meshgen

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[3]

READER = """
import sys
from ztunnel.state.store import State
r = State.open(sys.argv[1], map_size=int(sys.argv[2]))
print(r.counts()["workloads"], flush=True)
sys.stdin.readline()
r.apply_changes([])  # (as a StateChanged would: read the newest snapshot)
print(r.counts()["workloads"], flush=True)
w = r.find_workload_by_uid(sys.argv[3])
print(w.name if w is not None else None, flush=True)
"""


def test_a_reader_opened_when_the_store_was_empty_reads_a_big_commit() -> None:
    # A worker maps the store at start (nearly empty) and the first sync brings tens of MiB:
    # LMDB sizes a reader's map by the space used when it opens unless told the writer's size.
    st = State(store=SharedStore.create(map_size=256 << 20))
    last = meshgen.pod(29_999, 3_000)
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, st.store.path, str(256 << 20), last.uid],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert reader.stdout is not None and reader.stdin is not None
        assert reader.stdout.readline().strip() == "0"
        with st.batch():
            for j in range(3_000):
                st.upsert_service(meshgen.service(j))
            for i in range(30_000):
                st.upsert_workload(meshgen.pod(i, 3_000))
        assert st.store.used_bytes() > 16 << 20  # (more than a reader maps by default)
        reader.stdin.write("go\n")
        reader.stdin.flush()
        assert reader.stdout.readline().strip() == "30000"
        assert reader.stdout.readline().strip() == last.name
        assert reader.wait(30) == 0
    finally:
        reader.kill()
        st.store.close()


def test_stale_stores_are_removed_and_live_ones_kept() -> None:
    with tempfile.TemporaryDirectory() as parent:
        live = SharedStore.create(parent)
        # A writer killed (its lock went with it), and one from before the lock existed.
        dead = Path(parent, PREFIX + "dead")
        dead.mkdir()
        (dead / OWNER).touch()
        (dead / "data.mdb").write_bytes(b"x" * 4096)
        unowned = Path(parent, PREFIX + "unowned")
        unowned.mkdir()
        other = Path(parent, "something-else")
        other.mkdir()
        removed = remove_stale(parent)
        assert sorted(removed) == sorted([str(dead), str(unowned)])
        assert Path(live.path).is_dir() and other.is_dir()
        # A new store cleans up the same way when it is made.
        dead.mkdir()
        second = SharedStore.create(parent)
        assert not dead.exists() and Path(live.path).is_dir()
        live.close()
        second.close()
        assert not Path(live.path).exists() and not Path(second.path).exists()
