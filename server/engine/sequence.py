"""A request's sequence and its states:
WAITING -> RUNNING -> FINISHED, with RUNNING -> SWAPPED -> RUNNING (swap preemption)
and RUNNING -> PREEMPTED -> RUNNING (recompute preemption: re-prefilled from WAITING)."""

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchpilot.server.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:  # these import torch; the API and scheduler modules must not
    from batchpilot.server.lora.adapter import LoRAAdapter
    from batchpilot.server.sampling.logprobs import PromptLogprobs, SampleLogprobs


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class Timings:
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        generator=None,
        lora: "LoRAAdapter | None" = None,
        lora_name: str | None = None,
    ):
        """generator: the torch.Generator this request samples from (unused when greedy);
        lora: the adapter it runs with (None: the base model, or an adapter lora_name names
        that is not loaded yet: the engine binds it once loaded, before admitting it)."""
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.token_ids = list(prompt_token_ids)  # prompt then output
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or string that ended it
        self.logprobs: SampleLogprobs = []  # one per output token, when params.logprobs is set
        # One per prompt token scored so far, when params.prompt_logprobs is set; nothing
        # predicts the first token, hence its None.
        self.prompt_logprobs: PromptLogprobs = [None]
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained digests of the full blocks computed
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        self.cpu_block_table: list[int] = []  # while SWAPPED
        self.num_preemptions = 0
        self.timings = Timings() if arrival_time is None else Timings(arrival_time)
        self.generator = generator
        self.lora = lora
        self.lora_name = lora.name if lora is not None else lora_name
        # Requests admitted ahead of it while its adapter could not run (scheduler.py).
        self.lora_overtaken = 0

    @property
    def cache_root(self) -> bytes | None:
        """The parent of its first KV block's key: its adapter's, so that no block is
        shared across adapters or with the base model."""
        return self.lora.cache_root if self.lora is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
