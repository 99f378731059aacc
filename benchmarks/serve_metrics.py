"""The server's own view of a load-test point (bench_serve.py): each API server's
/metrics before and after, and what changed in between.

`serve --api-servers M` answers /metrics from whichever process took the connection, and
each says which it is (`graphexec_api_server{index=...}`); fresh connections land on all
of them. Per point: requests each server accepted (how evenly the port spread the load),
the servers' own time to first token (arrival in the route to the first output) and their
event loops' lag, as the histograms' bucket bounds at the 50th and 99th percentiles: if
the clients wait seconds for a first token while these stay small, the wait is before
the route (accept, HTTP parsing) or in the clients.
"""

from __future__ import annotations

import re

HISTOGRAMS = ("time_to_first_token_seconds", "event_loop_lag_seconds", "request_queue_seconds")
_BUCKET = re.compile(r'graphexec_(\w+)_bucket\{le="([^"]+)"\} (\d+)')


def parse(text: str) -> tuple[int | None, dict]:
    """(the API server's index or None, {"requests": n, histogram: {le: cumulative}})."""
    m = re.search(r'graphexec_api_server\{index="(\d+)"\} 1', text)
    req = re.search(r"^graphexec_requests_total (\d+)", text, re.M)
    out: dict = {"requests": int(req.group(1)) if req else 0}
    for name, le, n in _BUCKET.findall(text):
        if name in HISTOGRAMS:
            out.setdefault(name, {})[float(le)] = int(n)
    return (int(m.group(1)) if m else None), out


def scrape(url: str, servers: int, tries_per_server: int = 20) -> dict[int, dict]:
    """Each API server's parsed /metrics (fresh connections until all `servers` answered
    or the tries run out: a missing one is left out)."""
    import httpx

    got: dict[int, dict] = {}
    for _ in range(servers * tries_per_server):
        index, parsed = parse(httpx.get(f"{url}/metrics", timeout=10).text)
        got[0 if index is None else index] = parsed
        if len(got) == servers:
            break
    return got


def _quantile(cum: dict[float, int], q: float) -> float | None:
    """The bucket bound at quantile q of a cumulative histogram (inf: past the last)."""
    total = cum.get(float("inf"), 0)
    if not total:
        return None
    return next(b for b in sorted(cum) if cum[b] >= q * total)


def delta(before: dict[int, dict], after: dict[int, dict]) -> dict:
    """What the servers did between two scrapes: requests per server (None where one was
    not reached both times), and each histogram's p50 / p99 bounds over all servers."""
    both = sorted(set(before) & set(after))
    out: dict = {"requests_per_server": [after[i]["requests"] - before[i]["requests"]
                                         if i in both else None
                                         for i in range(max(after, default=-1) + 1)]}  # fmt: skip
    for name in HISTOGRAMS:
        cum: dict[float, int] = {}
        for i in both:
            for b, n in after[i].get(name, {}).items():
                cum[b] = cum.get(b, 0) + n - before[i].get(name, {}).get(b, 0)
        out[name] = {"p50_s": _quantile(cum, 0.5), "p99_s": _quantile(cum, 0.99),
                     "count": cum.get(float("inf"), 0)}  # fmt: skip
    return out
