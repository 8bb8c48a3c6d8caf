"""Which CPU a run measured, and whether all of its cores were the run's: the two things that decide
whether a figure is what a user of the machine would see.

/proc/cpuinfo's model name can be masked ("AMD EPYC" on both the Zen 4 and
the Zen 5 hosts this project runs on), and a Zen 5 core issues twice as many
int8 dot products per cycle as a Zen 4 core: figures from the two, read as
one machine, once made the bench's prefill look wrong against a user's
(docs/notes/performance-log.md). So a run names the CPU by family and model, and
measures the int8 peak on one thread (one core's rate) beside the all-thread
peak. When the all-thread peak falls well short of one core's rate times the
threads, another process held a core (or the threads share one through SMT),
and every compute-bound figure of the run sits far below what the machine
gives: the OpenMP team waits at each barrier for its descheduled member.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import machine_peak
from bench.figures import Figure, Target, skipped

SECTION = "machine"
PER_CORE = "machine.int8_dot_peak.one_thread"
CORES_FREE = "machine.cores_free"
# The all-thread peak over threads x one thread's: below this, a core was not the run's.
CORES_FREE_TARGET = Target(0.8, "higher")
SYSFS_CPU = Path("/sys/devices/system/cpu")


@dataclass(frozen=True)
class CpuIdentity:
    """What /proc/cpuinfo says the CPU is."""

    vendor: str
    family: int
    model: int
    stepping: int
    name: str
    generation: str | None = None

    def label(self) -> str:
        """'AMD EPYC (family 26 model 2, Zen 5)': the name alone may hide the generation."""
        generation = f", {self.generation}" if self.generation else ""
        return f"{self.name} (family {self.family} model {self.model}{generation})"


def amd_generation(family: int, model: int, flags: set[str]) -> str | None:
    """AMD's core generation from the CPU family (family 25 holds Zen 3 and Zen 4: AVX-512 tells)."""
    if family == 26:
        return "Zen 5"
    if family == 25:
        return "Zen 4" if "avx512f" in flags else "Zen 3"
    if family == 23:
        return "Zen 2" if model >= 0x30 else "Zen/Zen+"
    return None


def cpu_identity(cpuinfo: str) -> CpuIdentity:
    """The first processor's identity from /proc/cpuinfo's text; raises ValueError naming a missing field."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    missing = [k for k in ("vendor_id", "cpu family", "model", "model name") if k not in fields]
    if missing:
        raise ValueError(f"/proc/cpuinfo has no {', '.join(missing)}")
    family, model = int(fields["cpu family"]), int(fields["model"])
    flags = set(fields.get("flags", "").split())
    vendor = fields["vendor_id"]
    return CpuIdentity(
        vendor=vendor,
        family=family,
        model=model,
        stepping=int(fields.get("stepping", "0") or 0),
        name=fields["model name"],
        generation=amd_generation(family, model, flags) if vendor == "AuthenticAMD" else None,
    )


def describe_cpu(path: Path = Path("/proc/cpuinfo")) -> str:
    """The run's CPU for the header and the JSON, or why it is unknown."""
    try:
        return cpu_identity(path.read_text()).label()
    except (OSError, ValueError) as exc:
        return f"unknown ({exc})"


def smt_shared(threads: int, sysfs: Path = SYSFS_CPU) -> bool:
    """Whether the first ``threads`` logical CPUs include two threads of one physical core."""
    cores = set()
    for cpu in range(threads):
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()))
        except OSError:
            return False  # no topology to go by: assume distinct cores
    return len(cores) < threads


def cores_free_figures(
    threads: int,
    all_threads: Figure,
    measure: Callable[[int], machine_peak.Int8DotPeak] = machine_peak.measure,
    shared: bool | None = None,
) -> list[Figure]:
    """One thread's int8 peak, and the all-thread peak's share of ``threads`` x that (target >= 0.8)."""
    try:
        one = measure(1)
    except Exception as exc:  # noqa: BLE001 - reported as skipped, the run goes on
        reason = f"the one-thread probe failed: {exc}"
        return [skipped(PER_CORE, machine_peak.UNIT, SECTION, reason), skipped(CORES_FREE, "share", SECTION, reason)]
    per_core = Figure(PER_CORE, one.gmacs, machine_peak.UNIT, SECTION, details={"isa": one.isa},
                      note="one core's int8 rate: a Zen 5 core's is twice a Zen 4 core's")
    if all_threads.value is None or threads < 2:
        return [per_core]
    share = all_threads.value / (threads * one.gmacs)
    shared = smt_shared(threads) if shared is None else shared
    note = (
        "the threads share physical cores (SMT): below 1 by design" if shared
        else "" if share >= CORES_FREE_TARGET.threshold
        else "another process held a core while the probe ran: compute-bound figures of this run are far "
        "below what the machine gives"
    )
    return [per_core, Figure(CORES_FREE, share, "share", SECTION, target=None if shared else CORES_FREE_TARGET,
                             details={"threads": threads}, note=note)]
