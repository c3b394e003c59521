"""Up to max_loras adapters in device tensors, and the step-time products.

Each fused projection of each layer has one A stack [S, P*R, d_in] holding the P PEFT
modules fused into it (q, k, v into qkv_proj), zero-padded to rank R. B, scaled by
lora_alpha / r, is laid out for the path that reads it. A step's rows each carry a slot
(-1: the base model alone):
- on CPU, B is block-diagonal over the modules. cpu_lora.py's kernel reads each row's
  own slot (float32 stacks, B as [S, P*R, d_out]) in one call per projection and skips
  base-model rows. Where it cannot be built, one matmul shrinks every row against every
  slot's A, a 0/1 row-by-slot mask keeps each row's own slot, and one matmul expands
  through B as [d_out, S*P*R]: no loop over rows, adapters or modules, since gathering
  per row costs more than these small matmuls' arithmetic;
- on GPUs the BGMV-style Triton kernels gather each row's slot (B [S, d_out, R] per
  module).
Slots keep their adapter between steps (least recently used goes first), so an adapter
is copied in only when a step needs it and it is not resident."""

from collections import OrderedDict
from dataclasses import dataclass

import torch

from batchpilot.server.lora import cpu_lora
from batchpilot.server.lora.adapter import LoRAAdapter

# Fused projection of the decoder -> the PEFT modules it holds, in its output order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}  # fmt: skip


def module_shapes(model) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (d_in, d_out) of a LlamaDecoder's projections."""
    layer = model.layers[0]
    q, kv, _ = layer.splits
    hidden = layer.qkv_proj.in_features
    inter = layer.down_proj.in_features
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}  # fmt: skip


@dataclass
class LoRABatch:
    """The adapters of one step's rows, handed to every layer."""

    slots: "LoRASlots"
    row_slots: torch.Tensor  # [n] long, -1 for base-model rows
    # CPU torch path: modules fused (P) -> [n, S*P*R], 1 in the columns of the row's own
    # slot (empty where the GPU kernels or cpu_lora's kernel read row_slots instead)
    masks: dict[int, torch.Tensor]

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> None:
        """y += each row's adapter product for the fused projection proj of layer."""
        self.slots.add(y, x, layer, proj, self)


class LoRASlots:
    def __init__(self, num_layers: int, shapes: dict[str, tuple[int, int]], max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device,
                 use_triton: bool, cpu_kernel: bool | None = None):  # fmt: skip
        """cpu_kernel: cpu_lora's kernel on CPU (None: where it builds)."""
        self.num_slots, self.rank = max_loras, max_rank
        self.dtype, self.device = dtype, device
        self.gpu = use_triton
        if cpu_kernel is None:
            cpu_kernel = cpu_lora.usable(dtype, device)
        self.kernel = not use_triton and cpu_kernel
        # The kernel reads float32 stacks (holding values rounded to dtype): see cpu_lora.
        self.store_dtype = torch.float32 if self.kernel else dtype
        self.d_out = {proj: [shapes[m][1] for m in modules] for proj, modules in FUSED.items()}
        # cpu_lora's kernel: each module's first output column, and the end
        self.bounds = {proj: [sum(outs[:p]) for p in range(len(outs) + 1)]
                       for proj, outs in self.d_out.items()}  # fmt: skip
        self.a = [{proj: self._zeros(self.num_slots, len(modules) * max_rank,
                                     shapes[modules[0]][0])
                   for proj, modules in FUSED.items()} for _ in range(num_layers)]  # fmt: skip
        self.b = [{proj: self._new_b(proj) for proj in FUSED} for _ in range(num_layers)]
        # adapter.cache_root (unique to one load) -> slot, least recently used first
        self.resident: OrderedDict[bytes, int] = OrderedDict()
        self.free = list(range(max_loras))

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.store_dtype, device=self.device)

    def _new_b(self, proj: str) -> torch.Tensor | list[torch.Tensor]:
        outs = self.d_out[proj]
        if self.gpu:
            return [self._zeros(self.num_slots, d_out, self.rank) for d_out in outs]
        if self.kernel:
            return self._zeros(self.num_slots, len(outs) * self.rank, sum(outs))
        return self._zeros(sum(outs), self.num_slots, len(outs) * self.rank)

    def batch(self, row_adapters: list[LoRAAdapter | None]) -> LoRABatch | None:
        """The step's rows (one adapter or None each) -> their batch, making every adapter
        they name resident; None when no row has one. At most num_slots distinct adapters:
        the scheduler admits no more."""
        distinct = {a.cache_root: a for a in row_adapters if a is not None}
        if not distinct:
            return None
        slot_of = {key: self._make_resident(a, distinct) for key, a in distinct.items()}
        rows = [slot_of[a.cache_root] if a is not None else -1 for a in row_adapters]
        row_slots = torch.tensor(rows, dtype=torch.long, device=self.device)
        masks = {}
        if not (self.gpu or self.kernel):
            columns = torch.arange(self.num_slots, device=self.device)
            mask = (row_slots[:, None] == columns).to(self.dtype)
            for parts in {len(m) for m in FUSED.values()}:
                width = parts * self.rank
                masks[parts] = mask.repeat_interleave(width, dim=1)
        return LoRABatch(self, row_slots, masks)

    def _make_resident(self, adapter: LoRAAdapter, needed: dict[bytes, LoRAAdapter]) -> int:
        key = adapter.cache_root
        if key in self.resident:
            self.resident.move_to_end(key)
            return self.resident[key]
        if self.free:
            slot = self.free.pop()
        else:
            victim = next(k for k in self.resident if k not in needed)
            slot = self.resident.pop(victim)
        self._write(slot, adapter)
        self.resident[key] = slot
        return slot

    def holds(self, adapter: LoRAAdapter) -> bool:
        """Whether adapter is in a slot: a step with it copies nothing."""
        return adapter.cache_root in self.resident

    def forget(self, adapter: LoRAAdapter) -> None:
        """Free an unloaded adapter's slot."""
        slot = self.resident.pop(adapter.cache_root, None)
        if slot is not None:
            self.free.append(slot)

    @torch.no_grad()
    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        r = self.rank
        for layer, (a_stacks, b_stacks) in enumerate(zip(self.a, self.b, strict=True)):
            for proj, modules in FUSED.items():
                a = a_stacks[proj][slot]
                a.zero_()
                row = 0  # the module's first output row in the fused projection
                for p, (module, d_out) in enumerate(zip(modules, self.d_out[proj], strict=True)):
                    b = self._b_block(b_stacks[proj], slot, p, row, d_out)
                    b.zero_()
                    row += d_out
                    pair = adapter.weights.get((layer, module))
                    if pair is None:
                        continue
                    a_m, b_m = pair
                    k = a_m.shape[0]
                    a[p * r : p * r + k].copy_(a_m.to(self.dtype))
                    b[:, :k].copy_(b_m.to(self.dtype))

    def _b_block(self, b_stack, slot: int, p: int, row: int, d_out: int) -> torch.Tensor:
        """Module p's [d_out, R] block of slot's B, whose outputs start at row."""
        r = self.rank
        if self.gpu:
            return b_stack[p][slot]
        if self.kernel:  # block-diagonal, transposed: [S, P*R, outputs]
            return b_stack[slot, p * r : (p + 1) * r, row : row + d_out].T
        return b_stack[row : row + d_out, slot, p * r : (p + 1) * r]  # block-diagonal

    def add(self, y, x, layer: int, proj: str, batch: LoRABatch) -> None:
        a, b = self.a[layer][proj], self.b[layer][proj]
        if self.gpu:
            self._add_triton(y, x, a, b, batch.row_slots)
        elif self.kernel:
            cpu_lora.load().lora_bgmv(y, x.contiguous(), a, b, batch.row_slots,
                                      self.bounds[proj], self.rank)  # fmt: skip
        else:
            s, pr, d_in = a.shape
            mask = batch.masks[pr // self.rank]
            h = torch.nn.functional.linear(x, a.view(s * pr, d_in)).mul_(mask)
            y += torch.nn.functional.linear(h, b.view(b.shape[0], s * pr))

    def _add_triton(self, y, x, a, b: list[torch.Tensor], row_slots: torch.Tensor) -> None:
        # Imported here so that servers without Triton kernels never load them.
        from batchpilot.server.lora.triton_lora import lora_expand, lora_shrink

        h = lora_shrink(x, a, row_slots)
        offset = 0
        for p, b_p in enumerate(b):
            h_p = h[:, p * self.rank : (p + 1) * self.rank]
            lora_expand(y, h_p, b_p, row_slots, offset)
            offset += b_p.shape[1]
