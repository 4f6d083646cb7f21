"""The process test bed shared by tests/ and bench/ (not part of kvgate's wheel).

- `testbed.harness`: the vLLM simulator, kvgate and the real Envoy as managed processes on
  free loopback ports (`Stack`, `ManagedProcess`, Envoy config rendering, metric scrapes).
- `testbed.redis_harness`: private redis-server / sentinel / cluster processes, and
  `RedisStack` (two kvgate replicas sharing one Redis behind one Envoy).
- `testbed.rig`: the same processes one by one (`Rig`: several simulators, kvgate processes,
  Envoys, no-op ext_proc servers side by side on distinct free ports; the benchmarks' stacks).
- `testbed.envoy_variants`: edits of a rendered Envoy bootstrap (no ext_proc, a catch-all
  route, more ext_proc endpoints, round-robin clusters).
- `testbed.noop_extproc`: an ext_proc server that lets everything through and decides nothing.
- `testbed.demo_model`: the demo tokenizer directory, built on first use.

Imported from the repository root: pytest puts it on sys.path (`pythonpath = ["."]` in
pyproject.toml), and bench/ runs as `python -m bench.<script>` from the root.
"""
