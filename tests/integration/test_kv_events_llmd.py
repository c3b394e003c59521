"""A real engine's KV events read by llm-d's own indexer (llm-d-kv-cache v0.9.0: its ZMQ
subscriber, vLLM event adapter, event pool and in-memory index, in
tests/k8s/tools/llmd-kvevents, which `make k8s-bins` builds): the index learns which
replica holds a prompt's blocks from the engine's BlockStored events, keyed by llm-d's own
hashes of their token ids, and forgets them from its BlockRemoved events."""

import itertools
import json
import subprocess

import pytest

from batchpilot.server.engine.core import EngineCore
from batchpilot.server.engine.llm_engine import LLMEngine
from batchpilot.server.kv.block_pool import block_digest
from tests.k8s import cluster as k8s_cluster
from tests.support.engine import BLOCK_BYTES_TINY, run_to_completion
from tests.support.wait import wait_for

pytestmark = pytest.mark.cluster  # the harness is among the binaries `make k8s-bins` builds

BLOCK = 16  # the engine's default block size, which the indexer must be told
MODEL, POD = "tiny", "pod-a"
HELD = f"{POD}@gpu"  # llm-d's PodEntry for the engine's own KV tier


class Indexer:
    """The llm-d harness process: binds a SUB endpoint, answers lookups on stdin."""

    def __init__(self, binary: str, endpoint: str):
        self.process = subprocess.Popen(
            [binary, "-endpoint", endpoint, "-block-size", str(BLOCK)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.process.stdout.readline().strip() == "ready"

    def holders(self, tokens: list[int]) -> list[list[str] | None]:
        """For each full block of tokens, the pods llm-d's index says hold it."""
        self.process.stdin.write(json.dumps({"model": MODEL, "tokens": tokens}) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())["pods"]


@pytest.fixture
def indexed_engine(tiny_path):
    binary = k8s_cluster.bin_dir() / "llmd-kvevents"
    if not binary.is_file():
        pytest.fail(f"{binary} is missing: run `make k8s-bins`", pytrace=False)
    endpoint = f"tcp://127.0.0.1:{k8s_cluster.free_port()}"
    indexer = Indexer(str(binary), endpoint)
    # 12 blocks of KV: a third 5-block prompt evicts the first one's blocks.
    engine = LLMEngine(model=tiny_path, dtype="float32", max_model_len=96,
                       kv_cache_memory_bytes=12 * BLOCK_BYTES_TINY,
                       kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint,
                                         "topic": f"kv@{POD}@{MODEL}"})  # fmt: skip
    core = EngineCore(engine)
    yield core, indexer
    core.close()
    indexer.process.kill()
    indexer.process.wait()


def generate(core: EngineCore, prompt: list[int], ids=itertools.count()) -> None:
    run_to_completion(core, f"r{next(ids)}", prompt)


def connected(core: EngineCore, indexer: Indexer) -> None:
    """Batches published before the PUB socket's connection is up are lost (a subscriber
    that cares asks the replay endpoint): one-block prompts until one of them is indexed."""
    sent = []

    def one_more_and_any_indexed() -> bool:
        sent.append([len(sent) + 1] * (BLOCK + 1))
        generate(core, sent[-1])
        return any(indexer.holders(prompt)[0] for prompt in sent)

    wait_for("the indexer to see a first event", one_more_and_any_indexed)


def test_llmds_index_learns_a_prompts_blocks_and_forgets_them_when_evicted(indexed_engine):
    core, indexer = indexed_engine
    connected(core, indexer)
    prompt = list(range(1000, 1000 + 5 * BLOCK))
    generate(core, prompt)
    wait_for("llm-d to index all five blocks",
             lambda: indexer.holders(prompt) == [[HELD]] * 5)  # fmt: skip
    # A prompt sharing the first two blocks: llm-d finds exactly those on this replica.
    sharing = prompt[: 2 * BLOCK] + list(range(2000, 2000 + 3 * BLOCK))
    assert indexer.holders(sharing)[:2] == [[HELD], [HELD]]
    assert not any(indexer.holders(sharing)[2:])
    # Newer prompts evict the first one's blocks, tail first: at each point llm-d's view
    # of the prompt comes to match the engine's own prefix cache, until it is all gone.
    for base in range(3000, 8000, 1000):  # three suffice: 12 blocks, 6 a prompt
        generate(core, list(range(base, base + 5 * BLOCK)))
        expected = engine_view(core, prompt)
        wait_for(f"llm-d to see {expected}", lambda want=expected: indexer.holders(prompt) == want)
        if expected == [None] * 5:
            break
    assert expected == [None] * 5, "the newer prompts never evicted the first one"
    assert indexer.holders(list(range(base, base + 5 * BLOCK))) == [[HELD]] * 5


def engine_view(core: EngineCore, tokens: list[int]) -> list[list[str] | None]:
    """What llm-d's lookup should answer for tokens, from the engine's own prefix cache:
    the replica for each block while every block up to it is cached (a lookup stops at
    the first miss)."""
    pool, view, parent = core.engine.kv_manager.pool, [], None
    for i in range(len(tokens) // BLOCK):
        parent = block_digest(parent, tokens[i * BLOCK : (i + 1) * BLOCK])
        cached = parent in pool.cached and (not view or view[-1] is not None)
        view.append([HELD] if cached else None)
    return view
