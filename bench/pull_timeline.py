"""`pdserve bench pull-timeline LOG...`: what each streamed NIXL pull did, from decode workers' logs.

A decode worker started with `--log-level debug` logs every progress reply of a streamed pull
(`KV progress of ...`), every layered READ it posted with its post and wait times (`KV layered
READ for ...`) and, at the end, the pull's tail: what was left to move once the prefill worker
said it was done (`KV pull of ...`, the same number as `pdserve_kv_pull_tail_seconds`). This
reads those lines (a log file, or a folder: every `*.log` under it, e.g. `pdserve up --log-dir`
or a hand-off bench's runs.tar.gz unpacked) and prints one row per pull: where its time went
before and after the prefill ended. A long tail then reads as one of

    tail READ wait long    the bytes moved slowly (the transport, the copy engine)
    tail READ post long    posting the READ was slow (descriptor lists, a lock, the host)
    tail READ MiB large    the reader was behind the prefill when it ended (progress replies late)
    none of them           the time went between the done reply and the READ (the decode host)

Only streamed NIXL pulls log READs; a TCP pull logs its tail alone.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

_PROGRESS = re.compile(r"KV progress of (\S+): (\d+)/(\d+) blocks ready, (\w+)[^,]*, after ([\d.]+) ms")
_READ = re.compile(r"KV layered READ for (\S+) from \S+: .*; ([\d.]+) MiB, post ([\d.]+) ms, wait ([\d.]+) ms")
_PULL = re.compile(r"KV pull of (\S+) \((\S+)\): ([\d.]+) MiB, its tail ([\d.]+) ms")


@dataclass
class Reads:
    count: int = 0
    mib: float = 0.0
    post_ms: float = 0.0
    wait_ms: float = 0.0

    def add(self, mib: float, post_ms: float, wait_ms: float) -> None:
        self.count += 1
        self.mib += mib
        self.post_ms += post_ms
        self.wait_ms += wait_ms


@dataclass
class Pull:
    request_id: str  # the decode worker's
    prefill_id: str = ""  # the prefill worker's (READ lines name it)
    mib: float = 0.0
    tail_ms: float = 0.0
    replies: int = 0
    longest_reply_ms: float = 0.0
    done: bool = False  # the done reply was read: READs from here on are the tail's
    reads: Reads = field(default_factory=Reads)
    tail: Reads = field(default_factory=Reads)


def parse(lines) -> list[Pull]:
    """The pulls whose tail line is among `lines` (one process's log, in order)."""
    running: dict[str, Pull] = {}  # decode request id -> its pull so far
    by_prefill: dict[str, Pull] = {}  # prefill request id -> the pull reading it
    reads: dict[str, list[tuple[float, float, float]]] = {}  # READs of a prefill id not yet matched
    ended: list[Pull] = []
    for line in lines:
        if (m := _PROGRESS.search(line)) is not None:
            pull = running.setdefault(m[1], Pull(m[1]))
            pull.replies += 1
            pull.longest_reply_ms = max(pull.longest_reply_ms, float(m[5]))
            pull.done = pull.done or m[4] == "done"
        elif (m := _READ.search(line)) is not None:
            read = (float(m[2]), float(m[3]), float(m[4]))
            pull = by_prefill.get(m[1])
            if pull is None:  # the first READ of it: the running pull not matched yet, if one alone
                unmatched = [p for p in running.values() if not p.prefill_id]
                if len(unmatched) != 1:
                    reads.setdefault(m[1], []).append(read)
                    continue
                pull = unmatched[0]
                pull.prefill_id, by_prefill[m[1]] = m[1], pull
            (pull.tail if pull.done else pull.reads).add(*read)
        elif (m := _PULL.search(line)) is not None:
            pull = running.pop(m[1], None) or Pull(m[1])
            if not pull.prefill_id:  # READs of several pulls at once: matched by the tail line
                pull.prefill_id = m[2]
                for read in reads.pop(m[2], []):
                    pull.reads.add(*read)
            by_prefill.pop(m[2], None)
            pull.mib, pull.tail_ms = float(m[3]), float(m[4])
            ended.append(pull)
    return ended


def log_files(paths: list[str]) -> list[Path]:
    files = []
    for p in map(Path, paths):
        files += sorted(p.rglob("*.log")) if p.is_dir() else [p]
    return files


def table(pulls: list[Pull]) -> str:
    head = ("| pull | MiB | progress replies (longest ms) | READs before done: n / MiB / post ms / wait ms "
            "| tail ms | tail READs: n / MiB / post ms / wait ms |\n| --- | ---: | ---: | --- | ---: | --- |")
    rows = [f"| {p.request_id[-12:]} | {p.mib:.1f} | {p.replies} ({p.longest_reply_ms:.1f}) | "
            f"{p.reads.count} / {p.reads.mib:.1f} / {p.reads.post_ms:.2f} / {p.reads.wait_ms:.2f} | {p.tail_ms:.2f} | "
            f"{p.tail.count} / {p.tail.mib:.1f} / {p.tail.post_ms:.2f} / {p.tail.wait_ms:.2f} |" for p in pulls]
    return "\n".join([head, *rows])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench pull-timeline", description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+", metavar="LOG", help="a decode worker's log file, or a folder of *.log files")
    args = p.parse_args(argv)
    files = log_files(args.logs)
    if not files:
        p.error(f"LOG: no log file in {', '.join(args.logs)}")
    pulls = []
    for f in files:
        with open(f, errors="replace") as lines:
            pulls += parse(lines)
    if not pulls:
        print("no streamed pull found: were the decode workers started with --log-level debug?", file=sys.stderr)
        return 1
    print(table(pulls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
