"""The sampling half of a step: the next token of every request whose chunk reached its end.

Model: the rows of the step's logits that end a request's chunk are sampled (the grammar's mask
applied where the request has one; a deferred mask whose free argmax the grammar rejects is
sampled again, masked); sampled logprobs are appended to the request, and the prompt logprobs of
every chunk that asked for them are recorded (logits at position p score prompt token p + 1).
A request with `max_tokens == 0` (prompt logprobs only) gets no token.
"""

from __future__ import annotations

import torch

from serve.core.request import Request
from serve.core.scheduler import Scheduler, SchedulerOutput
from serve.model.grammar import Bitmasks, GrammarBackend
from serve.model.sampler import SampleInput, Sampler, logprobs_of, select_rows
from serve.model.step_inputs import StepInputs


class StepSampling:
    def __init__(
        self,
        scheduler: Scheduler,
        grammars: GrammarBackend,
        eos_token_ids: frozenset[int],
        seed: int,
    ) -> None:
        self.scheduler, self.grammars = scheduler, grammars
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler(seed)

    def wants_token(self, request_id: str) -> bool:
        return self.scheduler.requests[request_id].sampling_params.max_tokens > 0

    def sample(
        self, inputs: StepInputs, logits: torch.Tensor, masks: Bitmasks | None
    ) -> dict[str, int]:
        """{request id: its next token} for every request that wants one this step."""
        ids = [r for r in inputs.sample_rows if self.wants_token(r)]
        if not ids:
            return {}
        requests = [self.scheduler.requests[r] for r in ids]
        rows = [inputs.sample_rows[r] for r in ids]
        sample_inputs = [self.sample_input(r) for r in requests]
        allowed = masks.aligned(ids) if masks is not None else None
        sampled = self.sampler.sample(select_rows(logits, rows), sample_inputs, allowed)
        tokens = {r: s.token_id for r, s in zip(ids, sampled)}
        if rejected := self.grammars.consume(tokens):
            # deferred masks whose free argmax the grammar rejected: the masked argmax now
            position = {r: k for k, r in enumerate(ids)}
            again = [position[r] for r in rejected]
            redrawn = self.sampler.sample(
                select_rows(logits, [rows[k] for k in again]),
                [sample_inputs[k] for k in again],
                self.grammars.masks_now(rejected).words,
            )
            for k, s in zip(again, redrawn):
                sampled[k] = s
                tokens[ids[k]] = s.token_id
            self.grammars.consume({r: tokens[r] for r in rejected})
        for request, s in zip(requests, sampled):
            if s.logprobs is not None:
                request.logprobs.append(s.logprobs)
        return tokens

    def sample_input(self, request: Request) -> SampleInput:
        params = request.sampling_params
        constrained = request.request_id in self.grammars.matchers
        generator = self.sampler.generator_for(request.request_id, params.seed)
        if not params.processes_row:  # at most a grammar's mask, read from the step's bitmasks
            return SampleInput(params, generator, constrained=constrained)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        return SampleInput(
            params,
            generator,
            request.prompt_token_ids,
            request.output_token_ids,
            stop_ids,
            constrained,
        )

    def record_prompt_logprobs(
        self, out: SchedulerOutput, inputs: StepInputs, logits: torch.Tensor
    ) -> None:
        """Token 0, and those before `prompt_logprobs_from`, get None."""
        for chunk in out.chunks:
            if chunk.request_id not in inputs.prompt_rows:
                continue
            request = self.scheduler.requests[chunk.request_id]
            first, count = inputs.prompt_rows[chunk.request_id]
            top_n = request.sampling_params.prompt_logprobs or 0
            if not request.prompt_logprobs:
                skipped = max(request.sampling_params.prompt_logprobs_from, 1)
                request.prompt_logprobs.extend([None] * min(skipped, request.num_prompt_tokens))
            rows: list[int] = []
            tokens: list[int] = []
            for i in range(count):
                target = chunk.start_pos + chunk.first_logprob_row + i + 1
                recorded = len(request.prompt_logprobs) + len(rows)
                if target == recorded and target < request.num_prompt_tokens:
                    rows.append(first + i)
                    tokens.append(request.prompt_token_ids[target])
            if rows:
                picked = select_rows(logits, rows)
                request.prompt_logprobs.extend(logprobs_of(picked, tokens, top_n))

    def release(self, request_id: str) -> None:
        """Drop the request's generator and grammar matcher."""
        self.sampler.release(request_id)
        self.grammars.release(request_id)
