"""Conversion and merge steps as Spark jobs: the production executor of trace plans.

:func:`~lamina.compacter.step.driver.spark_convert` and
:func:`~lamina.compacter.step.driver.spark_merge` carry out a
:class:`~lamina.trace.plan.ConversionPlan` / :class:`~lamina.trace.plan.MergePlan` and
return the written files; the caller commits them (``Trace.commit_conversion`` /
``Trace.commit_merge``). For the same plan and inputs the output is identical, row for row
and in order, to the in-process reference executor :mod:`lamina.compacter.executors.reference`; the
tests compare the two.

Spark schedules the tasks, retries them, places them on executors and cancels them; the
rows never enter the JVM. A step is two Spark jobs of Python tasks (an RDD of ``n``
partitions of one id each, only metadata collected: :mod:`~lamina.compacter.step.wire`), and the
decode tasks hand the write tasks their rows as Arrow files in the trace directory, which
every executor sees already (tasks read WAL segments and write parts there)::

    job 1: G decode tasks     read and verify inputs, forward, split off future rows,
                              order by prefix, write runs, return metadata (with the
                              number of updates decoded) and a sample
    driver                    cut the sampled keys into chunks, chunks into P parts
    job 2: P + B write tasks  per part: every run's rows of each chunk, sorted,
                              consolidated, written; per bucket group: pending files

A merge does not need job 1: its inputs are sorted Parquet batches whose row-group
statistics already cut the key space, so a merge runs as one job of write tasks, each
reading of every input only the row groups of its key range
(:mod:`~lamina.compacter.step.merge`; floats, decimals and one key holding most of the
rows keep the two jobs).

A step whose input is at most ``JobTuning.single_task_bytes`` runs as one task that does
all of it in memory (job 1 only, no runs), which is what keeps the common small
conversion cheap. Either way the tasks report how many updates they decoded
(:attr:`StepOutput.input_rows <lamina.compacter.step.driver.StepOutput.input_rows>`, the
conversions' ``lamina_job_input_rows_total``): decode tasks in their metadata, a single
task in a tally row next to its parts' rows. Only the attempts whose output the driver
collects are counted, so a retried task counts once.

Why not Spark's shuffle and sort: measured on 10M updates (docs/performance.md), the
JVM's share of the former design (``repartitionByRange`` + ``sortWithinPartitions`` between
two ``mapInArrow`` stages) was most of the step: Arrow-to-UnsafeRow conversion, a sampling
pass that decoded the input twice, TimSort with full-row comparisons on prefix ties, and
UnsafeRow-to-Arrow conversion back; the step ran at 0.30 of DuckDB's throughput. Arrow's
own sort, adaptive to presorted runs, and neighbour-comparison consolidation on sorted
rows do the same work in a fraction of the CPU time.

The modules, in the order a step uses them:

- :mod:`~lamina.compacter.step.work`: tuning, work items (WAL byte ranges, Parquet parts)
  and their packing into task groups;
- :mod:`~lamina.compacter.step.context`: what every task receives (pickled);
- :mod:`~lamina.compacter.step.decode`: decode tasks (read, verify, split, order, write
  runs, sample);
- :mod:`~lamina.compacter.step.runs`: the scratch run format between the two jobs;
- :mod:`~lamina.compacter.step.cuts`: full sort keys cutting the batch into chunks and
  parts;
- :mod:`~lamina.compacter.step.write`: write tasks and the single task;
- :mod:`~lamina.compacter.step.merge`: one-pass merges (the cut from row-group
  statistics, and their write tasks);
- :mod:`~lamina.compacter.step.wire`: the records tasks return to the driver;
- :mod:`~lamina.compacter.step.failures`: errors as records, and their translation;
- :mod:`~lamina.compacter.step.driver`: the driver (sizing, the two jobs, the output).

Pushed down elsewhere: WAL byte ranges (:mod:`lamina.wal.ranges`), the batch order
(:mod:`lamina.trace.order`), bucket lower ends (:func:`lamina.trace.pending.bucket_lows`)
and consolidation of sorted rows (:func:`lamina.consolidate.consolidate_sorted`).

Task functions are closures over a :class:`~lamina.compacter.step.context.StepContext`
that cloudpickle ships to the executors; everything they call is a module-level function
importable there.
"""
