"""``python -m vllm_sim``: the same as the ``vllm-sim`` console script."""

from vllm_sim.cli import main

main()
