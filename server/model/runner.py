"""Turns one scheduler decision into one forward pass: the step's tokens are flattened
(decodes first, then prefill chunks) with per-token positions and slots, and logits
are computed only where a sequence will sample."""

import torch

from batchpilot.server.attention.metadata import build_metadata
from batchpilot.server.kv.cache import KVCache
from batchpilot.server.model.llama import LlamaDecoder
from batchpilot.server.sampler import sample
from batchpilot.server.sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaDecoder, kv: KVCache, block_size: int, device):
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]) -> dict[int, int]:
        """-> {id(seq): sampled token} for the sequences whose uncomputed tokens are
        all computed this step."""
        # Decodes first, shortest context first, so attention can bucket them by length.
        ordered = sorted(
            scheduled,
            key=lambda item: (item[1] > 1 or item[0].is_prefill, item[0].num_computed_tokens),
        )
        num_decodes = sum(1 for seq, n in ordered if n == 1 and not seq.is_prefill)
        input_ids, positions, logits_index, samplers = [], [], [], []
        for seq, n in ordered:
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            if start + n == seq.num_tokens:
                logits_index.append(len(input_ids) - 1)
                samplers.append(seq)
        meta = build_metadata(
            [(seq.block_table, seq.num_computed_tokens, n) for seq, n in ordered],
            num_decodes,
            self.block_size,
            self.model.lm_head.weight.dtype,
            self.device,
        )
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        logits = self.model(
            as_tensor(input_ids), as_tensor(positions), self.kv, meta, as_tensor(logits_index)
        )
        tokens = sample(logits, [s.params for s in samplers], [s.generator for s in samplers])
        return {id(seq): tok for seq, tok in zip(samplers, tokens, strict=True)}
