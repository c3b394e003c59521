"""Faults injected into a `batchpilot serve` started with this directory on PYTHONPATH
(Python imports sitecustomize at start-up); tests/integration/test_server_step_faults.py
uses it. Production code has no hook for this: the sampler and the model runner are
monkeypatched here.

- A sequence whose request carries seed POISON_SEED raises in its sampling, wherever it
  is sampled (batched or alone): a fault pinned to one sequence.
- A step whose input holds token POISON_TOKEN raises in the forward: that step's batch
  fails.
- A step whose input holds token LATCH_TOKEN raises in the forward, and so does every
  step after it, like a device-side assert that poisons the CUDA context.
"""

import torch

from batchpilot.server.model import runner
from batchpilot.server.sampling import sampler

POISON_SEED = 424242
POISON_TOKEN = 4242
LATCH_TOKEN = 4243

_real_sample = sampler.sample
_real_forward = runner.ModelRunner._forward
_latched = []


def _faulty_sample(logits, seqs, logprobs_mode="raw_logprobs"):
    if any(seq.params.seed == POISON_SEED for seq in seqs):
        raise RuntimeError("injected sampling fault")
    return _real_sample(logits, seqs, logprobs_mode)


def _faulty_forward(self, input_ids: torch.Tensor, *args, **kwargs):
    if (input_ids == LATCH_TOKEN).any():
        _latched.append(True)
    if _latched or (input_ids == POISON_TOKEN).any():
        raise RuntimeError("injected forward fault")
    return _real_forward(self, input_ids, *args, **kwargs)


sampler.sample = _faulty_sample
runner.ModelRunner._forward = _faulty_forward
