"""The decoder made where and as it will run: from_hf builds LlamaDecoder with torch's
defaults (fp32 on the CPU, every parameter randomly initialized), overwrites each
parameter, then casts and moves the whole model. Inside made_in_place, the modules are
made in the serving dtype on the serving device and left uninitialized, so from_hf's copy
is the only pass over the weights (it converts on the way) and its final .to() finds
nothing to do. On 2 CPUs the random init alone took about 1 s for SmolLM2-135M.

The copies run on one thread: they are bound by memory, not arithmetic, and on a shared or
CPU-quota'd machine a descheduled OpenMP thread stalls the other at every copy's barrier
(SmolLM2-135M's from_hf: 0.44 s on one thread against 2.75 s on two, 2 CPUs at load 10)."""

import contextlib

import torch

# What nn.Linear and nn.Embedding call to initialize their parameters.
SKIPPED_INITS = ("kaiming_uniform_", "uniform_", "normal_")


def _left_as_is(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def made_in_place(dtype: torch.dtype, device: torch.device):
    """Modules made inside get dtype parameters on device, uninitialized: every one must be
    overwritten (from_hf copies each), on one thread. Process-wide while it lasts: only the
    engine's own thread may make tensors meanwhile, which is the case while it loads."""
    default, threads = torch.get_default_dtype(), torch.get_num_threads()
    inits = {name: getattr(torch.nn.init, name) for name in SKIPPED_INITS}
    torch.set_default_dtype(dtype)
    torch.set_num_threads(1)
    for name in SKIPPED_INITS:
        setattr(torch.nn.init, name, _left_as_is)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(default)
        torch.set_num_threads(threads)
        for name, init in inits.items():
            setattr(torch.nn.init, name, init)
