import os
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a long end-to-end run (several JVMs or a real data set); CI runs "
                                       "those not also marked on_demand, `-m 'not slow'` skips them while developing")
    config.addinivalue_line("markers", "airflow_e2e: the Airflow DAG's dag.test() through the real spark-submit")
    config.addinivalue_line("markers", "on_demand: an end-to-end run of minutes whose parts other tests cover; "
                                       "outside the default command (CI's 30 minutes): run it with -m on_demand")
    config.addinivalue_line("markers", "connect: also run on a local Spark Connect server, in the subprocess "
                                       "tests/test_connect_suite.py starts with XMC_TEST_SPARK_REMOTE set")


def write_xc(path, X, Y):
    """Write (X, Y) as an XC text file (test helper)."""
    X, Y = sp.csr_matrix(X), sp.csr_matrix(Y)
    with open(path, "w") as f:
        f.write(f"{X.shape[0]} {X.shape[1]} {Y.shape[1]}\n")
        for i in range(X.shape[0]):
            labs = ",".join(str(j) for j in Y.indices[Y.indptr[i]:Y.indptr[i + 1]])
            feats = " ".join(f"{j}:{v:.6g}" for j, v in zip(X.indices[X.indptr[i]:X.indptr[i + 1]],
                                                              X.data[X.indptr[i]:X.indptr[i + 1]]))
            # a row with neither labels nor features would be a blank line, which ingest rejects:
            # it is written with one explicit zero feature (the same sample once parsed)
            f.write(f"{labs} {feats or ('0:0' if not labs else '')}\n")


def write_split(folder, n_train, **problem):
    """A random_problem written as folder/train.txt (first n_train rows) and folder/test.txt (the rest)."""
    X, Y = random_problem(**problem)
    write_xc(folder / "train.txt", X[:n_train], Y[:n_train])
    write_xc(folder / "test.txt", X[n_train:], Y[n_train:])
    return X, Y


def random_problem(n=120, d=40, L=12, seed=0, density=0.2):
    """A small learnable problem: each label owns a few features."""
    rng = np.random.default_rng(seed)
    Y = sp.csr_matrix((rng.random((n, L)) < 0.18).astype(np.float32))
    owner = rng.integers(0, L, size=d)
    base = np.asarray(Y.todense())[:, owner] * rng.uniform(0.5, 1.0, (n, d))
    noise = (rng.random((n, d)) < density * 0.3) * rng.uniform(0, 0.5, (n, d))
    X = sp.csr_matrix((base + noise).astype(np.float32))
    return X, Y


# set (e.g. "local[2]") in the process tests/test_connect_suite.py starts: there the ``spark``
# fixture is a Spark Connect session (one session kind per process), else a classic one
CONNECT_ENV = "XMC_TEST_SPARK_REMOTE"


def executed_plan(df) -> str:
    """The physical plan Spark would run for ``df`` (planning only), as text."""
    return df._jdf.queryExecution().executedPlan().toString()


def stage_tasks(spark, fn, group: str = "xmc-test-stage-tasks"):
    """(fn's result, the task count of every stage that ran tasks in the jobs ``fn`` ran), on
    classic Spark. Skipped stages are left out: past ``spark.ui.retainedStages`` in a long test
    session Spark's status store evicts them first (their info is then None). Each call's job
    group is its own (``group`` and a fresh suffix): the status tracker keeps a group's earlier
    jobs."""
    import uuid
    group = f"{group}-{uuid.uuid4().hex}"
    sc = spark.sparkContext
    sc.setJobGroup(group, group)
    try:
        out = fn()
    finally:
        for key in ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel"):
            sc.setLocalProperty(key, None)
    sc._jsc.sc().listenerBus().waitUntilEmpty()        # the tracker has every job's and task's end
    st = sc.statusTracker()
    jobs = [st.getJobInfo(j) for j in st.getJobIdsForGroup(group)]
    infos = [st.getStageInfo(s) for j in jobs if j is not None for s in j.stageIds]
    return out, [i.numTasks for i in infos if i is not None and i.numCompletedTasks > 0]


def spark_params(warehouse: str):
    """The tests' Spark settings (the ``spark`` fixture's), on a local master or the Connect one."""
    from xmc_spark.params import SparkParams

    # 2 attempts a task (tests/stages/test_faults.py)
    # no class-data archive from this long-lived process: it would hold the archive's lock for the whole
    # run (the CLI tests' subprocesses write and use it) and spend ~15 s writing it at the end
    params = SparkParams(master="local[2,2]", remote=os.environ.get(CONNECT_ENV, ""), class_data_sharing=False)
    params.conf.update({"spark.sql.shuffle.partitions": "4", "spark.default.parallelism": "2",
                        "spark.driver.memory": "2g", "spark.sql.warehouse.dir": warehouse})
    return params


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    from xmc_spark.session import get_spark

    s = get_spark(spark_params(str(tmp_path_factory.mktemp("warehouse"))))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def bibtex():
    p = SHARED / "bibtex"
    if not (p / "train.txt").exists():
        pytest.skip("../shared/data/bibtex is not present")
    return p


@pytest.fixture(scope="session")
def connect_spark(spark):
    """The session when it is Spark Connect (the process tests/test_connect_suite.py starts),
    else the test is skipped: it runs there, on a local Spark Connect server."""
    from xmc_spark.compat import is_connect
    if not is_connect(spark):
        pytest.skip("Spark Connect only: runs in tests/test_connect_suite.py's subprocess")
    return spark
