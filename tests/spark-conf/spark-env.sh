# Sourced by bin/spark-class (load-spark-env.sh) for a test run's standalone master and
# worker (tests/compacter/cluster.py): the same JIT choice as spark-defaults.conf.
SPARK_DAEMON_JAVA_OPTS="-XX:TieredStopAtLevel=1"
