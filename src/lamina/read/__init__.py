"""Reading a relation: the read contract, and one module per way of reading.

**The read contract.** A relation's updates live in three places at once: trace batches
(converted and merged), the trace's pending area (future updates) and the WAL segments the
compacter has not converted yet. Every read takes

    trace state version N  +  the WAL segments numbered above N's ``converted_through``

and so sees every acknowledged update exactly once, whatever the compacter does meanwhile:

1. **State first, then the WAL tail.** A read loads the newest trace state, then lists the
   WAL segments. The tail must start right after ``converted_through``; if it does not,
   the compacter converted and deleted segments after the state was loaded, and the read
   starts over (listing first would let a conversion hide a newer segment).
2. **What keeps a read's files alive: its lease.** Before it loads state N, a read puts a
   lease on N in the relation's trace (``leases/``, :mod:`lamina.trace.lease`) and makes
   sure N is still the newest version; garbage collection never deletes a file that a
   state held by a live lease names. The lease is renewed while the read runs (a
   subscription, a ``snapshot_reader`` not yet exhausted, a Spark DataFrame until it is
   released or garbage-collected) and deleted when it ends. A reader that dies leaves a
   lease that holds nothing once it expires (``Store.open(lease_seconds=...)``, 60 s by
   default). The same holds on ``file://`` and ``s3://`` and for readers on any machine.
   No read depends on the compacter's ``keep_versions`` or ``keep_versions_seconds``: those
   keep older trace states for time travel over the trace's own history. (Where a lease
   cannot be written, a read-only copy of a data directory, a read goes on without one and
   starts over if files vanish while it opens them.)
3. **Readers never write to the data directory, whatever they find**, but their own lease:
   no quarantine marker (only the daemon quarantines), no repair; damage is a
   :class:`~lamina.errors.CorruptionError` naming the file.
4. **as_of.** Omitted (None), a read is at the latest readable time, ``upper - 1``
   (:class:`~lamina.errors.AsOfOutOfRangeError` while nothing is readable); otherwise at
   an int in ``[since, upper)`` or, for a relation whose times are epoch milliseconds
   (``time_unit="ms"``), a timezone-aware datetime, rounded down to its millisecond
   (:mod:`lamina.frontier`).

The ways of reading, one module each (docs/reading.md says what each costs):

- :mod:`lamina.read.view`: :func:`~lamina.read.view.pin` (the protocol above), the pinned
  view and its open parts, the ``as_of`` rules;
- :mod:`lamina.read.snapshot`: ``Relation.snapshot``, in memory;
- :mod:`lamina.read.stream`: ``Relation.snapshot_reader``, in bounded memory;
- :mod:`lamina.read.lookup`: ``Relation.lookup``, only the row groups that can hold the keys;
- :mod:`lamina.read.subscribe`: ``Relation.subscribe``, the snapshot then every interval;
- :mod:`lamina.read.unsealed`: ``Relation.updates(lower, upper)``, updates in an interval,
  sealed or not;
- :mod:`lamina.read.spark`: ``lamina.spark.read_snapshot``, a DataFrame of Spark tasks.

Nothing outside this package reads a relation's data: the public API
(:class:`lamina.store.Relation`) calls these modules, and :mod:`lamina.datadir` gives them
the relation's files.
"""
