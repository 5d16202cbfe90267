"""Linux ``/proc`` readings of a process tree for the benchmarks: names, CPU seconds, threads,
memory. Every function returns zeros / nothing for a process that is gone (or off Linux)."""

from __future__ import annotations

import os


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def tree(root: int) -> dict[int, str]:
    """pid -> name (``/proc/PID/comm``) of ``root`` and every descendant."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            stat = _read(f"/proc/{entry}/stat")
            if stat:
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == pid and p not in found]
        found.update(kids)
        frontier.extend(kids)
    return {pid: _read(f"/proc/{pid}/comm").strip() or "?" for pid in found}


def cmdline(pid: int) -> str:
    return _read(f"/proc/{pid}/cmdline").replace("\0", " ")


def cpu_threads(pid: int) -> tuple[float, int]:
    """(user + system CPU seconds so far, threads) of one process."""
    fields = _read(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()
    if len(fields) < 18:
        return 0.0, 0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[17])


def memory_mb(pid: int) -> tuple[float, float]:
    """(RSS, PSS) of one process in MiB: PSS splits shared pages between their users, so the
    PSS of a tree sums to its real footprint."""
    rss = pss = 0.0
    for line in _read(f"/proc/{pid}/smaps_rollup").splitlines():
        if line.startswith("Rss:"):
            rss = int(line.split()[1]) / 1024
        elif line.startswith("Pss:"):
            pss = int(line.split()[1]) / 1024
    return rss, pss


def engine_cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds so far of each ``tandem-*`` process under ``root`` (worker, scheduler, ...),
    by role."""
    return {name.removeprefix("tandem-"): cpu_threads(pid)[0] for pid, name in tree(root).items()
            if name.startswith("tandem-")}
