"""The HTTP layer: FastAPI app, OpenAI protocol, metrics and admin API."""
