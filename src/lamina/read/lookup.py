"""Key lookups: the consolidated rows with given key values at ``as_of``.

Parts are sorted by key, and written in row groups of ``ROW_GROUP_ROWS`` rows with min/max
statistics (lamina.trace.batch), so the row groups of one part cover narrow, ordered ranges
of the first key column. A lookup:

1. pins a consistent view with the state-first protocol (:func:`lamina.read.view.pin`,
   holding a lease): the batches and pending parts at or below ``as_of`` (opened, not
   read) and the WAL tail (decoded);
2. for each part, reads only the footer and then the key columns of the row groups whose
   first-key-column range ``[min, max]`` holds one of the looked-up values (a binary
   search over the sorted values; a row group without statistics is read), and the other
   columns only of the row groups where a key matched;
3. keeps the rows whose key columns equal one of the given keys (and ``_time <= as_of``),
   adds the WAL tail's and the pending parts' matching rows, and consolidates: the result
   is exactly ``snapshot(as_of)`` filtered to those keys, in the same order.

The footers and the per-row-group key ranges of the parts (:class:`KeyIndex`, a small
in-memory key index per relation handle) are kept between lookups: parts are immutable,
so a later lookup parses no footer it has seen.

Lookups do not read whole part files, so the whole-file CRC32C is not checked; Parquet's
page checksums (written with every part) are verified for the pages read.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from lamina import columns, kernels
from lamina.datadir import RelationFiles
from lamina.errors import InvalidArgumentError, SchemaError
from lamina.objstore.base import ObjectStore
from lamina.read.snapshot import consolidated
from lamina.read.view import filter_times, pin, resolve_as_of
from lamina.schema import DIFF, TIME, RelationMeta
from lamina.trace.batch import OpenPart, PartFile
from lamina.trace.parquet import FileMetaData


def key_table(meta: RelationMeta, keys: pa.Table | Mapping[str, Any]) -> pa.Table:
    """The looked-up keys as a table of exactly the key columns, in the relation's types."""
    if not meta.key:
        raise InvalidArgumentError(f"relation {meta.name!r} has no key columns: a lookup "
                                   "needs them (read a snapshot instead)")
    if not isinstance(keys, pa.Table):
        try:
            keys = pa.table({name: _int_list(values) for name, values in keys.items()}
                             if isinstance(keys, Mapping) else keys)
        except (pa.ArrowException, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"keys must be a pyarrow.Table of the key columns "
                                       f"{list(meta.key)} or a mapping pa.table() accepts: "
                                       f"{exc}") from exc
    if sorted(keys.column_names) != sorted(meta.key):
        raise SchemaError(f"keys have columns {keys.column_names}; relation {meta.name!r} "
                          f"has key columns {list(meta.key)}: pass exactly those")
    arrays = []
    for name in meta.key:
        target = meta.schema.field(name).type
        try:
            arrays.append(kernels.cast(keys.column(name), target))
        except (pa.ArrowException, TypeError, ValueError) as exc:
            raise SchemaError(f"key column {name!r} cannot be cast to {target}: {exc}") from exc
    return pa.Table.from_arrays(arrays, names=list(meta.key))


def _int_list(values: Any) -> Any:
    """A list of Python ints as an int64 array built through numpy (pa.table() would
    import pandas on the way, half a second in a cold process: lamina.columns); anything
    else as given."""
    if isinstance(values, list) and values and all(type(v) is int for v in values):
        with contextlib.suppress(OverflowError):
            return columns.array(np.asarray(values, dtype=np.int64))
    return values


@dataclass(frozen=True)
class PartIndex:
    """The footer of one part and the first key column's range per row group: ``(min,
    max)``, or None where a group has no usable statistics or holds nulls (always read)."""

    metadata: FileMetaData
    ranges: tuple[tuple[Any, Any] | None, ...]

    @classmethod
    def of(cls, metadata: FileMetaData, column: int) -> PartIndex:
        ranges: list[tuple[Any, Any] | None] = []
        for rg in range(metadata.num_row_groups):
            stats = metadata.row_group(rg).column(column).statistics
            if (stats is None or not stats.has_min_max or not stats.has_null_count
                    or stats.null_count > 0):
                ranges.append(None)
            else:
                ranges.append((stats.min, stats.max))
        return cls(metadata, tuple(ranges))


class KeyIndex:
    """Footers and key ranges of part files, kept between lookups (a relation handle holds
    one). Parts are immutable and their names fresh per write, so an entry never goes
    stale; the least recently used are dropped beyond ``max_parts``."""

    def __init__(self, max_parts: int = 4096) -> None:
        self.max_parts = max_parts
        self._entries: OrderedDict[tuple[str, int, int], PartIndex] = OrderedDict()
        self._mu = threading.Lock()

    @staticmethod
    def _key(store: ObjectStore, part: PartFile) -> tuple[str, int, int]:
        return store.location(part.path), part.crc32c, part.bytes

    def footer(self, store: ObjectStore, part: PartFile) -> FileMetaData | None:
        with self._mu:
            entry = self._entries.get(self._key(store, part))
            return None if entry is None else entry.metadata

    def get(self, part: OpenPart, column: int) -> PartIndex:
        key = self._key(part.store, part.part)
        with self._mu:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry
        entry = PartIndex.of(part.file.metadata, column)
        with self._mu:
            self._entries[key] = entry
            while len(self._entries) > self.max_parts:
                self._entries.popitem(last=False)
        return entry


class _Matcher:
    """Which rows (and row groups) can hold one of the keys."""

    def __init__(self, meta: RelationMeta, keys: pa.Table, index: KeyIndex) -> None:
        self.key = list(meta.key)
        self.keys = keys
        self.index = index
        self.values = {name: kernels.unique(keys.column(name).combine_chunks())
                       for name in self.key}
        first = [v for v in self.values[self.key[0]].to_pylist() if v is not None]
        try:
            self.first_sorted: list[Any] | None = sorted(first)
        except TypeError:
            self.first_sorted = None

    @functools.cached_property
    def tuples(self) -> set[tuple[Any, ...]]:
        return {tuple(r[k] for k in self.key) for r in self.keys.to_pylist()}

    def row_groups(self, part: OpenPart) -> list[int]:
        col = part.file.schema_arrow.get_field_index(self.key[0])
        ranges = self.index.get(part, col).ranges
        keys = self.first_sorted
        if keys is None:
            return list(range(len(ranges)))
        out = []
        for rg, r in enumerate(ranges):
            if r is None:
                out.append(rg)
                continue
            try:
                i = bisect.bisect_left(keys, r[0])
                if i < len(keys) and keys[i] <= r[1]:
                    out.append(rg)
            except TypeError:  # statistics in another Python type: read the group
                out.append(rg)
        return out

    def mask(self, table: pa.Table) -> pa.ChunkedArray | pa.Array:
        """Rows whose every key column holds a looked-up value (a superset of the matches
        when the key has several columns)."""
        mask = None
        for name in self.key:
            m = kernels.is_in(table.column(name), self.values[name])
            mask = m if mask is None else kernels.and_(mask, m)
        assert mask is not None  # a key has at least one column
        return mask

    def rows(self, table: pa.Table) -> pa.Table:
        if not table.num_rows:
            return table
        table = kernels.filter(table, self.mask(table))
        if len(self.key) > 1 and table.num_rows:  # the columns matched, now the tuples
            exact = [tuple(r[k] for k in self.key) in self.tuples
                     for r in table.select(self.key).to_pylist()]
            table = kernels.filter(table, columns.array(np.array(exact, dtype=np.bool_)))
        return table


def lookup(files: RelationFiles, keys: pa.Table | Mapping[str, Any], as_of: object, *,
           upper: int, since: int, index: KeyIndex | None = None) -> pa.Table:
    """The rows of ``snapshot(as_of)`` whose key is one of ``keys`` (module docstring;
    ``as_of`` None: the latest readable time); ``index`` keeps part footers between
    lookups."""
    meta = files.meta
    as_of = resolve_as_of(files, as_of, upper=upper, since=since)
    index = index or KeyIndex()
    matcher = _Matcher(meta, key_table(meta, keys), index)
    wanted = [*meta.row_columns, TIME]
    tables: list[pa.Table] = []

    def take(part: OpenPart, whole: bool) -> None:
        groups = matcher.row_groups(part)
        if not groups:
            return
        # the key columns first; the other columns only of the groups that hold a key
        keys = part.file.read_row_groups(groups, columns=matcher.key)
        sizes = [part.file.metadata.row_group(g).num_rows for g in groups]
        hit = columns.numpy(matcher.mask(keys))
        starts = np.cumsum([0, *sizes])
        groups = [g for i, g in enumerate(groups) if hit[starts[i]:starts[i + 1]].any()]
        if not groups:
            return
        t = matcher.rows(part.file.read_row_groups(groups, columns=[*wanted, DIFF]))
        if not whole:
            t = filter_times(t, 0, as_of)
        tables.append(t.drop_columns([TIME]))

    with pin(files, 0, as_of, verify=False, footers=index.footer, what="lookup") as view:
        for p, whole in view.parts(0, as_of):
            take(p, whole)
        wal = [matcher.rows(t).drop_columns([TIME]) for t in view.wal]
    # the parts' rows are sorted runs (a filter keeps their order), the WAL tail's are not
    return consolidated(meta, tables, wal, context=f"lookup in {meta.name!r} at {as_of}")
