"""A SparkSession set up the way the mqks data source needs it on one machine.

Spark starts its Python workers with `python3` from PATH unless told otherwise, and they
must import pyarrow and mqks: PYSPARK_PYTHON pins them to this interpreter. Binding to
loopback and switching the UI off keeps a local session off every other interface.
"""

from __future__ import annotations

import os
import sys


def local_session(app_name: str, master: str = "local[2]"):
    """A session on `master` (local by default) with the `mqks` format registered."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    from mqks.spark.datasource import MqksDataSource

    session = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("WARN")
    session.dataSource.register(MqksDataSource)
    return session
