"""What the benchmark scripts record about the machine they ran on (imported by bench-vs-llama-cpp.py and
bench-ab.py): the CPU and its SIMD flags, the load average, and the CPU time counters behind idle and steal shares."""
import os


def cpu_info():
    """The CPU model, its count and its SIMD-related flags, from /proc/cpuinfo."""
    model, flags = None, []
    for line in open("/proc/cpuinfo"):
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model is None:
            model = value.strip()
        if key.strip() == "flags" and not flags:
            flags = value.split()
    simd = [f for f in flags if f.startswith(("avx", "fma", "f16c", "sse4", "ssse3", "bmi", "amx", "vnni"))]
    return {"model": model, "cpus": os.cpu_count(), "simd_flags": sorted(simd)}


def loadavg():
    return open("/proc/loadavg").read().split()[:3]


def cpu_times():
    """All CPUs' time counters from /proc/stat: user nice system idle iowait irq softirq steal ..."""
    return [int(x) for x in open("/proc/stat").readline().split()[1:]]


def share(before, after, *columns):
    """The share (0-1) of the CPU time between two `cpu_times()` that went to `columns` (3 idle, 4 iowait,
    7 steal: what the hypervisor gave other guests); None where the kernel lacks a column."""
    delta = [b - a for a, b in zip(before, after)]
    if any(c >= len(delta) for c in columns):
        return None
    return sum(delta[c] for c in columns) / max(sum(delta), 1)


IDLE, IOWAIT, STEAL = 3, 4, 7
