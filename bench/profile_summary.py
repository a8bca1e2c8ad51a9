"""Summarise a py-spy profile recorded with `--format raw` (collapsed stacks).

    profile_summary.py FILE [--top N]
    profile_summary.py FILE --base OTHER [--top N]

Prints the functions with the most self time (the sample's innermost frame), the most total
time (any frame of the sample, counted once per sample), and self time per package. Each
line of FILE is `frame;frame;...;frame COUNT` with frames like `name (path:line)`.

With --base, FILE is compared with OTHER (a profile of the code before a change, under the
same load): self time per package and total time per function as shares of each profile's
samples, side by side, the largest changes first. Shares, not sample counts: two profiles
of the same duration hold as many samples whatever each request costs, so a share that
grows is work that takes a larger part of each request.

Samples whose innermost frame is a thread pool's `_worker` loop are left out (and counted):
such a worker waits in `queue.get` for work, which py-spy reports as active although the
thread uses no CPU (its utime in /proc/PID/task/TID/stat stays put). The authserver's SQLite
store keeps one such thread.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

OUR_PACKAGES = ("gateway/", "authserver/", "portcullis/")
IDLE_FRAMES = (
    "_worker (stdlib/concurrent/futures/thread.py",
    "_worker (concurrent/futures/thread.py",
)
_FRAME = re.compile(r"^(?P<name>.*) \((?P<path>[^()]*?)(?::(?P<line>\d+))?\)$")


def short_frame(frame: str) -> str:
    """`handle (/work/main/gateway/app.py:87)` -> `handle (gateway/app.py:87)`."""
    match = _FRAME.match(frame)
    if match is None:
        return frame
    path = match.group("path")
    for marker in ("site-packages/", "/lib/python3."):
        if marker in path:
            path = path.split(marker, 1)[1]
            if marker.startswith("/lib"):
                path = "stdlib/" + path.split("/", 1)[1]
            break
    else:
        for root in ("/gateway/", "/authserver/", "/portcullis/", "/bench/"):
            if root in path:
                path = root[1:] + path.split(root, 1)[1]
                break
    line = match.group("line")
    return f"{match.group('name')} ({path}:{line})" if line else f"{match.group('name')} ({path})"


def package_of(frame: str) -> str:
    match = _FRAME.match(frame)
    if match is None:
        return "other"
    path = match.group("path")
    if path.startswith("stdlib/"):
        parts = path.split("/")
        return "stdlib/" + parts[1] if len(parts) > 2 else "stdlib"
    return path.split("/", 1)[0].removesuffix(".py")


def read_stacks(path: Path) -> list[tuple[list[str], int]]:
    stacks = []
    for line in path.read_text().splitlines():
        body, _, count = line.rpartition(" ")
        if not body or not count.isdigit():
            continue
        frames = [
            short_frame(f)
            for f in body.split(";")
            if f and not f.startswith(("process ", "thread ("))
        ]
        if frames:
            stacks.append((frames, int(count)))
    return stacks


@dataclass(frozen=True)
class Summary:
    total: int  # on-CPU samples
    idle: int  # samples of idle thread-pool workers, left out of the rest
    own: Counter[str]  # self samples per function
    inclusive: Counter[str]  # samples with the function anywhere in the stack
    packages: Counter[str]  # self samples per package


def summarise(path: Path) -> Summary:
    stacks = read_stacks(path)
    idle = sum(count for frames, count in stacks if frames[-1].startswith(IDLE_FRAMES))
    stacks = [(frames, count) for frames, count in stacks if not frames[-1].startswith(IDLE_FRAMES)]
    total = sum(count for _, count in stacks)
    if not total:
        raise SystemExit(f"{path}: no samples")
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    for frames, count in stacks:
        own[frames[-1]] += count
        packages[package_of(frames[-1])] += count
        for frame in set(frames):
            inclusive[frame] += count
    return Summary(total, idle, own, inclusive, packages)


def ours(counter: Counter[str]) -> Counter[str]:
    return Counter({f: c for f, c in counter.items() if f.split(" (")[-1].startswith(OUR_PACKAGES)})


def print_one(summary: Summary, top: int) -> None:
    def table(title: str, counter: Counter[str]) -> None:
        print(f"\n{title}")
        for frame, count in counter.most_common(top):
            print(f"  {count / summary.total:6.1%}  {frame}")

    print(f"{summary.total} samples (on-CPU only; time waiting in the event loop is not sampled)")
    if summary.idle:
        print(f"({summary.idle} samples of idle thread-pool workers left out)")
    table("Self time by package", summary.packages)
    table("Self time by function", summary.own)
    table("Total time by function", summary.inclusive)
    table(
        "Total time, functions of " + ", ".join(p.rstrip("/") for p in OUR_PACKAGES),
        ours(summary.inclusive),
    )


def print_comparison(base: Summary, head: Summary, top: int) -> None:
    def table(title: str, before: Counter[str], after: Counter[str]) -> None:
        share = {
            name: (before[name] / base.total, after[name] / head.total)
            for name in before.keys() | after.keys()
        }
        changes = sorted(share.items(), key=lambda item: -abs(item[1][1] - item[1][0]))
        print(f"\n{title}\n    base    head  change")
        for name, (was, now) in changes[:top]:
            print(f"  {was:6.1%}  {now:6.1%}  {now - was:+6.1%}  {name}")

    print(
        f"base: {base.total} samples, head: {head.total} samples (on-CPU only); shares of "
        "each profile's samples, the largest changes first"
    )
    table("Self time by package", base.packages, head.packages)
    table("Self time by function", base.own, head.own)
    table("Total time by function", base.inclusive, head.inclusive)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--base", type=Path, help="a profile to compare FILE with")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    if args.base is None:
        print_one(summarise(args.file), args.top)
    else:
        print_comparison(summarise(args.base), summarise(args.file), args.top)


if __name__ == "__main__":
    main()
