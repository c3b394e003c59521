"""The seed document's workload: "请解释一下" + "机器学习" * k for k in {1, 5, 20, 50}, plus
English prompts of similar spread, each with an exact output length (EOS is ignored)."""

import random
from dataclasses import dataclass

SEED_REPEATS = (1, 5, 20, 50)
DEFAULT_OUTPUT_LENS = (16, 32, 64, 128)
ENGLISH_PROMPTS = (
    "Explain what a KV cache is.",
    "Summarize the history of the transformer architecture in a few paragraphs, covering "
    "attention, positional encodings and the shift from recurrent networks.",
    "Write a short story about a lighthouse keeper who discovers that the light has been "
    "signalling to ships that no longer exist. " * 3,
    "List the trade-offs between static batching and continuous batching for a language "
    "model server, considering latency, throughput, memory and fairness. " * 6,
)


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    output_len: int


def seed_prompt(repeats: int) -> str:
    return "请解释一下" + "机器学习" * repeats


def make_workload(
    num_prompts: int,
    seed: int,
    output_lens: tuple[int, ...] = DEFAULT_OUTPUT_LENS,
    repeats: tuple[int, ...] = SEED_REPEATS,
) -> list[BenchRequest]:
    """Half Chinese seed prompts, half English ones, output lengths drawn from output_lens;
    the same seed gives the same list, so every system in a run sees identical requests."""
    if num_prompts < 1 or not output_lens or not repeats:
        raise ValueError("need at least one prompt, one output length and one repeat count")
    rng = random.Random(seed)
    pool = [seed_prompt(k) for k in repeats] + list(ENGLISH_PROMPTS)
    return [
        BenchRequest(prompt=rng.choice(pool), output_len=rng.choice(output_lens))
        for _ in range(num_prompts)
    ]


def parse_int_list(text: str) -> tuple[int, ...]:
    """'16,32,64' -> (16, 32, 64)."""
    values = tuple(int(v) for v in text.split(",") if v.strip())
    if not values or min(values) < 1:
        raise ValueError(f"expected a comma-separated list of positive integers, got {text!r}")
    return values
