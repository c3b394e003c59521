"""/proc/cpuinfo, read without torch: the engine picks its CPU dtype and kernel build from
the flags, and the benchmarks record them beside their figures."""


def cpuinfo_field(name: str) -> str:
    """The first value of `name` in /proc/cpuinfo; empty where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(name)), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()


def cpu_flags() -> set[str]:
    """The CPU feature flags; empty where /proc/cpuinfo cannot be read."""
    return set(cpuinfo_field("flags").split())
