"""The process test bed shared by tests/ and bench/ (not part of kvgate's wheel).

- `testbed.harness`: the vLLM simulator, kvgate and the real Envoy as managed processes on
  free loopback ports (`Stack`, `ManagedProcess`, Envoy config rendering, metric scrapes).
- `testbed.redis_harness`: private redis-server / sentinel / cluster processes, and
  `RedisStack` (two kvgate replicas sharing one Redis behind one Envoy).
- `testbed.demo_model`: the demo tokenizer directory, built on first use.

Imported from the repository root: pytest puts it on sys.path (`pythonpath = ["."]` in
pyproject.toml), and bench/ runs as `python -m bench.<script>` from the root.
"""
