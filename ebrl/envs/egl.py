"""Which EGL device renders a simulator's cameras (docs/use/environments.md, "Rendering on a GPU").

EGL lists every device of every vendor library (NVIDIA's, then Mesa's, which `python -m ebrl.install` installs) in an
order of its own, and robosuite's EGL context (1.4 in LIBERO, 1.5, RoboCasa's fork) takes MUJOCO_EGL_DEVICE_ID as an
index into that list. A CUDA index is no such index: NVIDIA's devices say which CUDA device they are through
EGL_NV_device_cuda's attribute EGL_CUDA_DEVICE_NV (counted among the CUDA devices the querying process sees, its
CUDA_VISIBLE_DEVICES), and Mesa's software renderer (llvmpipe) says it is one (EGL_MESA_device_software).

ctypes over libEGL and the standard library only: the simulator side imports no torch (docs/internals/design.md,
"Layers").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

EGL_CUDA_DEVICE_NV = 0x323A  # EGL_NV_device_cuda
EGL_EXTENSIONS = 0x3055
SOFTWARE = "EGL_MESA_device_software"
NVIDIA_EGL = (
    "install the NVIDIA driver's EGL library (libEGL_nvidia.so.0, listed by glvnd's 10_nvidia.json; in a "
    "container set NVIDIA_DRIVER_CAPABILITIES=all, or a list with graphics)"
)

# (device index, device handle) -> its EGL_CUDA_DEVICE_NV, or None where the device has none (not NVIDIA's)
CudaOrdinal = Callable[[int, int], "int | None"]


@dataclass(frozen=True)
class EglDevice:
    """One entry of eglQueryDevicesEXT's list: `index` is what MUJOCO_EGL_DEVICE_ID names, `cuda` its CUDA ordinal as
    the querying process counts them (None: not an NVIDIA device), `extensions` its device extensions."""

    index: int
    cuda: int | None
    extensions: str = ""

    @property
    def software(self) -> bool:
        """A renderer on the CPU (Mesa's llvmpipe), not a GPU."""
        return self.cuda is None and SOFTWARE in self.extensions.split()


class _Egl:
    """libEGL's device functions (EGL_EXT_device_enumeration, EGL_EXT_device_query), looked up once."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(ctypes.util.find_library("EGL") or "libEGL.so.1")
        lib.eglGetProcAddress.restype = ctypes.c_void_p
        lib.eglGetProcAddress.argtypes = [ctypes.c_char_p]

        def function(name: str, *signature: type) -> Callable:
            address = lib.eglGetProcAddress(name.encode())
            if not address:
                raise OSError(f"libEGL has no {name}")
            return ctypes.CFUNCTYPE(*signature)(address)

        self.query_devices = function(
            "eglQueryDevicesEXT",
            ctypes.c_uint,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_int),
        )
        self.query_string = function("eglQueryDeviceStringEXT", ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int)
        self.query_attrib = function(
            "eglQueryDeviceAttribEXT", ctypes.c_uint, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_ssize_t)
        )

    def cuda_ordinal(self, index: int, handle: int) -> int | None:
        value = ctypes.c_ssize_t(-1)
        return int(value.value) if self.query_attrib(handle, EGL_CUDA_DEVICE_NV, ctypes.byref(value)) else None


def egl_devices(cuda_ordinal: CudaOrdinal | None = None) -> list[EglDevice] | None:
    """Every EGL device in EGL's order; None where there is no libEGL or it cannot list devices. `cuda_ordinal`
    answers for EGL_CUDA_DEVICE_NV instead of the driver (a test's NVIDIA device, which a CPU cannot have)."""
    try:
        egl = _Egl()
    except OSError:
        return None
    count = ctypes.c_int(0)
    if not egl.query_devices(0, None, ctypes.byref(count)) or count.value <= 0:
        return None
    handles = (ctypes.c_void_p * count.value)()
    if not egl.query_devices(count.value, handles, ctypes.byref(count)):
        return None
    ordinal = cuda_ordinal or egl.cuda_ordinal
    devices = []
    for index, handle in enumerate(handles[: count.value]):
        extensions = egl.query_string(handle, EGL_EXTENSIONS) or b""
        devices.append(EglDevice(index, ordinal(index, handle), extensions.decode(errors="replace")))
    return devices


def device_of_gpu(gpu: int, devices: Sequence[EglDevice], visible: Sequence[int] | None) -> EglDevice | None:
    """The EGL device of the machine's GPU `gpu`: NVIDIA's whose CUDA ordinal is that GPU among those the querying
    process saw (`visible`: their machine indices in its CUDA_VISIBLE_DEVICES order; None: every GPU, in order)."""
    for device in devices:
        if device.cuda is None or device.cuda < 0:
            continue
        if visible is None:
            machine = device.cuda
        else:
            machine = visible[device.cuda] if device.cuda < len(visible) else None
        if machine == gpu:
            return device
    return None


def chosen_index(environ: Mapping[str, str]) -> int:
    """The EGL device robosuite opens in a process with this environment (its renderers/context/egl_context.py with
    device_id -1, the same in 1.4, 1.5 and RoboCasa's fork): MUJOCO_EGL_DEVICE_ID, else CUDA_VISIBLE_DEVICES' first
    entry, else the first device."""
    chosen = environ.get("MUJOCO_EGL_DEVICE_ID", environ.get("CUDA_VISIBLE_DEVICES"))
    if chosen is None:
        return 0
    first = chosen.split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def software_renderer(environ: Mapping[str, str] | None = None) -> str:
    """'' where MuJoCo's EGL context opens a GPU; else what it opens, Mesa's software renderer on the CPU, and the fix,
    as a clause for the supervisor's line (ebrl/envs/worker.py, `SimWorkerPool.start`)."""
    environ = os.environ if environ is None else environ
    devices = egl_devices()
    index = chosen_index(environ)
    if not devices or index >= len(devices) or not devices[index].software:
        return ""
    return (
        f"MuJoCo renders through EGL device {index}, Mesa's software renderer ({SOFTWARE}), as EGL lists no "
        f"device of NVIDIA's driver for this GPU: {NVIDIA_EGL}"
    )
