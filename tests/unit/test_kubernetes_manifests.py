"""examples/kubernetes/jobset-deepspeed.yaml, the recipe users apply: its objects hold to the
Kubernetes API's types (tests/harness/kubernetes_schema.py; JobSet's own fields against its
v1alpha2 API), and it keeps what ftmem needs of a pod: /dev/shm in memory that outlives a
container restart, restarts inside the pod, a grace longer than ftmem's flush at preemption, a
node rank that follows the pod, and a memory limit over the slots. Its command runs under the
harness in tests/integration/deepspeed/test_kubernetes_recipe.py."""
import json
import os
import re

import pytest
import yaml

from harness.kubernetes_schema import build, problems

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(REPO, "examples", "kubernetes", "jobset-deepspeed.yaml")
# JobSet's own fields (jobset.x-k8s.io/v1alpha2, its API reference): the rest are batch/v1's.
JOBSET_SPEC = {"replicatedJobs", "network", "successPolicy", "failurePolicy", "startupPolicy", "suspend",
               "coordinator", "managedBy", "ttlSecondsAfterFinished"}
REPLICATED_JOB = {"name", "groupName", "template", "replicas", "dependsOn"}
FAILURE_POLICY = {"maxRestarts", "restartStrategy", "rules"}
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", quantity).groups()
    return int(number) * _BINARY.get(unit, 1)


@pytest.fixture(scope="module")
def recipe():
    with open(RECIPE) as f:
        config_map, jobset = yaml.safe_load_all(f)
    return config_map, jobset


def test_its_objects_hold_to_the_kubernetes_api_s_types(recipe):
    config_map, jobset = recipe
    assert problems(config_map, "V1ConfigMap") == []
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    assert set(jobset["spec"]) <= JOBSET_SPEC and set(jobset["spec"]["failurePolicy"]) <= FAILURE_POLICY
    for replicated in jobset["spec"]["replicatedJobs"]:
        assert set(replicated) <= REPLICATED_JOB
        assert problems(replicated["template"], "V1JobTemplateSpec") == []
        build(replicated["template"], "V1JobTemplateSpec")  # required fields present


def test_the_schema_check_catches_a_misspelt_field_and_a_missing_required_one(recipe):
    template = recipe[1]["spec"]["replicatedJobs"][0]["template"]
    container = template["spec"]["template"]["spec"]["containers"][0]
    misspelt = {**container, "volumeMount": container["volumeMounts"]}
    assert problems(misspelt, "V1Container") == [".volumeMount: no such field of V1Container"]
    with pytest.raises(ValueError):
        build({k: v for k, v in container.items() if k != "name"}, "V1Container")


def test_it_keeps_what_ftmem_needs_of_a_pod(recipe):
    config_map, jobset = recipe
    ftmem = json.loads(config_map["data"]["ds_config.json"])["ftmem"]
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod = job["template"]["spec"]
    container, = pod["containers"]
    # Restarts inside the pod: a failed container comes back in the same pod, its emptyDir kept.
    assert pod["restartPolicy"] == "OnFailure" and job["backoffLimit"] > 0
    # /dev/shm: memory, a limit, and the shm_dir ftmem uses.
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == ftmem["shm_dir"])
    shm = next(v for v in pod["volumes"] if v["name"] == mount["name"])["emptyDir"]
    assert shm["medium"] == "Memory" and _bytes(shm["sizeLimit"]) > 0
    # tmpfs pages count against the container's memory limit: the limit holds the slots and more.
    assert _bytes(container["resources"]["limits"]["memory"]) > _bytes(shm["sizeLimit"])
    # SIGKILL only after ftmem's flush at preemption had its grace.
    assert pod["terminationGracePeriodSeconds"] > ftmem["preemption"]["grace_s"]
    # One pod a node; the node rank the pod's index; as many ranks a pod as ftmem counts a node.
    args = dict(a.lstrip("-").split("=", 1) for a in container["args"] if a.startswith("--") and "=" in a)
    assert args["node-rank"] == "$(JOB_COMPLETION_INDEX)" and job["completionMode"] == "Indexed"
    assert int(args["nnodes"]) == job["parallelism"] == job["completions"]
    assert int(args["nproc-per-node"]) == ftmem["ranks_per_node"] and int(args["max-restarts"]) > 0
    assert "--load" in container["args"]  # a restart resumes
