"""A progress bar while the model loads. The loader reports no stages, so the bar shows
elapsed time and ticks until loading ends; on a terminal it redraws in place, in a log
(not a TTY) it writes a line every few seconds."""

import contextlib
import sys
import threading

from tqdm import tqdm


@contextlib.contextmanager
def loading_progress(model: str, tick_seconds: float = 0.5):
    interactive = sys.stderr.isatty()
    done = threading.Event()
    bar = tqdm(desc=f"Loading {model}", unit="tick", bar_format="{desc}: {elapsed}",
               mininterval=tick_seconds if interactive else 5.0, file=sys.stderr)  # fmt: skip

    def tick():
        while not done.wait(tick_seconds):
            bar.update(1)

    ticker = threading.Thread(target=tick, name="loading-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        bar.close()
