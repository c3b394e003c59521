"""batchpilot: a Kubernetes operator for LLM inference and the continuous-batching server it runs."""

__version__ = "0.1.0"
