"""A tiny random-weight Llama with the bundled model's tokenizer, for tests and smoke
benchmarks: real architecture and real tokenizer, no download, loads in a second.

tests/ is on sys.path (pytest puts the directory of the rootdir conftest.py there, as
tests/ is no package), so tests import this as `from tiny_llama import make_tiny_llama`."""

from pathlib import Path

from batchpilot.server.model.loader import resolve_source


def make_tiny_llama(path: str | Path, seed: int = 0, model_type: str = "llama",
                    random_norms: bool = False, **config_overrides) -> str:  # fmt: skip
    """model_type: any family the decoder runs (llama, mistral, qwen2, qwen3, gemma).
    random_norms: RMSNorm weights moved off their identity init (ones; zeros for Gemma's
    1 + w), so a wrong norm formula or a norm weight left uncopied changes the tokens."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if (path / "config.json").is_file():
        return str(path)
    tokenizer = AutoTokenizer.from_pretrained(resolve_source(None)[0], local_files_only=True)
    # A wide init gives logits with clear margins, so float rounding differences between
    # batched and unbatched kernels cannot flip a greedy argmax.
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    settings.update(config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **settings))
    if random_norms:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
