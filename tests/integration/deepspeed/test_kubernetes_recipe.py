"""The container command of examples/kubernetes/jobset-deepspeed.yaml, run under the harness
as the recipe's three pods would run it: torchrun in each, the node rank from the pod's index,
the config from the recipe's ConfigMap; only the paths, the head's address and the number of
steps differ. Then what each kind of restart leaves: a container restarted in its pod (every
process of it gone, its SMP too, its /dev/shm kept) resumes from its own memory; a pod
rescheduled elsewhere (its /dev/shm gone with it) is rebuilt from the others' parity. Bitwise
against DeepSpeed's default engine. The manifest's schema: tests/unit/test_kubernetes_manifests.py."""
import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest
import yaml

from ftmem import restored_from_memory
from ftmem._shm import jobs
from ftmem._shm.procs import pid_alive
from harness.common import logged
from harness.ds_jobs import CONFIGS, ENV, ITERS, STOP, TIMEOUT, reference
from harness.ranks import REPO, free_port, wait_until
from harness.toy import assert_same_training

RECIPE = os.path.join(REPO, "examples", "kubernetes", "jobset-deepspeed.yaml")
PODS = 3


def _recipe(tmp_path, shm_dir) -> tuple[list, dict]:
    """The container's args (its $(VAR)s left for each pod) and the config, paths made the test's."""
    with open(RECIPE) as f:
        config_map, jobset = yaml.safe_load_all(f)
    container = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    config = json.loads(config_map["data"]["ds_config.json"])
    config["ftmem"]["shm_dir"] = shm_dir
    config["ftmem"]["persist"]["dir"] = config["ftmem"]["persist"]["dir"].replace("/ckpt", str(tmp_path / "ckpt"))
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    moved = {"--deepspeed-config": str(tmp_path / "ds_config.json"), "--iters": str(ITERS),
             "--master-addr": "127.0.0.1", "--master-port": str(free_port())}
    args = []
    for arg in container["args"]:
        flag, _, value = arg.partition("=")
        args.append(f"{flag}={moved[flag]}" if flag in moved else arg.replace("/ckpt", str(tmp_path / "ckpt")))
    assert container["command"] == ["torchrun"]
    return args, config


def _start(args: list, pod: int, out, *extra) -> subprocess.Popen:
    """One pod's container: the command in a session of its own (what the container's end kills)."""
    expanded = [arg.replace("$(JOB_COMPLETION_INDEX)", str(pod)) for arg in args]
    env = dict(os.environ, **ENV, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", JOB_COMPLETION_INDEX=str(pod))
    with open(out / f"pod{pod}.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *expanded, "--out", str(out), *extra],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts each rank in a session of its own)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _end_container(pod: subprocess.Popen) -> None:
    """A container's end: every process of it SIGKILLed (the SMP, which left its tree, apart)."""
    doomed = _descendants(pod.pid)
    pod.kill()
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    pod.wait()
    wait_until(lambda: not any(pid_alive(pid) for pid in doomed), TIMEOUT, "the container's processes to end")


def _log(out, pod: int) -> str:
    with open(out / f"pod{pod}.log", errors="replace") as f:
        return f.read()


@pytest.mark.fault("node lost (its ranks, SMP and memory)", phase="between saves", framework="DeepSpeed ZeRO-1",
                   expect="resumes bitwise from memory: the Kubernetes recipe's command, two containers restarted in "
                          "their pods (their /dev/shm kept), one pod rescheduled (rebuilt from parity)")
def test_the_recipe_s_command_resumes_from_memory_after_container_restarts_and_a_rescheduled_pod(shm_dir, tmp_path):
    args, config = _recipe(tmp_path, shm_dir)
    with open(os.path.join(CONFIGS, "zero1.json")) as f:
        trained_as = {k: v for k, v in json.load(f).items() if k not in ("checkpoint", "ftmem")}
    assert {k: v for k, v in config.items() if k not in ("checkpoint", "ftmem")} == trained_as
    ref = reference("zero1.json", PODS, str(tmp_path / "reference"))
    out = tmp_path / "out"
    out.mkdir()
    pods = [_start(args, pod, out, "--stop-after", str(STOP)) for pod in range(PODS)]
    try:
        wait_until(lambda: all("stopped after" in _log(out, p) for p in range(PODS)) or
                   any(pod.poll() is not None for pod in pods), TIMEOUT, f"step {STOP} in every pod")
        assert all(pod.poll() is None for pod in pods), "\n".join(_log(out, p)[-3000:] for p in range(PODS))
        job, = [j["job"] for j in jobs.status(shm_dir)["jobs"]]
        smps = {node["node"]: node["smp_pid"] for node in jobs.status(shm_dir, job)["jobs"][0]["nodes"]}
        for pod in pods:  # every container ends: its processes, and (below) its SMP
            _end_container(pod)
        for node in (0, 2):  # restarted in their pods: /dev/shm stays
            os.kill(smps[node], signal.SIGKILL)
        jobs.lose_node(shm_dir, job, 1)  # rescheduled: its /dev/shm went with the pod
        pods = [_start(args, pod, out) for pod in range(PODS)]
        codes = [pod.wait(TIMEOUT) for pod in pods]
        assert codes == [0] * PODS, "\n".join(_log(out, p)[-3000:] for p in range(PODS))
    finally:
        for pod in pods:
            if pod.poll() is None:
                _end_container(pod)
    for pod in range(PODS):
        assert logged(restored_from_memory(STOP + 1, pod, f"tag global_step{STOP + 1}", rebuilt=pod == 1),
                      _log(out, pod)), _log(out, pod)[-3000:]
    assert_same_training(str(out), ref, PODS, ITERS)
