"""``calid bench hostile``: what a hostile or careless client can do to a running calid server.

Run against a server you own (``calid serve`` in another terminal). Each probe
prints what was tried, what the server answered and how long it took; the
last columns say whether anything was left behind (the server's Health counts
return to zero) and whether the server kept answering meanwhile.
"""
from __future__ import annotations

import asyncio
import statistics
import time


def add_parser(sub) -> None:
    p = sub.add_parser("hostile", help="probe a running server with a burst, oversized input and cancels")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--app", default="calid")
    p.add_argument("--api-key", default=None)
    p.add_argument("--burst", type=int, default=150, help="concurrent Generate calls in the burst (default 150)")
    p.add_argument("--cancels", type=int, default=50, help="streams cancelled after their first chunk (default 50)")
    p.add_argument("--prompt-mb", type=float, default=20.0, help="size of the oversized prompt (default 20 MB)")
    p.set_defaults(func=run)


def run(args) -> int:
    rows = asyncio.run(_probes(args))
    print(f"{'probe':48} {'answer':34} {'seconds':>8}  notes")
    for probe, answer, seconds, notes in rows:
        print(f"{probe:48} {answer:34} {seconds:>8.2f}  {notes}")
    return 0


async def _probes(args) -> list[tuple[str, str, float, str]]:
    from calid.client import AsyncClient, CalidAPIError

    async with AsyncClient(args.address, app=args.app, timeout=900, retries=0, api_key=args.api_key) as c:
        rows = []

        async def timed(coro):
            start = time.perf_counter()
            try:
                await coro
                return "OK", time.perf_counter() - start
            except CalidAPIError as e:
                return e.code.name, time.perf_counter() - start

        async def health_latency(during):
            """Health's worst latency while ``during`` runs: the event loop stays free or it does not."""
            worst, task = 0.0, asyncio.ensure_future(during)
            while not task.done():
                t = time.perf_counter()
                await c.health(timeout=60)
                worst = max(worst, time.perf_counter() - t)
                await asyncio.sleep(0.05)
            return await task, worst

        async def idle_after(start: float, timeout_s: float = 300) -> float:
            while time.perf_counter() - start < timeout_s:
                h = await c.health()
                if h.active_requests == 0 and h.queued_requests == 0:
                    return time.perf_counter() - start
                await asyncio.sleep(0.1)
            return float("inf")

        # 1. a burst beyond max_active + queue_capacity
        outcomes = await asyncio.gather(*(timed(c.generate("Count to three.", max_new_tokens=8, ignore_eos=True))
                                          for _ in range(args.burst)))
        by_code: dict[str, list[float]] = {}
        for code, secs in outcomes:
            by_code.setdefault(code, []).append(secs)
        refused = by_code.get("RESOURCE_EXHAUSTED", [])
        served = by_code.get("OK", [])
        rows.append(
            (
                f"{args.burst} concurrent Generate calls",
                ", ".join(f"{len(v)} {k}" for k, v in sorted(by_code.items())),
                max(s for _, s in outcomes),
                f"refusals p50 {_ms(refused)}, max {_ms(refused, max)}; served p50 "
                f"{statistics.median(served) if served else 0:.1f} s",
            )
        )

        # 2. oversized prompt, with Health probed meanwhile
        big = "a " * int(args.prompt_mb * 2**20 / 2)
        (code, secs), worst = await health_latency(timed(c.generate(big, max_new_tokens=4)))
        rows.append(
            (f"a {args.prompt_mb:g} MB prompt", code, secs, f"Health answered within {worst * 1000:.0f} ms meanwhile")
        )

        # 3. absurd output length, 4. huge stop strings
        code, secs = await timed(c.generate("hi", max_new_tokens=2**32 - 1))
        rows.append(("max_new_tokens = 2^32-1", code, secs, ""))
        code, secs = await timed(c.generate("hi", max_new_tokens=8, stop=["x" * 200_000] * 16))
        rows.append(("16 stop strings of 200 KB", code, secs, ""))

        # 5. streams cancelled after their first chunk
        async def cancel_after_first():
            stream = c.stream("Write a long story about a lighthouse.", max_new_tokens=256)
            async for _ in stream:
                break
            await stream.aclose()

        start = time.perf_counter()
        await asyncio.gather(*(cancel_after_first() for _ in range(args.cancels)))
        rows.append((f"{args.cancels} streams cancelled after their first chunk", "CANCELLED (client side)",
                     time.perf_counter() - start,
                     f"server idle {await idle_after(time.perf_counter()):.2f} s after the last cancel"))

        # 6. the server still serves
        code, secs = await timed(c.generate("What is 2 + 2?", max_new_tokens=8))
        rows.append(("a normal request afterwards", code, secs, ""))
        return rows


def _ms(xs: list[float], f=statistics.median) -> str:
    return f"{f(xs) * 1000:.0f} ms" if xs else "-"

