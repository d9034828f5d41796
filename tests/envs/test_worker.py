"""Simulator worker processes: shared-memory slots, small notices, clean shutdown (real robosuite Lift)."""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

from ebrl.envs.base import EnvSetupError
from ebrl.envs.egl import EglDevice, egl_devices
from ebrl.envs.slots import SlotLayout
from ebrl.envs.worker import (
    Progress,
    SimFailure,
    SimulatorsFailing,
    SimWorker,
    SimWorkerPool,
    egl_environment,
    simulator_gpu_environment,
)

LIFT = dict(
    _target_="ebrl.envs.robosuite_env.RobosuiteEnv",
    name="robosuite",
    task="Lift",
    num_envs=2,
    max_episode_steps=8,
    cameras=[],
    image_size=64,
    reward="dense",
    terminate_on_success=True,
    python=None,
    robot="Panda",
    control_freq=20,
)


def shm_segments():
    return set(os.listdir("/dev/shm"))


def close_within(closable, seconds=60.0):
    """Run close() in a thread; True if it returned (a hang guard, not a timing check)."""
    thread = threading.Thread(target=closable.close, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def test_pool_runs_chunks_in_child_processes_and_reports_episode_ends():
    before = shm_segments()
    pool = SimWorkerPool(LIFT, num_envs=2, seed=3, execute=5)
    with pool:
        pids = [w.pid for w in pool.workers]
        assert len(set(pids)) == 2 and os.getpid() not in pids
        assert all(w.shm_name.lstrip("/") in shm_segments() for w in pool.workers)
        assert pool.spec.obs["state"].shape == (60,) and pool.spec.instruction == "lift the red cube"

        pool.reset_all()
        start = pool.stacked_obs()
        assert start["state"].shape == (2, 60) and start["state"].dtype == np.float32
        assert not np.array_equal(start["state"][0], start["state"][1])  # env i is seeded seed*1000+i

        actions = np.random.default_rng(0).uniform(-1, 1, (2, 5, 7)).astype(np.float32)
        pool.submit_all(5, actions)
        reports = pool.wait_all()
        for report in reports:
            assert report.executed == 5 and not report.done and report.episode is None
            assert report.rewards.shape == (5,) and report.rewards.dtype == np.float32
            assert report.successes.shape == (5,) and report.step_times.shape == (5,)
            assert (report.step_times > 0).all()
        after = pool.stacked_obs()["state"]
        assert not np.array_equal(after, start["state"])  # the children wrote new obs into shm

        pool.submit_all(5, actions)  # 3 more steps end the 8-step episode
        for report in pool.wait_all():
            assert report.executed == 3 and report.truncated
            assert report.episode["length"] == 8
            assert report.final_obs["state"].shape == (60,)
    assert shm_segments() - before == set()
    assert all(w.pid is None or not _alive(w.pid) for w in pool.workers)


def test_grouped_seeded_resets_share_initial_states_and_a_0_step_chunk_leaves_an_env_alone():
    from ebrl.rl.grpo import group_seeds

    # groups {0, 1} and {2, 3}, each built from one seed (Lift's cube size is drawn when the model is built)
    with SimWorkerPool(LIFT, num_envs=4, seed=0, execute=4, group_size=2) as pool:
        pool.reset_all(group_seeds(0, 0, 4, 2))
        first = pool.stacked_obs()["state"]
        assert np.array_equal(first[0], first[1]) and np.array_equal(first[2], first[3])
        assert not np.array_equal(first[0], first[2])

        # envs 0 and 2 step on, 1 and 3 submit 0 steps: nothing runs there, their obs stays
        pool.submit_all([4, 0, 4, 0], np.random.default_rng(0).uniform(-1, 1, (4, 4, 7)).astype(np.float32))
        reports = pool.wait_all()
        assert [r.executed for r in reports] == [4, 0, 4, 0]
        assert reports[1].rewards.shape == (0,) and not reports[1].done and reports[1].episode is None
        after = pool.stacked_obs()["state"]
        assert np.array_equal(after[1], first[1]) and not np.array_equal(after[0], first[0])

        # the next iteration: members with different histories start equal again, from new states
        pool.reset_all(group_seeds(0, 1, 4, 2))
        second = pool.stacked_obs()["state"]
        assert np.array_equal(second[0], second[1]) and np.array_equal(second[2], second[3])
        assert not np.array_equal(second[0], second[2])
        assert not np.array_equal(second[0], first[0]) and not np.array_equal(second[2], first[2])


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers signal 0; it is gone once reaped
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_construction_error_arrives_as_one_line():
    before = shm_segments()
    worker = SimWorker(dict(LIFT, task="Lfit"), seed=0, execute=4)
    with pytest.raises(EnvSetupError) as info:
        worker.start()
    worker.close()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("env.task='Lfit' is not a robosuite task; choose one of: ")
    assert shm_segments() - before == set()


def test_camera_worker_survives_sigint_its_render_threads_follow_bind_and_a_killed_worker_does_not_hang_close():
    before = shm_segments()
    worker = SimWorker(dict(LIFT, cameras=["agentview"]), seed=0, execute=4)
    worker.start()
    try:
        worker.reset(seed=1)
        image = worker.obs["image/agentview"]
        assert image.shape == (64, 64, 3) and image.dtype == np.uint8 and image.std() > 5

        os.kill(worker.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group; workers ignore it
        worker.actions[:2] = 0.0
        worker.submit(2)
        assert worker.wait().executed == 2

        # Mesa's software renderer runs threads of its own: a core hand-over and the nice must reach them too
        threads = [int(tid) for tid in os.listdir(f"/proc/{worker.pid}/task")]
        assert len(threads) > 1
        core = max(os.sched_getaffinity(0))
        worker.bind([core])
        worker.renice(7)
        assert {tid: os.sched_getaffinity(tid) for tid in threads} == {tid: {core} for tid in threads}
        assert {tid: os.getpriority(os.PRIO_PROCESS, tid) for tid in threads} == {tid: 7 for tid in threads}
        # attaching its slot started no resource tracker, which would free the block (with a warning) once the
        # process is killed: the block is the parent's until it closes the worker
        assert not [c for c in psutil.Process(worker.pid).children() if "resource_tracker" in " ".join(c.cmdline())]

        os.kill(worker.pid, signal.SIGKILL)
        worker.submit(2)
        with pytest.raises(SimFailure, match="stopped; exit code -9"):
            worker.wait()
        assert worker.shm_name in shm_segments()
    finally:
        assert close_within(worker)
    worker.close()  # idempotent
    assert shm_segments() - before == set()


def test_a_failed_simulator_is_replaced_in_its_slot_and_repeated_failures_stop():
    before = shm_segments()
    with SimWorkerPool(LIFT, num_envs=2, seed=0, execute=4, max_failures=1) as pool:
        pool.reset_all()
        old_pid, old_shm = pool.workers[1].pid, pool.workers[1].shm_name
        os.kill(old_pid, signal.SIGKILL)
        pool.submit_all(2, np.zeros((2, 2, pool.spec.action_dim), np.float32))
        first, second = pool.wait_all()
        assert first.executed == 2 and first.failed is None
        assert second.failed.startswith(f"sim worker 1 (pid {old_pid}) stopped") and second.done
        replacement = pool.workers[1]
        assert replacement.pid != old_pid and replacement.replacements == 1 and replacement.seed == 1 + 100_003
        assert old_shm not in shm_segments() and np.isfinite(replacement.obs["state"]).all()
        pool.submit_all(2)
        assert [r.executed for r in pool.wait_all()] == [2, 2]  # the new process steps its new episode
        os.kill(replacement.pid, signal.SIGKILL)
        pool.submit_all(2)
        with pytest.raises(
            SimulatorsFailing, match="2 simulator failures within 600 s, more than scheduler.max_sim_failures=1"
        ):
            pool.wait_all()
    assert shm_segments() - before == set()


def test_progress_is_cpu_time_a_stopped_process_hangs_and_a_spinning_one_hits_the_bound():
    limit = 1.0
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # (both started: the interpreter's own start is CPU time)
        watches = {"stopped": Progress(sleeper.pid), "spinning": Progress(spinner.pid)}
        start, why = time.monotonic(), {}
        while len(why) < 2 and time.monotonic() - start < 10:
            time.sleep(min(w.until_check(limit) for w in watches.values()))
            why |= {name: w.hung(limit) for name, w in watches.items() if name not in why and w.hung(limit)}
        assert why["stopped"].startswith("no CPU time for ") and why["spinning"].endswith(" s of CPU on one chunk")
    finally:
        sleeper.kill(), spinner.kill()


def test_a_simulator_slowed_past_the_timeout_is_waited_for_and_a_stopped_one_is_replaced():
    """Env 0 spends 1.5 s of CPU in its chunk while stopped and continued in bursts (0.8 s stopped, 0.4 s running),
    so that its chunk takes longer than chunk_timeout_s in wall-clock: it advances, and is waited for. Env 1 is
    stopped for good: replaced."""
    fault = dict(kind="slow", env=0, chunk=1, seconds=1.5)
    with SimWorkerPool({**LIFT, "fault": fault}, num_envs=2, seed=0, execute=4, chunk_timeout_s=2.5) as pool:
        pool.reset_all()
        slow, stopped = pool.workers[0].pid, pool.workers[1].pid
        done = threading.Event()

        def throttle():
            while not done.is_set():
                os.kill(slow, signal.SIGSTOP)
                done.wait(0.8)
                os.kill(slow, signal.SIGCONT)
                done.wait(0.4)

        os.kill(stopped, signal.SIGSTOP)
        throttler = threading.Thread(target=throttle, daemon=True)
        start = time.monotonic()
        pool.submit_all(2, np.zeros((2, 2, pool.spec.action_dim), np.float32))
        throttler.start()
        try:
            first = pool.wait_chunk(0)
            slowed = time.monotonic() - start
            second = pool.wait_chunk(1)
        finally:
            done.set()
            throttler.join()
            os.kill(slow, signal.SIGCONT)
        assert slowed > 2.5 and first.failed is None and first.executed == 2  # (past the timeout in wall-clock)
        assert second.failed.startswith(f"sim worker 1 (pid {stopped}) hung: no CPU time for ")
        assert pool.workers[0].pid == slow and pool.workers[1].pid != stopped


def test_a_pool_whose_simulators_do_not_exit_kills_them_after_one_shared_wait(monkeypatch):
    """Stopped (as a loaded machine's may be too slow to answer), none exits on its close: the pool waits 5 s for all
    of them together, not 5 s for each, then kills them and frees their slots."""
    from ebrl.envs import worker as worker_module

    waits = []
    release = worker_module._Resources.release
    monkeypatch.setattr(
        worker_module._Resources,
        "release",
        lambda self, timeout=5.0: (waits.append(timeout), release(self, timeout))[1],
    )
    before = shm_segments()
    pool = SimWorkerPool(LIFT, num_envs=3, seed=0, execute=4)
    pool.start()
    for worker in pool.workers:
        os.kill(worker.pid, signal.SIGSTOP)
    pids = [w.pid for w in pool.workers]
    assert close_within(pool)
    assert sum(waits) <= 5.0 and len(waits) == 3  # (one deadline for the three)
    assert not any(_alive(pid) for pid in pids) and shm_segments() - before == set()


def test_a_simulator_that_dies_before_a_seeded_reset_is_replaced_and_reset_from_its_seed():
    """GRPO resets every env each iteration from its group's seed: a simulator that died since its last chunk is a
    simulator failure there too (replaced, counted), and its replacement starts the group's episode."""
    pool = SimWorkerPool(LIFT, num_envs=2, seed=0, execute=4, group_size=2)  # one group of two
    try:
        pool.start()
        pool.reset_all(seeds=[3, 3])
        old = pool.workers[1].pid
        os.kill(old, signal.SIGKILL)
        pool.workers[1]._res.process.wait(10)
        pool.reset_all(seeds=[7, 7])
        assert len(pool.failures) == 1 and "sim worker 1" in pool.failures[0][2]
        assert pool.workers[1].pid != old
        first, second = (w.obs["state"].copy() for w in pool.workers)  # (the slots go with the pool)
        np.testing.assert_array_equal(first, second)  # built alike and reset from one seed: one initial state
    finally:
        pool.close()


def test_slot_layout_is_aligned_and_disjoint():
    from ebrl.envs.base import ArraySpec, EnvSpec

    spec = EnvSpec(
        obs={"state": ArraySpec((9,), "float32"), "image/cam": ArraySpec((8, 8, 3), "uint8")},
        action_dim=7,
        instruction="x",
        max_episode_steps=10,
    )
    layout = SlotLayout.build(spec, execute=5)
    spans = sorted(
        (offset, offset + int(np.prod(shape)) * np.dtype(dtype).itemsize) for _, shape, dtype, offset in layout.fields
    )
    assert all(offset % 64 == 0 for offset, _ in spans)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= layout.size
    views = layout.views(memoryview(bytearray(layout.size)))
    assert views["actions"].shape == (5, 7) and views["final/image/cam"].dtype == np.uint8


def test_importing_the_worker_does_not_import_torch():
    code = "import sys, ebrl.envs.process, ebrl.envs.worker; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert out.stdout.strip() == "False"


@pytest.mark.slow  # (the default suite's time)
def test_worker_runs_under_the_interpreter_env_python_names(tmp_path):
    # a second interpreter (a venv sharing this one's packages) stands for a benchmark's own environment
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(tmp_path / "venv")], check=True
    )
    python = str(tmp_path / "venv" / "bin" / "python")
    worker = SimWorker(dict(LIFT, python=python), seed=0, execute=4)
    try:
        worker.start()
        with open(f"/proc/{worker.pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert argv[0].decode() == python and argv[1:3] == [b"-m", b"ebrl.envs.process"]
        worker.reset(seed=0)
        worker.actions[:] = 0.0
        worker.submit(4)
        assert worker.wait().executed == 4
    finally:
        worker.close()


def test_missing_interpreter_is_one_line():
    worker = SimWorker(dict(LIFT, python="/nonexistent/bin/python"), seed=0, execute=4)
    with pytest.raises(EnvSetupError) as info:
        worker.start()
    worker.close()
    assert "env.python='/nonexistent/bin/python' cannot be started" in str(info.value)
    assert "\n" not in str(info.value)


def robosuite_egl_device(env: dict[str, str]) -> int:
    """The EGL device robosuite renders on in a process with `env` (its utils/binding_utils.py assertion and its
    renderers/context/egl_context.py choice, the same in 1.4 (LIBERO), 1.5 and RoboCasa's fork), with device_id -1."""
    visible, chosen = env.get("CUDA_VISIBLE_DEVICES", ""), env.get("MUJOCO_EGL_DEVICE_ID")
    if visible != "" and chosen is not None:
        assert chosen.isdigit() and chosen in visible
    selected = chosen if chosen is not None else env.get("CUDA_VISIBLE_DEVICES")
    if selected is None:
        return 0
    return int(selected) if selected.isdigit() else [int(x) for x in selected.split(",")][0]


UUIDS = ["GPU-0aa3c1d2-7e51-4f0c-9b6e-1d2f3a4b5c6d", "GPU-5bb8e2f1-0c3d-4a5e-8f7a-9b0c1d2e3f4a"]


@pytest.mark.parametrize(
    "visible, gpus, device",
    [
        (None, 1, 0),  # python run.py on a one-GPU node: CUDA's device 0
        ("5", 8, 5),  # a torchrun rank, pinned to the node's GPU 5: its simulators render there too
        ("2,3", 2, 2),  # one process given GPUs 2 and 3 runs on the first
        ("GPU-5bb8", 2, 1),  # a UUID (prefix) is looked up: robosuite would fail on int("GPU-...")
    ],
)
def test_simulators_on_a_gpu_node_render_on_their_supervisors_gpu(visible, gpus, device):
    env = egl_environment(visible, gpus, UUIDS)
    assert env["MUJOCO_EGL_DEVICE_ID"] == str(device) and robosuite_egl_device(env) == device
    # whatever the supervisor's own CUDA_VISIBLE_DEVICES became (an MPS client's "0"), robosuite's check holds
    assert robosuite_egl_device({"CUDA_VISIBLE_DEVICES": "0", **env}) == device


@pytest.mark.parametrize("visible, gpus", [(None, 0), ("3", 0), ("", 2), ("GPU-ffff", 2), ("MIG-0aa3", 1)])
def test_cpu_nodes_and_gpus_it_cannot_name_get_no_egl_device(visible, gpus):
    # a CPU-only node (hw.gpus=0, on any machine) renders with Mesa's software EGL as before; no GPU shown, an unknown
    # UUID or a MIG instance: robosuite's own rule
    assert egl_environment(visible, gpus, UUIDS) == {}


def test_a_simulator_process_starts_with_the_pools_environment(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    # a supervisor that generates under MPS is a client (Placement.check_memory): its simulators are not
    for key, value in (
        ("CUDA_MPS_PIPE_DIRECTORY", "/tmp/ebrl-mps-x/gpu0"),
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "40"),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1024M"),
    ):
        monkeypatch.setenv(key, value)
    extra = simulator_gpu_environment(gpus=1)
    assert extra == {"MUJOCO_EGL_DEVICE_ID": "0", "CUDA_VISIBLE_DEVICES": "0"}  # (this machine's one EGL device)
    assert simulator_gpu_environment(gpus=0) == {}
    pool = SimWorkerPool(LIFT, num_envs=1, seed=0, execute=4, process_env=extra)
    worker = pool.workers[0]
    worker.start(wait=False)  # (the environment is the process's from exec on: no need to wait for Lift)
    try:  # (read again until the image that runs is the interpreter's: a launcher in between may exec it anew)
        deadline = time.monotonic() + 10
        while True:
            with open(f"/proc/{worker.pid}/environ", "rb") as f:
                environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            if b"MUJOCO_EGL_DEVICE_ID" in environ or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        pool.close()
    assert environ[b"MUJOCO_EGL_DEVICE_ID"] == b"0" and environ[b"CUDA_VISIBLE_DEVICES"] == b"0"
    assert environ[b"OMP_NUM_THREADS"] == b"1"  # beside the worker's own variables
    assert not [key for key in environ if key.startswith(b"CUDA_MPS_")]


# --- the EGL device of a GPU: this machine's real device list (Mesa's llvmpipe); NVIDIA's attribute, which a CPU
# cannot have, answered by the test where a test needs an NVIDIA device
def nvidia(ordinals: dict[int, int]):
    """EGL_CUDA_DEVICE_NV as NVIDIA's driver would answer it: device index -> CUDA ordinal."""
    return lambda index, handle: ordinals.get(index)


def test_this_machines_egl_devices_are_listed_and_mesas_says_it_is_software():
    devices = egl_devices()
    if devices is None:
        pytest.skip("no libEGL here: python -m ebrl.install installs Mesa's")
    assert [d.index for d in devices] == list(range(len(devices)))
    assert all(d.cuda is None for d in devices)  # (no NVIDIA device on a CPU machine)
    assert any(d.software for d in devices)
    claimed = egl_devices(nvidia({0: 0}))[0]  # NVIDIA's device: a GPU, whatever else it lists
    assert claimed.cuda == 0 and not claimed.software


@pytest.mark.parametrize(
    "visible, gpu_index, egl",
    [
        (None, 0, 1),  # every GPU shown: EGL lists GPU 1 first, and the run's GPU is 0
        ("1", 1, 0),  # a rank pinned to GPU 1: NVIDIA's driver counts ordinals among the GPUs its process sees
        ("5,4", 5, 2),  # ordinal 0 is GPU 5 here
    ],
)
def test_a_gpu_renders_on_the_egl_device_nvidias_driver_says_is_it(visible, gpu_index, egl):
    shown = {None: {0: 1, 1: 0}, "1": {0: 0}, "5,4": {0: 2, 1: 0}}[visible]  # CUDA ordinal -> EGL index
    devices = [EglDevice(i, next((o for o, e in shown.items() if e == i), None), "") for i in range(3)]
    devices.append(EglDevice(3, None, "EGL_MESA_device_software"))  # Mesa's, last as glvnd lists vendors
    env = egl_environment(visible, 8, UUIDS, devices)
    assert env["MUJOCO_EGL_DEVICE_ID"] == str(egl)
    assert env["CUDA_VISIBLE_DEVICES"].split(",")[0] == str(gpu_index)  # CUDA (SAPIEN) sees the GPU first
    assert robosuite_egl_device(env) == egl  # robosuite's import-time check holds and it opens that device


def test_a_gpu_without_an_nvidia_egl_device_renders_on_mesas_software_device_and_robosuite_opens_it(monkeypatch):
    """A rank pinned to GPU 3 on a node whose EGL lists Mesa's llvmpipe alone (NVIDIA's EGL library missing: this
    machine, as a container without it would be): the index 3 was out of EGL's range and robosuite stopped."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    env = simulator_gpu_environment(gpus=1)
    devices = egl_devices()
    if devices is None:
        pytest.skip("no libEGL here: python -m ebrl.install installs Mesa's")
    software = next(d.index for d in devices if d.software)
    assert env == {"MUJOCO_EGL_DEVICE_ID": str(software), "CUDA_VISIBLE_DEVICES": f"3,{software}"}
    # the real robosuite: its import-time check, then its EGL context on the device chosen
    code = (
        "import robosuite.utils.binding_utils\n"
        "from robosuite.renderers.context.egl_context import EGLGLContext\n"
        "EGLGLContext(64, 64, device_id=-1)\n"
        "from ebrl.envs.egl import software_renderer\n"
        "print(software_renderer())"
    )
    child = {**os.environ, "MUJOCO_GL": "egl", "PYOPENGL_PLATFORM": "egl", **env}
    proc = subprocess.run([sys.executable, "-c", code], env=child, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"MuJoCo renders through EGL device {software}, Mesa's software renderer")
    # the device NVIDIA's driver says is GPU 3 (ordinal 0 of what the rank sees): no software renderer to say
    assert egl_environment("3", 1, (), egl_devices(nvidia({0: 0}))) == {
        "MUJOCO_EGL_DEVICE_ID": "0",
        "CUDA_VISIBLE_DEVICES": "3,0",
    }


def test_simulators_that_render_on_the_cpu_on_a_gpu_node_say_so_once(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    if egl_devices() is None:
        pytest.skip("no libEGL here: python -m ebrl.install installs Mesa's")
    cfg = dict(LIFT, cameras=["agentview"])
    with SimWorkerPool(
        cfg, num_envs=2, seed=0, execute=2, process_env=simulator_gpu_environment(gpus=1), on_gpu=True
    ) as pool:
        pool.reset_all()
        assert pool.stacked_obs()["image/agentview"].shape == (2, 64, 64, 3)
        assert pool.spec.software_render  # (what a CPU node's pool, on_gpu=False, leaves unsaid)
    lines = [line for line in capsys.readouterr().err.splitlines() if "render on the CPU" in line]
    assert len(lines) == 1 and "not on the run's GPU: MuJoCo renders through EGL device 0" in lines[0]
