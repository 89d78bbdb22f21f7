"""benchmarks/prime_steps.py on a tiny synth set: every variant runs its steps, and drawing the
random negatives in-batch runs a step on no more labels than uniform draws do."""
import sys
from pathlib import Path

import numpy as np

from xmc_spark.kernels import prime as P
from xmc_spark.model import XMCModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import prime_steps as B  # noqa: E402


def test_variants_run_and_in_batch_draws_touch_fewer_labels(capsys):
    X, Y = B.rows(1500, 400, 600)
    S, _ = XMCModel.train_local(X, Y).predict(X, beam_size=5, topk=10)
    prm = P.PrimeParams(dim=8, ffn=16, batch_size=128, n_hard=4, n_random=16, cluster_size=8)
    got = {v: B.measure(X, Y, S, prm, v, blob=512, steps=3) for v in B.VARIANTS}
    assert all(r["steps"] == 3 and np.isfinite(r["median_s"]) for r in got.values())
    assert got["random + in-batch"]["labels_per_step"] < got["random"]["labels_per_step"]
    assert got["clustered"]["batching_s"] > 0 and got["random"]["batching_s"] >= 0
    assert B.main(["--rows", "600", "--labels", "100", "--features", "300", "--steps", "1", "--blob", "256",
                   "--batch-size", "64"]) == 0
    assert capsys.readouterr().out.count("\n| ") == 4                     # the header row and three variants
