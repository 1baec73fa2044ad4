"""The files source on real files: complete lines only, CSV/JSONL/Parquet, file order,
malformed input (stall naming file and line, or the errors relation), resumption."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lamina.errors import SourceStalledError
from lamina.ingest.files import ERRORS_SCHEMA, FilesSource
from lamina.ingest.settings import FilesSourceSettings
from lamina.ingest.source import Event, Stall, Transaction, Upper


def settings(path: Path, fmt: str = "jsonl", **kw: Any) -> FilesSourceSettings:
    base: dict[str, Any] = {"name": "src", "kind": "files", "path": str(path), "format": fmt,
                            "schema": {"id": "int64", "name": "string"}, "key": ["id"]}
    base.update(kw)
    return FilesSourceSettings.model_validate(base)


def drain(src: FilesSource, polls: int = 5) -> list[Event]:
    out: list[Event] = []
    for _ in range(polls):
        out.extend(src.poll(0.01))
    return out


def rows(events: list[Event], table: str = "src") -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for ev in events:
        if isinstance(ev, Transaction) and table in ev.changes:
            out.extend(ev.changes[table].to_pylist())
    return out


def uppers(events: list[Event]) -> list[Any]:
    return [ev.offset for ev in events if isinstance(ev, Upper)]


def test_jsonl_reads_only_complete_lines_and_moves_through_files_in_name_order(
        tmp_path: Path) -> None:
    (tmp_path / "b.jsonl").write_text('{"id": 3, "name": "c"}\n')
    (tmp_path / "a.jsonl").write_text('{"id": 1, "name": "a"}\n{"id": 2, "na')
    (tmp_path / ".hidden.jsonl").write_text("not json\n")
    src = FilesSource(settings(tmp_path))
    specs = src.open(None)
    assert specs["src"].key == ("id",)
    ev = drain(src)
    assert rows(ev) == [{"id": 1, "name": "a", "_diff": 1}]
    assert uppers(ev)[-1] == ["a.jsonl", 23]     # waits for the partial line, not b.jsonl
    with open(tmp_path / "a.jsonl", "a") as f:
        f.write('me": "b"}\n')
    ev = drain(src)
    assert rows(ev) == [{"id": 2, "name": "b", "_diff": 1}, {"id": 3, "name": "c", "_diff": 1}]
    assert uppers(ev)[-1] == ["b.jsonl", 23]
    txns = [e for e in ev if isinstance(e, Transaction)]
    assert [t.offset for t in txns] == [["a.jsonl", 23], ["b.jsonl", 0]]
    ups = uppers(ev)
    assert ups == sorted(ups)
    assert src.lag_offsets() == 0


def test_resume_mid_file_reads_only_what_follows(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"id": 1, "name": "a"}\n{"id": 2, "name": "b"}\n')
    src = FilesSource(settings(tmp_path))
    src.open(src.decode_offset(src.encode_offset(["a.jsonl", 23])))
    assert rows(drain(src)) == [{"id": 2, "name": "b", "_diff": 1}]


def test_malformed_line_stalls_naming_file_and_line_after_emitting_what_precedes(
        tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"id": 1, "name": "a"}\n\n{"id": "x", "name": "b"}\n'
                                      '{"id": 3, "name": "c"}\n')
    src = FilesSource(settings(tmp_path))
    src.open(None)
    ev = drain(src)
    assert rows(ev) == [{"id": 1, "name": "a", "_diff": 1}]
    stalls = [e for e in ev if isinstance(e, Stall)]
    assert len(stalls) == 1
    assert "a.jsonl line 3" in stalls[0].error
    assert "line 3" in stalls[0].hint
    assert uppers(ev)[-1] == ["a.jsonl", 24]     # stops at the bad line's first byte
    assert rows(drain(src)) == []                # nothing after it, ever


@pytest.mark.parametrize("line", ['{"id": null, "name": "a"}', '{"id": 1, "extra": 2}',
                                  "[1, 2]", '{"id": 1, "name": "a"'])
def test_what_counts_as_malformed(tmp_path: Path, line: str) -> None:
    (tmp_path / "a.jsonl").write_text(line + "\n")
    src = FilesSource(settings(tmp_path))
    src.open(None)
    assert any(isinstance(e, Stall) and "line 1" in e.error for e in drain(src))


def test_errors_relation_takes_bad_lines_and_reading_goes_on(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"id": 1, "name": "a"}\nnope\n{"id": 3, "name": "c"}\n')
    src = FilesSource(settings(tmp_path, errors="relation"))
    specs = src.open(None)
    assert specs["src.errors"].schema == ERRORS_SCHEMA
    ev = drain(src)
    assert [r["id"] for r in rows(ev)] == [1, 3]
    bad = rows(ev, "src.errors")
    assert len(bad) == 1
    assert bad[0]["file"] == "a.jsonl"
    assert bad[0]["line"] == 2
    assert bad[0]["byte"] == 23
    assert bad[0]["text"] == "nope"
    assert bad[0]["error"]
    assert not any(isinstance(e, Stall) for e in ev)


def test_csv_with_header_in_any_column_order(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text('name,id\n"x, y",1\nz,2\n')
    src = FilesSource(settings(tmp_path, "csv"))
    src.open(None)
    assert rows(drain(src)) == [{"id": 1, "name": "x, y", "_diff": 1},
                                {"id": 2, "name": "z", "_diff": 1}]
    with open(tmp_path / "a.csv", "a") as f:
        f.write("w,notanint\n")
    ev = drain(src)
    assert any(isinstance(e, Stall) and "a.csv line 4" in e.error for e in ev)
    # resumed after the header: the header is read again from line 1
    src2 = FilesSource(settings(tmp_path, "csv"))
    src2.open(["a.csv", 16])
    assert rows(drain(src2))[0]["id"] == 2


def test_csv_records_with_quoted_newlines_are_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text('id,name\n200,"plain"\n201,"multi\nline value"\n'
                    '202,"three\n""quoted""\nlines"\n203,"open\nstill open')
    src = FilesSource(settings(tmp_path, "csv", errors="relation"))
    src.open(None)
    ev = drain(src)
    # record 203's closing quote is not written yet: it waits, no part of it is a row
    assert rows(ev) == [{"id": 200, "name": "plain", "_diff": 1},
                        {"id": 201, "name": "multi\nline value", "_diff": 1},
                        {"id": 202, "name": 'three\n"quoted"\nlines', "_diff": 1}]
    assert not rows(ev, "src.errors")
    upper = uppers(ev)[-1]
    assert upper == ["a.csv", path.read_bytes().index(b"203")]
    with open(path, "a") as f:
        f.write('"\n204,x\n205,"bad\nmulti",line\n206,y\n')
    ev = drain(src)
    assert [(r["id"], r["name"]) for r in rows(ev)] == [(203, "open\nstill open"),
                                                        (204, "x"), (206, "y")]
    (bad,) = rows(ev, "src.errors")          # one malformed record, named by its first line
    assert bad["line"] == 11
    assert bad["text"] == '205,"bad\nmulti",line'
    # resumed at a record boundary: line numbers and records as before
    src2 = FilesSource(settings(tmp_path, "csv", errors="relation"))
    src2.open(upper)
    assert [r["id"] for r in rows(drain(src2))] == [203, 204, 206]
    # batches of at most 1 KiB end at record boundaries, never inside a quoted value
    other = tmp_path / "b"
    other.mkdir()
    (other / "b.csv").write_text("id,name\n" + "".join(
        f'{i},"{i}\n{"x" * (i % 50)}\n"\n' for i in range(300)))
    src3 = FilesSource(settings(other, "csv", max_batch_bytes=1024))
    src3.open(None)
    got = rows(drain(src3, polls=40))
    assert [(r["id"], r["name"]) for r in got] == [
        (i, f"{i}\n{'x' * (i % 50)}\n") for i in range(300)]


def test_csv_bad_header_stalls(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("id,wrong\n1,a\n")
    src = FilesSource(settings(tmp_path, "csv"))
    src.open(None)
    stalls = [e for e in drain(src) if isinstance(e, Stall)]
    assert stalls
    assert "line 1" in stalls[0].error
    assert "header" in stalls[0].error


def test_parquet_files_are_read_whole(tmp_path: Path) -> None:
    t = pa.table({"name": ["a", "b"], "id": pa.array([1, 2], pa.int32()), "x": [0.5, 1.5]})
    pq.write_table(t, tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": [3]}), tmp_path / "b.parquet")   # lacks "name"
    src = FilesSource(settings(tmp_path, "parquet"))
    src.open(None)
    ev = drain(src)
    assert rows(ev) == [{"id": 1, "name": "a", "_diff": 1}, {"id": 2, "name": "b", "_diff": 1}]
    stalls = [e for e in ev if isinstance(e, Stall)]
    assert stalls
    assert "b.parquet" in stalls[0].error
    assert "name" in stalls[0].error


def test_missing_directory_and_missing_resume_file_are_definite(tmp_path: Path) -> None:
    with pytest.raises(SourceStalledError, match="not a directory"):
        FilesSource(settings(tmp_path / "nope")).open(None)
    with pytest.raises(SourceStalledError, match="gone"):
        FilesSource(settings(tmp_path)).open(["gone.jsonl", 10])


def test_offsets_round_trip_and_order(tmp_path: Path) -> None:
    src = FilesSource(settings(tmp_path))
    for off in (["", 0], ["a.jsonl", 5], ["b.jsonl", 0]):
        assert src.decode_offset(src.encode_offset(off)) == off
    assert ["", 0] < ["a.jsonl", 5] < ["a.jsonl", 6] < ["b.jsonl", 0]
    with pytest.raises(SourceStalledError):
        src.decode_offset("42")


def test_a_batch_never_spans_a_barrier(tmp_path: Path) -> None:
    """After a restart the replayed bindings' uppers are barriers: a re-read batch stops at
    each, so every line gets the binding time it had before."""
    (tmp_path / "a.jsonl").write_text("".join(f'{{"id": {i}, "name": "x"}}\n'
                                              for i in range(4)))
    src = FilesSource(settings(tmp_path))
    src.set_barriers([["a.jsonl", 46]])      # after line 2
    src.open(None)
    txns = [e for e in drain(src) if isinstance(e, Transaction)]
    assert [t.offset for t in txns] == [["a.jsonl", 0], ["a.jsonl", 46]]
    assert [t.changes["src"].num_rows for t in txns] == [2, 2]


def test_a_file_it_may_not_read_stalls_with_a_hint_instead_of_a_bare_oserror(
        tmp_path: Path) -> None:
    """Run as an unprivileged user (root reads everything), the source meets a file it may
    not open: a definite SourceStalledError naming the file, not an OSError."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    import pytest

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root to run the child as user nobody")
    d = Path(tempfile.mkdtemp(prefix="lamina-files-perm-"))
    try:
        d.chmod(0o755)
        f = d / "a.jsonl"
        f.write_text('{"id": 1, "name": "x"}\n')
        f.chmod(0o200)
        child = (
            "import sys\n"
            "from lamina.errors import SourceStalledError\n"
            "from lamina.ingest.files import FilesSource\n"
            "from lamina.ingest.settings import FilesSourceSettings\n"
            "s = FilesSourceSettings.model_validate({'name': 'src', 'kind': 'files', "
            f"'path': {str(d)!r}, 'format': 'jsonl', "
            "'schema': {'id': 'int64', 'name': 'string'}, 'key': ['id']})\n"
            "src = FilesSource(s)\nsrc.open(None)\n"
            "try:\n    [src.poll(0.01) for _ in range(5)]\n"
            "except SourceStalledError as e:\n    print('STALLED', e.error, '|', e.hint)\n"
            "    sys.exit(0)\n"
            "sys.exit(3)\n")
        src_dir = Path(__file__).resolve().parents[2] / "src"
        r = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                            sys.executable, "-c", child], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(src_dir)}, timeout=60,
                           check=False)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "STALLED" in r.stdout
        assert str(f) in r.stdout
        assert "let the user running `lamina ingest` read" in r.stdout
    finally:
        shutil.rmtree(d, ignore_errors=True)
