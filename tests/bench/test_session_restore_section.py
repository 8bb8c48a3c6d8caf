"""The session-restore bench section's pure parts: its step and its figures.

No model: the section itself runs in ``make bench`` (``--only session_restore``).
"""

from __future__ import annotations

from bench.context import BenchContext
from bench.profile import PROFILES
from bench.run import SECTIONS
from bench.sections import session_restore


def test_registered_with_an_offload_dir_and_a_data_dir_of_its_own():
    assert SECTIONS["session_restore"] is session_restore.steps
    [step] = session_restore.steps(BenchContext(PROFILES["default"]))
    flag, offload = step.resource.args
    assert flag == "--kv-offload-dir"
    [(name, data_dir)] = step.resource.env
    assert name == "PROTOSERVE_DATA_DIR" and offload != data_dir
    assert ("session_restore.ttft_ratio", "x") in step.expects


def test_the_ratio_is_restored_over_recomputed_medians_held_to_a_fifth():
    sizes = session_restore.SIZES["default"]
    figures = {f.name: f for f in session_restore.session_figures([0.5, 0.4, 0.9], [10.0, 12.0, 11.0], sizes)}
    assert figures["session_restore.ttft.restored"].value == 0.5
    assert figures["session_restore.ttft.recomputed"].value == 11.0
    ratio = figures["session_restore.ttft_ratio"]
    assert ratio.value == 0.5 / 11.0 and ratio.target.met(ratio.value)
    assert not session_restore.RATIO_TARGET.met(0.21)
