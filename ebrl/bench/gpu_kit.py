"""The folder that carries what `python -m ebrl.bench.gpu_check` needs to a GPU machine that reaches no package
registry: `python -m ebrl.bench.gpu_check --kit DIR` (docs/use/full-size.md, "The GPU check on a machine without a
registry").

Such a machine (the lent single-GPU H100 or H200) has Python 3.12, torch 2.11 (CUDA 13), numpy 2 and the packages the
`gpu-image` venv of ebrl/envs/setup.py mirrors, no hydra, omegaconf, antlr4 or simulator, and takes at most 64 MiB of
working tree and carried folders per call of at most 10 minutes. The kit holds Python 3.12 manylinux x86-64 wheels of
what the checks import beyond that (`CARRIED`) and the Debian packages of the EGL and Vulkan loaders (`LOADERS`),
fetched through this machine's own pip and apt sources. robosuite is too large to carry: the run check skips, saying
so, and the egl check renders through MuJoCo itself. `device_command` is the one line that runs a part there.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from ebrl.install import InstallError, read_apt_sources, run

REPO = Path(__file__).resolve().parents[2]
CARRY_LIMIT = 64 * 2**20  # bytes of working tree and carried folders one call takes
# what the checks import that the machine's image lacks, at the versions requirements.txt pins (one version of each:
# two stop the install); hydra-core's and omegaconf's antlr4 4.9 comes only as source, built into a wheel here
CARRIED = {
    "hydra-core": "1.3.8",
    "omegaconf": "2.3.1",
    "antlr4-python3-runtime": "4.9.3",
    "mujoco": "3.9.0",
    "pyopengl": "3.1.10",
}  # (PyOpenGL: MuJoCo's EGL context; its glfw is for windows, which no check opens)
SOURCE_ONLY = {"antlr4-python3-runtime"}
PYTHON = "3.12"
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
LOADERS = ("libvulkan1", "libegl1", "libglvnd0", "libopengl0", "libgl1", "libglx0", "libgles2")
# the driver's EGL vendor file on such a machine, named to glvnd where its own folders hold none
NVIDIA_EGL_VENDOR = "/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json"
APT_AMD64 = ["-oAPT::Architecture=amd64", "-oAPT::Architectures=amd64"]


class KitError(InstallError):
    """The kit cannot be built or would not fit; one line."""


def say(message: str) -> None:
    print(f"[gpu_check --kit] {message}", flush=True)


def normal(name: str) -> str:
    """A project's name as a wheel's file name spells it (PEP 427: runs of -_. as one _, lower case)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_key(filename: str) -> tuple[str, str]:
    """(normalised project name, version) of a wheel's file name."""
    name, version = filename.split("-")[:2]
    return normal(name), version


def download_wheels(folder: Path) -> list[Path]:
    """`CARRIED` as Python 3.12 manylinux x86-64 wheels in `folder`, and nothing else there (an older pin's wheel is
    removed)."""
    folder.mkdir(parents=True, exist_ok=True)
    binary = [f"{name}=={version}" for name, version in CARRIED.items() if name not in SOURCE_ONLY]
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            PYTHON,
            "--implementation",
            "cp",
            *platforms,
            "-d",
            str(folder),
            *binary,
        ],
        "pip download",
    )
    for name in sorted(SOURCE_ONLY):  # (pure Python: the wheel built here installs on any 3.x)
        run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(folder), f"{name}=={CARRIED[name]}"],
            f"pip wheel {name}",
        )
    wanted = {(normal(name), version) for name, version in CARRIED.items()}
    wheels = []
    for path in sorted(folder.glob("*.whl")):
        if wheel_key(path.name) in wanted:
            wheels.append(path)
        else:
            path.unlink()
    if len(wheels) != len(CARRIED):
        found = {wheel_key(p.name)[0] for p in wheels}
        raise KitError(
            f"no wheel of {', '.join(n for n in CARRIED if normal(n) not in found)} in {folder} after the download"
        )
    return wheels


def download_loaders(folder: Path) -> list[Path]:
    """`LOADERS` as amd64 Debian packages in `folder`, from this machine's own apt sources (those that serve main),
    with lists and caches of their own so that this machine's apt state is not touched."""
    folder.mkdir(parents=True, exist_ok=True)
    have = {path.name.split("_")[0]: path for path in folder.glob("*.deb")}
    if all(name in have for name in LOADERS):
        return [have[name] for name in LOADERS]
    if shutil.which("apt-get") is None:
        raise KitError(
            "the EGL loaders are Debian packages and this machine has no apt-get: build the kit on a "
            "Debian or Ubuntu machine"
        )
    entries = [
        replace(s, types=["deb"]).deb822() for s in read_apt_sources() if "deb" in s.types and "main" in s.components
    ]
    if not entries:
        raise KitError("no apt source of this machine serves main: the EGL loaders cannot be downloaded")
    state = Path(tempfile.gettempdir()) / "ebrl-kit-apt"  # (kept: a second build updates its lists quickly)
    for sub in ("lists/partial", "cache/archives/partial", "sources.list.d"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    (state / "sources.list.d" / "kit.sources").write_text("\n".join(entries))
    options = [
        *APT_AMD64,
        f"-oDir::State::Lists={state / 'lists'}",
        f"-oDir::Cache={state / 'cache'}",
        "-oDir::Etc::SourceList=/dev/null",
        f"-oDir::Etc::SourceParts={state / 'sources.list.d'}",
    ]
    run(["apt-get", "-qq", *options, "update"], "apt-get update (amd64 lists of this machine's sources)")
    for path in folder.glob("*.deb"):
        path.unlink()
    run(["apt-get", "-qq", *options, "download", *LOADERS], "apt-get download", cwd=folder)
    debs = sorted(folder.glob("*.deb"))
    if len(debs) != len(LOADERS):
        raise KitError(f"apt-get download left {len(debs)} packages in {folder}, not the {len(LOADERS)} loaders")
    return debs


def tree_bytes(repo: Path, kit: Path) -> int:
    """Bytes of the working tree a call sends (tracked files and untracked ones git does not ignore), the kit
    apart."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:
        raise KitError(f"{repo} is not a git checkout ({listed.stderr.strip()}): the kit goes in the repository")
    total = 0
    for name in filter(None, listed.stdout.split("\0")):
        path = repo / name
        if path.is_file() and not path.is_symlink() and kit not in path.parents:
            total += path.stat().st_size
    return total


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def device_command(kit: str, part: int) -> str:
    """The one line a GPU machine runs from the repository's root, with the kit carried at `kit` (relative to the
    root): the loaders unpacked (the device tool's recipe), the wheels installed beside the image's own packages, one
    part of the check, its figures and log under $OUT."""
    site = "${TMPDIR:-/tmp}/ebrl-site"
    out = f"$OUT/gpu_check_part{part}"
    return (
        f"for f in {kit}/deb/*.deb; do dpkg -x $f /; done; ldconfig; "
        f"ls /usr/share/glvnd/egl_vendor.d/*.json >/dev/null 2>&1 || [ ! -e {NVIDIA_EGL_VENDOR} ] || "
        f"export __EGL_VENDOR_LIBRARY_FILENAMES={NVIDIA_EGL_VENDOR}; " + check_command(kit, part, site, out)
    )


def check_command(kit: str, part: int, site: str, out: str) -> str:
    """The Python half of `device_command` (what a test runs on this machine, which must not unpack into /)."""
    return (
        f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target {site} "
        f"{kit}/whl/*.whl && export PYTHONPATH={site} || exit; set -o pipefail; "
        f"PYTHONUNBUFFERED=1 python3 -m ebrl.bench.gpu_check --part {part} --out {out}.json 2>&1 | tee {out}.log"
    )


def build_and_print(kit: Path, parts: dict[int, tuple[str, ...]], repo: Path = REPO) -> int:
    """Build (or bring up to date) the kit in `kit`, inside `repo`; print its size, the git-ignore step and the device
    command of each of gpu_check's `parts` (part -> its checks). 0, or 1 with one line."""
    kit = kit.resolve()
    if repo.resolve() not in kit.parents:
        print(
            f"error: --kit {kit} is outside the repository {repo}: a call carries folders of the repository only",
            file=sys.stderr,
        )
        return 1
    relative = kit.relative_to(repo.resolve()).as_posix()
    try:
        wheels = download_wheels(kit / "whl")
        debs = download_loaders(kit / "deb")
        size, tree = folder_bytes(kit), tree_bytes(repo, kit)
    except InstallError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    say(
        f"{relative}: {size / 2**20:.1f} MiB ({len(wheels)} wheels, {len(debs)} loader packages); with the working "
        f"tree's {tree / 2**20:.1f} MiB, {(size + tree) / 2**20:.1f} MiB of the {CARRY_LIMIT // 2**20} MiB a call "
        "carries"
    )
    if size + tree > CARRY_LIMIT:
        print(
            f"error: the kit and the working tree come to {(size + tree) / 2**20:.1f} MiB, over the "
            f"{CARRY_LIMIT // 2**20} MiB a call carries: drop a wheel from CARRIED (ebrl/bench/gpu_kit.py)",
            file=sys.stderr,
        )
        return 1
    ignored = subprocess.run(["git", "check-ignore", "-q", relative], cwd=repo).returncode == 0
    if not ignored:
        exclude = subprocess.run(
            ["git", "rev-parse", "--git-path", "info/exclude"], cwd=repo, capture_output=True, text=True
        ).stdout.strip()
        say(f"{relative} is not ignored by git; ignore it (never commit the wheels): echo /{relative}/ >> {exclude}")
    for part, names in parts.items():
        say(f"part {part} ({' '.join(names)}): carry [{relative}], timeout_s 600, command:")
        print(device_command(relative, part), flush=True)
    say(
        "then, here, with the hw of the GPU it ran on: python -m ebrl.bench.at_scale policy=openpi policy.preset=full "
        "env=libero hw=h200x1 --sim-step-ms 40 60 --gpu-costs gpu_check_part1.json"
    )
    return 0
