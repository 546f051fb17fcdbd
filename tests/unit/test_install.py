"""What each entry point installs and needs: scripts/setup.sh installs the extra set it is
asked for (run.sh: no test tools; test.sh: with them, even after run.sh), and only a
prefill or decode instance needs NIXL."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvduplex.cli.main import main

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for .venv/bin/python: torch is "installed"; records what pip is asked for.
if [[ "$1" == "-c" ]]; then exit 0; fi
echo "$*" >> "$(dirname "$0")/../pip.log"
"""


@pytest.fixture()
def checkout(tmp_path: Path) -> Path:
    """A copy of the scripts and pyproject.toml, with a fake .venv."""
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return tmp_path


def _setup(checkout: Path, *args: str, env: dict[str, str] | None = None) -> list[str]:
    """Run setup.sh; the pip installs it asked for."""
    log = checkout / ".venv" / "pip.log"
    log.unlink(missing_ok=True)
    run_env = {k: v for k, v in os.environ.items() if k != "KVDUPLEX_EXTRAS"}
    subprocess.run(
        ["bash", str(checkout / "scripts" / "setup.sh"), *args],
        check=True, env={**run_env, **(env or {})}, capture_output=True, timeout=60,
    )  # fmt: skip
    return log.read_text().splitlines() if log.exists() else []


def test_run_sh_installs_no_test_tools_and_test_sh_then_adds_them(checkout: Path) -> None:
    run_sh = (checkout / "scripts" / "run.sh").read_text()
    test_sh = (checkout / "scripts" / "test.sh").read_text()
    assert "setup.sh nixl,bench\n" in run_sh and "setup.sh nixl,bench,dev,store\n" in test_sh
    assert _setup(checkout, "nixl,bench") == [
        "-m pip install --disable-pip-version-check -q -e .[nixl,bench]"
    ]
    assert _setup(checkout, "nixl,bench") == []  # nothing changed: only checks
    assert _setup(checkout, "nixl,bench,dev") == [
        "-m pip install --disable-pip-version-check -q -e .[nixl,bench,dev]"
    ]
    assert _setup(checkout, "nixl,bench,dev") == []
    os.utime(checkout / "pyproject.toml", (2e9, 2e9))  # a changed pyproject reinstalls
    assert len(_setup(checkout, "nixl,bench")) == 1


def test_setup_takes_its_extras_from_the_environment_too(checkout: Path) -> None:
    assert _setup(checkout, env={"KVDUPLEX_EXTRAS": "nixl"}) == [
        "-m pip install --disable-pip-version-check -q -e .[nixl]"
    ]
    assert _setup(checkout)[0].endswith(".[nixl,bench]")  # the default
    with pytest.raises(subprocess.CalledProcessError):
        _setup(checkout, "nixl; rm -rf /")


def test_the_dev_extra_holds_the_test_tools_and_bench_the_plots() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = " ".join(project["dependencies"])
    extras = project["optional-dependencies"]
    for tool in ("pytest", "mypy", "ruff", "schemathesis", "hypothesis", "openai", "matplotlib"):
        assert tool not in runtime
    assert any(d.startswith("matplotlib") for d in extras["bench"])
    assert not any(d.startswith("matplotlib") for d in extras["dev"])


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_prefill_and_decode_without_nixl_exit_2_and_say_so(
    role: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("kvduplex.transport.nixl_agent.nixl_available", lambda: False)
    monkeypatch.setattr("kvduplex.instance.server.serve", lambda *a: pytest.fail("served"))
    with pytest.raises(SystemExit) as info:
        main(["serve", "--role", role])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"--role {role} needs NIXL" in err and "kvduplex[nixl]" in err


def test_colocated_instances_and_the_router_do_not_import_nixl() -> None:
    code = (
        "import sys\n"
        "sys.modules['nixl'] = sys.modules['nixl_cu12'] = None  # not importable\n"
        "from kvduplex.cli.main import require_transport\n"
        "from kvduplex.common.config import Role\n"
        "require_transport(Role.BOTH)\n"
        "import kvduplex.router.app, kvduplex.instance.server\n"
        "from kvduplex.transport.nixl_agent import nixl_available\n"
        "assert not nixl_available()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
