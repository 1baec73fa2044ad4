# The two commands of the README:
#   make run    start the compacter daemon on ./lamina-data with Spark local[*]
#   make test   lint, type-check and run the whole test suite
# Everything else here is what those two need.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# Bytecode is cached, whatever the environment says. Where PYTHONDONTWRITEBYTECODE is set
# (this machine's environment does, and CI runs on one like it), every process of a test
# run (the xdist workers, each daemon, Spark's Python workers) compiled lamina, the tests
# and what they import from source again; and the install skips compiling the 11,000
# modules of the dependencies (61 s of a 109 s install), which are then compiled once,
# when first imported.
# docs/reliability.md, "The test suite's time", has the measurements.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: run test check lint typecheck pytest bench java clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "lamina needs Python 3.11 or newer")'
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# dev includes every extra (compacter, ingest, postgres, s3: pyproject.toml) and the tools
	$(BIN)/pip install --quiet --no-compile -e '.[dev]'
	touch $(STAMP)

java:
	@command -v java >/dev/null 2>&1 || { echo "lamina needs Java 17 or newer for Spark: install it (Debian: apt-get install openjdk-17-jre-headless) or set JAVA_HOME" >&2; exit 1; }
	@v=$$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1); \
	  if [ -z "$$v" ] || [ "$$v" -lt 17 ]; then echo "lamina needs Java 17 or newer for Spark, found '$$v': install openjdk-17-jre-headless or point JAVA_HOME at a JDK 17+" >&2; exit 1; fi

run: $(STAMP) java
	$(BIN)/lamina serve

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples

# the benchmarks too: pyproject.toml's mypy section names the lamina package only
typecheck: $(STAMP)
	$(BIN)/mypy
	$(BIN)/mypy bench

# tests/spark_jvm.py: the class-data archive the run's drivers map (dumped once per machine,
# Java and Spark; 25 to 36 s)
pytest: $(STAMP) java
	$(BIN)/python -m tests.spark_jvm
	$(BIN)/pytest $(PYTEST_ARGS)

# The archive's dump (tests/spark_jvm.py: 25 to 36 s, mostly one JVM, once per machine) runs
# beside lint and typecheck; pytest's own call of it then finds the archive there.
test: $(STAMP) java
	@$(BIN)/python -m tests.spark_jvm > $(VENV)/spark_jvm.log 2>&1 & dump=$$!; \
	  $(MAKE) --no-print-directory lint typecheck; checks=$$?; \
	  wait $$dump; dumped=$$?; cat $(VENV)/spark_jvm.log; \
	  [ $$checks -eq 0 ] && [ $$dumped -eq 0 ]
	$(MAKE) --no-print-directory pytest

bench: $(STAMP) java
	$(BIN)/pip install --quiet --no-compile -e '.[dev,bench]'
	$(BIN)/python -m bench.run

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache tests/.jvm
