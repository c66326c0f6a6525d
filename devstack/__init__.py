"""The local development stack: a private PostgreSQL cluster, an Apache Kafka broker (KRaft)
and the jars Spark needs, all on 127.0.0.1, started and stopped by this package.

Used by ``outbox dev ...``, the test fixtures, the benchmarks and the demo.
"""

from outbox.devstack.procs import StackError
from outbox.devstack.stack import LocalStack, StackInfo, prepare, spark_jars, stack_home

__all__ = ["LocalStack", "StackError", "StackInfo", "prepare", "spark_jars", "stack_home"]
