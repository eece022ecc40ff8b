"""The megatron-core GPT driver (real megatron-core on CPU, gloo) and its
``--ckpt-format torch`` checkpoints: Megatron-LM's layout and keys, and a resume from
them bitwise equal to an uninterrupted run (per-iteration losses and every rank's
final parameters and optimizer state)."""
import os
import shutil

import pytest
import torch

from harness.common import job_id, read_json
from harness.megatron_jobs import TINY_GPT
from harness.ranks import LocalJob

ITERS, SAVE_INTERVAL, TIMEOUT = 6, 3, 120



def run_driver(world: int, log_dir: str, *args: str) -> None:
    os.makedirs(log_dir, exist_ok=True)
    with LocalJob("examples.megatron.pretrain_gpt", TINY_GPT + list(args), world, job_id(), log_dir) as job:
        codes = job.wait(TIMEOUT)
        assert codes == [0] * world, "\n".join(job.log(r)[-3000:] for r in range(world))


@pytest.mark.parametrize("world, parallel, rank_dirs", [
    (2, ["--tensor-model-parallel-size", "2"], ["mp_rank_00", "mp_rank_01"]),
    (2, ["--pipeline-model-parallel-size", "2"], ["mp_rank_00_000", "mp_rank_00_001"]),
    (2, ["--use-distributed-optimizer"], ["mp_rank_00"]),  # DP 2: one writer
], ids=["tp2", "pp2", "dp2-distributed-optimizer"])
def test_resume_from_torch_checkpoint_is_bitwise(world, parallel, rank_dirs, tmp_path):
    save = str(tmp_path / "ckpt")
    run_driver(world, str(tmp_path / "reference"), *parallel, "--save", save,
               "--save-interval", str(SAVE_INTERVAL), "--out", str(tmp_path / "reference.json"))
    reference = read_json(str(tmp_path / "reference.json"))
    assert sorted(reference["losses"], key=int) == [str(i) for i in range(1, ITERS + 1)]

    assert sorted(os.listdir(save)) == ["iter_0000003", "iter_0000006", "latest_checkpointed_iteration.txt"]
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == str(ITERS)
    assert sorted(os.listdir(os.path.join(save, "iter_0000003"))) == rank_dirs
    state = torch.load(os.path.join(save, "iter_0000003", rank_dirs[-1], "model_optim_rng.pt"), weights_only=False)
    assert {"args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler", "rng_state",
            "num_floating_point_operations_so_far"} <= state.keys()
    # One RNG entry, the writer's: Megatron-LM 0.19.2 gathers every DP rank's only with --data-parallel-random-init.
    assert state["iteration"] == 3 and len(state["rng_state"]) == 1

    # The state a crash between the saves of iterations 3 and 6 leaves behind.
    shutil.rmtree(os.path.join(save, "iter_0000006"))
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    run_driver(world, str(tmp_path / "resumed"), *parallel, "--load", save, "--out", str(tmp_path / "resumed.json"))
    resumed = read_json(str(tmp_path / "resumed.json"))
    assert "successfully loaded checkpoint" in LocalJob.read_log(str(tmp_path / "resumed"), 0)
    assert resumed["losses"] == {str(i): reference["losses"][str(i)] for i in range(SAVE_INTERVAL + 1, ITERS + 1)}
    assert resumed["digests"] == reference["digests"]


def test_only_the_torch_checkpoint_format_is_supported():
    from examples.megatron.pretrain_gpt import parse_args

    with pytest.raises(SystemExit):
        parse_args(TINY_GPT + ["--ckpt-format", "torch_dist"])
    assert parse_args(TINY_GPT + ["--ckpt-format", "torch"]).ckpt_format == "torch"
