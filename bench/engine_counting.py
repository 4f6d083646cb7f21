"""What counting by the engine (`counting: engine`) adds to a count, against local counting.

    .venv/bin/python -m bench.engine_counting             # 200 counts per arm and size
    .venv/bin/python -m bench.engine_counting --counts 50

The simulator (vLLM 0.34's /tokenize) runs as its own process on a free port, serving the
demo model; kvgate's TokenizerService runs in this process. Per chat size (one user message
plus one tool, distinct text every count so no cache helps), one count at a time:

| arm    | what is timed                                                            |
|--------|--------------------------------------------------------------------------|
| local  | `count_chat` with the demo model's local counter (render + tokenize)     |
| engine | `count_chat` with an engine counter: fair slot, deadline, HTTP, parse    |
| raw    | the same /tokenize body posted with a bare aiohttp session (the engine's |
|        | own time and the round trip, nothing of kvgate)                          |

engine - raw is kvgate's own overhead on this path; engine - local is what a decision pays
for exactness by construction. Prints a table of medians and p99s in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from kvgate.tokenize import PromptCounter, TokenizerService
from kvgate.tokenize.engine_counting import EngineCounter, EngineEndpoint
from testbed.demo_model import DEMO_MODEL_NAME, demo_model_dir
from testbed.rig import Rig

TOOL = {
    "type": "function",
    "function": {
        "name": "lookup_order",
        "description": "Find an order by its number",
        "parameters": {"type": "object", "properties": {"order": {"type": "string"}}},
    },
}
JSON = {"Content-Type": "application/json"}
SIZES = {"short": 8, "~1k tokens": 140, "~8k tokens": 1100}
SENTENCE = "the river runs past the old mill "


def _quantiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered) * 1e3, ordered[int(0.99 * (len(ordered) - 1))] * 1e3


async def _run(url: str, counts: int) -> list[tuple[str, str, float, float]]:
    service = TokenizerService(max_workers=2, inline_max_cost=16384)
    service.register("local", PromptCounter.from_model_dir(demo_model_dir(), name="local"))
    engine = EngineCounter(
        EngineEndpoint(url),
        name=DEMO_MODEL_NAME,
        timeout_s=5.0,
        max_concurrency=8,
        reserve_upper_bound=False,
    )
    service.register(DEMO_MODEL_NAME, engine)
    rows: list[tuple[str, str, float, float]] = []
    async with aiohttp.ClientSession() as raw:
        for size, repeats in SIZES.items():
            timings: dict[str, list[float]] = {"local": [], "engine": [], "raw": []}
            for i in range(counts + 5):  # the first five warm connections and caches
                messages = [{"role": "user", "content": f"{i} {size} " + SENTENCE * repeats}]
                started = time.perf_counter()
                await service.count_chat("local", messages, [TOOL])
                local = time.perf_counter() - started
                started = time.perf_counter()
                await service.count_chat(DEMO_MODEL_NAME, messages, [TOOL])
                asked = time.perf_counter() - started
                body = {"model": DEMO_MODEL_NAME, "messages": messages, "tools": [TOOL]}
                started = time.perf_counter()
                async with raw.post(url, data=json.dumps(body), headers=JSON) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
                bare = time.perf_counter() - started
                if i >= 5:
                    timings["local"].append(local)
                    timings["engine"].append(asked)
                    timings["raw"].append(bare)
            for arm, samples in timings.items():
                rows.append((size, arm, *_quantiles(samples)))
    service.close()
    await service.close_engines()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, default=200)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="kvgate-engine-counting-") as work,
        Rig(Path(work), model_dir=demo_model_dir()) as rig,
    ):
        sim = rig.sim("tokenize", served_model_name=DEMO_MODEL_NAME)
        sim.wait_ready(60)
        rows = asyncio.run(_run(f"{sim.url}/tokenize", args.counts))
    print(f"| chat | arm | median ms | p99 ms |  ({args.counts} counts each)")
    print("|---|---|---|---|")
    for size, arm, median, p99 in rows:
        print(f"| {size} | {arm} | {median:.2f} | {p99:.2f} |")


if __name__ == "__main__":
    main()
