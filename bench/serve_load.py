"""Closed-loop streaming HTTP load on an OpenAI-compatible completions server, and the numbers of one window.

Used by bench_serve.py. N clients (asyncio tasks on one aiohttp session, in the
calling process) each send ``POST /v1/completions`` with ``stream: true``, read
the server-sent events to ``data: [DONE]`` and send the next request. Every
``data:`` event is timestamped when its line arrives; with a chars tokenizer one
character of text is one token, so an event carrying k characters is k tokens
arriving at once (one gap, then k - 1 gaps of 0: what a streaming client sees).
The usage block at the end of each stream (``stream_options.include_usage``)
cross-checks that count.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Record:
    """One request as the client saw it: when it was sent and when each event's tokens arrived."""

    sent: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)   # (perf_counter, tokens in the event)
    done: bool = False          # data: [DONE] was read
    usage: int | None = None    # completion_tokens the server reported
    status: int = 0


async def _one_request(session, url: str, body: dict, records: list[Record]) -> Record:
    """Send one streaming completion and read it to the end (the record is listed before the first byte)."""
    rec = Record(time.perf_counter())
    records.append(rec)
    async with session.post(url, json=body) as resp:
        rec.status = resp.status
        if resp.status != 200:
            await resp.read()
            return rec
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                rec.done = True
                break
            now = time.perf_counter()
            obj = json.loads(payload)
            if obj.get("choices"):
                rec.arrivals.append((now, len(obj["choices"][0]["text"])))
            if obj.get("usage"):
                rec.usage = obj["usage"]["completion_tokens"]
    return rec


async def _client(session, url: str, index: int, prompts: list[str], body: dict, start: float, stop: float,
                  budget: list[int], records: list[Record], seed: int) -> None:
    """Closed loop: start at `start`, send request after request until `stop` or the shared budget runs out."""
    rng = random.Random(seed * 100_003 + index)
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    while time.perf_counter() < stop and budget[0] > 0:
        budget[0] -= 1
        rec = await _one_request(session, url, {**body, "prompt": rng.choice(prompts)}, records)
        if rec.status != 200:
            await asyncio.sleep(0.05)     # 429 or a failure: do not spin


async def scrape(session, base: str) -> dict[str, float]:
    """GET /metrics and return {sample name with labels: value}."""
    async with session.get(base + "/metrics") as resp:
        text = await resp.text()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def wait_idle(session, base: str, seconds: float) -> bool:
    """Poll /metrics until no sequence runs or waits (cancelled streams freed); return whether it got there."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        m = await scrape(session, base)
        if m.get("hpcpipe_running_sequences", 1) == 0 and m.get("hpcpipe_queue_depth", 1) == 0:
            return True
        await asyncio.sleep(0.2)
    return False


async def run_load(base: str, concurrency: int, prompts: list[str], body: dict, warmup: float, seconds: float,
                   max_requests: int, seed: int) -> dict:
    """Run one point: warm up, measure for `seconds`, cancel the clients; return the window's numbers."""
    import aiohttp
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()
        w0, w1 = t0 + warmup, t0 + warmup + seconds
        # starts spread over half the warm-up, so that requests do not all begin (and end) on one step
        spread = warmup / 2 / concurrency
        records: list[Record] = []
        budget = [max_requests]
        tasks = [asyncio.create_task(_client(session, base + "/v1/completions", i, prompts, body, t0 + i * spread,
                                             w1, budget, records, seed)) for i in range(concurrency)]
        await asyncio.sleep(max(0.0, w0 - time.perf_counter()))
        before = await scrape(session, base)
        await asyncio.wait(tasks, timeout=max(0.0, w1 - time.perf_counter()))
        after = await scrape(session, base)
        window = time.perf_counter() - w0
        for task in tasks:
            task.cancel()           # closes the open streams: the server frees their slots
        await asyncio.gather(*tasks, return_exceptions=True)
        idle = await wait_idle(session, base, 60.0)
    out = window_stats(records, w0, w0 + window)
    out["server"] = server_stats(before, after, window)
    out["idle_after"] = idle
    out["budget_exhausted"] = budget[0] <= 0
    return out


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def window_stats(records: list[Record], w0: float, w1: float) -> dict:
    """Tokens/s, requests done, TTFT and inter-token p50/p99 (ms) of the arrivals in [w0, w1)."""
    tokens, done, gaps, ends, ttft, mismatch, errors = 0, 0, [], [], [], 0, 0
    started = sum(1 for r in records if w0 <= r.sent < w1)
    for r in records:
        if r.status not in (0, 200):
            errors += w0 <= r.sent < w1
            continue
        prev = None
        for t, k in r.arrivals:
            if w0 <= t < w1:
                tokens += k
                if prev is not None:
                    gaps.append(t - prev)
                    ends.append(t)
                gaps.extend([0.0] * max(k - 1, 0))     # the event's other tokens came with its first
                ends.extend([t] * max(k - 1, 0))
            prev = t
        if r.arrivals and w0 <= r.sent < w1 and r.arrivals[0][0] < w1:
            ttft.append(r.arrivals[0][0] - r.sent)
        if r.done and r.arrivals and w0 <= r.arrivals[-1][0] < w1:
            done += 1
        if r.done and r.usage is not None and r.usage != sum(k for _, k in r.arrivals):
            mismatch += 1
    ms = [g * 1e3 for g in gaps]
    p50, p99 = _pct(ms, 50), _pct(ms, 99)
    firsts = np.sort([r.arrivals[0][0] for r in records if r.arrivals])
    long_gaps = [t for g, t in zip(gaps, ends, strict=True) if p50 and g * 1e3 >= 2 * p50]
    return {"window_s": w1 - w0, "tokens": tokens, "tokens_per_s": tokens / (w1 - w0), "requests_done": done,
            "requests_started": started, "errors": errors, "usage_mismatches": mismatch,
            "ttft_n": len(ttft), "ttft_p50_ms": _pct([x * 1e3 for x in ttft], 50),
            "ttft_p99_ms": _pct([x * 1e3 for x in ttft], 99),
            "itl_n": len(ms), "itl_zero_share": (sum(1 for g in gaps if g == 0.0) / len(gaps)) if gaps else None,
            "itl_p50_ms": p50, "itl_p99_ms": p99,
            "itl_p99_over_p50": (p99 / p50) if p50 else None,
            "itl_long_n": len(long_gaps),
            # one step's tokens reach the clients within a burst of a few ms (the HTTP thread writes them one
            # stream after another), steps are ~p50 apart: a quarter of p50 tells one step from the next
            "itl_long_with_first_token_share": _near_share(long_gaps, firsts, max(0.002, (p50 or 0) / 4e3))}


def _near_share(times: list[float], marks: np.ndarray, tolerance: float) -> float | None:
    """Share of `times` within `tolerance` s of some mark (long gaps ending when a new request's first
    token arrives: the step that carried that request's prefill delayed the tokens beside it)."""
    if not times or not len(marks):
        return None
    i = np.searchsorted(marks, times)
    left = np.abs(np.asarray(times) - marks[np.clip(i - 1, 0, len(marks) - 1)])
    right = np.abs(marks[np.clip(i, 0, len(marks) - 1)] - np.asarray(times))
    return float(np.mean(np.minimum(left, right) <= tolerance))


def _bucket_quantile(before: dict, after: dict, name: str, q: float) -> float | None:
    """Upper bound (ms) of the histogram bucket holding quantile q of the observations between two scrapes."""
    prefix = name + '_bucket{le="'
    bounds = sorted((float(k[len(prefix):-2]), after[k] - before.get(k, 0.0))
                    for k in after if k.startswith(prefix))
    total = bounds[-1][1] if bounds else 0
    if total <= 0:
        return None
    for bound, cum in bounds:
        if cum >= q * total:
            return bound * 1e3
    return None


def server_stats(before: dict, after: dict, window: float) -> dict:
    """The server's own view of the window from two /metrics scrapes (histogram quantiles are bucket bounds)."""
    gen = "hpcpipe_generated_tokens_total"
    ok = 'hpcpipe_requests_total{status="200"}'
    itl, ttft = "hpcpipe_inter_token_seconds", "hpcpipe_time_to_first_token_seconds"
    return {"tokens_per_s": (after.get(gen, 0) - before.get(gen, 0)) / window,
            "requests_200": after.get(ok, 0) - before.get(ok, 0),
            "itl_p50_le_ms": _bucket_quantile(before, after, itl, 0.5),
            "itl_p99_le_ms": _bucket_quantile(before, after, itl, 0.99),
            "ttft_p50_le_ms": _bucket_quantile(before, after, ttft, 0.5),
            "ttft_p99_le_ms": _bucket_quantile(before, after, ttft, 0.99)}


def measure(base: str, concurrency: int, prompts: list[str], body: dict, warmup: float, seconds: float,
            max_requests: int, seed: int) -> dict:
    """Blocking wrapper of run_load (one event loop per point)."""
    return asyncio.run(run_load(base, concurrency, prompts, body, warmup, seconds, max_requests, seed))
