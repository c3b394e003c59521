"""Models made in the test, nothing downloaded: a tiny random-weight Llama with the bundled
model's tokenizer (real architecture and tokenizer, loads in a second), and PEFT LoRA
adapters for a base model directory (random, non-zero weights: init_lora_weights=False,
saved as PEFT saves them), with transformers' greedy continuation to compare against."""

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


ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base: str, path: str | Path, rank: int = 8, seed: int = 0,
                 modules: tuple[str, ...] = ALL_MODULES, alpha: int | None = None,
                 **config) -> str:  # fmt: skip
    """An adapter of the given rank over every module named, saved to path."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if (path / "adapter_config.json").is_file():
        return str(path)
    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True,
                                                 dtype=torch.float32)  # fmt: skip
    torch.manual_seed(seed)
    lora = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=list(modules),
                      init_lora_weights=False, **config)  # fmt: skip
    get_peft_model(model, lora).save_pretrained(path)
    return str(path)


def peft_greedy(base: str, adapter: str | None, prompt_ids: list[int], max_tokens: int,
                merged: bool = False) -> list[int]:  # fmt: skip
    """transformers (+ PEFT) greedy continuation, EOS not stopping, in float32."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True,
                                                 dtype=torch.float32)  # fmt: skip
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
        if merged:
            model = model.merge_and_unload()
    ids = torch.tensor([prompt_ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_tokens, eos_token_id=None)  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()
