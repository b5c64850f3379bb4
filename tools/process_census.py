"""Which processes a run's CPU went to: sample every process's CPU from /proc, then sum by kind.

    python3 tools/process_census.py record /tmp/census.json &   # beside a test run; SIGTERM ends it
    python3 tools/process_census.py report /tmp/census.json

`record` reads /proc/<pid>/stat twice a second (user + system ticks, start time) and keeps each
process's last value under (pid, start time), with its command line as first seen (re-read for
5 s, past a fork's exec); it writes the JSON every 30 s and on SIGTERM. A process's CPU between
its last sample and its exit is lost (under half a second). Processes running when recording
began are left out of the report (kernel threads, the shell): their counters start before it.
Produced the census of docs/results/ci/2026-12-08-cpu-ci-processes.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import statistics
import sys
import time

TICKS = os.sysconf("SC_CLK_TCK")


def _cmdline(pid: str) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:400]


def record(out: str, interval_s: float = 0.5) -> None:
    procs: dict[str, dict] = {}

    def dump(*_):
        with open(out + ".tmp", "w") as f:
            json.dump(list(procs.values()), f)
        os.replace(out + ".tmp", out)
        if _:
            sys.exit(0)

    signal.signal(signal.SIGTERM, dump)
    me, started, last_dump = str(os.getpid()), time.time(), time.time()
    while True:
        now = time.time()
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid == me:
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
                fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
                key = f"{pid}-{fields[19]}"
                p = procs.get(key)
                if p is None:
                    p = procs[key] = dict(pid=int(pid), ppid=int(fields[1]), cmd=_cmdline(pid), first=now,
                                          before=now - started < interval_s)
                elif now - p["first"] < 5:
                    p["cmd"] = _cmdline(pid)
                p["cpu"], p["last"] = (int(fields[11]) + int(fields[12])) / TICKS, now
            except (OSError, ValueError, IndexError):
                pass  # gone between listdir and read
        if now - last_dump > 30:
            dump()
            last_dump = now
        time.sleep(interval_s)


def kind(cmd: str) -> str:
    if not cmd:
        return "(no command line)"
    if "exec(eval(sys.stdin.readline()))" in cmd:
        return "pytest-xdist worker"
    words = cmd.split(" ")
    for i, word in enumerate(words[:-1]):  # `pdserve <command>` or `python -m pdserve.cli.main <command>`
        if word == "pdserve.cli.main" or (i < 2 and (word == "pdserve" or word.endswith("/pdserve"))):
            return f"pdserve {words[i + 1]}"
        if word.startswith("pdserve.bench."):  # python -m pdserve.bench.<name>
            return "pdserve bench"
    if "multiprocessing" in cmd:
        return "multiprocessing child"
    if "-m pytest" in cmd or words[0].endswith("pytest"):
        return "pytest (other)"
    exe = cmd.split(" ")[0].rsplit("/", 1)[-1]
    if exe.startswith("python"):
        return "python " + " ".join(cmd.split(" ")[1:3])[:60]
    return exe


def report(path: str, top: int) -> None:
    with open(path) as f:
        procs = [p for p in json.load(f) if not p.get("before")]
    cpu, count, each = collections.Counter(), collections.Counter(), collections.defaultdict(list)
    for p in procs:
        k = kind(p["cmd"])
        cpu[k] += p["cpu"]
        count[k] += 1
        each[k].append(p["cpu"])
    total = sum(cpu.values())
    span = max(p["last"] for p in procs) - min(p["first"] for p in procs)
    print(f"{total:.0f} CPU-s in {len(procs)} processes over {span:.0f} s")
    print(f"{'CPU-s':>8}  {'share':>5}  {'started':>7}  {'median':>6}  kind")
    for k, v in cpu.most_common(top):
        print(f"{v:8.1f}  {100 * v / total:4.1f}%  {count[k]:7d}  {statistics.median(each[k]):6.2f}  {k}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("record").add_argument("out")
    rep = sub.add_parser("report")
    rep.add_argument("path")
    rep.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    record(args.out) if args.command == "record" else report(args.path, args.top)


if __name__ == "__main__":
    main()
