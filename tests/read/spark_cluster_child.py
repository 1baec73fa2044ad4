"""Child of test_spark_cluster: read_snapshot against a standalone master, printed as one
line ``RESULT {json}`` (a process of its own: the test process holds the local
SparkContext). Must not import pytest.

    python -m tests.read.spark_cluster_child --master spark://... --data-dir DIR \\
        --relation NAME --as-of T
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULT_PREFIX = "RESULT "


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--master", required=True)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--relation", required=True)
    parser.add_argument("--as-of", type=int, required=True)
    args = parser.parse_args()

    from lamina.compacter.spark import build_session
    from lamina.spark import read_snapshot

    spark = build_session(args.master, app_name="lamina-read-cluster-test",
                          driver_memory="512m",
                          conf={"spark.executor.memory": "512m", "spark.cores.max": "2",
                                "spark.executor.cores": "2"})
    try:
        df = read_snapshot(spark, args.data_dir, args.relation, args.as_of)
        rows = df.toArrow().to_pylist()
        executors = spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size()
    finally:
        spark.stop()
    print(RESULT_PREFIX + json.dumps({"rows": rows, "block_managers": executors}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
