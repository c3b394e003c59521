"""Stop strings, searched in the decoded text as it grows. While streaming, the last
len(longest stop) - 1 characters are held back so a client never sees the start of a
stop string that later completes."""


class StopChecker:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.checked = 0  # text before this offset held no stop string

    def find(self, text: str) -> tuple[int, str] | None:
        """(where text must be cut, the stop string found there) for the earliest stop
        string, or None."""
        if not self.stops:
            return None
        start = max(0, self.checked - self.longest + 1)
        self.checked = len(text)
        hits = [(i, stop) for stop in self.stops if (i := text.find(stop, start)) >= 0]
        return min(hits) if hits else None

    def releasable(self, text: str) -> str:
        return text[: len(text) - self.longest + 1] if self.longest > 1 else text
