"""The output processor: turns sequences that got a token into RequestOutputs. It owns
each request's text: incremental detokenizing, stop strings, and how much text a client
has already been sent."""

from dataclasses import dataclass

from batchpilot.server.engine.sequence import Sequence
from batchpilot.server.output.detokenizer import IncrementalDetokenizer
from batchpilot.server.output.outputs import CompletionOutput, RequestOutput
from batchpilot.server.output.stop_strings import StopChecker


@dataclass
class RequestText:
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    text: str = ""
    num_sent_chars: int = 0


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestText] = {}

    def add(self, seq: Sequence) -> None:
        detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
        self.requests[seq.request_id] = RequestText(
            detokenizer, StopChecker(seq.params.stop_strings)
        )

    def find_stop_strings(self, seqs: list[Sequence]) -> list[Sequence]:
        """Decode each sequence's new token and cut its text at a stop string.
        -> the sequences whose text hit one: they must finish with reason "stop"."""
        stopped = []
        for seq in seqs:
            if seq.finish_reason == "stop":
                continue  # a stop token (EOS or stop_token_ids) is not part of the text
            state = self.requests[seq.request_id]
            state.text += state.detokenizer.add(seq.token_ids[-1])
            if seq.num_output_tokens <= seq.params.min_tokens:
                continue  # vLLM checks stop strings only past min_tokens
            hit = state.stop_checker.find(state.text)
            if hit is not None:
                state.text = state.text[: hit[0]]
                seq.stop_reason = hit[1]
                stopped.append(seq)
        return stopped

    def discard(self, request_id: str) -> None:
        """Forget a request that ends without a final output from here."""
        self.requests.pop(request_id, None)

    def failed(self, seq: Sequence, message: str) -> RequestOutput:
        """The final output of a request the engine failed: no new text, and why."""
        self.discard(seq.request_id)
        completion = CompletionOutput(0, "", seq.output_token_ids, "", [], "abort")
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion],
                             True, seq.timings, seq.num_cached_tokens, error=message)  # fmt: skip

    def output(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        """seq's output after this step; the last one for a finished sequence."""
        finished = seq.is_finished
        state = self.requests.pop(seq.request_id) if finished else self.requests[seq.request_id]
        visible = state.text if finished else state.stop_checker.releasable(state.text)
        delta_text = visible[state.num_sent_chars :]
        state.num_sent_chars = len(visible)
        params = seq.params
        completion = CompletionOutput(
            0, visible, seq.output_token_ids, delta_text, new_tokens,
            seq.finish_reason if finished else None, seq.stop_reason if finished else None,
            seq.logprobs if params.logprobs is not None else None,
        )  # fmt: skip
        prompt_logprobs = seq.prompt_logprobs if params.prompt_logprobs is not None else None
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion],
                             finished, seq.timings, seq.num_cached_tokens,
                             prompt_logprobs=prompt_logprobs)  # fmt: skip
