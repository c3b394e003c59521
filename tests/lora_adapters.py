"""PEFT LoRA adapters made in the test, for a base model directory: random, non-zero
weights (init_lora_weights=False), saved as PEFT saves them. Nothing downloads.

tests/ is on sys.path, so tests import this as `from lora_adapters import make_adapter`."""

from pathlib import Path

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
