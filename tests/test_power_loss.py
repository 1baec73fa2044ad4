"""Power loss (lamina.testing.faults.PowerLossFileSystem): a crash that drops or tears every byte
not yet fdatasynced and undoes directory operations not yet made durable by a directory
fsync, which kill -9 (the page cache survives it) cannot show.

First the model itself, on plain files. Then the proof that it catches a missing fsync:
the same lamina workload, run through a storage layer with a deliberate bug (a skipped
fdatasync or directory fsync), loses acknowledged data at some crash point. Then lamina
as it is: a workload of appends and seals with segment rotation, conversions and merges
with the reference executor, segment deletion and garbage collection, crashed at many
random points (each crash taken into a copy of the data directory while the workload
carries on), never loses an acknowledged write, a frontier or a published trace state,
and recovers to a clean ``verify``.

``LAMINA_POWER_SEED`` shifts every seed (the default is fixed so failures repeat).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest

from lamina.errors import LaminaError, RelationNotFoundError
from lamina.fs import FileSystem
from lamina.objstore.local import LocalObjectStore
from lamina.schema import RelationMeta
from lamina.store import Relation, Store
from lamina.testing.faults import Op, PowerCut, PowerLossFileSystem
from lamina.trace.trace import Trace
from lamina.verify import verify_store
from tests.trace.helpers import (
    KEY,
    NAME,
    SCHEMA,
    NoSyncFileSystem,
    Oracle,
    Update,
    check_trace,
    collect_all,
    convert,
    table_of,
)

SEED = int(os.environ.get("LAMINA_POWER_SEED", "0"))


# --- the model on plain files -------------------------------------------------------------

def _images(fs: PowerLossFileSystem, tmp: Path, n: int) -> list[dict[str, bytes]]:
    """``n`` crash images of the shim's root (seeds 0..n-1): every file by name."""
    out = []
    for seed in range(n):
        dest = tmp / f"image-{seed}"
        fs.crash(random.Random(seed), into=dest)
        out.append({p.relative_to(dest).as_posix(): p.read_bytes()
                    for p in sorted(dest.rglob("*")) if p.is_file()})
    return out


def test_unsynced_bytes_are_dropped_or_torn_synced_bytes_never(tmp_path: Path) -> None:
    """Appended bytes after the last fdatasync come back dropped, whole or cut (sometimes
    with a garbage tail), always as an extension of the synced bytes, which survive every
    crash."""
    root = tmp_path / "root"
    root.mkdir()
    fs = PowerLossFileSystem(root)
    h = fs.open_append(root / "log", create=True)
    h.write(b"A" * 100)
    h.sync()
    fs.fsync_dir(root)
    h.write(b"B" * 100)
    assert fs.unsynced() == ([], [Path("log")])
    seen = set()
    for image in _images(fs, tmp_path, 40):
        data = image["log"]
        assert data[:100] == b"A" * 100
        assert 100 <= len(data) <= 200
        kept = data[100:]
        seen.add("dropped" if not kept else "whole" if kept == b"B" * 100
                 else "cut" if set(kept) == {ord("B")} else "garbled")
    assert seen == {"dropped", "whole", "cut", "garbled"}
    h.sync()
    assert all(image["log"] == b"A" * 100 + b"B" * 100 for image in _images(fs, tmp_path / "s", 5))


def test_a_truncation_before_its_fdatasync_may_be_lost(tmp_path: Path) -> None:
    """A file cut back (as WAL recovery cuts a torn tail) comes back cut or whole until
    the cut is fdatasynced; after that, always cut."""
    root = tmp_path / "root"
    root.mkdir()
    fs = PowerLossFileSystem(root)
    h = fs.open_append(root / "log", create=True)
    h.write(b"A" * 50 + b"torn")
    h.sync()
    fs.fsync_dir(root)
    h.truncate(50)
    assert {image["log"] for image in _images(fs, tmp_path / "a", 12)} == {
        b"A" * 50, b"A" * 50 + b"torn"}
    h.sync()
    assert {image["log"] for image in _images(fs, tmp_path / "b", 4)} == {b"A" * 50}


def test_directory_operations_need_a_directory_fsync(tmp_path: Path) -> None:
    """A create, rename or unlink is undone by some crash until its directory is fsynced;
    undoing a rename brings back the file it replaced, undoing an unlink restores the
    file, and operations on the same name keep their order."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "old").write_bytes(b"old")
    (root / "doomed").write_bytes(b"doomed")
    fs = PowerLossFileSystem(root)
    fs.write_atomic(root / "new", b"x")  # temp, fsync, rename, dir fsync: durable
    h = fs.open_append(root / "tmp", create=True)
    h.write(b"replacement")
    h.sync()
    h.close()
    fs.rename(root / "tmp", root / "old", sync_dir=False)
    fs.unlink(root / "doomed", sync_dir=False)
    ops, _ = fs.unsynced()
    assert ops == ["create tmp", "rename tmp -> old", "unlink doomed"]
    outcomes = set()
    for image in _images(fs, tmp_path, 40):
        assert image["new"] == b"x"
        assert "tmp" not in image or image["old"] == b"old"  # rename undone if tmp is back
        assert image["old"] in (b"old", b"replacement")
        outcomes.add((image["old"], "doomed" in image))
    assert outcomes == {(b"old", True), (b"old", False), (b"replacement", True),
                        (b"replacement", False)}
    fs.fsync_dir(root)
    assert fs.unsynced() == ([], [])
    assert all(image == {"new": b"x", "old": b"replacement"}
               for image in _images(fs, tmp_path / "s", 5))


def test_cut_stops_every_operation_and_crash_in_place_rewrites_the_files(tmp_path: Path) -> None:
    """``cut_at`` turns the power off before that operation: it and everything after it
    raise PowerCut; ``crash`` then applies the loss to the real files and the shim starts
    afresh with everything on disk durable."""
    fs = PowerLossFileSystem(tmp_path, cut_at=6)
    fs.write_atomic(tmp_path / "a", b"1")  # ops 1-4
    h = fs.open_append(tmp_path / "b", create=True)
    h.write(b"2")  # op 5
    with pytest.raises(PowerCut):
        h.sync()  # op 6
    with pytest.raises(PowerCut):
        fs.write_atomic(tmp_path / "c", b"3")
    fs.crash(random.Random(1))
    assert (tmp_path / "a").read_bytes() == b"1"
    assert not (tmp_path / "c").exists()
    assert not (tmp_path / "b").exists() or (tmp_path / "b").read_bytes() in (b"", b"2")
    assert fs.unsynced() == ([], [])
    fs.write_atomic(tmp_path / "d", b"4")  # the power is back on
    assert (tmp_path / "d").read_bytes() == b"4"


# --- lamina under power loss ------------------------------------------------------------------

@dataclass(frozen=True)
class Expect:
    """What a crash image must hold: everything acknowledged, maybe the call in flight."""

    updates: tuple[Update, ...]
    upper: int
    since: int
    version: int
    created: bool
    inflight: tuple[str, object] | None

    def oracles(self) -> list[Oracle]:
        """The acceptable outcomes: without and with the call in flight."""
        base = Oracle(list(self.updates), self.upper, self.since)
        out = [base]
        if self.inflight is not None:
            kind, arg = self.inflight
            alt = Oracle(list(self.updates), self.upper, self.since)
            if kind == "append":
                alt.updates.extend(arg)  # type: ignore[arg-type]
            elif kind == "seal":
                alt.upper = int(arg)  # type: ignore[call-overload]
            elif kind == "since":
                alt.since = int(arg)  # type: ignore[call-overload]
            out.append(alt)
        return out


@dataclass(frozen=True)
class Image:
    root: Path
    op: Op
    expect: Expect
    report: str


@dataclass
class Workload:
    """Drives the workload through a power-loss file system and takes crash images (a
    crash into a fresh copy) before every rename, link and unlink, and before each other
    file operation with probability ``rate``."""

    root: Path
    scratch: Path
    seed: int
    rate: float
    fs_factory: Callable[..., PowerLossFileSystem] = PowerLossFileSystem
    kill_at: int | None = None
    """Raise Killed before this file operation (a kill -9: the page cache survives)."""
    oracle: Oracle = field(default_factory=Oracle)
    version: int = 0
    created: bool = False
    inflight: tuple[str, object] | None = None
    images: list[Image] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.fs = self.fs_factory(self.root, on_op=self._on_op)

    def _on_op(self, op: Op) -> None:
        if op.number == self.kill_at:
            raise Killed(f"killed before {op}")
        if not self.rate or (op.kind not in ("rename", "link", "unlink")
                             and self.rng.random() >= self.rate):
            return
        self.image(op)

    def expect(self) -> Expect:
        return Expect(tuple(self.oracle.updates), self.oracle.upper, self.oracle.since,
                      self.version, self.created, self.inflight)

    def image(self, op: Op) -> None:
        """A crash image of the data directory now (before ``op``)."""
        dest = self.scratch / f"image-{len(self.images):04d}"
        report = self.fs.crash(self.rng, into=dest)
        self.images.append(Image(dest, op, self.expect(), str(report)))

    # --- acknowledged calls ---------------------------------------------------------------
    def append(self, rel: Relation, rows: Sequence[Update]) -> None:
        self.inflight = ("append", list(rows))
        self.oracle.append(rel, rows)
        self.inflight = None

    def seal(self, rel: Relation, upper: int) -> None:
        self.inflight = ("seal", upper)
        self.oracle.seal(rel, upper)
        self.inflight = None

    def allow_compaction(self, rel: Relation, since: int) -> None:
        self.inflight = ("since", since)
        self.oracle.allow_compaction(rel, since)
        self.inflight = None

    def rounds(self, rel: Relation, n: int, seed: int) -> None:
        """Appends of present, future (pending) and retracting updates, and seals; the
        segments (4 KiB) rotate every few rounds."""
        for i in range(n):
            j = seed + i
            up = self.oracle.upper
            rows = [(j % 5, "abc"[j % 3] * (1 + j % 40), up + (j * 7) % 5, 1 + j % 2),
                    (j % 3, "x", up + 9 + j % 23, 1)]
            if j % 3 == 0:
                rows.append(((j + 1) % 5, "abc"[(j + 1) % 3] * (2 + j % 40), up, -1))
            self.append(rel, rows)
            self.seal(rel, up + 2)

    def run(self) -> None:
        """Create, write, convert and merge, delete segments, collect garbage, write on."""
        store = Store.open(self.root, segment_bytes=4096, fs=self.fs)
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        self.created = True
        trace = Trace.open(store.layout.trace_store(NAME, self.fs), rel.meta, fs=self.fs)
        self.rounds(rel, 14, self.seed)
        convert(trace, rel.wal_dir, per_plan=2)  # conversions, each followed by merges
        self.version = trace.state.version
        trace.delete_converted_segments(rel.wal_dir)
        self.allow_compaction(rel, self.oracle.upper - 6)
        self.rounds(rel, 10, self.seed + 14)
        convert(trace, rel.wal_dir, per_plan=3)
        self.version = trace.state.version
        trace.delete_converted_segments(rel.wal_dir)
        collect_all(trace, keep_versions=2)
        self.rounds(rel, 4, self.seed + 24)
        store.close()


class Killed(BaseException):
    """The process under test was killed (SIGKILL): nothing after this point runs, and the
    page cache, unlike after a power cut, keeps everything written."""


def recover_image(root: Path, fs: FileSystem | None = None) -> None:
    """What lamina does after a restart: the writer's WAL recovery, then the compacter's
    (delete converted segments, convert the rest, merge, collect garbage)."""
    fs = fs or NoSyncFileSystem()
    with Store.open(root, fs=fs) as store:
        try:
            rel = store.relation(NAME)
        except RelationNotFoundError:
            return
        rel.seal(rel.upper)  # takes the writer: WAL recovery
        trace = Trace.open(store.layout.trace_store(NAME, fs), rel.meta, fs=fs)
        trace.delete_converted_segments(rel.wal_dir)
        convert(trace, rel.wal_dir, per_plan=8)
        trace.delete_converted_segments(rel.wal_dir)
        collect_all(trace)


def check_image(root: Path, exp: Expect) -> list[str]:
    """Read a crash image as a reader would, recover it the way lamina does, and list what
    is wrong with it. A lost acknowledgement is reported with the word "acknowledged"."""
    problems: list[str] = []
    try:
        with Store.open(root, fs=NoSyncFileSystem()) as store:
            try:
                rel = store.relation(NAME)
            except RelationNotFoundError:
                return ["acknowledged relation lost"] if exp.created else []
            trace_dir = store.layout.trace_dir(NAME)
            state = check_trace(trace_dir, rel.meta)
            version = 0 if state is None else state.version
            if version < exp.version:
                problems.append(f"acknowledged trace state version {exp.version} lost "
                                f"(found {version})")
            problems += _check_contents(rel, exp.oracles(), "read before recovery")
        recover_image(root)
        with Store.open(root, fs=NoSyncFileSystem()) as store:
            rel = store.relation(NAME)
            problems += _check_contents(rel, exp.oracles(), "after recovery")
            rel.append(table_of([(99, "after", rel.upper, 1)]))  # the writer works on
            rel.seal(rel.upper + 1)
            problems += [f"verify: {p}" for r in verify_store(store.layout) for p in r.problems]
    except (LaminaError, AssertionError, FileNotFoundError) as exc:
        problems.append(f"recovery failed: {type(exc).__name__}: {exc}")
    return problems


def _check_contents(rel: Relation, oracles: list[Oracle], when: str) -> list[str]:
    """Frontiers and snapshots match one acceptable outcome."""
    upper, since = rel.upper, rel.since
    if upper < oracles[0].upper:
        return [f"{when}: acknowledged upper {oracles[0].upper} lost (found {upper})"]
    if since < oracles[0].since:
        return [f"{when}: acknowledged since {oracles[0].since} lost (found {since})"]
    points = sorted({since, upper - 1, oracles[0].upper - 1} & set(range(since, upper)))
    got = {t: rel.snapshot(t).to_pylist() for t in points}
    if any(all(got[t] == o.snapshot(t) for t in points) for o in oracles):
        return []
    return [f"{when}: acknowledged updates lost: snapshots at {points} match no acceptable "
            "outcome"]


def _run(tmp_path: Path, seed: int, rate: float,
         factory: Callable[..., PowerLossFileSystem] = PowerLossFileSystem,
         kill_at: int | None = None) -> Workload:
    w = Workload(tmp_path / "data", tmp_path / "images", seed, rate, factory, kill_at)
    try:
        w.run()
    except Killed:
        assert kill_at is not None
    return w


@pytest.mark.parametrize(("seed", "rate"), [(1, 0.5), (2, 0.25)])
def test_lamina_never_loses_acknowledged_data_at_a_power_cut(tmp_path: Path, seed: int,
                                                             rate: float) -> None:
    """The module docstring's main claim: a crash before every rename, link and unlink of
    the workload and before half of its other file operations (seed 1) or a quarter
    (seed 2: other operations, other loss choices), each image read, recovered and
    checked against the acknowledged calls: every acknowledged update, frontier and trace
    state version is there, nothing is corrupt, recovery converts the rest, the writer
    appends on, and verify is clean."""
    w = _run(tmp_path, SEED * 1000 + seed, rate=rate)
    assert len(w.images) > 40
    assert sum("undone" in img.report for img in w.images) > 10
    assert sum("unsynced bytes" in img.report for img in w.images) > 10
    assert any(img.expect.version > 0 for img in w.images)
    kinds = {img.op.kind for img in w.images}
    assert kinds == {"write", "fdatasync", "fsync_dir", "rename", "link", "unlink"}
    failures = {f"{img.root.name} before {img.op}: {p}\n{img.report}"
                for img in w.images for p in check_image(img.root, img.expect)}
    assert not failures, "\n".join(sorted(failures)[:5])


def test_a_power_cut_during_recovery_loses_nothing(tmp_path: Path) -> None:
    """Recovery itself (cutting a torn WAL tail, finishing a segment left open by a
    rotation, deleting converted segments, converting, merging, collecting garbage) is
    crashed too: a second power cut at random points of the recovery of crash images
    leaves images that recover to every acknowledged write."""
    w = _run(tmp_path, SEED * 1000 + 3, rate=0.2)
    rng = random.Random(SEED * 1000 + 4)
    nested: list[tuple[Path, Expect]] = []
    for img in w.images[::2]:
        fs = PowerLossFileSystem(img.root)

        def hook(op: Op, img: Image = img, fs: PowerLossFileSystem = fs) -> None:
            if rng.random() < 0.08:
                dest = img.root.with_name(f"{img.root.name}-again-{op.number}")
                fs.crash(rng, into=dest)
                nested.append((dest, img.expect))

        fs.on_op = hook
        recover_image(img.root, fs)
    assert len(nested) > 10
    failures = {f"{root.name}: {p}" for root, exp in nested for p in check_image(root, exp)}
    assert not failures, "\n".join(sorted(failures)[:5])


class SkipsSyncs(PowerLossFileSystem):
    """A storage layer with a durability bug: it skips the fdatasync or directory fsync
    calls that ``skip`` picks (they return as if done)."""

    skip: Callable[[str, Path], bool] = staticmethod(lambda kind, path: False)

    def os_fdatasync(self, fd: int, path: Path) -> None:
        if not self.skip("fdatasync", path):
            super().os_fdatasync(fd, path)

    def os_fsync_dir(self, path: Path) -> None:
        if not self.skip("fsync_dir", path):
            super().os_fsync_dir(path)


def _skipping(rule: Callable[[str, Path], bool]) -> Callable[..., PowerLossFileSystem]:
    return type("Buggy", (SkipsSyncs,), {"skip": staticmethod(rule)})


BUGS: dict[str, Callable[[str, Path], bool]] = {
    # appends acknowledged without reaching the disk
    "no fdatasync of WAL appends": lambda kind, p: (kind == "fdatasync"
                                                    and p.name.endswith(".wal.open")),
    # new segments and finished names never made durable
    "no fsync of the WAL directory": lambda kind, p: (kind == "fsync_dir"
                                                      and p.parent.name == "wal"),
    # a published trace state is not durable when the converted segments are deleted
    "no fsync of the state directory": lambda kind, p: kind == "fsync_dir" and p.name == "state",
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_missing_fsync_loses_acknowledged_data(tmp_path: Path, bug: str) -> None:
    """The shim finds a missing sync: the same workload run through a storage layer that
    skips one kind of sync loses acknowledged data (an update, a frontier or a trace
    state) at some crash point, which kill -9 alone would never show."""
    w = _run(tmp_path, SEED * 1000 + 7, rate=0.35, factory=_skipping(BUGS[bug]))
    lost = next((p for img in w.images for p in check_image(img.root, img.expect)
                 if "acknowledged" in p), None)
    assert lost is not None, f"{bug}: no crash image lost acknowledged data"


def _publish_kill_points(tmp_path: Path, seed: int) -> list[int]:
    """File operations right after the first state publications of the workload (the
    link of a new state version, before its temp name is removed and the state directory
    fsynced): where a kill leaves a published state that is not durable yet."""
    w = _run(tmp_path, seed, rate=0.0, factory=partial(PowerLossFileSystem, record=True))
    links = [op.number for op in w.fs.ops if op.kind == "link"][:3]
    assert links
    return [n + k for n in links for k in (1, 2)]


def test_a_power_cut_after_a_killed_compacter_restarted_loses_nothing(tmp_path: Path) -> None:
    """Two faults in a row: the compacter is killed right after linking a new state
    version (before the state directory was fsynced), restarts with the page cache intact
    (it reads that version and deletes the segments it converted), and then the power
    fails at any point of that recovery. The restarted compacter must make the state it
    read durable before deleting the inputs it replaced (crash-safety rule 3,
    docs/architecture.md): no crash image
    may lose an acknowledged update."""
    seed = SEED * 1000 + 5
    failures: list[str] = []
    for kill_at in _publish_kill_points(tmp_path / "dry", seed):
        w = _run(tmp_path / f"kill-{kill_at}", seed, rate=0.0, kill_at=kill_at)
        fs = w.fs

        def hook(op: Op, w: Workload = w) -> None:
            if op.kind in ("unlink", "fsync_dir", "link"):
                for _ in range(4):  # several loss choices at each point
                    w.image(op)

        fs.on_op = hook
        meta_path = w.root / "wal" / NAME / "relation.json"
        meta = RelationMeta.from_json(meta_path.read_bytes(), meta_path)
        wal_dir = w.root / "wal" / NAME
        # the restart
        trace = Trace.open(LocalObjectStore(w.root / "trace" / NAME, fs), meta, fs=fs)
        trace.delete_converted_segments(wal_dir)
        convert(trace, wal_dir, per_plan=8)
        trace.delete_converted_segments(wal_dir)
        fs.on_op = None
        for _ in range(4):  # and crashes once recovery is done
            w.image(Op(0, "fsync_dir", 0, w.root))
        assert w.images
        failures += [f"kill at {kill_at}, {img.root.name} before {img.op}: {p}"
                     for img in w.images for p in check_image(img.root, img.expect)]
    assert not failures, "\n".join(failures[:5])
