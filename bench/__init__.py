"""Benchmarks (scripts, not tests): run each as ``python -m bench.<name>``; results go to
bench/results/<name>.json."""
