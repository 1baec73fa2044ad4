# syntax=docker/dockerfile:1
#
# lamina compacter image: the daemon, Python 3.11, PySpark (with its Spark jars) and a
# Java 17 runtime. The same image also runs a Spark standalone master and workers
# (deploy/docker-compose.yml), so driver, executors and the lamina code they run always
# have the same versions.
#
#   docker build -t lamina .
#   docker run -p 127.0.0.1:9740:9740 -v lamina-data:/var/lib/lamina --stop-timeout 45 lamina
#
# tini is already PID 1 (ENTRYPOINT), so `docker run --init` is not needed. --stop-timeout 45
# gives the daemon its 30 s shutdown grace (Docker's default is 10 s, then SIGKILL: safe,
# only slower to recover).
#
# Pinned to Debian bookworm: openjdk-17-jre-headless is a bookworm package (trixie, the
# newer default of python:3.11-slim, ships Java 21 only).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- builder: a self-contained virtualenv in /opt/venv --------------------------------------
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
# Not editable: the runtime stage gets the venv only, not the sources. Every extra: the
# daemon (compacter), `lamina ingest` from PostgreSQL (postgres) and s3:// traces (s3).
RUN --mount=type=cache,target=/root/.cache/pip \
    /opt/venv/bin/pip install --upgrade pip \
 && /opt/venv/bin/pip install '.[compacter,postgres,s3]'

# --- runtime -----------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
# tini as PID 1: forwards SIGTERM to the daemon (only to it: the daemon stops the JVM itself
# after its grace period) and reaps zombies left by Spark's child processes.
# procps: `ps`, used by Spark's scripts and handy when debugging.
RUN mkdir -p /usr/share/man/man1 \
 && apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless tini procps \
 && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 10001 lamina \
 && useradd --system --uid 10001 --gid lamina --home-dir /var/lib/lamina \
            --no-create-home --shell /usr/sbin/nologin lamina \
 && install -d -o lamina -g lamina -m 0750 /var/lib/lamina \
 && install -d -o lamina -g lamina -m 0750 /var/cache/lamina

COPY --from=builder /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SPARK_HOME=/opt/venv/lib/python3.11/site-packages/pyspark \
    PYSPARK_PYTHON=/opt/venv/bin/python \
    SPARK_LOCAL_DIRS=/var/cache/lamina/spark \
    SPARK_WORKER_DIR=/var/cache/lamina/worker \
    LAMINA_DATA_DIR=/var/lib/lamina \
    LAMINA_HTTP=0.0.0.0:9740

USER lamina
# Spark drops spark-warehouse/ and derby.log into the working directory: keep them out of
# the data volume.
WORKDIR /var/cache/lamina
VOLUME /var/lib/lamina
EXPOSE 9740

# Liveness only (/healthz): /readyz is 503 during recovery and under backlog, which is not
# a reason to restart. The HTTP server starts before the SparkSession, hence the short
# start period.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9740/healthz', timeout=4)"]

STOPSIGNAL SIGTERM
# Exec form throughout: tini is PID 1 and signals reach `lamina` directly (no shell between).
ENTRYPOINT ["/usr/bin/tini", "--", "lamina"]
CMD ["serve"]
