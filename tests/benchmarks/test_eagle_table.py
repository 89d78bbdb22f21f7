"""benchmarks/eagle_table.py's validation metrics on hand-made predictions (closed-form answers)."""
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from eagle_table import choose, group_metrics  # noqa: E402


def test_coverage_rewards_members_predicting_their_own_labels_and_precision_does_not():
    """One group of two members (ids 7, 3) with labels {0, 1, 2, 3, 4, 5}. Row 0 is sample 3.
    'same': both members predict 0, 1, 2, 3, 4; 'own': member 7 predicts 0, 1, 2, 9, 8 and
    member 3 predicts 3, 4, 5, 9, 8."""
    ids = np.array([3, 7])
    val = {0: (np.array([7, 3]), {0, 1, 2, 3, 4, 5})}
    sc = np.tile(np.array([0.9, 0.8, 0.7, 0.6, 0.5]), (2, 1))
    same = group_metrics(np.array([[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]), sc, ids, val)
    own = group_metrics(np.array([[3, 4, 5, 9, 8], [0, 1, 2, 9, 8]]), sc, ids, val)
    # coverage: union of top-k over members / min(6, 2k): same 1/2, 3/6, 5/6; own 2/2, 6/6, 6/6
    assert same["coverage"] == pytest.approx(100 * (1 / 2 + 3 / 6 + 5 / 6) / 3)
    assert own["coverage"] == pytest.approx(100.0)
    # precision: labels ranked by their best member score, ties by label; same: 0, 1, 2, 3, 4;
    # own: 0, 3 (0.9), 1, 4 (0.8), 2: all in the group, so it cannot tell the two apart
    assert same["precision"] == pytest.approx(100.0)
    assert own["precision"] == pytest.approx(100.0)


def test_missing_predictions_and_groups_are_averaged():
    """-1 (no label) never counts; two groups average; a group smaller than members x k is
    scored out of its own size."""
    ids = np.array([0, 1, 2])
    val = {5: (np.array([0, 1]), {4}), 6: (np.array([2]), {1, 2})}
    lab = np.array([[4, -1, -1], [-1, -1, -1], [2, 9, 1]])
    sc = np.array([[1.0, 0, 0], [0, 0, 0], [0.5, 0.4, 0.3]])
    m = group_metrics(lab, sc, ids, val)
    # group 5: coverage 1 at every k (1 of 1); group 6: k=1 1/1, k=3 2/2, k=5 2/2
    assert m["coverage"] == pytest.approx(100.0)
    # group 5: ranking [4]: P@1 1, P@3 1/3, P@5 1/5; group 6: [2, 9, 1]: 1, 2/3, 2/5
    assert m["precision"] == pytest.approx(100 * ((1 + 1 / 3 + 1 / 5) + (1 + 2 / 3 + 2 / 5)) / 6)


def test_keep_default_needs_a_significant_paired_gain():
    """choose(): 'best' takes the highest mean; 'keep-default' keeps the default tau unless a
    candidate's per-group differences have mean / standard error > 1.96.
    10: differences 2, 0, 2, 0 (mean 1, SE 1.155 / 2 = 0.577: z 1.73, kept out);
    300: 1, 1, 1, 1.5 (mean 1.125, SE 0.125: z 9); 30: -1 on every group (no spread: z 0, as a
    candidate +1 on every group would get: no evidence, never picked)."""
    base = np.array([50.0, 60.0, 70.0, 80.0])
    both = {100.0: base, 10.0: base + [2, 0, 2, 0], 300.0: base + [1, 1, 1, 1.5], 30.0: base - 1}
    both = {t: {"precision": float(v.mean()), "per_group": list(v)} for t, v in both.items()}
    assert choose(both, "precision", "best", 100.0) == (300.0, None)
    tau, z = choose(both, "precision", "keep-default", 100.0)
    assert tau == 300.0
    assert z[10.0] == pytest.approx(1.0 / (np.std([2, 0, 2, 0], ddof=1) / 2))
    assert z[100.0] == 0.0 and z[30.0] == 0.0 and z[300.0] == pytest.approx(9.0)
    flat = {100.0: both[100.0], 10.0: {"precision": 66.0, "per_group": list(base + 1)}}
    assert choose(flat, "precision", "keep-default", 100.0) == (100.0, {100.0: 0.0, 10.0: 0.0})
    del both[300.0]
    assert choose(both, "precision", "best", 100.0)[0] == 10.0             # the higher mean
    assert choose(both, "precision", "keep-default", 100.0)[0] == 100.0    # but not significantly
    # the per-group precisions group_metrics reports average to its precision
    ids = np.array([0, 1, 2])
    val = {5: (np.array([0, 1]), {4}), 6: (np.array([2]), {1, 2})}
    m = group_metrics(np.array([[4, -1, -1], [-1, -1, -1], [2, 9, 1]]), np.array([[1.0, 0, 0], [0, 0, 0],
                                                                                   [0.5, 0.4, 0.3]]), ids, val)
    assert np.mean(m["per_group"]) == pytest.approx(m["precision"])
    assert len(m["per_group"]) == 2
