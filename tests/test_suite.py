"""The suite's own settings (pytest.ini): a passed test's tmp_path folder is removed as the test
ends, a failed test's stays to be looked at. The suite writes checkpoints, datasets and whole
runs into tmp_path; kept to the session's end they reached 2.9 GB, and a CI run on a shared disk
failed for want of space."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

PASSING_AND_FAILING = '''
def test_passes(tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(b"0" * 1_000_000)

def test_fails(tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(b"0" * 1_000_000)
    assert False
'''


def test_only_a_failed_tests_tmp_path_is_kept(tmp_path):
    (tmp_path / "test_two.py").write_text(PASSING_AND_FAILING)
    basetemp = tmp_path / "base"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
         str(REPO / "pytest.ini"), "--rootdir", str(tmp_path), "--basetemp", str(basetemp),
         str(tmp_path / "test_two.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "1 failed, 1 passed" in done.stdout, done.stdout + done.stderr
    kept = sorted(p.name for p in basetemp.iterdir() if not p.is_symlink())  # "...current"
    assert kept == ["test_fails0"], kept
    assert (basetemp / "test_fails0" / "checkpoint.pt").stat().st_size == 1_000_000
