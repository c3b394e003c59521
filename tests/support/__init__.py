"""What test modules share, by concern: waiting (wait.py), tiny models and LoRA adapters
made in the test (models.py), a real `batchpilot serve` on 127.0.0.1 (servers.py), the
operator against the loopback control plane (cluster.py) and the kind tier (kind.py).

Test modules import from here (`from tests.support.wait import wait_for`: pytest puts the
repository root on sys.path), never from one another; tests/unit/test_test_layout.py
checks that. Fixtures shared by many modules live in conftest.py files, built on these."""
