"""Trace storage: conversion and merge with the trace on ``s3://`` against ``file://``.

    .venv/bin/python -m bench.trace_storage [--scale 0.1] [--rounds 3] [--master 'local[*]']
    .venv/bin/python -m bench.trace_storage --table   # re-render the docs table only

The inputs are bench.convert's and bench.merge's (:mod:`bench.dataset`, cached), at
``--scale`` (0.1: 1M updates to convert, two batches of 500,000 to merge). Two contenders,
each in a child process of its own with its own Spark session on ``--master``
(:mod:`bench.procs`), run both steps on the same input:

- **file**: the trace in a local directory (``file://``, the default of a data directory);
- **s3**: the trace under ``s3://<bucket>/<prefix>`` on a moto S3 server
  (``tests/objstore/s3server.py``) started by the parent, every request passing through a
  recording proxy (:class:`tests.objstore.s3server.LossyProxy`, losing nothing) that the
  parent reads around each step: requests by kind (GET, PUT, HEAD, POST, DELETE and LIST,
  a GET carrying ``list-type``) and bytes up (to the server) and down. The child's Spark
  executors get the endpoint and credentials through their environment, as a cluster's
  would (``spark.executorEnv.AWS_*``).

A step is what the daemon times: conversion = ``spark_convert`` (segments read from the
local WAL: ``stage_segments=False``, as in local mode) + ``Trace.commit_conversion``;
merge = ``spark_merge`` + ``Trace.commit_merge``. Before the clock starts each child opens
a fresh trace (``Trace.open``) and plans; for a merge it first copies the cached
two-batch trace into it. After the clock, outside the counted requests, it reads the
committed trace back (rows and a SHA-256 of the sorted rows of every batch and pending
part) and removes it. Each child warms up on one run of each step; then ``--rounds`` rounds
of every step, the contenders' order alternating from round to round.

Reported per step: median seconds with (min, max) for both and the ratio s3 / file (moto
serves from memory, one request at a time, on the same 2 cores: the ratio is lamina's
overhead of going through the object store API, not S3's latency); for s3 the median
requests by kind and bytes up and down per step; whether both contenders committed the
same content in every round. Writes bench/results/trace_storage.json, trace_storage.png
and the table between ``<!-- bench:trace_storage -->`` and
``<!-- /bench:trace_storage -->`` of docs/performance.md (unless ``LAMINA_BENCH_RESULTS``
moves the results). The cost on real S3 is estimated from the counted requests in the
docs, by hand (docs/performance.md, "Trace on S3").
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench import procs, report
from bench.dataset import CACHE, Input, conversion_input, merge_input

NAME = "trace_storage"
CONTENDERS = ("file", "s3")
STEPS = ("convert", "merge")
KINDS = ("GET", "LIST", "HEAD", "PUT", "POST", "DELETE")
DOC = Path(__file__).resolve().parents[1] / "docs" / "performance.md"
BEGIN, END = "<!-- bench:trace_storage -->", "<!-- /bench:trace_storage -->"
DEFAULT_SCALE = 0.1
PRICE_PER_1000 = {"PUT": 0.005, "POST": 0.005, "LIST": 0.005, "GET": 0.0004, "HEAD": 0.0004,
                  "DELETE": 0.0}
"""Assumed request prices, USD per 1,000: S3 Standard, us-east-1, as published on
https://aws.amazon.com/s3/pricing/ (PUT, COPY, POST, LIST $0.005; GET, SELECT and all
other requests $0.0004; DELETE free); not re-checked at the time of the run."""
LATENCY_S = 0.025
"""Assumed time per request on real S3 from a machine in the bucket's region (small
objects: first byte in about 10 to 50 ms); the estimate is ``requests * LATENCY_S``."""
BANDWIDTH = 100e6
"""Assumed bytes/s of one connection to S3 in the bucket's region."""


# --- the contenders (child side) -----------------------------------------------------------------

def content_digest(store: Any, state: Any) -> dict[str, Any]:
    """Rows and a SHA-256 of the sorted rows of the state's batches and pending parts
    (independent of part names and of how rows were cut into parts)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out: dict[str, Any] = {}
    groups = {"batches": [p for b in state.batches for p in b.parts],
              "pending": [p.part for p in state.pending]}
    for what, parts in groups.items():
        tables = [pq.read_table(pa.BufferReader(store.get(p.path))) for p in parts]
        digest = hashlib.sha256()
        rows = 0
        if tables:
            table = pa.concat_tables(tables).replace_schema_metadata(None)
            table = table.sort_by([(c, "ascending") for c in table.column_names])
            rows = table.num_rows
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table.combine_chunks())
            digest.update(sink.getvalue().to_pybytes())
        out[what] = {"rows": rows, "parts": len(parts), "sha256": digest.hexdigest()}
    return out


class Contender(procs.SparkContender):
    """A child: its session, both inputs, and the trace of the step under way."""

    def __init__(self, name: str, scale: float, master: str, endpoint: str | None,
                 bucket: str | None) -> None:
        env: dict[str, str] = {}
        if name == "s3":
            from tests.objstore.s3server import ACCESS_KEY, CLEARED_ENV, REGION, SECRET_KEY

            assert endpoint is not None
            assert bucket is not None
            for k in CLEARED_ENV:
                os.environ.pop(k, None)
            env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                   "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION}
            os.environ.update(env)  # the driver's store, and the JVM it starts
        super().__init__(NAME, "lamina", master, CACHE)  # "lamina": a Spark contender
        self.name = name
        if env:  # the Python workers' environment (what spark.executorEnv.* sets)
            self.spark.sparkContext.environment.update(env)
        self.bucket = bucket
        self.conv = conversion_input(scale, log=False)
        self.spans = self.conv.spans()
        self.merge = merge_input(scale, log=False)
        self.trace: Any = None
        self.plan: Any = None
        for step in STEPS:  # warm-up: Python workers, JIT, page cache, the S3 client
            self.prepare(step)
            self.run(step)
            self.finish()

    def _store(self) -> Any:
        from lamina.objstore.base import open_store

        if self.name == "s3":
            return open_store(f"s3://{self.bucket}/{NAME}-{uuid.uuid4().hex[:8]}")
        path = self.work / f"trace-{uuid.uuid4().hex[:8]}"
        path.mkdir()
        return open_store(path.absolute().as_uri())

    def prepare(self, step: str) -> dict[str, Any]:
        """A fresh trace and the step's plan (for a merge: the cached batches copied in)."""
        from lamina.trace.plan import plan_conversion, plan_merge
        from lamina.trace.trace import Trace

        store = self._store()
        inp: Input = self.conv if step == "convert" else self.merge
        copied = 0
        if step == "merge":
            for f in sorted(inp.trace_dir.rglob("*")):
                if f.is_file():
                    data = f.read_bytes()
                    store.put(f.relative_to(inp.trace_dir).as_posix(), data)
                    copied += len(data)
        self.trace = Trace.open(store, inp.meta)
        self.plan = (plan_conversion(self.trace.state, self.spans) if step == "convert"
                     else plan_merge(self.trace.state))
        assert self.plan is not None
        return {"url": store.url if hasattr(store, "url") else repr(store),
                "copied_bytes": copied}

    def run(self, step: str) -> dict[str, Any]:
        """The step, timed as the daemon times it: the Spark job and the commit."""
        from lamina.compacter.step.driver import spark_convert, spark_merge

        started = time.monotonic()
        if step == "convert":
            result = spark_convert(self.spark, self.trace, self.plan, stage_segments=False)
            parts = result.parts
            self.trace.commit_conversion(self.plan, parts, result.pending)
        else:
            parts = spark_merge(self.spark, self.trace, self.plan)
            self.trace.commit_merge(self.plan, parts)
        seconds = time.monotonic() - started
        return {"seconds": seconds, "rows_out": sum(p.rows for p in parts),
                "bytes_out": sum(p.bytes for p in parts), "parts": len(parts)}

    def finish(self) -> dict[str, Any]:
        """What the step committed, read back; then the trace is removed."""
        digest = content_digest(self.trace.store, self.trace.state)
        self.trace.store.delete_prefix("")
        self.trace = self.plan = None
        return digest

    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        what = command["command"]
        if what == "ready":
            return {"ok": True}
        if what == "prepare":
            return self.prepare(command["step"])
        if what == "run":
            return self.run(command["step"])
        if what == "finish":
            return self.finish()
        raise ValueError(f"unknown command {what!r}")


# --- the parent ---------------------------------------------------------------------------------

def classify(line: str) -> tuple[str, str]:
    """A request line (``METHOD /bucket/key?query``) as its kind (:data:`KINDS`) and its
    operation: the kind, the trace area of its key (state, batches, scratch, pending,
    staging) and, for multipart uploads and batch deletes, which request of them."""
    from urllib.parse import parse_qs, unquote, urlsplit

    method, _, target = line.partition(" ")
    url = urlsplit(target)
    query = parse_qs(url.query, keep_blank_values=True)
    kind = "LIST" if method == "GET" and "list-type" in query else method
    key = query["prefix"][0] if kind == "LIST" and "prefix" in query else \
        unquote(url.path).lstrip("/").partition("/")[2]
    inner = key.partition("/")[2]  # below the bench's per-trace prefix
    area = inner.split("/", 1)[0] or "(root)"
    if area == "batches" and ".scratch/" in inner:
        area = "scratch"
    op = ("create-multipart" if "uploads" in query else
          "upload-part" if method == "PUT" and "uploadId" in query else
          "complete-multipart" if method == "POST" and "uploadId" in query else
          "abort-multipart" if method == "DELETE" and "uploadId" in query else
          "delete-objects" if "delete" in query else "")
    return kind, " ".join(x for x in (kind, area, op) if x)


class Counter:
    """The requests and bytes the proxy forwarded between two points of time."""

    def __init__(self, proxy: Any) -> None:
        self.proxy = proxy
        self.mark()

    def mark(self) -> None:
        time.sleep(0.1)  # the last response's bytes are counted just after they are sent
        self.n, self.up, self.down = (len(self.proxy.requests), self.proxy.bytes_up,
                                      self.proxy.bytes_down)

    def since_mark(self) -> dict[str, Any]:
        time.sleep(0.1)
        lines = self.proxy.requests[self.n:]
        kinds = dict.fromkeys(KINDS, 0)
        operations: dict[str, int] = {}
        for line in lines:
            kind, operation = classify(line)
            kinds[kind] = kinds.get(kind, 0) + 1
            operations[operation] = operations.get(operation, 0) + 1
        return {"requests": len(lines), "by_kind": kinds,
                "by_operation": dict(sorted(operations.items())),
                "bytes_up": self.proxy.bytes_up - self.up,
                "bytes_down": self.proxy.bytes_down - self.down}


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": round(procs.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3), "all": [round(v, 3) for v in values]}


def contest(children: list[procs.Child], rounds: int, proxy: Any) -> dict[str, Any]:
    """Every step ``rounds`` times on every child, the order alternating."""
    out: dict[str, Any] = {}
    for step in STEPS:
        runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in children}
        for r in range(rounds):
            order = children[r % len(children):] + children[:r % len(children)]
            for child in order:
                child.call({"command": "prepare", "step": step})
                counter = Counter(proxy)
                answer, peaks = child.call({"command": "run", "step": step})
                answer["s3"] = counter.since_mark()
                answer["peak_rss_bytes"] = peaks["total"]
                answer["content"], _ = child.call({"command": "finish"})
                runs[child.name].append(answer)
                print(f"  {step} round {r + 1}/{rounds} {child.name:>5}: "
                      f"{answer['seconds']:7.2f} s, {answer['s3']['requests']} requests",
                      file=sys.stderr, flush=True)
        out[step] = summarize(runs)
    return out


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name, rs in runs.items():
        s: dict[str, Any] = {"seconds": spread([a["seconds"] for a in rs]),
                             "rows_out": rs[-1]["rows_out"], "bytes_out": rs[-1]["bytes_out"],
                             "parts": rs[-1]["parts"],
                             "peak_rss_bytes": max(a["peak_rss_bytes"] for a in rs),
                             "content": rs[-1]["content"]}
        if name == "s3":
            s["requests"] = spread([float(a["s3"]["requests"]) for a in rs])
            s["requests_by_kind"] = {k: procs.median([a["s3"]["by_kind"].get(k, 0) for a in rs])
                                     for k in KINDS}
            ops = sorted({o for a in rs for o in a["s3"]["by_operation"]})
            s["requests_by_operation"] = {
                o: procs.median([a["s3"]["by_operation"].get(o, 0) for a in rs]) for o in ops}
            s["bytes_up"] = spread([float(a["s3"]["bytes_up"]) for a in rs])
            s["bytes_down"] = spread([float(a["s3"]["bytes_down"]) for a in rs])
        else:
            s["requests"] = spread([float(a["s3"]["requests"]) for a in rs])  # 0: no S3
        summary[name] = s
    contents = {str(a["content"]) for rs in runs.values() for a in rs}
    out: dict[str, Any] = {"contenders": summary, "same_content": len(contents) == 1}
    if "file" in summary and "s3" in summary:
        out["ratio_s3_to_file"] = round(summary["s3"]["seconds"]["median"]
                                        / summary["file"]["seconds"]["median"], 3)
    return out


def _prices() -> str:
    return ", ".join(f"{k} {v:g}" for k, v in PRICE_PER_1000.items())


def estimate(s3: dict[str, Any]) -> dict[str, float]:
    """The cost of one step on real S3 from its measured requests (the module's
    assumptions: :data:`PRICE_PER_1000`, :data:`LATENCY_S`, :data:`BANDWIDTH`)."""
    kinds = s3["requests_by_kind"]
    usd = sum(PRICE_PER_1000[k] * n / 1000 for k, n in kinds.items())
    moved = s3["bytes_up"]["median"] + s3["bytes_down"]["median"]
    return {"usd": usd, "latency_s": s3["requests"]["median"] * LATENCY_S,
            "transfer_s": moved / BANDWIDTH}


def _mb(v: float) -> str:
    return f"{v / 1e6:,.1f}"


def table(results: Path = report.RESULTS) -> str:
    """The results as markdown: one row per step."""
    path = results / f"{NAME}.json"
    if not path.exists():
        return "(no results yet: run python -m bench.trace_storage)"
    import json

    doc = json.loads(path.read_text())
    head = ["| step | input | file s, median (min to max) | s3 s, median (min to max) "
            "| s3 / file | s3 requests: GET / LIST / HEAD / PUT / POST / DELETE (total) "
            "| s3 MB up / down | same content |",
            "|---|---|---|---|---|---|---|---|"]
    rows = []
    inputs = {"convert": f"{doc['input']['convert']['updates']:,} updates, "
                         f"{_mb(doc['input']['convert']['wal_bytes'])} MB WAL",
              "merge": f"2 batches, {doc['input']['merge']['rows']:,} rows, "
                       f"{_mb(doc['input']['merge']['parquet_bytes'])} MB"}
    for step in STEPS:
        st = doc["steps"][step]
        c = st["contenders"]
        f, s = c["file"]["seconds"], c["s3"]["seconds"]
        k = c["s3"]["requests_by_kind"]
        kinds = " / ".join(f"{k[n]:g}" for n in KINDS)
        rows.append(f"| {step} | {inputs[step]} | {f['median']} ({f['min']} to {f['max']}) "
                    f"| {s['median']} ({s['min']} to {s['max']}) | {st['ratio_s3_to_file']} "
                    f"| {kinds} ({c['s3']['requests']['median']:g}) "
                    f"| {_mb(c['s3']['bytes_up']['median'])} / "
                    f"{_mb(c['s3']['bytes_down']['median'])} "
                    f"| {'yes' if st['same_content'] else '**no**'} |")
    rows += ["", "Estimated on paper from the median counts above, not measured: the request "
             f"prices of `PRICE_PER_1000` (USD per 1,000: {_prices()}), {LATENCY_S * 1000:g} ms "
             f"per request and {BANDWIDTH / 1e6:g} MB/s per connection "
             "(bench/trace_storage.py):", "",
             "| step | requests cost per step, USD | per 1M steps, USD | requests x latency, s "
             "(one at a time) | bytes / bandwidth, s (one connection) | s3 requests by "
             "operation |", "|---|---|---|---|---|---|"]
    for step in STEPS:
        c = doc["steps"][step]["contenders"]["s3"]
        cost = estimate(c)
        ops = ", ".join(f"{o} {n:g}" for o, n in c["requests_by_operation"].items() if n)
        rows.append(f"| {step} | {cost['usd']:.6f} | {cost['usd'] * 1e6:,.2f} "
                    f"| {cost['latency_s']:.2f} | {cost['transfer_s']:.2f} | {ops} |")
    load = doc["load_average"]
    foot = [f"- `{NAME}` ({doc['when']}, {doc['rounds']} rounds, {doc['master']}, load "
            f"average {load['before'][0]} before, {load['after'][0]} after, "
            f"{doc['seconds']} s): `{doc['command']}`"]
    return "\n".join([*head, *rows, "", "Run:", "", *foot])


def update_doc(text: str, doc: Path = DOC) -> bool:
    from bench import run

    return run.update_doc(text, doc, BEGIN, END)


def plot(doc: dict[str, Any]) -> Path:
    groups: list[tuple[str, dict[str, float]]] = []
    for step in STEPS:
        c = doc["steps"][step]["contenders"]
        groups.append((f"{step}: seconds (median)",
                       {n: float(c[n]["seconds"]["median"]) for n in c}))
    for step in STEPS:
        k = doc["steps"][step]["contenders"]["s3"]["requests_by_kind"]
        groups.append((f"{step}: s3 requests", {n: float(k[n]) for n in KINDS if k[n]}))
    load = doc["load_average"]
    ratios = ", ".join(f"{s} {doc['steps'][s]['ratio_s3_to_file']}x" for s in STEPS)
    return report.bar_chart(NAME, "Trace on s3:// (moto, via a counting proxy) vs file://",
                            groups, ylabel="",
                            note=f"s3 / file: {ratios}; load average {load['before'][0]} "
                                 f"before, {load['after'][0]} after")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trace_storage",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--scale", type=float, default=DEFAULT_SCALE)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--table", action="store_true",
                        help="only render the docs table from the existing results")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--bucket", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return procs.child_main(lambda: Contender(args.child, args.scale, args.master,
                                                  args.endpoint, args.bucket))
    if args.table:
        return 0 if update_doc(table()) else 1
    import pyarrow.parquet as pq
    from tests.objstore.s3server import LossyProxy, S3Server

    run = report.Run(NAME, argv)
    conv, merge = conversion_input(args.scale), merge_input(args.scale)
    merge_files = list(merge.trace_dir.rglob("*.parquet"))
    doc: dict[str, Any] = {
        "scale": args.scale, "master": args.master, "rounds": args.rounds,
        "input": {"convert": {"updates": conv.updates, "keys": conv.keys,
                              "wal_bytes": conv.wal_bytes(), "segments": len(conv.spans())},
                  "merge": {"rows": sum(int(pq.ParquetFile(f).metadata.num_rows)
                                        for f in merge_files),
                            "keys": merge.keys,
                            "parquet_bytes": sum(f.stat().st_size for f in merge_files)}}}
    server = S3Server.start()
    proxy = LossyProxy(server.endpoint)
    logs = procs.ROOT / "bench" / ".cache" / "logs"
    common = ["--scale", str(args.scale), "--master", args.master]
    children: list[procs.Child] = []
    try:
        bucket = server.make_bucket()
        extra = {"file": [], "s3": ["--endpoint", proxy.endpoint, "--bucket", bucket]}
        for name in CONTENDERS:
            children.append(procs.Child(name, "bench.trace_storage",
                                        ["--child", name, *common, *extra[name]],
                                        logs / f"{NAME}-{name}.log"))
        for child in children:
            child.call({"command": "ready"}, timeout=1800)
        doc["steps"] = contest(children, args.rounds, proxy)
    finally:
        for child in children:
            child.close()
        proxy.close()
        server.stop()
    doc = run.document(doc)
    report.write_result(NAME, doc)
    plot(doc)
    for step in STEPS:
        st = doc["steps"][step]
        c = st["contenders"]
        print(f"{step}: file {c['file']['seconds']['median']} s, s3 "
              f"{c['s3']['seconds']['median']} s, s3/file {st['ratio_s3_to_file']}x; s3 "
              f"requests {c['s3']['requests_by_kind']}, up {_mb(c['s3']['bytes_up']['median'])}"
              f" MB, down {_mb(c['s3']['bytes_down']['median'])} MB; same content: "
              f"{st['same_content']}")
    if report.RESULTS.resolve() == report.DEFAULT_RESULTS.resolve() and update_doc(table()):
        print(f"updated {DOC}")
    return 0 if all(doc["steps"][s]["same_content"] for s in STEPS) else 1


if __name__ == "__main__":
    sys.exit(main())
