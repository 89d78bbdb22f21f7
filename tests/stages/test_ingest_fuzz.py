"""Fuzzed bad input: seeded mutations of small clean XC, svmlight and Parquet files.

Every mutated input must either stop with an :class:`IngestError` whose message starts with the
input's path and (text) names the line the mutation touched, or 1 for XC header and sample
count errors, or load exactly the clean file's rows. Any other exception fails the test.

Mutations are chosen so that each has one right answer: a truncation ends inside a token where
the rest of the line cannot be valid (a cut at a token boundary leaves a shorter valid line,
which no text format can tell from the original), huge numbers are beyond int32/float32, only
ids (not values) are negated, and Parquet files carry page checksums (a flipped data bit is a
checksum failure, not a silently different value).
"""
import random
import re
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from xmc_spark.params import IngestParams
from xmc_spark.schemas import IngestError
from xmc_spark.stages import ingest

pytestmark = pytest.mark.slow          # 200 Spark validations: about 1.5 minutes on 2 cores

SEED = 20261126
N_TEXT = {"xc": 80, "svmlight": 64}
N_PARQUET = 56
# CI feeds the start of each seeded sequence: each text mutation kind three times (the kinds
# cycle), five Parquet flips, five truncations and ten logical faults (the logical fault's kind
# is drawn); all 200 on demand, to keep CI under its 30 minutes
N_CI = {"xc": 27, "svmlight": 24, "parquet": 20}
CI_RUNS = [pytest.param(False, id="all", marks=pytest.mark.on_demand), pytest.param(True, id="ci")]

# sample i: (labels, [(feature, value)]); XC ids are 0-based, svmlight ones 1-based
ROWS = [([0, 2], [(0, "1"), (3, "0.5")]), ([1], [(2, "2"), (7, "1")]), ([], [(5, "1.5")]),
        ([3, 4, 5], [(1, "1"), (4, "2"), (6, "0.25")]), ([2], [(0, "3")])]
N_FEATURES, N_LABELS = 8, 6
POISON = [b"x", b"#", b";", b'"', b"\x00", b"\xff"]    # bytes that no valid token can hold
HUGE_ID = ["2147483648", "99999999999", "99999999999999999999"]
HUGE_VALUE = ["1e39", "-1e40", "1e400"]


def _line(labels, feats, shift):
    return ",".join(map(str, labels)) + " " + " ".join(f"{j + shift}:{v}" for j, v in feats)


def clean_lines(fmt):
    shift = 1 if fmt == "svmlight" else 0
    lines = [_line(lab, ft, shift) for lab, ft in ROWS]
    return ([f"{len(ROWS)} {N_FEATURES} {N_LABELS}"] if fmt == "xc" else []) + lines


def _rows(df):
    return sorted((r.sample_id, list(r.feature_idx), list(r.feature_val), list(r.label_idx)) for r in df.collect())


# ---- text mutations: (lines, rng, fmt) -> (bytes, lines the error may name) ---------------------
def _join(lines, crlf=False):
    return ("\r\n" if crlf else "\n").join(lines).encode() + (b"\r\n" if crlf else b"\n")


def _data_range(fmt, lines):
    return range(1 if fmt == "xc" else 0, len(lines))


def poison_byte(lines, rng, fmt):
    data = bytearray(_join(lines))
    pos = rng.randrange(len(data))
    line = data[:pos].count(b"\n") + 1
    data[pos:pos + 1] = rng.choice(POISON)
    return bytes(data), {line}


def truncate(lines, rng, fmt):
    """The file ends inside a token where the partial line cannot be valid: in a feature index,
    right after ':' or after a label's ','. In XC the cut may fall anywhere before the last
    line (its sample count tells the lost lines)."""
    k = rng.choice(list(_data_range(fmt, lines)))
    text = lines[k]
    if fmt == "xc" and k < len(lines) - 1 and rng.random() < 0.5:
        cut = rng.randrange(len(text) + 1)
    else:
        cuts = [m.end() for m in re.finditer(r"[:,]", text)]
        for m in re.finditer(r"(\d+):", text):
            cuts += range(m.start(1) + 1, m.end(1) + 1)
        cut = rng.choice(cuts)
    head = b"".join(line.encode() + b"\n" for line in lines[:k])
    return head + text[:cut].encode(), {k + 1} | ({1} if fmt == "xc" else set())


def reorder_tokens(lines, rng, fmt):
    k = rng.choice([i for i in _data_range(fmt, lines) if len(lines[i].split()) >= 2])
    labels, *feats = lines[k].split(" ")
    out = list(lines)
    if labels and rng.random() < 0.4:              # the label list after a feature: malformed token
        out[k] = " ".join([feats[0], labels, *feats[1:]])
        return _join(out), {k + 1}
    rng.shuffle(feats)                             # features in any order: the same row
    out[k] = labels + " " + " ".join(feats)
    return _join(out), set()


def _numbers(line):
    """(start, end, kind) of each number: 'label', 'index' or 'value'."""
    spans = []
    labels, _, feats = line.partition(" ")
    spans += [(m.start(), m.end(), "label") for m in re.finditer(r"\d+", labels)]
    off = len(labels) + 1
    for m in re.finditer(r"(\d+):([0-9.]+)", feats):
        spans.append((off + m.start(1), off + m.end(1), "index"))
        spans.append((off + m.start(2), off + m.end(2), "value"))
    return spans


def huge_number(lines, rng, fmt):
    k = rng.choice(list(_data_range(fmt, lines)))
    s, e, kind = rng.choice(_numbers(lines[k]))
    out = list(lines)
    out[k] = lines[k][:s] + rng.choice(HUGE_VALUE if kind == "value" else HUGE_ID) + lines[k][e:]
    return _join(out), {k + 1}


def negative_id(lines, rng, fmt):
    """'-' before a label or feature index: an error, or the same row for '-0'."""
    k = rng.choice(list(_data_range(fmt, lines)))
    s, e, kind = rng.choice([n for n in _numbers(lines[k]) if n[2] != "value"])
    out = list(lines)
    out[k] = lines[k][:s] + "-" + lines[k][s:]
    return _join(out), {k + 1}


def empty_field(lines, rng, fmt):
    """'j:', ':v', 'j::v', a label list with an empty item ('0,,2', ',2', '0,2,')."""
    k = rng.choice(list(_data_range(fmt, lines)))
    labels, _, feats = lines[k].partition(" ")
    edits = [lambda: (labels, re.sub(r":[0-9.]+", ":", feats, count=1)),
             lambda: (labels, re.sub(r"\d+:", ":", feats, count=1)),
             lambda: (labels, feats.replace(":", "::", 1))]
    if labels:
        edits += [lambda: (labels + ",", feats), lambda: ("," + labels.partition(",")[2], feats)]
    if "," in labels:
        edits.append(lambda: (labels.replace(",", ",,", 1), feats))
    out = list(lines)
    out[k] = " ".join(rng.choice(edits)())
    return _join(out), {k + 1}


def blank_line(lines, rng, fmt):
    at = rng.randrange(1 if fmt == "xc" else 0, len(lines) + 1)
    out = list(lines)
    out.insert(at, rng.choice(["", " ", "\t", "  \t "]))
    return _join(out), {at + 1}


def whitespace(lines, rng, fmt):
    """Tabs, runs of spaces or CRLF line ends: the same rows."""
    if rng.random() < 0.3:
        return _join(lines, crlf=True), set()
    k = rng.choice(list(_data_range(fmt, lines)))
    out = list(lines)
    out[k] = re.sub(" ", lambda m: rng.choice(["\t", "  ", " \t "]), lines[k])
    return _join(out), set()


def header(lines, rng, fmt):
    """XC only: header with missing or extra counts, a wrong sample count, or smaller/larger
    label and feature counts (an id beyond them is an error on its first line)."""
    n, d, L = len(ROWS), N_FEATURES, N_LABELS
    out = list(lines)
    choice = rng.randrange(6)
    if choice == 0:
        out[0] = rng.choice([f"{n} {d}", f"{n}", "", f"{n} {d} {L} 1", f"{n}  {L}", f"-{n} {d} {L}", f"{n} {d} {L}.0"])
        return _join(out), {1}
    if choice == 1:
        out[0] = f"{n + rng.choice([-2, -1, 1, 3])} {d} {L}"
        return _join(out), {1}
    if choice == 2:                                # a data line lost or repeated
        k = rng.randrange(1, len(lines))
        out = lines[:k] + lines[k + 1:] if rng.random() < 0.5 else lines[:k + 1] + lines[k:]
        return _join(out), {1}
    d2, L2 = d + rng.randrange(-4, 3), L + rng.randrange(-4, 3)
    out[0] = f"{n} {d2} {L2}"
    bad = [i + 2 for i, (lab, ft) in enumerate(ROWS) if any(x >= L2 for x in lab) or any(j >= d2 for j, _ in ft)]
    return _join(out), set(bad[:1])


TEXT_MUTATIONS = [poison_byte, truncate, reorder_tokens, huge_number, negative_id, empty_field, blank_line,
                  whitespace]


def text_inputs(fmt, n, seed):
    rng = random.Random(seed)
    lines = clean_lines(fmt)
    ops = TEXT_MUTATIONS + ([header] if fmt == "xc" else [])
    for i in range(n):
        op = ops[i % len(ops)]
        data, allowed = op(lines, rng, fmt)
        yield f"{i:03d}-{op.__name__}", data, allowed


def check(path, outcome, clean, allowed=None):
    """None when the outcome is right, else what is wrong. ``allowed``: for text, the lines an
    error may name (empty: the input holds the clean rows and must load)."""
    if isinstance(outcome, list):
        return None if outcome == clean else f"loaded rows that differ from the clean file: {outcome}"
    if not isinstance(outcome, IngestError):
        return f"{type(outcome).__name__} instead of IngestError: {outcome}"
    msg = str(outcome)
    if not msg.startswith(f"{path}:"):
        return f"message does not start with the path: {msg}"
    if allowed is None:
        return None
    if not allowed:
        return f"rejected an input that holds the clean rows: {msg}"
    m = re.match(re.escape(path) + r":(\d+): ", msg)
    if m is None:
        return f"message names no line: {msg}"
    return None if int(m.group(1)) in allowed else f"names line {m.group(1)}, expected one of {sorted(allowed)}: {msg}"


def outcome_of(spark, path):
    try:
        df, _ = ingest.read_samples(spark, path, IngestParams())
        return _rows(df)
    except IngestError as e:
        return e
    except Exception as e:             # noqa: BLE001 - any other class is a failure, reported below
        return e


def _report(failures, n, seconds):
    print(f"FUZZ {n} inputs in {seconds:.1f} s")
    assert not failures, f"{len(failures)} of {n} fuzzed inputs went wrong:\n" + "\n".join(failures[:15])


@pytest.mark.parametrize("ci", CI_RUNS)
@pytest.mark.parametrize("fmt", ["xc", "svmlight"])
def test_fuzzed_text(spark, tmp_path, fmt, ci):
    ext = ".txt" if fmt == "xc" else ".svm"
    clean_path = tmp_path / f"clean{ext}"
    clean_path.write_bytes(_join(clean_lines(fmt)))
    clean = outcome_of(spark, str(clean_path))
    assert isinstance(clean, list) and len(clean) == len(ROWS), clean
    failures, t0 = [], time.time()
    n = N_CI[fmt] if ci else N_TEXT[fmt]
    for name, data, allowed in text_inputs(fmt, n, SEED + len(fmt)):
        path = str(tmp_path / f"{name}{ext}")
        with open(path, "wb") as f:
            f.write(data)
        problem = check(path, outcome_of(spark, path), clean, allowed)
        if problem:
            failures.append(f"{name} {data!r}: {problem}")
    _report(failures, n, time.time() - t0)


# ---- Parquet --------------------------------------------------------------------------------------
def _table(rows, types=None):
    """rows: (sample_id, feature_idx, feature_val, label_idx) lists; ``types`` overrides the
    Arrow types (int64 ids, float64 values by default)."""
    types = {"sample_id": pa.int64(), "feature_idx": pa.list_(pa.int64()), "feature_val": pa.list_(pa.float64()),
             "label_idx": pa.list_(pa.int64()), **(types or {})}
    cols = list(zip(*rows)) if rows else [[], [], [], []]
    return pa.table({name: pa.array(list(c), types[name]) for name, c in zip(types, cols)})


def clean_table_rows():
    return [[i, [j for j, _ in ft], [float(v) for _, v in ft], list(lab)] for i, (lab, ft) in enumerate(ROWS)]


def parquet_logical(rng):
    """(table, sample_id the error must name or None, True when the rows stay the clean ones)."""
    rows = clean_table_rows()
    i = rng.randrange(len(rows))
    kind = rng.randrange(9)
    if kind == 0:                                              # a null inside a list
        col = rng.choice([1, 2, 3] if rows[i][3] else [1, 2])
        rows[i][col] = rows[i][col][:-1] + [None]
        return _table(rows), i, False
    if kind == 1:                                              # lengths differ
        rows[i][2] = rows[i][2] + [1.0]
        return _table(rows), i, False
    if kind == 2:                                              # negative / huge ids
        col = rng.choice([1, 3] if rows[i][3] else [1])
        rows[i][col] = [rng.choice([-1, -7, 2 ** 31, 2 ** 40])] + rows[i][col][1:]
        return _table(rows), i, False
    if kind == 3:                                              # values NaN, infinite, beyond float32
        rows[i][2] = [rng.choice([float("nan"), float("inf"), 1e39, -1e300])] + rows[i][2][1:]
        return _table(rows), i, False
    if kind == 4:                                              # null or repeated sample_id
        rows[i][0] = None if rng.random() < 0.5 else rows[(i + 1) % len(rows)][0]
        return _table(rows), None, False
    if kind == 5:                                              # no rows
        return _table([]), None, False
    if kind == 6:                                              # a missing or mistyped column
        t = _table(rows)
        name = rng.choice(t.column_names)
        if rng.random() < 0.5:
            return t.drop([name]), None, False
        return t.set_column(t.column_names.index(name), name, pa.array(["x"] * len(rows))), None, False
    if kind == 7:                                              # rows shuffled, features permuted with values
        rng.shuffle(rows)
        for r in rows:
            perm = list(range(len(r[1])))
            rng.shuffle(perm)
            r[1], r[2] = [r[1][p] for p in perm], [r[2][p] for p in perm]
        return _table(rows), None, True
    return _table(rows, {"feature_idx": pa.list_(pa.int32()), "feature_val": pa.list_(pa.float32()),  # narrower
                         "label_idx": pa.list_(pa.int16())}), None, True


def parquet_inputs(data, tmp_path, n, seed):
    """(name, path, sample_id the error must name or None, whether the rows stay the clean ones)
    for ``n`` inputs: bits flipped in or a truncation of the clean file's bytes ``data``, or a
    table written with a logical fault."""
    rng = random.Random(seed)
    for i in range(n):
        path = tmp_path / f"{i:03d}.parquet"
        kind = i % 4
        if kind == 0:
            b = bytearray(data)
            for _ in range(rng.choice([1, 1, 2, 8])):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            path.write_bytes(bytes(b))
            yield f"{i:03d}-flip", str(path), None, False
        elif kind == 1:
            path.write_bytes(data[:rng.randrange(len(data))])
            yield f"{i:03d}-truncate", str(path), None, False
        else:
            t, sid, same = parquet_logical(rng)
            pq.write_table(t, path, write_page_checksum=True)
            yield f"{i:03d}-logical", str(path), sid, same


@pytest.mark.parametrize("ci", CI_RUNS)
def test_fuzzed_parquet(spark, tmp_path, ci):
    clean_path = tmp_path / "clean.parquet"
    pq.write_table(_table(clean_table_rows()), clean_path, write_page_checksum=True)
    clean = outcome_of(spark, str(clean_path))
    assert isinstance(clean, list) and len(clean) == len(ROWS), clean
    failures, t0 = [], time.time()
    n = N_CI["parquet"] if ci else N_PARQUET
    for name, path, sid, same in parquet_inputs(clean_path.read_bytes(), tmp_path, n, SEED):
        out = outcome_of(spark, path)
        problem = check(path, out, clean)
        if problem is None and same and not isinstance(out, list):
            problem = f"rejected an input that holds the clean rows: {out}"
        if problem is None and sid is not None and f"row with sample_id {sid}:" not in str(out):
            problem = f"does not name sample_id {sid}: {out}"
        if problem:
            failures.append(f"{name}: {problem}")
    _report(failures, n, time.time() - t0)
