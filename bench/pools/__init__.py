"""Pools: prefix affinity, fair queueing and the cost of picking, measured.

    .venv/bin/python -m bench.pools --quick    # ~2 min: short versions of every part
    .venv/bin/python -m bench.pools            # the published run (~7 min)
    .venv/bin/python -m bench.pools --parts affinity,fairness,cost --out DIR --keep

Every process runs on 127.0.0.1 (free ports) and is started once: six vLLM simulators
(`vllm-sim`; r0-r2 for parts 1 and 2, c0-c2 for part 3), the main kvgate (memory store; each
arm is a hot reload of its config, SIGHUP, checked with `kvgate_config_reloads_total`; a
failed reload would restart it, noted in the results), its Envoy (`envoy/envoy.yaml`,
`--concurrency 1`, with the pool's ORIGINAL_DST cluster and a STATIC round-robin cluster of
r0-r2) and, for part 3, a kvgate with one plain backend (c0) behind its own Envoy and a plain
Envoy without ext_proc. Results: `bench/results/pools/pools.json`, `pools.md` and
`pools-requests.csv.gz` (every request of parts 1 and 2); `pools-quick.*` with --quick; `--out
DIR` writes there instead. Process logs: `var/bench/pools-<date>/logs` (kept with --keep).
Before each arm the run waits (bounded) for the shared machine to be quiet, and records the
CPU other users took during the arm.

**1. affinity** — prefix affinity against load-only picking and round-robin. r0-r2 run with
vLLM's prefix caching (`--enable-prefix-caching --enable-prompt-tokens-details`), 1,000 blocks
of 16 tokens, `--ttft-ms 2 --itl-ms 10` and a prefill cost of 50 ms per 1k uncached prompt
tokens (`--prefill-ms-per-1k-tokens 50`: on this machine the simulator itself spends ~45 ms
tokenizing a 3k-token prompt, which would hide a 20 ms/1k saving). Six tenants (API keys), each
with its own system prompt (2,000-4,000 tokens, distinct text); each request is a random
tenant's system prompt plus a short new user turn, streamed, 16 output tokens, closed loop with
8 in flight. Arms back to back on the same processes, simulators reset between arms
(`POST /sim/reset`, checked to empty the prefix cache; else they are restarted); the request
sequence is the same in every arm:

| arm                 | kvgate backend                                   | Envoy cluster          |
|---------------------|--------------------------------------------------|------------------------|
| pool-affinity       | pool of r0-r2, 16,000 KV tokens each, defaults   | ORIGINAL_DST           |
| pool-load           | the same, `picking.prefix_affinity: false`       | ORIGINAL_DST           |
| round-robin         | one backend of 48,000 KV tokens (the sum)        | STATIC x3, ROUND_ROBIN |
| pool-affinity-gate1 | the pool with `picking.load_gate: 1.0` (a probe) | ORIGINAL_DST           |

Per arm: prefix-cache hit rate from the simulators' counters (hits / queries, in tokens), mean
`cached_tokens` from the streamed usage, client TTFT (first content event) p50/p95/mean and
split by cache hit, throughput, and per pod the requests served (and by which tenants),
preemptions, the peak KV its running sequences held (a shared block once) against its
capacity, and kvgate's reserved KV on it (`kvgate_kv_tokens_in_flight`, sampled at 10 Hz).

**2. fairness** — a full pool with a queue, on r0-r2 with per-request `x-sim-*` headers
(5 ms TTFT, 10 ms per token, 32 output tokens, 8 tokens per SSE event). kvgate's budget per
endpoint is 2,400 tokens: two requests of ~1,010 prompt + 32 output tokens each, six in the
pool, ~0.4 s each. Closed loop: tenant `heavy` with 20 clients, `light` with 2, same shape:

| phase    | kvgate                                     | load                             |
|----------|--------------------------------------------|----------------------------------|
| queue    | pool with `queue: {max_wait_s: 10}`        | heavy 20, light 2                |
| no-queue | the same pool without a queue              | the same; a 429 retries in 0.1 s |
| priority | the queue; tenant `vip` has `priority: 1`  | heavy 20, light 2, vip 2         |

A request's admission time is its arrival at a simulator (`/sim/requests`, matched by an
`x-bench-id` header; Envoy forwards as soon as kvgate admits). Per tenant: attempts, 429s, the
wait from send to admission (client clock) and kvgate's own `kvgate_queue_wait_seconds`
(bucket-interpolated), requests and tokens (prompt + max_tokens) admitted per second, and the
VTC check: over every interval in which both heavy and light had a request waiting, the largest
difference of their weighted service (w_p·prompt + w_q·output, the queue's weights, counted at
admission), against 2·max over requests of (w_p·L_input + w_q·M); over the whole phase and
from the moment both had been admitted once (the start-up burst left out).

**3. cost** — one request in flight, arms interleaved request by request (bench/interleaved.py's
`send`: CPU per request from /proc/<pid>/task/*/schedstat): plain Envoy, kvgate with one
backend, kvgate with a pool of three (picking on); ~1k-token prompts, unique per request,
c0-c2 answering at once. And an in-process `timeit` of the pieces of `PoolScheduler.place`
(affinity_text, block_hashes, matches, rendezvous_order, rank_endpoints, record) for 3 and 32
endpoints and 1k / 16k-token prompts, on a prefix index filled to its 100,000 entries.

The package, one job a module: `plans` (what each part runs: arms, phases, sizes, tenants),
`rig` (the processes, on testbed/rig.py, and kvgate's config per arm), `load` (the streamed
client and the load drivers), `measure` (what a run's readings add up to: hit rates, waits,
the VTC check, CPU), `microbench` (the in-process timeit of picking), `scenarios` (each
part: configure, drive, read back), `report` (pools.md, the raw request CSV, pools.json's
values) and `cli` (the command line).
"""
