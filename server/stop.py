"""Stop strings: found in the decoded text as it grows, which is then cut before the
stop string. While streaming, the last len(longest stop) - 1 characters are held back
so a client never sees the start of a stop string that later completes."""


class StopChecker:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.checked = 0

    def truncate(self, seq) -> bool:
        if not self.stops:
            return False
        text = seq.text
        start = max(0, self.checked - self.longest + 1)
        self.checked = len(text)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        if not hits:
            return False
        seq.text = text[: min(hits)]
        return True

    def releasable(self, text: str) -> str:
        return text[: len(text) - self.longest + 1] if self.longest > 1 else text
