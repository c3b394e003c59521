"""The continuous-batching engine (llm_engine: LLMEngine, built by parts, stepping its
scheduler, sequences and stats) and how the API runs it: one turn at a time (core), on
a thread of the server's process (async_engine) or in a process of its own
(engine_process), both behind the EngineClient interface (client)."""
