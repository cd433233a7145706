"""A process's own peak resident set, for the benchmarks' fresh measuring processes.

`ru_maxrss` cannot be used there: Linux carries a parent's high-water mark into its child across fork
and exec (exec records the copied address space's peak), so a small child of a large benchmark
process reports the parent's size (measured: a 13 MiB child of an 813 MiB parent reads 813 MiB).
`VmHWM` in /proc/self/status is the peak of this process's own address space."""

from __future__ import annotations


def peak_rss_kib() -> int:
    """The peak resident set of this process's address space, in KiB (Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/status has no VmHWM line: peak memory is measured on Linux only")
