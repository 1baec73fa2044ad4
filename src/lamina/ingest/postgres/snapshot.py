"""Tables read through an exported snapshot: the initial snapshot of a first start, and one
table's fresh snapshot for a resync.

Another session imports the slot's exported snapshot (``SET TRANSACTION SNAPSHOT``, in a
``REPEATABLE READ, READ ONLY`` transaction, before the replication connection runs
anything else) and ``COPY (SELECT <columns> FROM <table>) TO STDOUT (FORMAT csv)``\\ s each
table into the :mod:`~lamina.ingest.postgres.spool`, in a thread, while :func:`read`
parses what is spooled already (1 MiB at a time, CSV with quoted newlines, every column
as text, then :func:`~lamina.ingest.postgres.types.to_arrow` per column) and yields it as
:class:`~lamina.ingest.source.Transaction`\\ s of at most ``batch_rows`` rows at one
offset. A ``COPY`` that fails raises from the reader (the spool's error, never a short
table).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import pyarrow as pa
import pyarrow.csv as pacsv
from psycopg2 import sql

from lamina.errors import SourceStalledError
from lamina.ingest.postgres.catalog import PgTable, quote_table
from lamina.ingest.postgres.spool import Spool
from lamina.ingest.postgres.types import to_arrow
from lamina.ingest.source import Offset, Transaction
from lamina.schema import DIFF

__all__ = ["BLOCK_BYTES", "open_spool", "read"]

BLOCK_BYTES: Final = 1 << 20
"""How much of a table's spool pyarrow parses at a time (the reader waits for that much,
or for the table's end)."""


def open_spool(conn: Any, snapshot: str, tables: Sequence[PgTable], *,
               spool_dir: str | None, log: Any) -> Spool:
    """Import ``snapshot`` in ``conn`` (a new, non-replication connection the spool then
    owns and closes) and start copying ``tables``."""
    try:
        conn.autocommit = False
        with conn.cursor() as cur:
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            cur.execute("SET TRANSACTION SNAPSHOT %s", (snapshot,))
            copies = [(t.upstream, sql.SQL("COPY (SELECT {} FROM {}) TO STDOUT "
                                           "WITH (FORMAT csv)").format(
                sql.SQL(", ").join(sql.Identifier(c[0]) for c in t.columns),
                quote_table(t.upstream)).as_string(cur)) for t in tables]
        spool = Spool(conn, copies, spool_dir, log)
    except BaseException:
        conn.close()
        raise
    spool.start()
    return spool


def read(spool: Spool, tables: Sequence[PgTable], offset: Offset, *, batch_rows: int,
         stalled: Callable[[str], bool],
         on_error: Callable[[str, SourceStalledError], None]) -> Iterator[Transaction]:
    """The spooled rows, table by table, as transactions at ``offset``; ends once every
    ``COPY`` returned. A table for which ``stalled(upstream)`` holds is read no further;
    a value that cannot be stored goes to ``on_error`` (which stalls the table)."""
    for table in tables:
        if not spool.wait_started(table.upstream):
            continue
        names = [c[0] for c in table.columns]
        source = spool.reader(table.upstream)
        schema = table.spec.schema.append(pa.field(DIFF, pa.int64()))
        try:
            reader = pacsv.open_csv(
                source, read_options=pacsv.ReadOptions(column_names=names,
                                                       block_size=BLOCK_BYTES),
                parse_options=pacsv.ParseOptions(newlines_in_values=True),
                convert_options=pacsv.ConvertOptions(
                    column_types={n: pa.string() for n in names}, null_values=[""],
                    strings_can_be_null=True, quoted_strings_can_be_null=False))
            for batch in reader:
                if stalled(table.upstream):
                    break
                for start in range(0, batch.num_rows, batch_rows):
                    part = batch.slice(start, batch_rows)
                    try:
                        cols = [to_arrow(part.column(i), t)
                                for i, t in enumerate(table.types)]
                    except SourceStalledError as e:
                        on_error(table.upstream, e)
                        break
                    cols.append(_ones(part.num_rows))
                    yield Transaction(offset=offset, changes={
                        table.upstream: pa.Table.from_arrays(cols, schema=schema)})
        except Exception:
            with spool.cond:
                if spool.error is not None:  # the COPY failed: that, not the parse
                    raise spool.error from None
            raise
        source.release()
    spool.finish()


def _ones(n: int) -> pa.Array:
    """``n`` int64 ones (the ``_diff`` of snapshot rows), without a Python list."""
    return pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(_ONE_LE * n)])


_ONE_LE: Final = (1).to_bytes(8, sys.byteorder)  # Arrow buffers are native-endian
