"""An output added to a files source (offsets replayable from the start) is filled by
replay, and the outputs that hold data already get nothing twice."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lamina import Store
from lamina.ingest.files import FilesSource
from lamina.ingest.runner import SourceRunner
from lamina.ingest.settings import FilesSourceSettings
from tests.ingest.running import run_until


def _settings(path: Path, errors: str) -> FilesSourceSettings:
    return FilesSourceSettings.model_validate({
        "name": "src", "kind": "files", "path": str(path), "format": "jsonl",
        "schema": {"id": "int64", "name": "string"}, "key": ["id"], "errors": errors,
        "timestamp_interval_seconds": 0.02, "poll_interval_seconds": 0.01})


def _run(store: Store, settings: FilesSourceSettings,
         cond: Callable[[SourceRunner], bool]) -> dict[str, Any]:
    return run_until(store, settings, FilesSource(settings), cond)[1]


def _ids(store: Store, relation: str) -> list[tuple[Any, int]]:
    rel = store.relation(relation)
    if rel.upper == 0:
        return []
    return sorted((r.get("id", r.get("line")), r["_diff"])
                  for r in rel.snapshot(rel.upper - 1).to_pylist())


def _lines(ids: range) -> str:
    return "".join(json.dumps({"id": i, "name": f"n{i}"}) + "\n" for i in ids)


def test_an_output_added_to_a_files_source_is_filled_by_replay(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "a.jsonl").write_text(_lines(range(0, 10)) + "not json\n")
    (spool / "b.jsonl").write_text(_lines(range(10, 20)))
    with Store.open(tmp_path / "d") as store:
        first = _settings(spool, "stall")
        _run(store, first, lambda r: r.health.state == "stalled")   # at the bad line
        assert _ids(store, "src") == [(i, 1) for i in range(10)]
        # now bad lines go to the new output "src.errors", which holds nothing yet
        second = _settings(spool, "relation")
        status = _run(store, second, lambda r: _ids(store, "src") == [
            (i, 1) for i in range(20)] or len(_ids(store, "src")) > 20)
        outs = {o["relation"]: o for o in status["outputs"]}
        assert outs["src.errors"]["state"] == "running", outs
        assert _ids(store, "src") == [(i, 1) for i in range(20)]      # nothing twice
        assert _ids(store, "src.errors") == [(11, 1)]                  # line 11 of a.jsonl


def test_an_output_added_to_a_source_that_cannot_replay_stalls_and_the_rest_commit(
        tmp_path: Path) -> None:
    """A scripted source without ``replays_from_start``: the added table's output stalls
    (nothing written, relation not created), the other output resumes where it was, gets
    nothing twice, and offsets are committed past the stalled output's (it is left out)."""
    from lamina.ingest.settings import PostgresSourceSettings
    from tests.ingest.test_runner import ScriptSource, ids

    def settings(tables: list[str]) -> PostgresSourceSettings:
        return PostgresSourceSettings.model_validate({
            "name": "pg", "kind": "postgres", "dsn": "host=/nowhere", "tables": tables,
            "timestamp_interval_seconds": 0.01})

    def run(tables: list[str], src: ScriptSource,
            cond: Callable[[SourceRunner], bool]) -> tuple[SourceRunner, dict[str, Any]]:
        return run_until(store, settings(tables), src, cond)

    with Store.open(tmp_path / "d") as store:
        run(["public.a"], ScriptSource(20), lambda r: r.committed == 20)
        assert ids(store, "pg.a") == [(i, 1) for i in range(0, 20, 2)]
        src = ScriptSource(40)
        r, status = run(["public.a", "public.b"], src, lambda r: r.committed == 40)
        assert src.opened[0] is not None          # resumed, not re-read from the start
        outs = {o["relation"]: o for o in status["outputs"]}
        assert outs["pg.b"]["state"] == "stalled"
        assert "holds no data" in outs["pg.b"]["error"]
        assert "lamina ingest resync --config FILE pg public.b" in outs["pg.b"]["hint"]
        assert outs["pg.a"]["state"] == "running"
        assert "pg.b" not in store.relations()
        assert ids(store, "pg.a") == [(i, 1) for i in range(0, 40, 2)]
        assert r.status()["resume_frontier"] == store.relation("pg.a").upper


def test_a_kill_between_the_seals_of_the_first_binding_is_completed_not_stalled(
        tmp_path: Path) -> None:
    """The first binding's changes are appended to both outputs, then (a kill between the
    seals) only one is sealed: on restart the other is sealed too, not taken for a new
    output, and both go on holding every row once."""
    from lamina import failpoints
    from lamina.ingest.settings import PostgresSourceSettings
    from tests.ingest.test_runner import ScriptSource, ids

    settings = PostgresSourceSettings.model_validate({
        "name": "pg", "kind": "postgres", "dsn": "host=/nowhere",
        "tables": ["public.a", "public.b"], "timestamp_interval_seconds": 0.01})

    def run(src: ScriptSource, cond: Callable[[SourceRunner], bool]) -> SourceRunner:
        return run_until(store, settings, src, cond)[0]

    with Store.open(tmp_path / "d") as store:
        with failpoints.active("ingest.outputs_appended=error"):
            run(ScriptSource(6), lambda r: r.health.state == "stalled")
        a, b = store.relation("pg.a"), store.relation("pg.b")
        assert a.upper == b.upper == 0
        first = store.relation("pg.remap").upper - 1       # the first binding's time
        a.seal(first + 1)                                   # as if killed before b's seal
        r = run(ScriptSource(20), lambda r: r.committed == 20)
        assert r.health.state == "ceased"
        assert ids(store, "pg.a") == [(i, 1) for i in range(0, 20, 2)]
        assert ids(store, "pg.b") == [(i, 1) for i in range(1, 20, 2)]
