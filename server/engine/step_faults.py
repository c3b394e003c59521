"""What a failed engine step raises, and how many failed steps in a row end the engine.

Torch-free, so the server's event-loop side can name them without importing the engine.
"""

# One failed step fails its batch and the engine goes on. A fault that outlives its batch
# (a device-side assert poisons every later CUDA call) fails every step after it: after
# this many in a row the engine is dead, /health answers 503 and the kubelet restarts the
# pod. A step that succeeds in between resets the count.
MAX_CONSECUTIVE_STEP_FAILURES = 3


class StepFailed(RuntimeError):
    """A step raised (its __cause__). The engine has failed the requests of its batch and
    is consistent again; outputs holds what the step returns, their error outputs too."""

    def __init__(self, outputs: list):
        super().__init__("an engine step failed")
        self.outputs = outputs
