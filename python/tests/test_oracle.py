"""What test_elastic.py's oracle rests on, checked beside other tests: its replays
are fixed-world launches with no fault and no heartbeat deadline, so unlike the
elastic jobs they need nothing to run alone (not `serial`)."""

import subprocess

from test_elastic import _binary, reference


def test_same_schedule_is_bitwise_and_other_worlds_are_not(tmp_path):
    """A schedule replayed gives the same bits; another world size gives other bits
    (so the oracle can tell schedules apart)."""
    url, ref, other = (f"file://{tmp_path / name}" for name in ("job", "reference", "other"))
    reference(url, [(0, 2)], steps=20)
    reference(ref, [(0, 2)], steps=20)
    reference(other, [(0, 3)], steps=20)
    same = subprocess.run([_binary(), "diff", ref, url], capture_output=True, text=True)
    assert same.returncode == 0 and "identical" in same.stdout, same.stdout
    different = subprocess.run([_binary(), "diff", ref, other], capture_output=True, text=True)
    assert "identical" not in different.stdout, different.stdout
