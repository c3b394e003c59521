"""A progress bar while the model loads: one step per engine load stage, with the
elapsed time. On a terminal it redraws in place; in a log (not a TTY) tqdm writes at most
one line every few seconds."""

import contextlib
import sys

from tqdm import tqdm

from batchpilot.server.model.loader import LOAD_STAGES


@contextlib.contextmanager
def loading_progress(model: str):
    """Yields on_stage(name) for LLMEngine(on_stage=...)."""
    bar = tqdm(
        total=len(LOAD_STAGES),
        desc=f"Loading {model}",
        bar_format="{desc} |{bar:20}| {n_fmt}/{total_fmt} [{elapsed}]",
        mininterval=0.1 if sys.stderr.isatty() else 5.0,
        file=sys.stderr,
    )
    started = False

    def on_stage(name: str) -> None:
        nonlocal started
        if started:
            bar.update(1)
        started = True
        bar.set_description_str(f"Loading {model}: {name}")

    try:
        yield on_stage
        bar.update(bar.total - bar.n)
        bar.set_description_str(f"Loading {model}: ready")
    finally:
        bar.close()
