"""``POST /pooling`` as vLLM 0.34 serves it for an embedding model (``entrypoints/pooling/
pooling``), on the simulator's embedding model (``vllm_sim.embeddings``).

The request is the embeddings request's completion form (``input``, ``encoding_format``,
``truncate_prompt_tokens``, ``add_special_tokens``...) with a ``task``: none or the model's
own (``embed``) is served; another task is refused as vLLM refuses it for a model that
supports only ``embed``; ``dimensions`` is refused ("not supported" on this path); plug-in
``data`` is refused (no IOProcessor plugin installed). The answer:
``{"id": "pooling-<id>", "object": "list", "created", "model", "data": [{"index",
"object": "pooling", "data": <vector>}], "usage": {...}}`` with the embeddings' usage.
"""

from __future__ import annotations

import asyncio
import base64
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import web

from vllm_sim import protocol
from vllm_sim.embeddings import EmbeddingRequest, EmbeddingServer, parse_embedding, pooling_usage
from vllm_sim.server import _error_response, _json_response
from vllm_sim.validation import RequestError

if TYPE_CHECKING:
    from vllm_sim.server import VllmSim

# vLLM's answer on a server whose model serves no pooling task.
NOT_POOLING = "The model does not support Pooling API"
MODEL_TASK = "embed"
SUPPORTED_TASKS = ("embed", "token_embed")
NO_PLUGIN = (
    "No IOProcessor plugin installed. Please refer to the documentation and to the "
    "'prithvi_geospatial_mae_io_processor' offline inference example for more details."
)


def check_pooling_task(body: dict[str, Any]) -> None:
    """``ServingPooling._verify_pooling_task``, in its order."""
    if body.get("dimensions") is not None:
        raise RequestError.bad_request("dimensions is currently not supported", "dimensions")
    task = "plugin" if "data" in body and "input" not in body else body.get("task") or MODEL_TASK
    if task == "plugin":
        raise RequestError.bad_request(NO_PLUGIN, "task")
    if task != MODEL_TASK:
        if task not in SUPPORTED_TASKS:
            raise RequestError.bad_request(
                f"Unsupported task: {task!r} Supported tasks: {SUPPORTED_TASKS}", "task"
            )
        raise RequestError.bad_request(
            f"Try switching the model's pooling_task via --pooler-config.task {task}.", "task"
        )


def pooling_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body the embeddings parser reads: ``task`` is this path's own field."""
    return {key: value for key, value in body.items() if key != "task"}


def pooling_response(
    server: EmbeddingServer,
    request_id: str,
    vectors: np.ndarray,
    prompts: list[list[int]],
    fmt: str,
) -> dict[str, Any]:
    data = []
    for index, vector in enumerate(vectors):
        if fmt == "base64":
            encoded: Any = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
        else:
            encoded = np.asarray(vector, dtype=np.float32).tolist()
        data.append({"index": index, "object": "pooling", "data": encoded})
    tokens = sum(len(ids) for ids in prompts)
    server.requests_total += 1
    server.inputs_total += len(prompts)
    server.prompt_tokens_total += tokens
    return {
        "id": f"pooling-{request_id}",
        "object": "list",
        "created": protocol.now(),
        "model": server.served_model_name,
        "data": data,
        "usage": pooling_usage(tokens),
    }


class PoolingRoutes:
    """The ``/pooling`` handler, on the server's embedding model and its worker thread."""

    def __init__(self, sim: VllmSim) -> None:
        self.sim = sim

    async def pooling(self, request: web.Request) -> web.Response:
        sim = self.sim
        try:
            body, steering = await sim._read(request)
            server = sim.embedder
            if server is None or sim._embed_executor is None:
                raise RequestError.bad_request(NOT_POOLING)
            if body.get("model") and body["model"] != server.served_model_name:
                raise RequestError.not_found(f"The model `{body['model']}` does not exist.")
            check_pooling_task(body)
            req = parse_embedding(pooling_body(body))
            server.check(req)
            loop = asyncio.get_running_loop()

            def prepare(req: EmbeddingRequest) -> list[list[int]]:
                prompts = server.render(req)
                server.check_engine(prompts)
                return prompts

            prompts = await loop.run_in_executor(sim._embed_executor, prepare, req)
        except RequestError as err:
            return _error_response(err)
        if steering.ttft_s > 0:
            await asyncio.sleep(steering.ttft_s)  # the forward pass
        vectors = await loop.run_in_executor(sim._embed_executor, server.compute, req, prompts)
        request_id = request.headers.get("X-Request-Id") or req.request_id or protocol.random_uuid()
        answer = pooling_response(server, request_id, vectors, prompts, req.encoding_format)
        return _json_response(answer)
