"""The files source: a directory of append-only JSON Lines or CSV files, or Parquet files
dropped whole, into one relation with a declared schema and key.

Files are the names in the directory matching the pattern (hidden names, starting with
``.``, are ignored: write ``.x.parquet`` and rename it into place), read in name order.
Offsets are ``[file name, byte offset]`` (JSON text in the remap relation), ordered as
that pair; before the first file the position is ``["", 0]``.

- **JSON Lines / CSV**: only complete records are read: a JSON line, or a CSV record, which
  ends at a newline outside double quotes (a quoted value may hold newlines: the record
  spans several lines and is read as one, never in part); a record without its ending
  newline waits for the writer. Each poll reads at most ``max_batch_bytes`` of complete
  records and emits them as one :class:`~lamina.ingest.source.Transaction` of inserts
  (``_diff = +1``) at the batch's first byte, then an :class:`~lamina.ingest.source.Upper`
  at the byte after its last record. A batch never spans a *barrier*
  (:meth:`FilesSource.set_barriers`: the uppers of durable bindings being replayed after a
  restart), so a re-read line gets the time it had. Blank lines are skipped. A CSV file
  starts with a header line naming the declared columns (any order) unless ``csv_header =
  false``. A record is numbered by its first line.
- **Parquet**: a whole file is one transaction at ``[name, 0]``; the upper moves to
  ``[name, size]``.
- The source moves to the next file once the current one is read to its end (no partial
  line left) and a later name exists; a line appended to a file after that is never read,
  so writers append to the newest file only.
- **Malformed input** (unparsable line, wrong type, a missing key, an unknown field): with
  ``errors = "stall"`` the lines before it are emitted, the upper stops at its first byte
  and the source stalls naming file and line; with ``errors = "relation"`` the line goes
  to ``<source>.errors`` (columns below, key ``file, line``) in the same transaction and
  reading goes on.

``<source>.errors``::

    file  string  not null   the file's name
    line  int64   not null   1-based line number
    byte  int64              byte offset of the line's start
    text  string             the record (at most 64 KiB of it)
    error string             what was wrong

``commit`` deletes nothing: files are the user's; ``lag_offsets`` is the bytes not read
yet. Each step lists the directory once (``os.scandir``) and stats only the files from the
current one on; ``lag_offsets`` reuses those sizes, so a directory of many read files costs
one listing per step and no stat per file. Commit times (``lag_seconds``) are the files'
modification times as that pass saw them (the lines read were written no later); once a
pass finds nothing more to read, its time is the upper's.
"""

from __future__ import annotations

import csv
import fnmatch
import io
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from lamina.errors import SourceError, SourceStalledError, SourceTransientError
from lamina.ingest.settings import FilesSourceSettings
from lamina.ingest.source import Event, Offset, Stall, TableSpec, Transaction, Upper
from lamina.schema import DIFF

ERRORS_SCHEMA = pa.schema([pa.field("file", pa.string(), False),
                           pa.field("line", pa.int64(), False),
                           pa.field("byte", pa.int64()), pa.field("text", pa.string()),
                           pa.field("error", pa.string())])
ERRORS_KEY = ("file", "line")
MAX_ERROR_TEXT = 64 << 10


@dataclass
class _Bad:
    line: int
    byte: int
    text: str
    error: str


class FilesSource:
    """Implements :class:`~lamina.ingest.source.Source` for a directory of files."""

    replays_from_start = True
    """``open(None)`` re-reads the files from the first: a new output is filled by replay."""

    def __init__(self, settings: FilesSourceSettings) -> None:
        self.settings = settings
        self.name = settings.name
        self.dir = Path(settings.path)
        self.upstream = settings.output_relation
        self.schema = settings.arrow_schema
        self.loose = pa.schema([f.with_nullable(True) for f in self.schema])
        self.key = tuple(settings.key)
        self.file = ""
        self.pos = 0
        self.line = 1
        self.header: list[str] | None = None
        self.stalled = False
        self.barriers: list[Offset] = []
        self._sizes: dict[str, int] | None = None     # the last pass over the directory
        self._mtimes: dict[str, float] = {}           # and the files' modification times

    def clock(self) -> float:
        return time.time()

    def set_barriers(self, offsets: list[Offset]) -> None:
        """Offsets no transaction may span: the uppers of bindings made durable before a
        restart. A batch ends at a barrier, so a re-read line lands at the time it had."""
        self.barriers = sorted(offsets)

    # --- offsets ---------------------------------------------------------------------------
    def encode_offset(self, offset: Offset) -> str:
        name, byte = offset
        return json.dumps([str(name), int(byte)])

    def decode_offset(self, text: str) -> Offset:
        value = json.loads(text)
        if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
                and isinstance(value[1], int)):
            raise SourceStalledError(f"files source {self.name!r}: offset {text!r} is not "
                                     "[file, byte]",
                                     hint="the remap relation was not written by this source; "
                                          "drop it or rename the source")
        return [value[0], value[1]]

    # --- lifecycle -------------------------------------------------------------------------
    def open(self, resume: Offset | None) -> dict[str, TableSpec]:
        try:
            return self._open(resume)
        except OSError as exc:
            raise self._translate(exc, "opening") from exc

    def _open(self, resume: Offset | None) -> dict[str, TableSpec]:
        if not self.dir.is_dir():
            raise SourceStalledError(f"files source {self.name!r}: {self.dir} is not a "
                                     "directory",
                                     hint=f"create {self.dir} or fix `path` in the config")
        self.file, self.pos = ("", 0) if resume is None else (resume[0], resume[1])
        self.header = None
        self.stalled = False
        self.line = 1
        self._sizes = None
        if self.file:
            path = self.dir / self.file
            if not path.exists():
                raise SourceStalledError(
                    f"files source {self.name!r}: {path} is gone, but ingestion must resume "
                    f"in it at byte {self.pos}",
                    hint="restore the file; remove files only once every output's upper is "
                         "past them (see /v1/sources: committed)")
            if self.settings.format != "parquet" and self.pos > 0:
                self.line = 1 + _count_newlines(path, self.pos)
        specs = {self.upstream: TableSpec(self.upstream, self.schema, self.key)}
        if self.settings.errors == "relation":
            er = self.settings.errors_relation
            specs[er] = TableSpec(er, ERRORS_SCHEMA, ERRORS_KEY)
        return specs

    def close(self) -> None:
        self.header = None

    def commit(self, offset: Offset) -> None:
        """Nothing to release: the files belong to the user."""

    def lag_offsets(self) -> int | None:
        """Bytes not read yet, by the sizes the last pass over the directory found (no file
        system call of its own); None before the first pass."""
        if self._sizes is None:
            return None
        return sum(max(0, size - self.pos) if name == self.file else size
                   for name, size in self._sizes.items() if name >= self.file)

    # --- reading ---------------------------------------------------------------------------
    def poll(self, timeout: float) -> list[Event]:
        try:
            return self._poll(timeout)
        except OSError as exc:
            raise self._translate(exc, "reading") from exc

    def _translate(self, exc: OSError, doing: str) -> SourceError:
        """An OS error of the directory or a file: a file that vanished under the read or
        an I/O error is retried (a re-opened source finds out whether the file it needs is
        gone); no permission is definite."""
        what = (f"files source {self.name!r}: {exc.strerror or type(exc).__name__} while "
                f"{doing} {exc.filename or self.dir}")
        if isinstance(exc, PermissionError):
            return SourceStalledError(what, hint=f"let the user running `lamina ingest` read "
                                      f"{self.dir} and its files, then restart `lamina ingest`")
        if isinstance(exc, IsADirectoryError | NotADirectoryError):
            return SourceStalledError(what, hint=f"keep only regular files matching "
                                      f"{self.settings.file_pattern!r} in {self.dir}")
        return SourceTransientError(what + "; retrying")

    def _poll(self, timeout: float) -> list[Event]:
        deadline = time.monotonic() + timeout
        while True:
            if self.stalled:
                time.sleep(max(0.0, deadline - time.monotonic()))
                return []
            scanned = time.time()
            events = self._step()
            if events:
                return events
            left = deadline - time.monotonic()
            if left <= 0:   # nothing more to read: every line written before the pass is
                return [Upper([self.file, self.pos], scanned)]
            time.sleep(min(left, self.settings.poll_interval_seconds))

    def _scan(self) -> dict[str, int]:
        """One pass over the directory: name -> size, in name order, of the files matching
        the pattern from the current file on. Files before it (read already) are not even
        statted; the entry type comes from the listing where the file system gives it."""
        pattern = self.settings.file_pattern
        sizes: dict[str, int] = {}
        mtimes: dict[str, float] = {}
        try:
            it = os.scandir(self.dir)
        except FileNotFoundError:
            it = None
        if it is not None:
            with it:
                for e in it:
                    n = e.name
                    if n.startswith(".") or n < self.file or \
                            not fnmatch.fnmatchcase(n, pattern):
                        continue
                    try:
                        if e.is_file():
                            st = e.stat()
                            sizes[n] = st.st_size
                            mtimes[n] = st.st_mtime
                    except FileNotFoundError:
                        continue        # removed since the listing: as if not listed
        self._sizes = dict(sorted(sizes.items()))
        self._mtimes = mtimes
        return self._sizes

    def _step(self) -> list[Event]:
        names = self._scan()
        if self.file and self.file not in names:
            self.stalled = True
            return [Stall(None, f"files source {self.name!r}: {self.dir / self.file} "
                                "disappeared before it was read to the end",
                          "restore the file; remove files only once ingestion moved past "
                          "them")]
        if self.file:
            size = names[self.file]
            if self.settings.format == "parquet":
                if self.pos == 0:
                    return self._parquet(size)
            elif size > self.pos:
                events = self._lines(size)
                if events:
                    return events
            if size < self.pos:
                self.stalled = True
                return [Stall(None, f"files source {self.name!r}: {self.dir / self.file} "
                                    f"shrank to {size} bytes below the {self.pos} already "
                                    "read", "files must be append-only; restore the file")]
            if size != self.pos:
                return []          # a partial line: wait for its newline
        later = [n for n in names if n > self.file]
        if not later:
            return []
        self.file, self.pos, self.line, self.header = later[0], 0, 1, None
        return [Upper([self.file, 0])]

    def _parquet(self, size: int) -> list[Event]:
        path = self.dir / self.file
        start = [self.file, 0]
        try:
            table = pq.read_table(path)
            missing = [n for n in self.schema.names if n not in table.column_names]
            if missing:
                raise ValueError(f"missing columns {missing}")
            table = table.select(self.schema.names).cast(self.loose)
            if self._null_key_rows(table):
                raise ValueError(f"key columns {list(self.key)} hold nulls")
        except (ValueError, OSError, pa.ArrowException) as exc:
            bad = _Bad(0, 0, "", f"not a readable Parquet file of the declared schema: {exc}")
            return self._failed(start, [], [bad], size)
        self.pos = size
        rows = _with_diff(table)
        return [Transaction(start, {self.upstream: rows}, commit_time=self._mtime()),
                Upper([self.file, size])]

    def _lines(self, size: int) -> list[Event]:
        path = self.dir / self.file
        want = min(size - self.pos, self.settings.max_batch_bytes)
        for b in self.barriers:
            if b[0] == self.file and b[1] > self.pos:
                want = min(want, b[1] - self.pos)
                break
        csv_ = self.settings.format == "csv"
        with open(path, "rb") as f:
            f.seek(self.pos)
            data = f.read(want)
            lines, end, end_line = _records(data, self.pos, self.line, csv=csv_)
            if end == 0 and want < size - self.pos:   # one record longer than a batch
                data += f.read(size - self.pos - want)
                lines, end, end_line = _records(data, self.pos, self.line, csv=csv_)
        if end == 0:
            return []
        start = [self.file, self.pos]
        if csv_ and self.settings.csv_header and self.header is None:
            stall = self._header(path, lines, start)
            if stall is not None:
                return stall
        good, bad = self._parse(lines)
        if bad and self.settings.errors == "stall":
            first = bad[0]
            keep = [r for r in lines if r[0] < first.line]
            table = self._parse(keep)[0]
            return self._failed(start, [table] if table.num_rows else [], [first],
                                size, stop_at=(first.byte, first.line))
        changes: dict[str, pa.Table] = {}
        if good.num_rows:
            changes[self.upstream] = _with_diff(good)
        if bad:
            changes[self.settings.errors_relation] = _errors_table(self.file, bad)
        self.pos += end
        self.line = end_line
        events: list[Event] = []
        if changes:
            events.append(Transaction(start, changes, commit_time=self._mtime()))
        events.append(Upper([self.file, self.pos]))
        return events

    def _mtime(self) -> float | None:
        """The current file's modification time at the last pass: its lines are older."""
        return self._mtimes.get(self.file)

    def _header(self, path: Path, lines: list[tuple[int, int, bytes]],
                start: Offset) -> list[Event] | None:
        """Read the CSV header (line 1); None when it is fine, else the stall events."""
        if self.pos > 0 or not lines or lines[0][0] != 1:
            with open(path, "rb") as f:
                first = f.readline()
            if not first.endswith(b"\n"):
                return []
            text = first
        else:
            text = lines.pop(0)[2]
        cols = next(csv.reader([text.decode("utf-8", "replace").rstrip("\r")]), [])
        cols = [c.strip() for c in cols]
        if sorted(cols) != sorted(self.schema.names):
            self.stalled = True      # a file without its columns cannot be read at all
            return [Stall(None, f"files source {self.name!r}: malformed input at "
                                f"{path} line 1: the CSV header names {cols}, expected the "
                                f"columns {self.schema.names} (any order)",
                          f"fix the header line of {self.file} (or set csv_header = false "
                          "if the files have none) and restart `lamina ingest`")]
        self.header = cols
        return None

    def _failed(self, start: Offset, tables: list[pa.Table], bad: list[_Bad], size: int,
                stop_at: tuple[int, int] | None = None) -> list[Event]:
        """Emit what precedes the first bad line, then stall (or, for ``errors =
        "relation"``, send the whole file's failure to the errors relation)."""
        first = bad[0]
        where = f"{self.dir / self.file}" + (f" line {first.line}" if first.line else "")
        if self.settings.errors == "relation":
            self.pos = size
            return [Transaction(start, {self.settings.errors_relation:
                                        _errors_table(self.file, bad)},
                                commit_time=self._mtime()),
                    Upper([self.file, self.pos])]
        events: list[Event] = []
        if stop_at is not None:
            byte, line = stop_at
            if tables:
                events.append(Transaction(start, {self.upstream: _with_diff(tables[0])},
                                          commit_time=self._mtime()))
            self.pos, self.line = byte, line
            events.append(Upper([self.file, self.pos]))
        self.stalled = True
        events.append(Stall(None, f"files source {self.name!r}: malformed input at {where}: "
                                  f"{first.error}",
                            f"fix or remove line {first.line} of {self.file} and restart "
                            "`lamina ingest` (everything before it is ingested, nothing after "
                            "it is skipped), or set errors = \"relation\" to route bad lines "
                            f"to {self.settings.errors_relation!r}"
                            if first.line else
                            f"replace {self.file} with a valid file of the declared schema "
                            "and restart `lamina ingest`"))
        return events

    def _parse(self, lines: list[tuple[int, int, bytes]]) -> tuple[pa.Table, list[_Bad]]:
        """Parse lines into rows of the declared schema; the failing ones come back as
        :class:`_Bad` (found by parsing line by line when the batch fails)."""
        if not lines:
            return self.loose.empty_table(), []
        try:
            table = self._parse_block(b"\n".join(r[2] for r in lines) + b"\n")
            if table.num_rows != len(lines):
                raise ValueError(f"{table.num_rows} rows from {len(lines)} lines")
            nulls = self._null_key_rows(table)
            if not nulls:
                return table, []
        except (ValueError, pa.ArrowException):
            pass
        good: list[pa.Table] = []
        bad: list[_Bad] = []
        for line, byte, raw in lines:
            text = raw.decode("utf-8", "replace")[:MAX_ERROR_TEXT]
            try:
                one = self._parse_block(raw + b"\n")
                if one.num_rows != 1:
                    raise ValueError("a line must hold exactly one record")
                if self._null_key_rows(one):
                    raise ValueError(f"key columns {list(self.key)} must not be null")
            except (ValueError, pa.ArrowException) as exc:
                bad.append(_Bad(line, byte, text, _first_line(str(exc))))
                continue
            good.append(one)
        table = pa.concat_tables(good) if good else self.loose.empty_table()
        return table, bad

    def _parse_block(self, block: bytes) -> pa.Table:
        if self.settings.format == "jsonl":
            opts = pajson.ParseOptions(explicit_schema=self.loose,
                                       unexpected_field_behavior="error")
            ropts = pajson.ReadOptions(block_size=max(1 << 20, len(block) + 1),
                                       use_threads=False)
            table = pajson.read_json(io.BytesIO(block), read_options=ropts,
                                     parse_options=opts)
        else:
            names = self.header or list(self.schema.names)
            ropts2 = pacsv.ReadOptions(column_names=names, use_threads=False,
                                       block_size=max(1 << 20, len(block) + 1))
            copts = pacsv.ConvertOptions(column_types={f.name: f.type for f in self.schema},
                                         strings_can_be_null=False)
            table = pacsv.read_csv(io.BytesIO(block), read_options=ropts2,
                                   parse_options=_CSV_PARSE, convert_options=copts)
        return table.select(self.schema.names).cast(self.loose)

    def _null_key_rows(self, table: pa.Table) -> bool:
        return any(table.column(k).null_count for k in self.key)


_CSV_PARSE = pacsv.ParseOptions(newlines_in_values=True)


def _records(data: bytes, first_byte: int, first_line: int, *, csv: bool,
             ) -> tuple[list[tuple[int, int, bytes]], int, int]:
    """The complete records at the start of ``data`` (read from byte ``first_byte`` of a
    file, at line ``first_line``): ``(line, byte, text)`` of each non-blank one, the bytes
    they take (0: no complete record yet) and the number of the line after them. A JSON
    line is a record; a CSV record ends at a newline outside double quotes (a quoted
    value may hold newlines; ``""`` inside quotes keeps the count even)."""
    records: list[tuple[int, int, bytes]] = []
    pos = line = 0
    start = start_line = 0
    end, end_line = 0, first_line
    quoted = False
    for raw in data.split(b"\n")[:-1]:
        if csv and raw.count(b'"') & 1:
            quoted = not quoted
        pos += len(raw) + 1
        line += 1
        if quoted:
            continue
        text = raw if start == pos - len(raw) - 1 else data[start:pos - 1]
        if text.strip():
            records.append((first_line + start_line, first_byte + start, text))
        start, start_line = pos, line
        end, end_line = pos, first_line + line
    return records, end, end_line


def _with_diff(table: pa.Table) -> pa.Table:
    return table.append_column(DIFF, pa.array([1] * table.num_rows, pa.int64()))


def _errors_table(file: str, bad: list[_Bad]) -> pa.Table:
    t = pa.table({"file": pa.array([file] * len(bad), pa.string()),
                  "line": pa.array([b.line for b in bad], pa.int64()),
                  "byte": pa.array([b.byte for b in bad], pa.int64()),
                  "text": pa.array([b.text for b in bad], pa.string()),
                  "error": pa.array([b.error for b in bad], pa.string())},
                 schema=ERRORS_SCHEMA)
    return t.append_column(DIFF, pc.cast(pa.array([1] * len(bad)), pa.int64()))


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unparsable"


def _count_newlines(path: Path, end: int) -> int:
    n = 0
    with open(path, "rb") as f:
        left = end
        while left > 0:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                break
            n += chunk.count(b"\n")
            left -= len(chunk)
    return n
