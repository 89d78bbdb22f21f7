"""benchmarks/kernels_ab.py on bibtex against this checkout's own commit: every kernel row is
printed, and a commit's kernels agree with themselves on every input (what the script reports as
0 inputs differing); a model folder adds the beam search's row."""
import subprocess
import sys
from pathlib import Path

from xmc_spark.local_io import read_xc
from xmc_spark.model import XMCModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import kernels_ab as B  # noqa: E402


def test_the_before_side_is_the_revisions_own_code(tmp_path):
    """The kernels of ``--before`` are the revision's file (``git show``; HEAD here, which any
    clone has, shallow or not), imported from the given folder, not this checkout's module."""
    from xmc_spark.kernels import squared_hinge
    old = B.old_kernel("HEAD", "squared_hinge", tmp_path)
    assert Path(old.__file__).parent == tmp_path and old.__name__ == "squared_hinge_before"
    assert old is not squared_hinge and old.train_node is not squared_hinge.train_node
    committed = subprocess.run(["git", "-C", str(B.ROOT), "show", "HEAD:xmc_spark/kernels/squared_hinge.py"],
                               capture_output=True, text=True, check=True).stdout
    assert "from numba import njit" in Path(old.__file__).read_text()
    assert [ln for ln in Path(old.__file__).read_text().splitlines() if "import" not in ln] == \
        [ln for ln in committed.splitlines() if "import" not in ln]


def test_head_against_itself_differs_nowhere(bibtex, tmp_path, capsys):
    X, Y = read_xc(str(bibtex / "train.txt"))
    XMCModel.train_local(X, Y).save(str(tmp_path / "model"))
    assert B.main(["--before", "HEAD", "--data", str(bibtex), "--model", str(tmp_path / "model"), "--groups", "3",
                   "--pass-rows", "2000"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| ") and "---" not in r][1:]
    assert [r.split(" | ")[0] for r in rows] == [
        "| solver (`train_node`)", "| 2-means split (`balanced_split`)", "| beam search (`beam_search`)",
        *["| distributed pass (`partial_pass`)"] * 3]
    assert all(r.rstrip(" |").endswith("| 0") for r in rows)
