"""The kNN re-ranker on Spark agrees with the numpy kernel (kernels.knn) on a tiny synth set:
blocked neighbours and votes = a brute-force sort of every similarity; re-ranking = the tree's
top K mixed with those votes (kernels.prime.rerank); the choice of k, power and weight = the
same grid searched in numpy on the held-out rows, whose neighbours are the other rows only;
stacked on a PRIME head, the same on PRIME's re-ranked candidates and held-out rows."""
import numpy as np
import pytest
import scipy.sparse as sp

from tests.stages.conftest import samples_frame, synth_rows
from xmc_spark.arrow_utils import to_arrow
from xmc_spark.kernels import knn as K
from xmc_spark.kernels import prime as PR
from xmc_spark.model import XMCModel
from xmc_spark.params import KnnParams, TreeParams
from xmc_spark.stages import knn as stage

N_TRAIN, N_TEST, L, D = 400, 120, 30, 150
DUPLICATES = (7, 150, 299, 388)             # copies of training row 3


def _synth(start, count):
    return synth_rows(start, count, L, D, seed=5)


@pytest.fixture(scope="module")
def data(spark):
    X, Y = _synth(0, N_TRAIN)
    X = X.tolil()
    for dup in DUPLICATES:                  # equal rows: ties, broken by id across the blocks
        X[dup] = X[3]
    X = X.tocsr()
    Xt, Yt = _synth(N_TRAIN, N_TEST)
    # a row with no feature (no neighbour, vote 0) and a copy of training row 3 (five tied neighbours)
    Xt = sp.vstack([Xt, sp.csr_matrix((1, D), dtype=np.float32), X[3]]).tocsr()
    Yt = sp.vstack([Yt, Yt[:2]]).tocsr()
    tree = XMCModel.train_local(X, Y, tree=TreeParams(max_leaf_size=4))
    return X, Y, Xt, Yt, samples_frame(spark, X, Y, partitions=2), samples_frame(spark, Xt, Yt, partitions=3), tree


def _by_id(t, col):
    return t.take(np.argsort(t.column("sample_id").to_numpy()))


def test_blocked_neighbours_vote_as_the_brute_force_sort(data):
    X, Y, Xt, _, train, test, _ = data
    # 50-row blocks: 3 query blocks x 8 training blocks, each (query, training) block one task
    nb = stage.neighbour_lists(stage.with_labels(stage.neighbours(test, stage.index_rows(train), 7, D, 50),
                                                 stage.index_rows(train)))
    t = _by_id(to_arrow(test.select("sample_id").join(nb, "sample_id", "left")), "sample_id")
    assert t.column("nbs")[N_TEST].as_py() is None                         # the featureless row
    ba = stage.blocks(stage.index_rows(train).count(), 50)
    blocks = {int(r["b"]) for r in train.filter(train.sample_id.isin(3, *DUPLICATES)).selectExpr(
        f"pmod(xxhash64(sample_id, 13), {ba}) AS b").collect()}
    assert len(blocks) > 1                                                   # the tied rows in several blocks
    twin = stage.neighbours(test.filter(test.sample_id == N_TEST + 1), stage.index_rows(train), 3, D, 50)
    assert [r["nb_id"] for r in twin.orderBy("rank").collect()] == [3, 7, 150]    # five tied at 1: smallest ids
    cand = np.tile(np.arange(L), (N_TEST + 2, 1))
    for k, power in ((7, 1.0), (3, 4.0), (1, 2.0)):
        np.testing.assert_allclose(stage.list_votes(t, cand, k, power, L), K.brute_force_votes(Xt, X, Y, k, power),
                                   atol=1e-5)


def test_rerank_equals_the_kernels_and_keeps_the_tree_beside(data):
    X, Y, Xt, _, train, test, tree = data
    prm = KnnParams(mode="rerank", K=12, block_rows=64)
    for w in (0.6, 1.0):
        preds, tree_preds = stage.rerank(test, stage.index_rows(train), tree, prm,
                                         {"knn.k": 5, "knn.power": 2.0, "knn.weight": w}, 3, 5, D, L)
        cand, sc = tree.predict(Xt, beam_size=3, topk=12)
        votes = np.take_along_axis(K.brute_force_votes(Xt, X, Y, 5, 2.0), np.maximum(cand, 0), 1)
        lab, fin = PR.rerank(cand, sc, np.where(cand >= 0, votes, 0.0), w)
        got = _by_id(to_arrow(preds), "sample_id")
        assert got.column("pred_labels").to_pylist() == [[x for x in r[:5] if x >= 0] for r in lab.tolist()]
        np.testing.assert_allclose(np.concatenate(got.column("pred_scores").to_pylist()),
                                   fin[:, :5][lab[:, :5] >= 0], rtol=1e-5, atol=1e-6)
        tp = _by_id(to_arrow(tree_preds), "sample_id")
        tl, _ = tree.predict(Xt, beam_size=3, topk=5)
        assert tp.column("pred_labels").to_pylist() == [[x for x in r if x >= 0] for r in tl.tolist()]
        if w == 1.0:                                   # weight 1: the tree's own order
            assert got.column("pred_labels").to_pylist() == tp.column("pred_labels").to_pylist()


def _grid_search(X, Y, held, fit, cand, sc):
    """(k, power, w, best mean, mean at w 1) over k 3/8 and power 1/4: the held-out rows' candidates
    ``cand`` (scores ``sc``) voted by the rows ``fit``, in numpy."""
    best = None
    for k in (3, 8):
        for power in (1.0, 4.0):
            v = np.take_along_axis(K.brute_force_votes(X[held], X[fit], Y[fit], k, power), np.maximum(cand, 0), 1)
            w, table = PR.choose_weight(cand, sc, np.where(cand >= 0, v, 0.0), Y[held])
            if best is None or table[w] > best[3]:
                best = (k, power, w, table[w], table[1.0])
    return best


def test_choice_is_the_numpy_grid_search_on_held_out_rows_voted_by_the_others(data, spark):
    X, Y, _, _, train, _, tree = data
    prm = KnnParams(mode="rerank", K=12, ks=[3, 8], powers=[1.0, 4.0], val_frac=0.3, block_rows=64)
    seen = {}

    def val_tree_fit(train_df):
        seen["ids"] = np.array(sorted(r["sample_id"] for r in train_df.select("sample_id").collect()))
        return XMCModel.train_local(X[seen["ids"]], Y[seen["ids"]], tree=TreeParams(max_leaf_size=4))

    facts = stage.choose(train, prm, N_TRAIN, D, L, 3, val_tree_fit)
    held = np.array(sorted(r["sample_id"] for r in train.filter(
        stage.is_held_out(stage.val_fraction(prm, N_TRAIN), prm.seed)).collect()))
    assert facts["knn.n_held_out"] == len(held) > 0 and not set(held) & set(seen["ids"])
    assert set(held) | set(seen["ids"]) == set(range(N_TRAIN))
    vtree = val_tree_fit(train.filter(~stage.is_held_out(stage.val_fraction(prm, N_TRAIN), prm.seed)))
    cand, sc = vtree.predict(X[held], beam_size=3, topk=12)
    best = _grid_search(X, Y, held, seen["ids"], cand, sc)
    assert (facts["knn.k"], facts["knn.power"], facts["knn.weight"]) == best[:3]
    assert facts["knn.val_rerank_mean_p"] == pytest.approx(best[3], abs=1e-4)
    assert facts["knn.val_tree_mean_p"] == pytest.approx(best[4], abs=1e-4)


def _head(weight=0.5, dim=8, seed=3):
    from xmc_spark.prime_model import PrimeHead
    rng = np.random.default_rng(seed)
    Z = rng.normal(size=(L, dim))
    return PrimeHead("rerank", 12, weight, {"E": rng.normal(size=(D, dim)).astype(np.float32),
                                             "Z": (Z / np.linalg.norm(Z, axis=1, keepdims=True)).astype(np.float32)})


@pytest.mark.parametrize("layout", ["whole", "sharded"])
def test_stacked_on_prime_reranks_primes_candidates_and_chooses_on_primes_held_out_rows(data, spark, layout):
    """tree -> PRIME -> kNN: the votes re-order PRIME's re-ranked top K (a head mixing at 0.5), weight
    1 keeps PRIME's order, tree_predictions are the tree's own; the choice is the numpy grid on
    PRIME's candidates of the rows that ``split`` (PRIME's 0.3, not the kNN section's 0.2) holds out.
    With the trees sharded (above predict.max_broadcast_mb) the same, against the whole tree's answers."""
    from tests.stages.conftest import as_sharded
    from xmc_spark.params import PrimeParams
    from xmc_spark.prime_model import PrimedModel
    X, Y, Xt, _, train, test, tree = data
    layout_of = (lambda m: m) if layout == "whole" else (lambda m: as_sharded(spark, m))

    def with_head(m, head):
        return PrimedModel(layout_of(m), head)

    head = _head()
    prm = KnnParams(mode="rerank", K=12, ks=[3, 8], powers=[1.0, 4.0], val_frac=0.2, block_rows=64)
    preds, tree_preds = stage.rerank(test, stage.index_rows(train), with_head(tree, head), prm,
                                     {"knn.k": 5, "knn.power": 2.0, "knn.weight": 0.6}, 3, 5, D, L)
    cand, sc = PrimedModel(tree, head).predict(Xt, beam_size=3, topk=12)
    tc, _ = tree.predict(Xt, beam_size=3, topk=12)
    assert (np.sort(cand, 1) == np.sort(tc, 1)).all() and (cand != tc).any()   # PRIME's order of the tree's top 12
    votes = np.take_along_axis(K.brute_force_votes(Xt, X, Y, 5, 2.0), np.maximum(cand, 0), 1)
    lab, fin = PR.rerank(cand, sc, np.where(cand >= 0, votes, 0.0), 0.6)
    got = _by_id(to_arrow(preds), "sample_id")
    assert got.column("pred_labels").to_pylist() == [[x for x in r[:5] if x >= 0] for r in lab.tolist()]
    np.testing.assert_allclose(np.concatenate(got.column("pred_scores").to_pylist()), fin[:, :5][lab[:, :5] >= 0],
                               rtol=1e-5, atol=1e-6)
    tl, _ = tree.predict(Xt, beam_size=3, topk=5)              # tree_predictions: the tree's own, not PRIME's
    assert _by_id(to_arrow(tree_preds), "sample_id").column("pred_labels").to_pylist() == [
        [x for x in r if x >= 0] for r in tl.tolist()]
    base, _ = stage.rerank(test, stage.index_rows(train), with_head(tree, head), prm,
                           {"knn.k": 5, "knn.power": 2.0, "knn.weight": 1.0}, 3, 5, D, L)
    assert _by_id(to_arrow(base), "sample_id").column("pred_labels").to_pylist() == [   # weight 1: PRIME's order
        [x for x in r[:5] if x >= 0] for r in cand.tolist()]

    split = PrimeParams(mode="rerank", val_frac=0.3, seed=1)
    seen = {}

    def val_tree_fit(train_df):
        seen["ids"] = np.array(sorted(r["sample_id"] for r in train_df.select("sample_id").collect()))
        return XMCModel.train_local(X[seen["ids"]], Y[seen["ids"]], tree=TreeParams(max_leaf_size=4))

    facts = stage.choose(train, prm, N_TRAIN, D, L, 3, lambda df: layout_of(val_tree_fit(df)), head=head,
                         split=split)
    held = np.setdiff1d(np.arange(N_TRAIN), seen["ids"])
    want = sorted(r["sample_id"] for r in train.filter(stage.is_held_out(0.3, 1)).select("sample_id").collect())
    assert held.tolist() == want and facts["knn.n_held_out"] == len(held) > 0
    cand, sc = PrimedModel(val_tree_fit(train.filter(~stage.is_held_out(0.3, 1))), head).predict(
        X[held], beam_size=3, topk=12)
    best = _grid_search(X, Y, held, seen["ids"], cand, sc)
    assert (facts["knn.k"], facts["knn.power"], facts["knn.weight"]) == best[:3]
    assert facts["knn.val_rerank_mean_p"] == pytest.approx(best[3], abs=1e-4)


def test_a_saved_choice_names_the_prime_head_it_was_made_on():
    """knn.json's PRIME digest: equal for the head's arrays in float32 or float64 (the prime table
    keeps float32), different for another weight or other prototypes; predict stops on any mismatch."""
    from xmc_spark.params import ConfigError
    from xmc_spark.prime_model import PrimeHead
    head = _head()
    d = stage.prime_digest(head)
    as64 = PrimeHead("rerank", 12, 0.5, {k: v.astype(np.float64) for k, v in head.weights.items()})
    assert stage.prime_digest(None) is None and stage.prime_digest(as64) == d
    other = _head(seed=4)
    assert stage.prime_digest(other)["sha256"] != d["sha256"]
    assert stage.prime_digest(_head(weight=0.7)) == {**d, "weight": 0.7}
    stage.check_prime({"prime": d}, as64, "m")
    stage.check_prime({}, None, "m")                  # a choice made before stacking existed, no prime/
    for info, h, msg in (({}, head, "chosen on the tree's candidates, but the folder also has PRIME"),
                         ({"prime": d}, None, "but the folder has no prime/"),
                         ({"prime": d}, _head(weight=0.7), "weight 0.5\\) than the folder's prime/ .*weight 0.7\\)"),
                         ({"prime": d}, other, "other arrays")):
        with pytest.raises(ConfigError, match=msg):
            stage.check_prime(info, h, "m")
