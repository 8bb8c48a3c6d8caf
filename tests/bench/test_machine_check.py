"""The run's CPU identity and the cores-free check (one-thread vs all-thread int8 peak), on canned
/proc/cpuinfo and sysfs text and a stand-in probe."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import machine_check
from bench.figures import Figure
from bench.machine_peak import Int8DotPeak

ZEN5 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu avx512f avx512_vnni

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 99
"""


def test_cpu_identity_names_the_generation_the_model_name_hides() -> None:
    cpu = machine_check.cpu_identity(ZEN5)
    assert (cpu.family, cpu.model, cpu.stepping, cpu.generation) == (26, 2, 1, "Zen 5")  # first processor only
    assert cpu.label() == "AMD EPYC (family 26 model 2, Zen 5)"
    zen4 = ZEN5.replace("cpu family\t: 26", "cpu family\t: 25").replace("model\t\t: 2", "model\t\t: 17")
    assert machine_check.cpu_identity(zen4).generation == "Zen 4"
    assert machine_check.cpu_identity(zen4.replace(" avx512f", "")).generation == "Zen 3"
    intel = ZEN5.replace("AuthenticAMD", "GenuineIntel").replace("AMD EPYC", "Intel Xeon")
    assert machine_check.cpu_identity(intel).label() == "Intel Xeon (family 26 model 2)"
    with pytest.raises(ValueError, match="cpu family"):
        machine_check.cpu_identity("vendor_id: AuthenticAMD\nmodel: 1\nmodel name: x\n")


def test_describe_cpu_says_why_it_is_unknown(tmp_path: Path) -> None:
    assert machine_check.describe_cpu(tmp_path / "none").startswith("unknown (")


def _topology(root: Path, cores: list[tuple[int, int]]) -> Path:
    for cpu, (package, core) in enumerate(cores):
        t = root / f"cpu{cpu}" / "topology"
        t.mkdir(parents=True)
        (t / "physical_package_id").write_text(f"{package}\n")
        (t / "core_id").write_text(f"{core}\n")
    return root


def test_smt_siblings_detected(tmp_path: Path) -> None:
    assert not machine_check.smt_shared(2, _topology(tmp_path / "a", [(0, 0), (0, 1)]))
    assert machine_check.smt_shared(2, _topology(tmp_path / "b", [(0, 0), (0, 0)]))
    assert not machine_check.smt_shared(2, tmp_path / "missing")


def _peak(gmacs: float | None) -> Figure:
    return Figure("machine.int8_dot_peak", gmacs, "GMAC/s", "machine")


def _probe(gmacs: float):
    return lambda threads: Int8DotPeak("avx512_vnni", threads, gmacs)


def test_cores_free_when_the_machine_is_quiet() -> None:
    per_core, share = machine_check.cores_free_figures(2, _peak(990.0), _probe(495.0), shared=False)
    assert per_core.name == "machine.int8_dot_peak.one_thread" and per_core.value == 495.0
    assert share.value == pytest.approx(1.0) and share.met and share.note == ""


def test_a_held_core_is_flagged() -> None:
    # Measured on the 2-core host with another process on one core: all threads 490, one thread 495.
    _, share = machine_check.cores_free_figures(2, _peak(490.0), _probe(495.0), shared=False)
    assert share.value == pytest.approx(0.495, abs=1e-3) and share.met is False
    assert "another process held a core" in share.note


def test_smt_is_not_counted_as_busy_and_failures_are_skipped() -> None:
    _, share = machine_check.cores_free_figures(2, _peak(500.0), _probe(495.0), shared=True)
    assert share.target is None and "SMT" in share.note

    def broken(threads: int) -> Int8DotPeak:
        raise RuntimeError("no C compiler")

    figures = machine_check.cores_free_figures(2, _peak(990.0), broken)
    assert [f.value for f in figures] == [None, None] and "no C compiler" in figures[0].note
    assert [f.name for f in machine_check.cores_free_figures(1, _peak(495.0), _probe(495.0))] == [
        "machine.int8_dot_peak.one_thread"]
    assert len(machine_check.cores_free_figures(2, _peak(None), _probe(495.0))) == 1
