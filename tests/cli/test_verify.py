"""lamina verify on damaged files says what is damaged, where, and what to do, in bounded
length; nothing it did not find (no "missing" segment after a damaged one, no quarantine
that no one made)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lamina.layout import QUARANTINE_NAME
from lamina.store import Store
from lamina.trace.trace import Trace
from lamina.verify import MAX_PROBLEM
from tests.cli.procs import SCHEMA, lamina, updates
from tests.trace.helpers import convert


def segments(root: Path, *, rounds: int = 12) -> None:
    """A relation ``r`` with a dozen finished segments."""
    with Store.open(root, segment_bytes=4096, fsync="never") as store:
        rel = store.create_relation("r", SCHEMA, key=["id"])
        for t in range(rounds):
            ids = np.arange(t * 60, (t + 1) * 60, dtype=np.int64)
            rel.append(updates(ids, ["x" * 20] * 60, t))
            rel.seal(t + 1)


def flip(path: Path, at: int | None = None, value: int | None = None) -> None:
    raw = bytearray(path.read_bytes())
    i = len(raw) // 2 if at is None else at
    raw[i] = raw[i] ^ 0x10 if value is None else value
    path.write_bytes(bytes(raw))


def report(root: Path) -> tuple[int, list[str]]:
    out = lamina("verify", "--data-dir", str(root))
    assert out.stderr == b""
    return out.returncode, out.stdout.decode().splitlines()


def test_a_damaged_segment_is_one_problem(tmp_path: Path) -> None:
    segments(tmp_path)
    wal = tmp_path / "wal" / "r"
    victim = sorted(wal.glob("*.wal"))[3]
    flip(victim)
    code, lines = report(tmp_path)
    assert code == 1
    problems = [line for line in lines if line.startswith("  problem: ")]
    assert len(problems) == 1, lines
    (problem,) = problems
    assert victim.name in problem
    assert "at byte" in problem
    assert "restore the file from a backup" in problem
    assert "missing" not in problem
    assert "quarantined" not in problem
    [todo] = [line for line in lines if line.startswith("  what to do: ")]
    assert "restore the named files" in todo
    assert QUARANTINE_NAME not in todo  # no marker: nothing to remove
    assert not (wal / QUARANTINE_NAME).exists()  # verify writes nothing
    assert lines[-1] == "1 relations checked, 1 with problems"


def test_a_damaged_state_file_is_described_not_dumped(tmp_path: Path) -> None:
    """A state file with a byte that is not UTF-8 used to be quoted whole as a bytes repr
    (in verify, the QUARANTINED marker and the log: the message is built in one place)."""
    segments(tmp_path)
    with Store.open(tmp_path) as store:
        rel = store.relation("r")
        trace = Trace.open(store.layout.trace_store("r"), rel.meta)
        convert(trace, rel.wal_dir, per_plan=3)
        trace.delete_converted_segments(rel.wal_dir)
    state_dir = tmp_path / "trace" / "r" / "state"
    newest = sorted(state_dir.iterdir())[-1]
    flip(newest, at=40, value=0xFF)
    code, lines = report(tmp_path)
    assert code == 1
    problems = [line for line in lines if line.startswith("  problem: ")]
    assert problems == [f"  problem: trace state is unreadable: not UTF-8 text (byte 0xff at "
                        f"offset 40) [{newest}]"], lines
    assert all(len(line) <= MAX_PROBLEM + 20 for line in lines)
    # the deleted, converted segments are not reported missing: the state that says which
    # were converted cannot be read, so the chain's start is not checked
    assert not any("missing" in line for line in lines)
    # a quarantine marker written from that error carries the same bounded description
    with Store.open(tmp_path) as store:
        store.layout.quarantine("r", problems[0], store.fs)
    code, lines = report(tmp_path)
    assert any(line.startswith("  problem: quarantined: ") and "b'" not in line
               for line in lines)
    [todo] = [line for line in lines if line.startswith("  what to do: ")]
    assert todo.endswith(f"then remove {tmp_path / 'wal' / 'r' / QUARANTINE_NAME}")
