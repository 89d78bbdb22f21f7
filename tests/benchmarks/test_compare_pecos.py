"""benchmarks/compare_pecos.py's summary of repeated pairs (no Spark, no PECOS)."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import compare_pecos  # noqa: E402


def pair(xmc_s, pecos_s):
    return {"seconds": {"process": xmc_s, "total": xmc_s - 5}}, {"seconds": {"total": pecos_s}}


def test_pair_ratios_median_and_range_of_the_pairs():
    """Each pair's process ratio (xmc-spark's process seconds over PECOS's total), then their
    median and range: the median of the ratios, not the ratio of the medians."""
    s = compare_pecos.pair_ratios([pair(150.0, 140.0), pair(120.0, 100.0), pair(160.0, 200.0)])
    assert s["ratios"] == [round(150 / 140, 3), 1.2, 0.8]
    assert s["median_ratio"] == round(150 / 140, 3)
    assert (s["min_ratio"], s["max_ratio"]) == (0.8, 1.2)
    assert (s["median_xmc_s"], s["median_pecos_s"]) == (150.0, 140.0)
    # the ratio of the medians (150 / 140) happens to agree here; with two pairs it need not
    two = compare_pecos.pair_ratios([pair(100.0, 50.0), pair(100.0, 200.0)])
    assert two["median_ratio"] == 1.25 and two["median_xmc_s"] / two["median_pecos_s"] == 100 / 125


def test_repeat_must_be_positive(capsys):
    with pytest.raises(SystemExit) as e:
        compare_pecos.main(["--data", "/nonexistent", "--repeat", "0"])
    assert e.value.code == 2
    assert "--repeat must be >= 1" in capsys.readouterr().err


def test_pecos_embedding_joins_its_tree_where_xmc_spark_times_them_together():
    """By default xmc-spark's tree stage holds the label embedding (no "embedding" row): PECOS's
    two rows are summed into its tree row; with an "embedding" row both keep theirs."""
    pe = {"p@1": 1.0, "seconds": {"embedding": 0.5, "tree": 1.25, "total": 9.0}}
    joined = compare_pecos.same_stages({"seconds": {"tree": 7.0}}, pe)
    assert joined["seconds"] == {"tree": 1.75, "total": 9.0} and joined["p@1"] == 1.0
    assert pe["seconds"]["embedding"] == 0.5                  # the caller's result is left as it was
    assert compare_pecos.same_stages({"seconds": {"embedding": 2.0, "tree": 5.0}}, pe) == pe
