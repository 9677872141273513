"""Every Celery queue and task name, spelled out once.

A name is a contract between processes that may run different builds (the API sends, a worker on
another node consumes), so it lives here and nowhere else; modules import these constants.

Queues: ``preprocess`` (CPU workers), ``generate.<node_id>`` (the GPU workers of one node; items
that carry feature handles must stay on the node that made them), ``generate.gpu.<worker>`` (one
GPU worker's own: the prompts whose prefix it holds), ``generate.shared`` (inline work any GPU
worker may take), ``webhooks`` and ``batches``.
"""

from __future__ import annotations

import os

PREPROCESS_QUEUE = "preprocess"
SHARED_GENERATE_QUEUE = "generate.shared"
WEBHOOKS_QUEUE = "webhooks"
BATCHES_QUEUE = "batches"


def node_generate_queue(node_id: str) -> str:
    """The generate queue of one node's GPU workers."""
    return f"generate.{node_id}"


def worker_name(node_id: str) -> str:
    """This worker process's name: its heartbeat's, and a GPU worker's own queue's."""
    return f"{node_id}-{os.getpid()}"


def direct_queue(worker: str) -> str:
    """One GPU worker's own generate queue (``domain/infra/gpu_affinity.py``)."""
    return f"generate.gpu.{worker}"


PREPROCESS_TASK = "rollout.preprocess"
GENERATE_TASK = "rollout.generate"
RENDER_TASK = "rollout.render"

JOB_ENDED_TASK = "rollout.webhooks.job_ended"
DELIVER_TASK = "rollout.webhooks.deliver"

ENQUEUE_CHUNK_TASK = "rollout.batches.enqueue_chunk"
CANCEL_BATCH_TASK = "rollout.batches.cancel"
EXPIRE_BATCH_TASK = "rollout.batches.expire"
SCORE_LINES_TASK = "rollout.batches.score_lines"
