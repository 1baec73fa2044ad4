"""Benchmarks (scripts, not tests): run each as ``python -m bench.<name>``; results go to
bench/results/<name>.json. Two measure the test suite rather than lamina and write no
result: ``bench.suite_jvm`` (what a JVM option costs a short-lived Spark driver) and
``bench.suite_cpu`` (a command's CPU by kind of process); docs/reliability.md, "The test
suite's time"."""
