"""LLMEngine: the engine core and the output processor in one process, synchronous (tests, scripts,
benchmarks; `ThreadedEngine` steps one for debug-serve).

Text in, text out: prompts are tokenized here, and the core's token ids come back as RequestOutputs
with detokenized text, stop strings applied and usage counted.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from flare.engine.config import EngineConfig
from flare.engine.core import EngineCore
from flare.engine.stats import RefusedRequest
from flare.engine.outputs import RequestOutput
from flare.engine.request import EngineRequest
from flare.engine.sampling_params import SamplingParams
from flare.frontend.output_processor import OutputProcessor
from flare.frontend.tokenizer import Tokenizer, load_tokenizer


class LLMEngine:
    def __init__(self, core: EngineCore, tokenizer: Tokenizer) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.output_processor = OutputProcessor(tokenizer)
        self._generate_ids = itertools.count()

    @classmethod
    def from_checkpoint(cls, directory: str | Path, engine_config: EngineConfig | None = None,
                        device: str = "cpu", dtype: str = "float32", seed: int | None = None) -> LLMEngine:
        """Load a Hugging Face checkpoint directory (weights, config and tokenizer)."""
        from flare.engine.factory import build_core, load_checkpoint_model

        tokenizer = load_tokenizer(directory)
        loaded = load_checkpoint_model(directory, engine_config, device, dtype, tokenizer.eos_token_ids)
        return cls(build_core(loaded, seed, lambda: tokenizer.hf), tokenizer)

    @classmethod
    def from_model(cls, model, model_config, tokenizer: Tokenizer, engine_config: EngineConfig,
                   device: str = "cpu", dtype: str = "float32", seed: int | None = None,
                   eos_token_ids: Sequence[int] | None = None) -> LLMEngine:
        """Serve an already built model (weights loaded); EOS ids default to the tokenizer's."""
        from flare.engine.factory import LoadedModel, build_core

        eos = tuple(tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids)
        loaded = LoadedModel(model_config, model, eos, engine_config, device, dtype)
        return cls(build_core(loaded, seed, lambda: tokenizer.hf), tokenizer)

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    wait_for_grammar: bool = True) -> None:
        """Queue a request; a text prompt is tokenized with the tokenizer's special tokens (e.g. BOS). A
        grammar is compiled before this returns, or with `wait_for_grammar=False` while the engine steps
        on (a grammar that fails then comes back from `take_refused`)."""
        params = params or SamplingParams()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.core.add_request(EngineRequest(request_id, tuple(prompt_ids), params), wait_for_grammar)
        self.output_processor.add_request(request_id, prompt_ids, params)

    def take_refused(self) -> list[RefusedRequest]:
        """The requests refused since the last call (grammars that failed to compile), forgotten here."""
        refused = self.core.take_refused()
        for request in refused:
            self.output_processor.abort(request.request_id)
        return refused

    def abort(self, request_id: str) -> None:
        self.core.abort([request_id])
        self.output_processor.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        outputs, stopped = self.output_processor.process(self.core.step())
        self.core.abort(stopped)
        return outputs

    def check_integrity(self) -> None:
        self.core.check_integrity()

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run `prompts` together to the end; one RequestOutput per prompt carrying its whole output."""
        params_list = params if isinstance(params, Sequence) else [params] * len(prompts)
        ids = [f"generate-{next(self._generate_ids)}" for _ in prompts]
        for request_id, prompt, request_params in zip(ids, prompts, params_list, strict=True):
            self.add_request(request_id, prompt, request_params)
        pieces: dict[str, list[RequestOutput]] = {request_id: [] for request_id in ids}
        while self.has_unfinished() and any(not p or not p[-1].finished for p in pieces.values()):
            for output in self.step():
                if output.request_id in pieces:
                    pieces[output.request_id].append(output)
        return [merge_outputs(pieces[request_id]) for request_id in ids]


def merge_outputs(pieces: Sequence[RequestOutput]) -> RequestOutput:
    """One RequestOutput holding what a stream of them said, in order."""
    last = pieces[-1]
    return RequestOutput(
        request_id=last.request_id,
        new_token_ids=tuple(t for p in pieces for t in p.new_token_ids),
        new_text="".join(p.new_text for p in pieces),
        new_logprobs=tuple(lp for p in pieces for lp in p.new_logprobs),
        finished=last.finished,
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        num_cached_tokens=pieces[0].num_cached_tokens,
        prompt_logprobs=pieces[0].prompt_logprobs,
    )
