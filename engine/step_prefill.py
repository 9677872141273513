"""One step's prefill, for the scheduler (:mod:`engine.scheduler`): the admitted prompts found
whole in the KV pool (no forward), the distinct prompts computed together in one padded forward
(each from the end of the blocks it found cached, once however many rows share it), or a long one
prefilled a chunk per step. While rows decode, prompts to compute wait until they are
``join_ratio`` of the running rows, at most ``join_wait_steps`` steps
(:func:`engine.prefill_plan.hold_joins`): one forward for several. Every forward is the runner's
(:class:`engine.step_runner.StepRunner`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from engine.capacity import SchedulerLimits
from engine.prefill_plan import PrefillPlan, hold_joins, plan_prefill
from engine.prefix_cache import PrefixCache
from engine.prompt_cache import PrefilledPrompt
from engine.scheduled_requests import Chunking, EngineStats, Job
from engine.step_runner import PromptInput, StepRunner


class StepPrefill:
    def __init__(self, runner: StepRunner, prefixes: PrefixCache, stats: EngineStats, limits: SchedulerLimits, *,
                 fail: Callable[[Job, BaseException], None]):
        self.runner, self.prefixes, self.stats, self.limits = runner, prefixes, stats, limits
        self._fail = fail  # a job whose prefill raised ends alone with its error
        self.chunking: Chunking | None = None
        self._join_waited = 0  # steps in a row that admitted prompts waited for company (hold_joins)
        self._step_prompts: list[PrefilledPrompt] = []  # this step's: released once their rows joined

    @property
    def chunking_job(self) -> Job | None:
        return self.chunking.job if self.chunking is not None else None

    def release_step(self) -> None:
        """The step's own references to the prompts it prefilled or found: the rows that joined
        hold the blocks they need."""
        for prompt in self._step_prompts:
            prompt.kv.release()
        self._step_prompts = []

    def run(self, admitted: list[Job], *, running_rows: int, hold: bool = True
            ) -> tuple[list[tuple[Job, PrefilledPrompt]], list[Job]]:
        """The jobs whose prompts are ready after this step's prefill (cached ones first), and the
        admitted jobs left waiting. A long prompt being chunked goes first: nothing else is
        prefilled until its last chunk ran. ``hold``: prompts may wait for company (``hold_joins``)."""
        if self.chunking is not None:
            joined = self._prefill_chunk()
            self._give_routing(joined)
            return joined, admitted
        plan = plan_prefill(admitted, self._find_cached, budget=self.limits.prefill_chunk_tokens if running_rows else None)
        if hold:
            plan = self._hold_lone_joins(plan, admitted, running_rows)
        taken = set(map(id, plan.taken))
        admitted = [job for job in admitted if id(job) not in taken]
        for job, _ in plan.cached:
            self._count_cached(job, job.prompt_len)
        joined = list(plan.cached)
        if plan.chunked is not None:
            self._start_chunking(plan.chunked)
        if plan.groups:
            joined += self._compute_prompts(plan.groups)
        if self.chunking is not None and not joined:
            joined += self._prefill_chunk()
        self._give_routing(joined)
        return joined, admitted

    def _give_routing(self, joined: list[tuple[Job, PrefilledPrompt]]) -> None:
        """Each row that asked for its routed experts gets its prompt's, before its first token.
        A prompt's part found in the prefix cache was computed by no forward of this request: the
        whole prompt's routing is computed again by a forward of its own (engine/routing/), under
        the weights that made the cached blocks (a weight update renames every block)."""
        for job, prompt in joined:
            if not job.request.sampling.routed_experts or job.state == "done":
                continue
            try:
                if prompt.routing is None or prompt.routing.shape[0] < prompt.length:
                    prompt.routing = self.runner.prompt_routing(job.request.prompt_token_ids, job.features,
                                                                job.adapter)
            except Exception as error:
                self._fail(job, error)
                continue
            for row in job.rows:
                row.routing.add_positions(0, prompt.routing)

    def _hold_lone_joins(self, plan: PrefillPlan, admitted: list[Job], running_rows: int) -> PrefillPlan:
        """``plan`` without its prompts to compute while they wait for company (``hold_joins``);
        what needs no forward (cached prompts, ended jobs) goes on. Company counts every admitted
        row to compute, also past this step's prefill budget (waiting would not widen the forward)."""
        if not plan.groups:
            return plan
        cached = {id(job) for job, _ in plan.cached}
        joining = sum(len(job.rows) for job in admitted if job.state != "done" and id(job) not in cached)
        limits = self.limits
        if not hold_joins(running=running_rows, joining=joining, waited_steps=self._join_waited,
                          ratio=limits.join_ratio, max_wait_steps=limits.join_wait_steps):
            self._join_waited = 0
            return plan
        self._join_waited += 1
        waiting = {id(job) for jobs in plan.groups.values() for job in jobs}
        return replace(plan, groups={}, taken=[job for job in plan.taken if id(job) not in waiting])

    def _find_cached(self, job: Job) -> PrefilledPrompt | None:
        """:meth:`engine.prefix_cache.PrefixCache.find`; a prompt found whole is released at the end
        of this step."""
        prompt = self.prefixes.find(job)
        if prompt is not None:
            self._step_prompts.append(prompt)
        return prompt

    def _compute_prompts(self, groups: dict[tuple, list[Job]]) -> list[tuple[Job, PrefilledPrompt]]:
        leaders = [jobs[0] for jobs in groups.values()]
        starts = [job.prefix_tokens for job in leaders]
        try:
            prefilled = zip(self.runner.prefill([self._prompt_input(job) for job in leaders]), starts, strict=True)
        except Exception as error:
            if len(leaders) == 1:
                for job in groups[leaders[0].key]:
                    self._fail(job, error)
                return []
            # One bad prompt must not fail the others: prefill each alone to find it.
            out = []
            for key, jobs in groups.items():
                out += self._compute_prompts({key: jobs})
            return out
        out = []
        for leader, (prompt, reused) in zip(leaders, prefilled, strict=True):
            self._step_prompts.append(prompt)
            self.prefixes.keep(leader, prompt)
            self.stats.prefill_tokens += prompt.length - reused
            for i, job in enumerate(groups[leader.key]):
                self._count_cached(job, job.prompt_len if i else reused)
                out.append((job, prompt))
        return out

    def _count_cached(self, job: Job, tokens: int) -> None:
        job.cached_tokens = tokens
        self.stats.cached_tokens += tokens

    def _prompt_input(self, job: Job) -> PromptInput:
        """What the runner prefills for ``job``; its cached prefix (and the references) go with it."""
        prompt = PromptInput(job.request.prompt_token_ids, job.features, job.units, job.prefix, job.prefix_tokens,
                             job.adapter, routed=job.request.sampling.routed_experts)
        job.prefix, job.prefix_tokens = [], 0
        return prompt

    def _start_chunking(self, job: Job) -> None:
        start = job.prefix_tokens
        self.chunking = Chunking(job, self.runner.start_chunked(self._prompt_input(job)), reused=start)

    def _prefill_chunk(self) -> list[tuple[Job, PrefilledPrompt]]:
        """The next chunk of the long prompt being prefilled; the prompt once its last chunk ran."""
        state = self.chunking
        job = state.job
        if job.state == "done":
            self.stop_chunking()
            return []
        try:
            prompt = self.runner.prefill_chunk(state.prefill, self.limits.prefill_chunk_tokens)
        except Exception as error:
            self.chunking = None
            self._fail(job, error)
            return []
        if prompt is None:
            return []
        self.chunking = None
        self._step_prompts.append(prompt)
        self.prefixes.keep(job, prompt)
        self.stats.prefill_tokens += prompt.length - state.reused
        self._count_cached(job, state.reused)
        return [(job, prompt)]

    def stop_chunking(self) -> None:
        """The long prompt being chunked is given up (its job ended): its prefix goes back."""
        if self.chunking is not None:
            self.runner.drop_chunked(self.chunking.prefill)
            self.chunking = None
