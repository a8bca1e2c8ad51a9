"""Turn the saved wrk outputs of one bench run into a markdown report.

    report.py --raw DIR --meta FILE [--out FILE]

DIR holds `<scenario>.txt`, wrk's output with `--latency`, for the scenarios below, and
`<scenario>.cpu-before` / `.cpu-after`, the cpuN lines of /proc/stat around the run; FILE
holds `key=value` lines describing the run (durations, versions, machine). The report is
printed and, with --out, written there too. A scenario with non-2xx answers or socket
errors is flagged: its throughput would not be a measure of the work it claims to do.

There is one table for each group of scenarios (the gateway, the token endpoint) of which at
least one scenario ran, each followed by its ratios and, where the project sets one, the
target each ratio is held to. A scenario the script could not run on this machine leaves
`<scenario>.skipped` in DIR, one line saying why; its row says so instead of a figure.
A scenario run a second time leaves `<scenario>.2.txt` (and its snapshots) too: the two runs
are counted as one (`combined`) in its row. When both scenarios of a ratio ran three times or
more, in turns (`none`, `warm`, `envoy`, `none.2`, `warm.2`, `envoy.2`, ...), the ratio is the
median of the ratios of each turn's two runs, shown with their range and the figure of all
runs pooled: the two runs of a turn are a few seconds apart, while a slowdown of the machine
lasting a run or two (seen here: one run in five 20% slower) weighs on one side of a pooled
figure only.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import median

GATEWAY_SCENARIOS = (
    ("direct", "1. nginx direct (upstream alone)"),
    ("none", "2. gateway, `auth: none` route"),
    ("warm", "3. gateway, one ES256 JWT (warm verified-token cache)"),
    ("dpop", "3b. gateway, one DPoP-bound ES256 JWT (warm), a fresh ES256 proof per request"),
    ("cold", "4. gateway, fresh ES256 JWT per request (token cache off)"),
    ("haproxy", "5. HAProxy, ES256 `jwt_verify` on every request"),
    ("envoy", "5b. Envoy, `jwt_authn` ES256 (JWT cache), RBAC scope check"),
    ("envoy-nocache", "5c. Envoy, `jwt_authn` ES256 on every request (no cache), RBAC scope check"),
)
WORKERS_SCENARIOS = (
    ("workers-1", "21. gateway `workers: 1`, warm ES256 JWT, worker limited to 45% of a CPU"),
    ("workers-2", "22. gateway `workers: 2`, warm ES256 JWT, each worker limited to 45% of a CPU"),
)
FRONT_SCENARIOS = (
    ("decision", "11. gateway decision listener alone (auth_request's question, warm JWT)"),
    ("nginx-authreq", "12. nginx auth_request → gateway decision → nginx upstream, warm JWT"),
)
TOKEN_SCENARIOS = (
    ("token-es256", "6. authserver token endpoint, ES256"),
    ("oidc-es256", "7. oidc-provider token endpoint, ES256"),
    ("sign-baseline", "8. baseline: bare aiohttp handler, one PyJWT ES256 signature"),
    ("token-rs256", "9. authserver token endpoint, RS256"),
    ("oidc-rs256", "10. oidc-provider token endpoint, RS256"),
)
STORE_SCENARIOS = (
    ("cc-sqlite", "13. client_credentials ES256, SQLite"),
    ("cc-postgres", "14. client_credentials ES256, PostgreSQL"),
    ("refresh-sqlite", "15. refresh_token (rotation), SQLite"),
    ("refresh-postgres", "16. refresh_token (rotation), PostgreSQL"),
    ("cc-1-replica", "17. client_credentials, 1 replica on PostgreSQL behind nginx"),
    ("cc-2-replicas", "18. client_credentials, 2 replicas on PostgreSQL behind nginx"),
    ("refresh-1-replica", "19. refresh_token, 1 replica on PostgreSQL behind nginx"),
    ("refresh-2-replicas", "20. refresh_token, 2 replicas on PostgreSQL behind nginx"),
)
SCENARIOS = (
    GATEWAY_SCENARIOS + WORKERS_SCENARIOS + FRONT_SCENARIOS + TOKEN_SCENARIOS + STORE_SCENARIOS
)

RPS = "requests/s"
CPU = "CPU per request"


@dataclass(frozen=True)
class Ratio:
    """One scenario's figures over another's. With a target, the ratio is held to it by each
    measure named in `judged_by` (requests/s, and CPU per request where the two servers
    are compared as servers, not as shares of a busy machine)."""

    top: str
    bottom: str
    label: str
    target: float | None = None
    judged_by: tuple[str, ...] = (RPS,)


GATEWAY_RATIOS = (
    Ratio("warm", "none", "gateway warm JWT / gateway auth none", 0.95),
    Ratio("dpop", "warm", "gateway DPoP, fresh proof / gateway warm bearer JWT"),
    Ratio("warm", "haproxy", "gateway warm JWT / HAProxy ES256", 1.0, (RPS, CPU)),
    Ratio("warm", "envoy", "gateway warm JWT / Envoy with cache"),
    Ratio("warm", "envoy-nocache", "gateway warm JWT / Envoy without cache"),
    Ratio("cold", "haproxy", "gateway cold JWT / HAProxy ES256", 0.5, (RPS, CPU)),
    Ratio("cold", "warm", "gateway cold JWT / gateway warm JWT"),
    Ratio("none", "direct", "gateway auth none / nginx direct"),
)
WORKERS_RATIOS = (Ratio("workers-2", "workers-1", "gateway workers: 2 / workers: 1", 1.8),)
FRONT_RATIOS = (
    Ratio("decision", "warm", "decision alone / gateway proxy, warm JWT"),
    Ratio("nginx-authreq", "warm", "nginx + auth_request + decision / gateway proxy, warm JWT"),
    Ratio("nginx-authreq", "direct", "nginx + auth_request + decision / nginx direct"),
)
TOKEN_RATIOS = (
    # Served by aiohttp alone: replicas, not a second HTTP server, scale token throughput.
    # Held to a bare aiohttp handler's rate in the same turns (bench/README.md, "Targets");
    # oidc-provider's, a runtime of another kind, is the reference peer.
    Ratio("token-es256", "oidc-es256", "authserver ES256 / oidc-provider ES256", 1.2),
    Ratio("token-rs256", "oidc-rs256", "authserver RS256 / oidc-provider RS256"),
    Ratio("token-es256", "sign-baseline", "authserver ES256 / signing baseline", 0.65),
    Ratio("token-rs256", "token-es256", "authserver RS256 / authserver ES256"),
    Ratio("oidc-rs256", "oidc-es256", "oidc-provider RS256 / oidc-provider ES256"),
)
STORE_RATIOS = (
    Ratio("cc-postgres", "cc-sqlite", "client_credentials: PostgreSQL / SQLite"),
    Ratio("refresh-postgres", "refresh-sqlite", "refresh: PostgreSQL / SQLite"),
    Ratio("refresh-sqlite", "cc-sqlite", "SQLite: refresh / client_credentials"),
    Ratio("refresh-postgres", "cc-postgres", "PostgreSQL: refresh / client_credentials"),
    Ratio("cc-2-replicas", "cc-1-replica", "client_credentials: 2 replicas / 1"),
    Ratio("refresh-2-replicas", "refresh-1-replica", "refresh: 2 replicas / 1"),
)
GROUPS = (
    ("Gateway", GATEWAY_SCENARIOS, GATEWAY_RATIOS),
    ("Gateway: two workers against one, under CPU quotas", WORKERS_SCENARIOS, WORKERS_RATIOS),
    ("Behind a front proxy (ext_authz)", FRONT_SCENARIOS, FRONT_RATIOS),
    ("Token endpoint", TOKEN_SCENARIOS, TOKEN_RATIOS),
    ("Token endpoint: storage and replicas", STORE_SCENARIOS, STORE_RATIOS),
)
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60_000.0}


@dataclass(frozen=True)
class WrkResult:
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    requests: int
    non_2xx: int
    socket_errors: int
    fresh_tokens: str | None  # "sent=N available=M wraps=W" from fresh_tokens.lua
    refresh_tokens: str | None = None  # "rotated=N lost=M empty=E" from refresh_post.lua


def _duration_ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if match is None:
        raise ValueError(f"not a wrk duration: {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_wrk(text: str) -> WrkResult:
    rps = re.search(r"^Requests/sec:\s+([\d.]+)", text, re.M)
    p50 = re.search(r"^\s+50%\s+(\S+)", text, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", text, re.M)
    total = re.search(r"^\s+(\d+) requests in", text, re.M)
    if not (rps and p50 and p99 and total):
        raise ValueError("wrk output without Requests/sec or a latency distribution")
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    errors = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text
    )
    fresh = re.search(r"^Fresh tokens: (.*)$", text, re.M)  # or proofs: the same script
    rotated = re.search(r"^Refresh tokens: (.*)$", text, re.M)
    return WrkResult(
        requests_per_s=float(rps.group(1)),
        p50_ms=_duration_ms(p50.group(1)),
        p99_ms=_duration_ms(p99.group(1)),
        requests=int(total.group(1)),
        non_2xx=int(non_2xx.group(1)) if non_2xx else 0,
        socket_errors=sum(int(n) for n in errors.groups()) if errors else 0,
        fresh_tokens=fresh.group(1).strip() if fresh else None,
        refresh_tokens=rotated.group(1).strip() if rotated else None,
    )


def _cpu_rows(text: str) -> dict[str, list[int]]:
    rows = (line.split() for line in text.splitlines() if line.startswith("cpu"))
    return {row[0]: [int(n) for n in row[1:9]] for row in rows}


@dataclass(frozen=True)
class CpuUse:
    busy: dict[str, float]  # cpuN -> busy share of that core during the run
    server_share: float | None  # share of core 0 used by the server under test
    server_us_per_request: float | None
    database_us_per_request: float | None = None  # PostgreSQL's processes, when one served


def cpu_use(raw: Path, key: str, requests: int, clk_tck: int) -> CpuUse | None:
    """Per-core busy shares between the /proc/stat snapshots taken around a run, and the
    server's own CPU time from its /proc/PID/stat ticks (both in clock ticks)."""
    try:
        start = _cpu_rows((raw / f"{key}.cpu-before").read_text())
        end = _cpu_rows((raw / f"{key}.cpu-after").read_text())
    except FileNotFoundError:
        return None
    busy, totals = {}, {}
    for cpu, values in end.items():
        delta = [b - a for a, b in zip(start[cpu], values, strict=True)]
        totals[cpu] = sum(delta)
        idle = delta[3] + delta[4]  # idle + iowait
        busy[cpu] = (totals[cpu] - idle) / totals[cpu] if totals[cpu] else 0.0
    share = per_request = None
    try:
        ticks = int((raw / f"{key}.server-after").read_text()) - int(
            (raw / f"{key}.server-before").read_text()
        )
    except (FileNotFoundError, ValueError):
        ticks = None
    if ticks is not None and totals.get("cpu0"):
        share = ticks / totals["cpu0"]
        per_request = ticks / clk_tck * 1e6 / requests if requests else None
    database = None
    try:
        database_ticks = int((raw / f"{key}.database-after").read_text()) - int(
            (raw / f"{key}.database-before").read_text()
        )
        database = database_ticks / clk_tck * 1e6 / requests if requests else None
    except (FileNotFoundError, ValueError):
        pass
    return CpuUse(busy, share, per_request, database)


def combined(first: WrkResult, second: WrkResult) -> WrkResult:
    """Two runs of one scenario as one: their requests over their time together, the worse
    of their latencies (percentiles of two runs cannot be merged exactly), every error."""
    seconds = first.requests / first.requests_per_s + second.requests / second.requests_per_s
    return WrkResult(
        requests_per_s=(first.requests + second.requests) / seconds,
        p50_ms=max(first.p50_ms, second.p50_ms),
        p99_ms=max(first.p99_ms, second.p99_ms),
        requests=first.requests + second.requests,
        non_2xx=first.non_2xx + second.non_2xx,
        socket_errors=first.socket_errors + second.socket_errors,
        fresh_tokens=first.fresh_tokens,
        refresh_tokens=first.refresh_tokens,
    )


def combined_cpu(first: CpuUse, second: CpuUse, weights: tuple[int, int]) -> CpuUse:
    """The CPU use of two runs (or of runs already combined, and one more) as one, each
    weighed by its requests (`weights`)."""
    a, b = weights
    total = a + b

    def mean(x: float | None, y: float | None) -> float | None:
        return None if x is None or y is None or not total else (x * a + y * b) / total

    return CpuUse(
        busy={
            cpu: (first.busy[cpu] * a + second.busy.get(cpu, 0.0) * b) / total if total else 0.0
            for cpu in first.busy
        },
        server_share=mean(first.server_share, second.server_share),
        server_us_per_request=mean(first.server_us_per_request, second.server_us_per_request),
        database_us_per_request=mean(first.database_us_per_request, second.database_us_per_request),
    )


def _ms(value: float) -> str:
    return f"{value:.3f} ms" if value < 10 else f"{value:.1f} ms"


def read_meta(path: Path) -> dict[str, str]:
    meta: dict[str, str] = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            meta[key.strip()] = value.strip()
    return meta


def _scenario_table(
    scenarios: tuple[tuple[str, str], ...],
    results: dict[str, WrkResult],
    cpu: dict[str, CpuUse],
    skipped: dict[str, str],
) -> list[str]:
    lines = [
        "| scenario | requests/s | p50 | p99 | server CPU per request "
        "| core 0: server process / rest | core 1 | non-2xx / socket errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, label in scenarios:
        r = results.get(key)
        if r is None:
            why = f": {skipped[key]}" if key in skipped else ""
            lines.append(f"| {label} | not run{why} | | | | | | |")
            continue
        flag = f"{r.non_2xx} / {r.socket_errors}"
        if r.non_2xx or r.socket_errors:
            flag = f"**{flag} (invalid)**"
        use = cpu.get(key)
        per_request = core0 = core1 = "n/a"
        if use is not None:
            core1 = f"{use.busy.get('cpu1', 0):.0%}"
            if use.server_share is not None:
                other = max(0.0, use.busy.get("cpu0", 0) - use.server_share)
                core0 = f"{use.server_share:.0%} / {other:.0%}"
            if use.server_us_per_request is not None:
                per_request = f"{use.server_us_per_request:,.0f} µs"
        lines.append(
            f"| {label} | {r.requests_per_s:,.0f} | {_ms(r.p50_ms)} | {_ms(r.p99_ms)} "
            f"| {per_request} | {core0} | {core1} | {flag} |"
        )
    return lines


def target_note(ratio: Ratio, measured: dict[str, float], skipped: dict[str, str]) -> str:
    """`target >= X: met` when the ratio reaches the target by every measure it is judged by
    that was measured, `NOT met` otherwise (naming the measures when they disagree); `not
    measured` with the reason when a scenario of the ratio could not run, target or not."""
    why = skipped.get(ratio.top) or skipped.get(ratio.bottom)
    if ratio.target is None:
        return f"not measured ({why})" if why is not None else ""
    head = f"target >= {ratio.target:.2f}"
    if why is not None:
        return f"{head}: not measured ({why})"
    verdicts = {
        measure: measured[measure] >= ratio.target
        for measure in ratio.judged_by
        if measure in measured
    }
    if not verdicts:
        return ""
    if all(verdicts.values()):
        return f"{head}: met"
    if not any(verdicts.values()):
        return f"{head}: NOT met"
    met = ", ".join(m for m, ok in verdicts.items() if ok)
    missed = ", ".join(m for m, ok in verdicts.items() if not ok)
    return f"{head}: NOT met (met by {met}, not by {missed})"


@dataclass(frozen=True)
class Turn:
    """One run of a scenario that ran in turns with others: its figures and CPU use."""

    result: WrkResult
    cpu: CpuUse | None


def turn_ratios(top: Sequence[Turn], bottom: Sequence[Turn]) -> dict[str, list[float]]:
    """The ratio of each turn's two runs, by each measure all turns have; empty unless both
    scenarios ran in the same three turns or more."""
    if len(top) < 3 or len(top) != len(bottom):
        return {}
    turns = list(zip(top, bottom, strict=True))
    ratios = {RPS: [a.result.requests_per_s / b.result.requests_per_s for a, b in turns]}
    cpu = [
        b.cpu.server_us_per_request / a.cpu.server_us_per_request
        for a, b in turns
        if a.cpu is not None
        and b.cpu is not None
        and a.cpu.server_us_per_request
        and b.cpu.server_us_per_request
    ]
    if len(cpu) == len(turns):
        ratios[CPU] = cpu
    return ratios


def _ratio_table(
    ratios: tuple[Ratio, ...],
    results: dict[str, WrkResult],
    cpu: dict[str, CpuUse],
    skipped: dict[str, str],
    turns: dict[str, list[Turn]] | None = None,
) -> list[str]:
    """Requests/s of one scenario over another's, and the same comparison by server CPU per
    request (the bottom's CPU per request over the top's: above 1 means the top is cheaper),
    which other work on the machine moves less. Scenarios that ran in turns are compared
    turn by turn (`turn_ratios`), by the median."""
    turns = turns or {}
    lines = [
        "| ratio | requests/s | by server CPU per request | note |",
        "| --- | ---: | ---: | --- |",
    ]
    for ratio in ratios:
        a, b = results.get(ratio.top), results.get(ratio.bottom)
        measured: dict[str, float] = {}
        pooled: dict[str, float] = {}
        if a and b:
            pooled[RPS] = a.requests_per_s / b.requests_per_s
        ca, cb = cpu.get(ratio.top), cpu.get(ratio.bottom)
        if ca and cb and ca.server_us_per_request and cb.server_us_per_request:
            pooled[CPU] = cb.server_us_per_request / ca.server_us_per_request
        by_turn = turn_ratios(turns.get(ratio.top, []), turns.get(ratio.bottom, []))
        measured = {**pooled, **{m: median(values) for m, values in by_turn.items()}}
        value = f"{measured[RPS]:.2f}" if RPS in measured else "n/a"
        by_cpu = f"{measured[CPU]:.2f}" if CPU in measured else "n/a"
        note = target_note(ratio, measured if RPS in measured else {}, skipped)
        if by_turn:
            spread = "; ".join(
                f"{m}: {min(v):.2f} to {max(v):.2f}, pooled {pooled[m]:.2f}"
                for m, v in by_turn.items()
                if m in pooled
            )
            turned = f"median of {len(by_turn[RPS])} turns ({spread})"
            note = f"{note}; {turned}" if note else turned
        lines.append(f"| {ratio.label} | {value} | {by_cpu} | {note} |")
    judged_by_both = [r.label for r in ratios if r.target is not None and CPU in r.judged_by]
    if any(r.target is not None for r in ratios):
        lines.append("")
        lines.append(
            "Targets are judged by requests/s"
            + (
                "; " + " and ".join(f"`{label}`" for label in judged_by_both) + " by server "
                "CPU per request too"
                if judged_by_both
                else ""
            )
            + "."
        )
    return lines


def _quota_lines(meta: dict[str, str], cpu: dict[str, CpuUse]) -> list[str]:
    """What the workers scenarios gave each worker, and how much of core 0 they took: a
    share well under the quota means something else (core 0's kernel work, other
    processes) held them back, not the quota."""
    quota = meta.get("worker_quota")
    if not quota:
        return []
    used = []
    for count, (key, _) in enumerate(WORKERS_SCENARIOS, start=1):
        use = cpu.get(key)
        if use is not None and use.server_share is not None:
            share = float(meta.get("worker_quota_percent", "0")) * count / 100
            used.append(f"`{key}` {use.server_share:.0%} of core 0 (quota {share:.0%})")
    line = f"Scenarios 21 and 22: {quota}."
    if used:
        line += " The gateway's processes used " + ", ".join(used) + "."
    return ["", line]


def render(
    results: dict[str, WrkResult],
    meta: dict[str, str],
    cpu: dict[str, CpuUse],
    background: CpuUse | None = None,
    skipped: dict[str, str] | None = None,
    repeated: Sequence[str] = (),
    turns: dict[str, list[Turn]] | None = None,
) -> str:
    """`repeated`: the scenarios whose figures combine two runs (`combined`); `turns`: each
    run of those, in order."""
    skipped = skipped or {}
    lines = [
        f"# Portcullis bench — {meta.get('date', '')}",
        "",
        f"Machine: {meta.get('nproc', '?')} cores, {meta.get('cpu', '?')}; "
        f"server under test pinned to core 0, wrk to core 1.",
        f"Load: wrk {meta.get('wrk_args', '')} for {meta.get('duration', '?')} s per scenario "
        f"(after a {meta.get('warmup', '?')} s warm-up).",
        f"Software: {meta.get('versions', '')}.",
    ]
    if any(key in results for key, _ in TOKEN_SCENARIOS) and meta.get("token_versions"):
        lines.append(f"Token endpoint: {meta['token_versions']}.")
    if background is not None:
        idle_load = " / ".join(f"{v:.0%}" for _, v in sorted(background.busy.items()))
        lines.append(f"Load from other processes before the run (core 0 / core 1): {idle_load}.")
        if max(background.busy.values(), default=0.0) > 0.10:
            lines.append(
                "**Warning: the machine was busy before the run; the figures below are skewed "
                "by whatever else was running. Run again on an idle machine.**"
            )
    for title, scenarios, ratios in GROUPS:
        if not any(key in results or key in skipped for key, _ in scenarios):
            continue
        lines += ["", f"## {title}", ""]
        lines += _scenario_table(scenarios, results, cpu, skipped)
        lines.append("")
        lines += _ratio_table(ratios, results, cpu, skipped, turns)
        if scenarios is WORKERS_SCENARIOS:
            lines += _quota_lines(meta, cpu)
    database = [
        f"`{key}` {use.database_us_per_request:,.0f} µs"
        for key, _ in STORE_SCENARIOS
        if (use := cpu.get(key)) is not None and use.database_us_per_request is not None
    ]
    if database:
        lines += [
            "",
            "PostgreSQL's own CPU per request (its processes, on core 1; not in the server "
            "column): " + ", ".join(database) + ".",
        ]
    rotations = [
        f"`{key}` {r.refresh_tokens}"
        for key, _ in STORE_SCENARIOS
        if (r := results.get(key)) is not None and r.refresh_tokens
    ]
    if rotations:
        lines.append(
            "Refresh scenarios: " + ", ".join(rotations) + " (lost=0: every request rotated "
            "a token the server had issued and got its successor)."
        )
    cold = results.get("cold")
    lines += [""]
    if repeated:
        lines.append(
            "Run more than once, alternating, and counted as one: "
            + ", ".join(f"`{key}`" for key in repeated)
            + " (a drift of the machine's speed during the run weighs on each alike; p50 "
            "and p99 are the worst of the runs)."
        )
    if cold is not None and cold.fresh_tokens:
        reused = not re.search(r"\bwraps=0\b", cold.fresh_tokens)
        lines.append(
            f"Scenario 4 tokens: {cold.fresh_tokens} "
            + (
                "(tokens were reused: raise BENCH_TOKENS; the token cache is off, so every "
                "request was still verified)."
                if reused
                else "(wraps=0: no token was sent twice); gateway token_cache_size: 0."
            )
        )
    dpop = results.get("dpop")
    if dpop is not None and dpop.fresh_tokens:
        reused = not re.search(r"\bwraps=0\b", dpop.fresh_tokens)
        lines.append(
            f"Scenario 3b proofs: {dpop.fresh_tokens} "
            + (
                "(proofs were reused, and a reused proof is refused: raise BENCH_PROOFS)."
                if reused
                else "(wraps=0: every request carried a proof never sent before)."
            )
        )
    busy = [
        key
        for key, _ in SCENARIOS
        if (use := cpu.get(key)) is not None
        and use.server_share is not None
        and use.busy.get("cpu0", 0) - use.server_share > 0.10
    ]
    if busy:
        lines.append(
            "Warning: in " + ", ".join(f"`{key}`" for key in busy) + ", other work took more "
            "than 10% of core 0 (column `rest`): those figures are skewed; compare them by "
            "server CPU per request, or run again on an idle machine."
        )
    for key, _ in SCENARIOS:
        r = results.get(key)
        if r is not None and (r.non_2xx or r.socket_errors):
            lines.append(
                f"Warning: scenario `{key}` had non-2xx answers or socket errors; "
                "its figures do not measure successful requests."
            )
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--raw", required=True, type=Path)
    parser.add_argument("--meta", required=True, type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    meta = read_meta(args.meta)
    clk_tck = int(meta.get("clk_tck", "100"))
    results = {}
    cpu = {}
    skipped = {}
    repeated = []
    turns: dict[str, list[Turn]] = {}
    for key, _ in SCENARIOS:
        path = args.raw / f"{key}.txt"
        reason = args.raw / f"{key}.skipped"
        if reason.exists():
            skipped[key] = reason.read_text().strip()
        if path.exists():
            results[key] = parse_wrk(path.read_text())
            use = cpu_use(args.raw, key, results[key].requests, clk_tck)
            if use is not None:
                cpu[key] = use
            turns[key] = [Turn(results[key], use)]
            # Further runs of the scenario (`KEY.2`, `KEY.3`, ...) count with the first.
            run = 2
            while (again := args.raw / f"{key}.{run}.txt").exists():
                later = parse_wrk(again.read_text())
                later_use = cpu_use(args.raw, f"{key}.{run}", later.requests, clk_tck)
                turns[key].append(Turn(later, later_use))
                weights = (results[key].requests, later.requests)
                if run == 2:
                    repeated.append(key)
                results[key] = combined(results[key], later)
                use = cpu.get(key)
                if use is not None and later_use is not None:
                    cpu[key] = combined_cpu(use, later_use, weights)
                else:
                    cpu.pop(key, None)
                run += 1
    background = cpu_use(args.raw, "idle", 0, clk_tck)
    report = render(results, meta, cpu, background, skipped, repeated, turns)
    sys.stdout.write(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    bad = [r for r in results.values() if r.non_2xx or r.socket_errors]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
