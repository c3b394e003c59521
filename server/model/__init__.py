"""Model loading and the Llama-family decoder that runs on the paged KV cache."""

from batchpilot.server.model.bundled import BundledModelMissing, bundled_model_path

__all__ = ["BundledModelMissing", "bundled_model_path"]
