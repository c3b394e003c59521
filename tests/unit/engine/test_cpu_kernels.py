"""`batchpilot kernels`: every C++ CPU kernel built ahead of time, and one that cannot
build reported, not fatal (the torch path it replaces serves)."""

import sys
import types

from batchpilot.cli import main
from batchpilot.server.platform import cpu_kernels


def fake_kernel(monkeypatch, name: str, module: object | None) -> None:
    fake = types.ModuleType(name)
    fake.load = lambda: module
    monkeypatch.setitem(sys.modules, name, fake)


def test_each_kernel_is_reported_as_its_load_left_it(monkeypatch):
    fake_kernel(monkeypatch, "fake_built", object())
    fake_kernel(monkeypatch, "fake_failed", None)
    monkeypatch.setattr(cpu_kernels, "KERNELS", {"fake_built": "a", "fake_failed": "b"})
    built = {name: ok for name, (ok, _) in cpu_kernels.build_all().items()}
    assert built == {"fake_built": True, "fake_failed": False}


def test_the_command_lists_every_kernel_and_succeeds_even_where_one_cannot_build(
    monkeypatch, capsys
):
    fake_kernel(monkeypatch, "fake_failed", None)
    kernels = {**cpu_kernels.KERNELS, "fake_failed": "nothing"}
    monkeypatch.setattr(cpu_kernels, "KERNELS", kernels)
    assert main(["kernels"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [n.rsplit(".", 1)[-1] for n in kernels]
    assert "unavailable" in lines[-1]
