"""The engine as a library, in one process: tokenize and validate, step the core, return outputs."""

from __future__ import annotations

from pathlib import Path

from ember.engine.config import EngineConfig
from ember.engine.core import EngineCore
from ember.engine.input_processor import InputProcessor, PromptType
from ember.engine.output_processor import OutputProcessor
from ember.engine.request import RequestStatus
from ember.models.config import ModelConfig
from ember.outputs import RequestOutput
from ember.sampling_params import SamplingParams
from ember.tokenizer.tokenizer import Tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if not Path(config.model).is_dir():
            raise FileNotFoundError(f"model directory {config.model!r} does not exist")
        # Cheap checks first: a bad config or tokenizer should fail before weights load.
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.core = EngineCore(config, self.model_config)
        self.max_model_len = self.core.resolved.max_model_len
        self.inputs = InputProcessor(
            self.tokenizer, self.model_config.vocab_size, self.max_model_len
        )
        self.processor = OutputProcessor(self.tokenizer)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> None:
        if request_id in self.processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        state, core_reqs = self.inputs.process(request_id, prompt, params, cache_salt)
        self.processor.add_request(state)
        try:
            for r in core_reqs:
                self.core.add_request(r)
        except Exception:
            self.abort_request(request_id)
            raise

    def abort_request(self, request_id: str) -> None:
        children = self.processor.child_ids(request_id)
        self.processor.abort_request(request_id)
        self.core.abort_requests(children)

    def close(self) -> None:
        """Stop the core's background work; KV tiers write out what they queued first."""
        self.core.close()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine step; the requests it advanced (only those it finished with `final_only`)."""
        outputs, to_stop = self.processor.process(self.core.step(), final_only)
        if to_stop:
            self.core.abort_requests(to_stop, RequestStatus.FINISHED_STOPPED)
        return outputs
