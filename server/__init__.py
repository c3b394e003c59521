"""batchpilot.server: the continuous-batching engine and its OpenAI-compatible API.

`LLM` and `SamplingParams` import lazily so that light modules (config, names) stay
importable without torch.
"""

__all__ = ["LLM", "EngineConfig", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":
        from batchpilot.server.llm import LLM

        return LLM
    if name == "SamplingParams":
        from batchpilot.server.sampling.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from batchpilot.server.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
