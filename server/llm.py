"""LLM: the offline API, shaped like vLLM's."""

import dataclasses

from tqdm import tqdm

from batchpilot.server.config import EngineConfig
from batchpilot.server.engine.llm_engine import LLMEngine
from batchpilot.server.engine.stats import EngineStats
from batchpilot.server.output.outputs import RequestOutput
from batchpilot.server.sampling.sampling_params import SamplingParams

Prompt = str | list[int] | dict


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def add_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter directory under name (needs enable_lora=True)."""
        self.engine.add_lora(name, path)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody holds, as vLLM's LLM.reset_prefix_cache."""
        self.engine.kv_manager.pool.reset_prefix_cache()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora: str | list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """lora: an adapter loaded with add_lora for every prompt, or one per prompt (None:
        the base model); vLLM passes a LoRARequest in its place."""
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(params) != len(prompts) or len(loras) != len(prompts):
            raise ValueError("sampling_params and lora must be one value or one per prompt")
        order: list[tuple[int, int]] = []
        for i, (prompt, p, name) in enumerate(zip(prompts, params, loras, strict=True)):
            if isinstance(prompt, dict):
                prompt = prompt.get("prompt_token_ids") or prompt["prompt"]
            for j in range(p.n):
                sub = p if p.n == 1 or p.seed is None else _with_seed(p, p.seed + j)
                self.engine.add_request(f"offline-{i}-{j}", prompt, sub, lora_name=name)
                order.append((i, j))
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(order), desc="generate", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.error is not None:
                        raise RuntimeError(f"request {out.request_id}: {out.error}")
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return _merge(finished, order, len(prompts))


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, seed=seed)


def _merge(finished: dict[str, RequestOutput], order, num_prompts: int) -> list[RequestOutput]:
    results: list[RequestOutput | None] = [None] * num_prompts
    for i, j in order:
        out = finished[f"offline-{i}-{j}"]
        out.outputs[0].index = j
        if results[i] is None:
            out.request_id = str(i)
            results[i] = out
        else:
            results[i].outputs.append(out.outputs[0])
    return results
