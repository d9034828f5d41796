"""gpu_check's kit for a GPU machine that reaches no registry: its device command, and every check imported in that
machine's Python 3.12 image with the kit's wheels on top (skipped, naming the commands, where either is missing)."""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from ebrl.bench.gpu_check import PARTS
from ebrl.bench.gpu_kit import CARRIED, LOADERS, check_command, device_command
from ebrl.envs.setup import benchmark_python

KIT = Path(os.environ.get("EBRL_GPU_KIT") or Path(__file__).resolve().parents[2] / ".kit")


def test_each_part_fits_one_device_command():
    for part in PARTS:
        assert len(device_command(".kit", part)) <= 2000  # (the device tool's limit on a command)


def test_every_check_imports_on_the_gpu_machines_image_with_the_kit(tmp_path):
    """The device command's Python half, run here in a venv like the GPU machine's image (Python 3.12, torch 2.11) with
    the kit's wheels installed as it installs them: each check imports what it needs, then skips for want of CUDA
    (the run check for want of robosuite, which the kit cannot carry); the kit's hydra composes our configs and its
    MuJoCo renders through EGL; the loader packages hold the libraries the device tool's recipe names."""
    python = benchmark_python("gpu-image")
    if python is None or not (KIT / "whl").is_dir():
        pytest.skip(
            "needs the GPU image's venv and the kit: python -m ebrl.envs.setup gpu-image && "
            "python -m ebrl.bench.gpu_check --kit .kit"
        )
    repo = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}",
        "TMPDIR": str(tmp_path),
        "OUT": str(tmp_path / "out"),
        "PYTHONPATH": "",
    }
    (tmp_path / "out").mkdir()
    site = "${TMPDIR:-/tmp}/ebrl-site"
    for part, names in PARTS.items():
        done = subprocess.run(
            ["bash", "-c", check_command(str(KIT), part, site, f"$OUT/gpu_check_part{part}")],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        figures = json.loads((tmp_path / "out" / f"gpu_check_part{part}.json").read_text())
        assert list(figures) == list(names)
        for name, result in figures.items():
            assert result["status"] == "SKIP", (name, result)
            expected = "robosuite not installed" if name == "run" else "no CUDA device"
            assert result["reason"].startswith(expected), (name, result)
    installed = {p.name.split("-")[0].lower() for p in (tmp_path / "ebrl-site").glob("*.dist-info")}
    assert installed == {name.replace("-", "_") for name in CARRIED}
    site_env = {**env, "PYTHONPATH": str(tmp_path / "ebrl-site")}
    code = (
        "from ebrl.bench.memory import compose; import hydra, torch, sys; cfg = compose('policy.preset=small'); "
        "print(cfg.policy.preset, torch.__version__, sys.version_info[:2], hydra.__file__)"
    )
    done = subprocess.run(
        [str(python), "-c", code], cwd=repo, env=site_env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[:2] == ["small", "2.11.0+cu130"] and str(tmp_path / "ebrl-site") in done.stdout
    if ctypes.util.find_library("EGL") is not None:  # (python -m ebrl.install brings Mesa's EGL here)
        from ebrl.bench.gpu_check import RENDER

        done = subprocess.run(
            [str(python), "-c", RENDER.replace("time.sleep(8)", "")],
            cwd=repo,
            env=site_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.stdout.startswith("READY "), done.stderr[-2000:]
    gl = tmp_path / "gl"
    for deb in sorted((KIT / "deb").glob("*.deb")):
        subprocess.run(["dpkg", "-x", str(deb), str(gl)], check=True)
    assert sorted(deb.name.split("_")[0] for deb in (KIT / "deb").glob("*.deb")) == sorted(LOADERS)
    libs = {p.name for p in gl.glob("usr/lib/x86_64-linux-gnu/*.so.*")}
    assert {"libEGL.so.1", "libOpenGL.so.0", "libGLX.so.0", "libGLdispatch.so.0", "libvulkan.so.1"} <= libs
