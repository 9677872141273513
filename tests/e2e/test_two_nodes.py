"""Two nodes on one machine, one Redis: feature handles never leave the node that made them.

Node A runs a CPU worker with the default transport (shm on this machine) and a GPU worker; node B
runs a CPU worker that sends features inline and a GPU worker. A job whose items carry handles is
routed to ``generate.<its node>``; an inline job goes to ``generate.shared``, which any node's GPU
worker may take. Which worker consumes which queue is switched with Celery's remote control
(``cancel_consumer`` / ``add_consumer``), so each phase is deterministic. The job result names the
node that preprocessed it and the one that generated it (``result["nodes"]``, kept in the job record).
"""

from __future__ import annotations

import base64
import io
import time

import pytest
from PIL import Image

from domain.infra.redis_server import EmbeddedRedis
from domain.names import PREPROCESS_QUEUE, SHARED_GENERATE_QUEUE
from tests.e2e.conftest import build_stack, log_dir_for, make_stack_env

GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
# kombu's Redis consumer blocks in BRPOP for up to 1 s; a cancelled queue is left out of the next one.
BRPOP_TIMEOUT_S = 1.0


def image_body(i: int) -> dict:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (40 * i % 256, 120, 255 - 30 * i % 256)).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return {"prompt": "<image>What is it?", "content_parts": [{"type": "image_url", "url": url}],
            "sampling_params": GREEDY}


@pytest.fixture(scope="module")
def nodes(demo_model_dir, loopback_host, tmp_path_factory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("two-node-redis"), persistent=False).start()
    env = make_stack_env(redis_url=server.url, model_dir=demo_model_dir, state_dir=tmp_path_factory.mktemp("node-a"),
                         loopback=loopback_host, node_id="node-a", ROLLOUT_SHM_POOL_BYTES=str(16 * 1024 * 1024))
    node_b = {"ROLLOUT_NODE_ID": "node-b", "ROLLOUT_STATE_DIR": str(tmp_path_factory.mktemp("node-b"))}
    workers = [("cpu-a", "cpu", {}), ("gpu-a", "gpu", {}),
               ("cpu-b", "cpu", {**node_b, "ROLLOUT_TRANSPORT": "inline"}), ("gpu-b", "gpu", node_b)]
    try:
        with build_stack(env, loopback_host, log_dir_for(tmp_path_factory, "two-nodes"), workers=workers) as stack:
            yield stack
    finally:
        server.stop()


def consume(stack, name: str, queue: str, on: bool) -> None:
    """Make worker ``name`` start or stop consuming ``queue`` (Celery remote control)."""
    env = {**stack.env, **stack.worker_env.get(name, {})}
    destination = f"{stack.kinds[name]}-{stack.workers[name].pid}@{env['ROLLOUT_NODE_ID']}"
    control = stack.services.celery.control
    command = control.add_consumer if on else control.cancel_consumer
    replies = command(queue, destination=[destination], reply=True, timeout=5)
    assert replies and destination in replies[0], replies


def settle() -> None:
    time.sleep(BRPOP_TIMEOUT_S + 0.5)


def run_jobs(stack, bodies) -> list[dict]:
    ids = [stack.submit(body)["id"] for body in bodies]
    done = [stack.wait(job_id, timeout=60) for job_id in ids]
    assert [job["status"] for job in done] == ["succeeded"] * len(ids), done
    # The API's result view leaves internal fields out; the job record keeps where the job ran.
    return [stack.services.jobs.get(job_id)["result"] for job_id in ids]


def where(result) -> tuple[str, str, str]:
    return result["transport"], result["nodes"]["preprocess"], result["nodes"]["generate"]


def test_handles_stay_on_their_node_and_crossing_jobs_go_inline(nodes):
    bodies = [image_body(i) for i in range(6)]

    # Node A alone preprocesses: shm handles, and only node A's GPU worker may take them, though
    # node B's sits idle on generate.shared and generate.node-b.
    consume(nodes, "cpu-b", PREPROCESS_QUEUE, on=False)
    settle()
    at_home = run_jobs(nodes, bodies)
    assert [where(r) for r in at_home] == [("shm", "node-a", "node-a")] * len(bodies)

    # Node B alone preprocesses (inline) and only node A's GPU worker takes shared work: every
    # prompt crosses nodes, inline, and gives the same tokens as the shm run.
    consume(nodes, "cpu-b", PREPROCESS_QUEUE, on=True)
    consume(nodes, "cpu-a", PREPROCESS_QUEUE, on=False)
    consume(nodes, "gpu-b", SHARED_GENERATE_QUEUE, on=False)
    settle()
    crossed = run_jobs(nodes, bodies)
    assert [where(r) for r in crossed] == [("inline", "node-b", "node-a")] * len(bodies)
    assert [r["choices"][0]["token_ids"] for r in crossed] == [r["choices"][0]["token_ids"] for r in at_home]
    assert [r["prompt_token_ids"] for r in crossed] == [r["prompt_token_ids"] for r in at_home]

    # Everything on: wherever a job lands, handles never cross a node boundary.
    consume(nodes, "cpu-a", PREPROCESS_QUEUE, on=True)
    consume(nodes, "gpu-b", SHARED_GENERATE_QUEUE, on=True)
    settle()
    mixed = run_jobs(nodes, [image_body(i) for i in range(6, 16)])
    for transport, made_on, generated_on in map(where, mixed):
        assert transport == ("shm" if made_on == "node-a" else "inline")
        assert transport == "inline" or generated_on == made_on
