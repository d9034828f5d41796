"""Make this machine ready to run EBRL: `python -m ebrl.install`.

Standard library only: it runs before anything else is installed. Two steps, each idempotent:
1. Debian packages for headless MuJoCo rendering (EGL/OSMesa) and, on machines without an NVIDIA
   Vulkan driver, Mesa's CPU Vulkan driver (lavapipe) >= 25, which ManiSkill 3 needs even for state
   observations (Mesa 22 lacks VK_KHR_external_semaphore_fd). Debian 12 ships Mesa 22, so the
   release's backports suite is added, derived from the apt sources this machine already has.
2. `pip install -r requirements.txt` into this interpreter.
Prints one line per step; exits non-zero with one line on failure.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REQUIREMENTS = REPO / "requirements.txt"

# Headless MuJoCo rendering: EGL (Mesa llvmpipe on CPU machines) with OSMesa as the fallback.
RENDER_PACKAGES = ("libegl1", "libegl-mesa0", "libgl1", "libgl1-mesa-dri", "libosmesa6")
# SAPIEN (ManiSkill) on machines without an NVIDIA driver: the Vulkan loader and lavapipe.
VULKAN_PACKAGES = ("libvulkan1", "mesa-vulkan-drivers")
MIN_MESA_VULKAN = "25"
BACKPORTS_FILE = Path("/etc/apt/sources.list.d/ebrl-backports.sources")
NVIDIA_ICD_GLOBS = (
    "/usr/share/vulkan/icd.d/nvidia*.json",
    "/etc/vulkan/icd.d/nvidia*.json",
    "/usr/local/share/vulkan/icd.d/nvidia*.json",
)


class InstallError(RuntimeError):
    """A step failed; the message is one line."""


def say(message: str) -> None:
    print(f"[ebrl.install] {message}", flush=True)


# --- apt sources -------------------------------------------------------------------------
@dataclass
class AptSource:
    """One apt source entry (a deb822 paragraph or a one-line `deb` entry)."""

    types: list[str]
    uris: list[str]
    suites: list[str]
    components: list[str]
    options: dict[str, str] = field(default_factory=dict)  # e.g. Signed-By

    def deb822(self) -> str:
        """This entry as a deb822 paragraph, its key file kept (an inline key block and other options are not)."""
        lines = [
            f"Types: {' '.join(self.types)}",
            f"URIs: {' '.join(self.uris)}",
            f"Suites: {' '.join(self.suites)}",
            f"Components: {' '.join(self.components)}",
        ]
        signed_by = self.options.get("signed-by")
        if signed_by and "\n" not in signed_by:
            lines.append(f"Signed-By: {signed_by}")
        return "\n".join(lines) + "\n"


def parse_deb822(text: str) -> list[AptSource]:
    """Entries of a `.sources` file; paragraphs with `Enabled: no` are skipped."""
    sources = []
    for paragraph in _paragraphs(text):
        fields: dict[str, str] = {}
        key = None
        for line in paragraph:
            if line[:1] in (" ", "\t") and key is not None:
                fields[key] += "\n" + line.strip()
            elif ":" in line:
                key, value = line.split(":", 1)
                key = key.strip().lower()
                fields[key] = value.strip()
        if fields.get("enabled", "yes").lower() == "no" or "uris" not in fields:
            continue
        options = {k: v for k, v in fields.items() if k not in ("types", "uris", "suites", "components")}
        sources.append(
            AptSource(
                types=fields.get("types", "").split(),
                uris=fields["uris"].split(),
                suites=fields.get("suites", "").split(),
                components=fields.get("components", "").split(),
                options=options,
            )
        )
    return sources


def _paragraphs(text: str) -> list[list[str]]:
    paragraphs, current = [], []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if not line.strip():
            if current:
                paragraphs.append(current)
            current = []
        else:
            current.append(line.rstrip())
    if current:
        paragraphs.append(current)
    return paragraphs


def parse_one_line(text: str) -> list[AptSource]:
    """Entries of a `sources.list`-style file: `deb [opt=value ...] URI suite component...`."""
    sources = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        options: dict[str, str] = {}
        if "[" in line and "]" in line:
            head, rest = line.split("[", 1)
            opts, tail = rest.split("]", 1)
            for opt in opts.split():
                if "=" in opt:
                    key, value = opt.split("=", 1)
                    options[key.strip().lower()] = value
            line = head + tail
        parts = line.split()
        if len(parts) < 3 or parts[0] not in ("deb", "deb-src"):
            continue
        sources.append(
            AptSource(types=[parts[0]], uris=[parts[1]], suites=[parts[2]], components=parts[3:], options=options)
        )
    return sources


def read_apt_sources(root: Path = Path("/etc/apt")) -> list[AptSource]:
    """Every enabled source of this machine (sources.list, sources.list.d/*.list and *.sources)."""
    sources: list[AptSource] = []
    one_line = [root / "sources.list"] + sorted((root / "sources.list.d").glob("*.list"))
    for path in one_line:
        if path.is_file():
            sources += parse_one_line(path.read_text(errors="replace"))
    for path in sorted((root / "sources.list.d").glob("*.sources")):
        sources += parse_deb822(path.read_text(errors="replace"))
    return sources


def backports_entry(sources: list[AptSource], codename: str) -> str | None:
    """A deb822 entry for `<codename>-backports`, from the source serving `<codename>` main.

    None when backports is already configured; InstallError when no source serves the release.
    """
    suite = f"{codename}-backports"
    if any(suite in s.suites and "deb" in s.types for s in sources):
        return None
    for source in sources:
        if "deb" in source.types and codename in source.suites and "main" in source.components:
            return replace(source, types=["deb"], uris=source.uris[:1], suites=[suite], components=["main"]).deb822()
    raise InstallError(f"no apt source serves '{codename} main'; add {suite} to your apt sources by hand")


# --- packages ----------------------------------------------------------------------------
def run(cmd: list[str], what: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """Run a command quietly with stdin closed (nothing may stop to ask); on failure raise with its last output line."""
    proc = subprocess.run(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd
    )
    if proc.returncode != 0:
        lines = [line for line in proc.stdout.splitlines() if line.strip()]
        last = lines[-1].strip() if lines else f"exit status {proc.returncode}"
        raise InstallError(f"{what} failed: {last}")
    return proc.stdout


def installed_version(package: str) -> str | None:
    proc = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}\t${Version}", package],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    if proc.returncode != 0 or "\t" not in proc.stdout:
        return None
    status, version = proc.stdout.split("\t", 1)
    return version.strip() if status.endswith(" installed") else None


def version_at_least(version: str, minimum: str) -> bool:
    return subprocess.run(["dpkg", "--compare-versions", version, "ge", minimum]).returncode == 0


def candidate_version(package: str) -> str | None:
    out = subprocess.run(
        ["apt-cache", "policy", package], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    ).stdout
    for line in out.splitlines():
        if line.strip().startswith("Candidate:"):
            value = line.split(":", 1)[1].strip()
            return None if value == "(none)" else value
    return None


def nvidia_vulkan_present() -> bool:
    return any(glob.glob(pattern) for pattern in NVIDIA_ICD_GLOBS)


def os_codename() -> str | None:
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VERSION_CODENAME="):
            return line.split("=", 1)[1].strip().strip('"') or None
    return None


def system_packages() -> None:
    """Install the missing Debian packages (step 1)."""
    want_vulkan = not nvidia_vulkan_present()
    wanted = list(RENDER_PACKAGES) + (list(VULKAN_PACKAGES) if want_vulkan else [])
    if shutil.which("dpkg-query") is None or shutil.which("apt-get") is None:
        say(
            "system packages: no apt-get here; install EGL/OSMesa and a Vulkan driver "
            f"(Mesa >= {MIN_MESA_VULKAN} lavapipe on CPU machines) with your package manager"
        )
        return
    missing = [p for p in wanted if installed_version(p) is None]
    mesa = installed_version("mesa-vulkan-drivers")
    old_mesa = want_vulkan and mesa is not None and not version_at_least(mesa, MIN_MESA_VULKAN)
    if old_mesa:
        missing.append("mesa-vulkan-drivers")  # an upgrade
    if not missing:
        note = "NVIDIA Vulkan driver present" if not want_vulkan else f"mesa-vulkan-drivers {mesa}"
        say(f"system packages: all present ({note})")
        return
    if os.geteuid() != 0:
        say(
            "system packages: not root; run: sudo apt-get install -y --no-install-recommends "
            f"{' '.join(missing)} (mesa-vulkan-drivers >= {MIN_MESA_VULKAN}: from <codename>-backports on Debian 12)"
        )
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    say("system packages: apt-get update")
    run(["apt-get", "-q", "update"], "apt-get update", env)
    target: list[str] = []
    if want_vulkan and ("mesa-vulkan-drivers" in missing or "~bpo" in (mesa or "")):
        # All Mesa packages must come from one Mesa release: when lavapipe comes from backports
        # (or already did: Debian marks backported versions "~bpo"), so do EGL/OSMesa.
        target = mesa_vulkan_target(env)
    say(f"system packages: installing {' '.join(missing)} {' '.join(target)}".rstrip())
    apt_get = ["apt-get", "-y", "-q", "-o", "Dpkg::Use-Pty=0", "--no-install-recommends"]
    run(apt_get + target + ["install"] + missing, "apt-get install", env)
    if want_vulkan:
        version = installed_version("mesa-vulkan-drivers")
        if version is None or not version_at_least(version, MIN_MESA_VULKAN):
            raise InstallError(
                f"mesa-vulkan-drivers is {version} after installing; ManiSkill needs >= {MIN_MESA_VULKAN}"
            )


def mesa_vulkan_target(env: dict[str, str]) -> list[str]:
    """apt-get options that give mesa-vulkan-drivers >= 25: none if the release has it, else its backports."""
    codename = os_codename()
    candidate = candidate_version("mesa-vulkan-drivers")
    if candidate is not None and version_at_least(candidate, MIN_MESA_VULKAN) and "~bpo" not in candidate:
        return []
    if codename is None:
        raise InstallError(
            f"cannot tell this release's codename from /etc/os-release; install "
            f"mesa-vulkan-drivers >= {MIN_MESA_VULKAN} by hand"
        )
    entry = backports_entry(read_apt_sources(), codename)
    if entry is not None:
        BACKPORTS_FILE.write_text(entry)
        say(f"system packages: added {codename}-backports in {BACKPORTS_FILE}")
        run(["apt-get", "-q", "update"], "apt-get update", env)
    return ["-t", f"{codename}-backports"]


# --- python packages ---------------------------------------------------------------------
def python_packages() -> None:
    """pip install -r requirements.txt into this interpreter (step 2)."""
    say(f"python packages: pip install -r {REQUIREMENTS.name}")
    run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r", str(REQUIREMENTS)],
        "pip install",
    )


def compile_fast_step(python: str | Path, prefix: str = "") -> None:
    """Compile the fast step's OSC controller for `python` now (about 10 s, cached on disk), so that a run's first
    simulators load it instead; a failure is only said: they fall back to its numpy arithmetic."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        run([str(python), "-m", "ebrl.envs.fast_kernels"], "compiling the fast step's controller", env=env)
        say(f"{prefix}compiled the fast step's controller (ebrl/envs/fast_kernels.py)")
    except InstallError as e:
        say(f"{prefix}warning: {e}; the simulators will compile it at their first step, or use numpy")


def main() -> int:
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(f"usage: python -m ebrl.install\n\n{__doc__.strip()}")
        return 0
    try:
        system_packages()
        python_packages()
    except InstallError as e:
        print(f"[ebrl.install] error: {e}", file=sys.stderr)
        return 1
    compile_fast_step(sys.executable)
    say("ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
