"""Agents' tool turns with sessions against token-in-token-out (issue #57 item 4's benchmark).

A real stack (embedded Redis, one GPU worker on the demo-qwen3 model, the API in-process through
Flask's test client): 16 agents x 6 tool turns, the agents' turns at once (one thread each), each
turn 16 sampled tokens (seeded, ``ignore_eos``) and then a tool result, with the tools rendered.
Two ways, alternated round by round with their own ``cache_salt`` (no round finds another's KV):

- sessions: every turn on ``/v1/chat/completions`` with ``X-Session-ID`` and the messages so far
  (the service continues the last turn's ids and tokenizes only the new messages);
- token-in: turn one on chat with ``return_token_ids``, each next turn on
  ``/v1/chat/completions/tokens`` with the ids stitched by the client from the last reply and a
  bridge from two ``/tokenize`` calls, as verifiers' token client does.

Rows: turns per second, sessions / token-in (goal >= 0.9), and each way's computed prompt share
(prompt tokens not found in the KV cache, from the replies' ``cached_tokens``, over prompt tokens)
of the continued turns (goal: equal) and of all turns (the agents' first turns share the tools'
prefix, computed once per engine step they meet in: arrival timing, the same for both ways).
The stack has a CPU worker, as ``rollout-queue up``: the random model samples media markers
(``<|vision_end|>``), and a token prompt holding them is preprocessed first. Medians of 5 rounds.
Run: ``python -m bench.token_turns`` from the repository root. ~2 min.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.rows import print_rows
from bench.stack import HEADERS, Service
from engine.demo_model import build_demo_model

TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the docs",
                                            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
TOOL_RESULT = "Found 3 pages: install, configure, run. The second says to set the key first."


def _post(client, path, body, headers=None):
    response = client.post(path, json=body, headers={**HEADERS, **(headers or {})})
    assert response.status_code == 200, response.get_json()
    return response.get_json()


def _stand_in_bridge(client, new, last_id, eot) -> list[int]:
    stand_in = {"role": "assistant", "reasoning_content": "", "content": "x"}
    full = _post(client, "/tokenize", {"messages": [stand_in, *new], "tools": TOOLS})["tokens"]
    base = _post(client, "/tokenize", {"messages": [stand_in], "tools": TOOLS, "add_generation_prompt": False})["tokens"]
    at = max(i for i, t in enumerate(base) if t == eot)
    return full[at + 1:] if last_id == eot else full[at:]


def agent(app, agent_id: int, turns: int, salt: str, sessions: bool, eot: int) -> tuple[int, int, int, int]:
    """One agent's turns: its prompt tokens and those computed (not found cached), of all its
    turns and of its continued ones (after the first)."""
    client = app.test_client()
    messages = [{"role": "user", "content": f"Agent {agent_id}: how do I set this service up?"}]
    ids: list[int] = []
    prompt = computed = later_prompt = later_computed = 0
    for turn in range(turns):
        body = {"messages": messages, "tools": TOOLS, "max_tokens": 16, "temperature": 1.0, "seed": agent_id * 100 + turn,
                "ignore_eos": True, "cache_salt": salt, "return_token_ids": True}
        if sessions or turn == 0:
            reply = _post(client, "/v1/chat/completions", body, {"X-Session-ID": f"{salt}-{agent_id}"} if sessions else None)
        else:
            reply = _post(client, "/v1/chat/completions/tokens", {**body, "tokens": ids})
        usage = reply["usage"]
        prompt += usage["prompt_tokens"]
        computed += usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
        if turn:
            later_prompt += usage["prompt_tokens"]
            later_computed += usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
        sampled = reply["choices"][0]["token_ids"]
        # The random model writes no call to answer: the tool's result comes as the next message.
        new = [{"role": "user", "content": f"Tool result: {TOOL_RESULT}"}]
        message = {k: v for k, v in reply["choices"][0]["message"].items() if v not in (None, [])}
        messages = [*messages, message, *new]
        if not sessions:
            ids = reply["prompt_token_ids"] + sampled + _stand_in_bridge(client, new, sampled[-1], eot)
    return prompt, computed, later_prompt, later_computed


def one_round(service: Service, agents: int, turns: int, salt: str, sessions: bool, eot: int) -> dict:
    started = time.perf_counter()
    with ThreadPoolExecutor(agents) as pool:
        done = list(pool.map(lambda i: agent(service.app, i, turns, salt, sessions, eot), range(agents)))
    wall = time.perf_counter() - started
    return {"turns_s": agents * turns / wall, "share": sum(d[1] for d in done) / sum(d[0] for d in done),
            "later": sum(d[3] for d in done) / max(1, sum(d[2] for d in done))}


def run(agents: int = 16, turns: int = 6, rounds: int = 5) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_demo_model(Path(tmp) / "model", arch="qwen3_tools")
        service = Service(Path(tmp) / "state", model_dir, batch=None, workers=("cpu", "gpu"))
        try:
            service.start_workers()
            service.wait_ready(timeout=300)
            eot = service.svc.tokenizer.convert_tokens_to_ids("<|im_end|>")
            one_round(service, 1, 2, "warm", True, eot)
            results: dict[bool, list[dict]] = {True: [], False: []}
            for r in range(rounds):
                for sessions in ((True, False) if r % 2 == 0 else (False, True)):
                    results[sessions].append(one_round(service, agents, turns, f"r{r}-{sessions}", sessions, eot))
        finally:
            service.close()
    rate = {way: statistics.median(x["turns_s"] for x in results[way]) for way in results}
    share = {way: statistics.median(x["share"] for x in results[way]) for way in results}
    later = {way: statistics.median(x["later"] for x in results[way]) for way in results}
    return [
        {"name": f"token_turns: sessions / token-in turns per second ({agents} agents x {turns} tool turns)",
         "value": f"{rate[True] / rate[False]:.2f}", "goal": ">= 0.9"},
        {"name": "· sessions, token-in turns per second", "value": f"{rate[True]:.1f} / {rate[False]:.1f}", "goal": ""},
        {"name": "token_turns: computed prompt share of continued turns, sessions / token-in",
         "value": f"{later[True]:.3f} / {later[False]:.3f}", "goal": "equal"},
        {"name": "· all turns (the first turns' shared tools prefix is computed once per step they meet in)",
         "value": f"{share[True]:.3f} / {share[False]:.3f}", "goal": ""},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print_rows(run(args.agents, args.turns, args.rounds))


if __name__ == "__main__":
    main()
