"""The numba line parser against a plain-Python parser of the same forms, and its refusals."""
import random
from fractions import Fraction

import numpy as np
import pytest

from xmc_spark.kernels.text_parse import parse_lines


def _run(lines, one_based=0, data=None):
    raw = [x.encode() if isinstance(x, str) else x for x in lines]
    buf = np.frombuffer(b"".join(raw), np.uint8)
    offs = np.concatenate([[0], np.cumsum([len(x) for x in raw])]).astype(np.int64)
    data = np.ones(len(raw), np.bool_) if data is None else np.asarray(data)
    ok, rep, lp, lab, fp, fidx, fval = parse_lines(buf, offs, data, one_based)
    return [(bool(ok[k]), bool(rep[k]), lab[lp[k]:lp[k + 1]].tolist(), fidx[fp[k]:fp[k + 1]].tolist(),
             fval[fp[k]:fp[k + 1]].tolist()) for k in range(len(raw))]


def _float32(text):
    """The float32 nearest to the decimal ``text`` (ties to even), as Java's Float.parseFloat:
    exact arithmetic over the neighbours of the double-rounded guess."""
    exact = Fraction(text)
    guess = np.float32(float(text))
    cands = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    return float(min(cands, key=lambda c: (abs(Fraction(float(c)) - exact), int(c.view(np.uint32)) & 1)))


def _reference(line, one_based):
    """Python's split() (the same whitespace for ASCII), values rounded once to float32."""
    toks = line.split()
    labels = []
    if toks and not line[0].isspace() and ":" not in toks[0]:
        labels = [int(x) for x in toks.pop(0).split(",")]
    feats = [t.split(":") for t in toks if not t.startswith("qid:")]
    return labels, [int(i) - one_based for i, _ in feats], [_float32(v) for _, v in feats]


@pytest.mark.parametrize("one_based", [0, 1])
def test_random_plain_lines_equal_the_reference(one_based):
    rng = random.Random(7)
    forms = ["{:d}", "{:.6f}", "{:.3e}", "{:+.2f}", "{:g}", "{:.0f}.", ".{:d}", "{:.15g}", "{:E}"]
    lines = []
    for _ in range(500):
        labels = ",".join(str(rng.randrange(1000)) for _ in range(rng.randrange(0, 4)))
        feats = []
        for _ in range(rng.randrange(0, 8)):
            v = rng.choice([rng.uniform(-100, 100), rng.uniform(0, 1e-6), rng.randrange(10 ** 6)])
            form = rng.choice(forms)
            text = form.format(abs(int(v))) if form in ("{:d}", ".{:d}") else form.format(v)
            feats.append(f"{rng.randrange(one_based, 10 ** 6)}:{text}")
        sep = rng.choice([" ", "\t", "  ", " \x0b"])
        line = sep.join(([labels] if labels else []) + feats)
        if not labels and feats:
            line = " " + line
        lines.append(line or "0")
    parsed = 0
    for line, (ok, rep, lab, idx, val) in zip(lines, _run(lines, one_based)):
        want = _reference(line, one_based)
        if not ok:             # only a value exactly halfway between two float32 after rounding
            assert any(len(v.replace(".", "").lstrip("+-0").split("e")[0].split("E")[0]) > 8
                       for t in line.split() if ":" in t for v in [t.split(":")[1]]), line
            continue
        parsed += 1
        assert (lab, idx) == want[:2], line
        assert val == want[2], line                    # float32 bit for bit
        assert rep == (len(set(idx)) != len(idx))
    assert parsed >= 495


def test_forms_it_leaves_to_the_sql_checks():
    odd = ["", " ", "\t", "x 1:1", "1 1:", "1 :1", "1 1:2:3", "1 1", "1,,2 1:1", "+1 1:1", "-1 1:1", "1 a:1",
           "1 -1:1", "1 +1:1", "1 1:b", "1 1:NaN", "1 1:inf", "1 1:1f", "1 1:0x1p3", "1 1:1e39", "1 1:1e-40",
           "1 1:1.2.3", "1 1:1e", "1 1:.", "1 1:1234567890123456", "1 1:1e99999", "1 1234567890123456789:1",
           "1\u00a02:1", "1:1 2:1:1", "1 2:1\u00e9"]
    for line, (ok, _, lab, idx, _) in zip(odd, _run(odd)):
        assert not ok and lab == [] and idx == [], line


def test_labels_qid_header_and_one_based():
    got = _run(["3 5 4", "0,2 qid:9 1:0.5 3:1", "  qid:1 2:2", "7"], one_based=1, data=[False, True, True, True])
    assert got[0] == (False, False, [], [], [])                    # not data (the XC header): untouched
    assert got[1] == (True, False, [0, 2], [0, 2], [0.5, 1.0])
    assert got[2] == (True, False, [], [1], [2.0])
    assert got[3] == (True, False, [7], [], [])
    assert _run(["1 1:1"], one_based=1) == [(True, False, [1], [0], [1.0])]
    assert _run(["1 0:1"], one_based=1)[0][0] is False            # index 0 in a 1-based file: negative


def test_repeated_indices_are_marked():
    assert [r[1] for r in _run(["0 3:1 1:2 3:2", "0 1:1 2:1", "0 2:1 2:-1"])] == [True, False, True]


def test_a_double_rounding_tie_is_left_to_the_sql_path():
    """Decimals whose nearest double lies exactly halfway between two float32: casting that
    double rounds the other way than Java's Float.parseFloat (bits from Java 17), so the kernel
    must not parse them; an exact halfway decimal would be fine either way but is refused too."""
    java = {"8.48125410079956": 0x4107b337, "8.19161081314087": 0x410310d7, "8.37816858291626": 0x41060cfb,
            "9.77526330947876": 0x411c677b, "4.22980809211731": 0x40875a97}
    for text, bits in java.items():
        assert int(np.float32(_float32(text)).view(np.uint32)) == bits      # the reference agrees with Java
        (ok, _, _, _, val), = _run([f"0 0:{text}"])
        assert not ok or int(np.float32(val[0]).view(np.uint32)) == bits, text
