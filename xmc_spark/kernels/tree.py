"""Label-tree bookkeeping in heap numbering, shared by the numpy reference and Spark stages.

Nodes are numbered as a B-ary heap: the root is 0 and the children of node n are
n*B + 1 .. n*B + B, so a node id alone gives its depth and every ancestor. A tree is the
list of label slots: (label, leaf node). A label normally has one slot; overlapping
clusters give it several.
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np
import scipy.sparse as sp

from .balanced_kmeans import balanced_split
from .interpolated_split import interpolated_split


def node_depth(ids, B: int) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64).copy()
    d = np.zeros(ids.shape, dtype=np.int64)
    while np.any(ids > 0):
        m = ids > 0
        ids[m] = (ids[m] - 1) // B
        d[m] += 1
    return d


def ancestor_at(ids, depths, target: int, B: int) -> np.ndarray:
    """Ancestor at depth ``target`` of each node (nodes shallower than target keep their id)."""
    ids = np.asarray(ids, dtype=np.int64).copy()
    depths = np.asarray(depths, dtype=np.int64)
    for _ in range(int(depths.max(initial=0)) - target):
        m = depths > target
        depths = np.where(m, depths - 1, depths)
        ids[m] = (ids[m] - 1) // B
    return ids


def split_seed(seed: int, node: int) -> int:
    """Deterministic per-node seed, the same in every executor."""
    return int((int(seed) * 1000003 + int(node) * 7919 + 17) % (2 ** 31 - 1))


def splits_balanced(node: int, nr_splits: int, lam: float, balanced_below_depth: int) -> bool:
    """Whether ``node``'s split is the balanced k-means: lam = 0, or the node at
    ``balanced_below_depth`` or deeper (else the interpolated split)."""
    return lam <= 0 or int(node_depth([node], nr_splits)[0]) >= balanced_below_depth


def split_node(Z: sp.csr_matrix, node: int, nr_splits: int, max_iter: int, seed: int, lam: float = 0.0,
               f=None, f_tilde=None, gamma: float = 0.1, balanced_below_depth: int = 32) -> np.ndarray:
    """Child node ids for the rows of Z (the embeddings of one node's labels, sorted by label).

    lam = 0 is the balanced B-way spherical k-means split; lam > 0 the interpolated 2-way
    split on the labels' frequencies f and f_tilde (nodes at ``balanced_below_depth`` or
    deeper split balanced, so heap ids stay bounded even for Fano-like chains).
    """
    s = split_seed(seed, node)
    if not splits_balanced(node, nr_splits, lam, balanced_below_depth):
        pos = interpolated_split(Z, f, f_tilde, lam, gamma=gamma, max_iter=max_iter, seed=s)
    else:
        pos = balanced_split(Z, nr_splits=nr_splits, max_iter=max_iter, seed=s)
    return node * nr_splits + 1 + pos


def build_tree(Z: sp.csr_matrix, max_leaf_size: int = 100, nr_splits: int = 2, max_iter: int = 20,
               seed: int = 0, lam: float = 0.0, f=None, f_tilde=None, gamma: float = 0.1,
               balanced_below_depth: int = 32, root: int = 0) -> np.ndarray:
    """Numpy reference of the level-by-level tree: the leaf node id of every label.

    ``f``/``f_tilde`` (per label, any scale) are needed when lam > 0. ``root`` builds the
    subtree below that node instead (same ids and seeds as in the whole tree).
    """
    Z = sp.csr_matrix(Z)
    L = Z.shape[0]
    if lam > 0 and (f is None or f_tilde is None):
        raise ValueError("an interpolated tree (lam > 0) needs label frequencies f and f_tilde")
    f = np.zeros(L) if f is None else np.asarray(f, np.float64)
    f_tilde = np.zeros(L) if f_tilde is None else np.asarray(f_tilde, np.float64)
    node = np.full(L, int(root), dtype=np.int64)
    while True:
        ids, counts = np.unique(node, return_counts=True)
        big = ids[counts > max_leaf_size]
        if len(big) == 0:
            return node
        for n in big:
            labels = np.flatnonzero(node == n)
            node[labels] = split_node(Z[labels], int(n), nr_splits, max_iter, seed, lam, f[labels],
                                      f_tilde[labels], gamma, balanced_below_depth)


def tree_from_params(Z: sp.csr_matrix, params, f=None, f_tilde=None, root: int = 0) -> np.ndarray:
    """:func:`build_tree` with a :class:`~xmc_spark.params.TreeParams`."""
    return build_tree(Z, params.max_leaf_size, params.nr_splits, params.max_iter, params.seed,
                      params.effective_lambda, f, f_tilde, params.gamma, params.balanced_below_depth, root)


def unique_pairs(r: np.ndarray, g: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The distinct (r, g) pairs sorted by r then g (``np.unique(np.stack([r, g]), axis=1)``,
    by a two-key sort instead of a sort of row records, several times faster)."""
    order = np.lexsort((g, r))
    r, g = r[order], g[order]
    keep = np.ones(len(r), bool)
    keep[1:] = (r[1:] != r[:-1]) | (g[1:] != g[:-1])
    return r[keep], g[keep]


class TreeIndex:
    """Lookups over the slots (label, leaf) of a tree, small enough to broadcast (O(labels))."""

    def __init__(self, slot_label, slot_leaf, n_labels: int, nr_splits: int):
        slot_label = np.asarray(slot_label, dtype=np.int64)
        slot_leaf = np.asarray(slot_leaf, dtype=np.int64)
        order = np.lexsort((slot_label, slot_leaf))     # slots sorted by (leaf, label)
        self.slot_label = slot_label[order]
        self.slot_leaf = slot_leaf[order]
        self.B = int(nr_splits)
        self.n_labels = int(n_labels)
        self.slot_depth = node_depth(self.slot_leaf, self.B)
        self.depth = int(self.slot_depth.max(initial=0))
        # label -> slots (CSR)
        by_label = np.argsort(self.slot_label, kind="mergesort")
        self.label_ptr = np.zeros(self.n_labels + 1, dtype=np.int64)
        np.add.at(self.label_ptr, self.slot_label + 1, 1)
        self.label_ptr = np.cumsum(self.label_ptr)
        self.label_slots = by_label
        self.leaves, self.leaf_start = np.unique(self.slot_leaf, return_index=True)
        self.leaf_end = np.append(self.leaf_start[1:], len(self.slot_leaf))
        # internal nodes: every proper ancestor of a leaf
        self.nodes, _, self.internal = self._sweep_up(np.zeros(len(self.slot_leaf)))

    def _sweep_up(self, w: np.ndarray):
        """(every node sorted, the sum of ``w`` (a value per slot) over the slots at or below each
        node, the proper ancestors of the leaves sorted), from the leaves up a depth at a time:
        O(leaves x depth), where taking each slot's ancestor at every depth is O(slots x depth^2)
        (11 s of driver time for a tree of 1M labels). Sums of integer values are exact."""
        if len(w) != len(self.slot_leaf):
            raise ValueError(f"{len(w)} values for {len(self.slot_leaf)} slots")
        lw = np.add.reduceat(np.asarray(w, np.float64), self.leaf_start) if len(self.leaf_start) else np.zeros(0)
        ldep = self.slot_depth[self.leaf_start]
        ids, sums, internal = [], [], []
        up, up_w = np.zeros(0, np.int64), np.zeros(0)
        for d in range(self.depth, -1, -1):
            at = ldep == d
            u, inv = np.unique(np.concatenate([self.leaves[at], up]), return_inverse=True)
            ids.append(u)
            sums.append(np.bincount(inv, weights=np.concatenate([lw[at], up_w]), minlength=len(u)))
            up, up_w = (u[u > 0] - 1) // self.B, sums[-1][u > 0]
            internal.append(np.unique(up))
        nodes, total = np.concatenate(ids), np.concatenate(sums)
        order = np.argsort(nodes, kind="stable")
        return nodes[order], total[order], np.unique(np.concatenate(internal))

    def node_sums(self, w: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(every node sorted, the sum of ``w`` (a value per slot, in slot order) over the slots at
        or below each node)."""
        return self._sweep_up(w)[:2]


    def label_depth(self) -> np.ndarray:
        """Depth of each label's deepest leaf (for expected depth@k)."""
        d = np.zeros(self.n_labels, dtype=np.int64)
        np.maximum.at(d, self.slot_label, self.slot_depth)
        return d
    def to_arrays(self) -> Dict[str, np.ndarray]:
        return {"slot_label": self.slot_label, "slot_leaf": self.slot_leaf}

    def slots_of_labels(self, labels: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(index into ``labels`` of each slot, slot id) for every slot of every label."""
        labels = np.asarray(labels, dtype=np.int64)
        cnt = self.label_ptr[labels + 1] - self.label_ptr[labels]
        src = np.repeat(np.arange(len(labels)), cnt)
        start = np.repeat(self.label_ptr[labels], cnt)
        off = np.arange(cnt.sum()) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        return src, self.label_slots[start + off]

    def groups_of_samples(self, offsets: np.ndarray, labels: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Training groups of each sample: every node whose classifiers see the sample.

        A sample reaches the root and, teacher-forced, every ancestor of the leaves of its
        labels, and those leaves. Returns unique (sample row, group node) pairs. Samples with
        no label are negatives at the root only.
        """
        offsets = np.asarray(offsets, dtype=np.int64)
        n = len(offsets) - 1
        rows = np.repeat(np.arange(n), np.diff(offsets))
        src, slots = self.slots_of_labels(np.asarray(labels, dtype=np.int64))
        rows = rows[src]
        anc, dep = self.slot_leaf[slots], self.slot_depth[slots]      # fresh arrays: lifted in place
        pr = [np.arange(n)]
        pg = [np.zeros(n, dtype=np.int64)]
        for t in range(self.depth, 0, -1):          # up from the deepest leaves, a depth at a time
            m = dep >= t
            pr.append(rows[m])
            pg.append(anc[m])                        # each pair's ancestor at depth t
            anc[m] = (anc[m] - 1) // self.B
        r = np.concatenate(pr)
        g = np.concatenate(pg)
        return unique_pairs(r, g)

    def node_problem(self, group: int, offsets: np.ndarray, labels: np.ndarray, label_weights=None):
        """(child ids or slot ids, Y n x K) for the classifiers trained at node ``group``.

        At an internal node the children are its child nodes that hold labels; at a leaf
        they are its slots (one classifier per label in the leaf). Y's values are the
        positives' weights: ``label_weights`` (aligned with ``labels``, default 1), the
        largest one where several labels of a sample fall under the same child.
        """
        offsets = np.asarray(offsets, dtype=np.int64)
        n = len(offsets) - 1
        rows = np.repeat(np.arange(n), np.diff(offsets))
        lw = np.ones(len(labels)) if label_weights is None else np.asarray(label_weights, np.float64)
        src, slots = self.slots_of_labels(np.asarray(labels, dtype=np.int64))
        rows = rows[src]
        lw = lw[src]
        k = np.searchsorted(self.leaves, group)
        if k < len(self.leaves) and self.leaves[k] == group:
            s0, s1 = self.leaf_start[k], self.leaf_end[k]
            m = (slots >= s0) & (slots < s1)
            children = np.arange(s0, s1)
            col = slots[m] - s0
            rows = rows[m]
            lw = lw[m]
        else:
            gd = int(node_depth([group], self.B)[0])
            leaf, dep = self.slot_leaf[slots], self.slot_depth[slots]
            m = dep > gd
            anc_child = ancestor_at(leaf[m], dep[m], gd + 1, self.B)
            parent = (anc_child - 1) // self.B
            keep = parent == group
            rows, anc_child, lw = rows[m][keep], anc_child[keep], lw[m][keep]
            lo, hi = np.searchsorted(self.nodes, [group * self.B + 1, group * self.B + self.B + 1])
            children = self.nodes[lo:hi]
            col = np.searchsorted(children, anc_child)
        K = len(children)
        if len(rows):
            key = rows * max(K, 1) + col
            order = np.lexsort((-lw, key))
            first = np.concatenate([[True], key[order][1:] != key[order][:-1]])
            pick = order[first]
            rows, col, lw = rows[pick], col[pick], lw[pick]
        Y = sp.csr_matrix((lw.astype(np.float32), (rows, col)), shape=(n, K))
        return children, Y


TREE_SHIFT = 52          # an ensemble's keys: tree << TREE_SHIFT | node (or slot) id of that tree


def encode_keys(tree: int, ids) -> np.ndarray:
    """Keys of tree ``tree``'s node or slot ids in an ensemble (tree 0: the ids themselves)."""
    ids = np.asarray(ids, dtype=np.int64)
    if len(ids) and int(ids.max()) >= 1 << TREE_SHIFT:
        raise ValueError(f"node id {int(ids.max())} of tree {tree} does not fit an ensemble key "
                         f"(< 2^{TREE_SHIFT}): the tree is too deep for tree.ensemble > 1")
    return ids | (np.int64(tree) << np.int64(TREE_SHIFT))


def decode_keys(keys) -> Tuple[np.ndarray, np.ndarray]:
    """(tree, node or slot id) of ensemble keys."""
    keys = np.asarray(keys, dtype=np.int64)
    return keys >> np.int64(TREE_SHIFT), keys & np.int64((1 << TREE_SHIFT) - 1)


def keyed_pairs(per_tree) -> Tuple[np.ndarray, np.ndarray]:
    """(rows, ids) pairs of each tree, t-th in ``per_tree`` -> one (rows, ensemble keys)."""
    return (np.concatenate([r for r, _ in per_tree]),
            np.concatenate([encode_keys(t, g) for t, (_, g) in enumerate(per_tree)]))


class Forest:
    """Several trees over the same labels (an ensemble), trained as one: the node trainer's
    view of :class:`TreeIndex` (``groups_of_samples``, ``node_problem``, ``leaves``) with every
    node and slot id made a key of its tree (:func:`encode_keys`), so that all trees' nodes
    are groups of the same Spark jobs."""

    def __init__(self, trees):
        self.trees = list(trees)
        if not self.trees:
            raise ValueError("a forest needs at least one tree")
        self.n_labels = self.trees[0].n_labels
        self.depth = max(t.depth for t in self.trees)
        self.leaves = np.concatenate([encode_keys(t, ix.leaves) for t, ix in enumerate(self.trees)])

    def __len__(self) -> int:
        return len(self.trees)

    def groups_of_samples(self, offsets: np.ndarray, labels: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        return keyed_pairs([ix.groups_of_samples(offsets, labels) for ix in self.trees])

    def node_problem(self, group: int, offsets: np.ndarray, labels: np.ndarray, label_weights=None):
        t, node = decode_keys([group])
        children, Y = self.trees[int(t[0])].node_problem(int(node[0]), offsets, labels, label_weights)
        return encode_keys(int(t[0]), children), Y

    def label_depth(self) -> np.ndarray:
        """Mean over the trees of each label's depth (expected depth@k of an ensemble)."""
        return np.mean([ix.label_depth() for ix in self.trees], axis=0)


def tree_list(index) -> list:
    """The trees of ``index``: a :class:`Forest`'s, or the one :class:`TreeIndex`."""
    return index.trees if isinstance(index, Forest) else [index]


def find_keys(sorted_keys: np.ndarray, keys) -> tuple:
    """(pos, found): where each of ``keys`` sits in ``sorted_keys`` (ascending) and whether it is
    there; ``pos`` is a valid index wherever found (0 for every key when ``sorted_keys`` is empty)."""
    keys = np.asarray(keys)
    if not len(sorted_keys):
        return np.zeros(len(keys), np.int64), np.zeros(len(keys), bool)
    pos = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
    return pos, sorted_keys[pos] == keys
