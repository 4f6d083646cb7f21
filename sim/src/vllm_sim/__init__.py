"""A vLLM stand-in: vLLM's OpenAI-compatible wire format, real tokenizer counts and a
GPU-like KV-cache model, for kvgate's end-to-end tests and benchmarks."""

from vllm_sim.config import VLLM_VERSION, SimConfig
from vllm_sim.server import VllmSim, create_app, get_sim

__all__ = ["VLLM_VERSION", "SimConfig", "VllmSim", "create_app", "get_sim"]
