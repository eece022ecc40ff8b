"""Megatron-LM 0.19.2 with ftmem, both ways: patches/megatron-lm-0.19.2-ftmem.patch
applied to its sources, and ftmem_megatron.install() on the unpatched sources, in the
trees ``make megatron-lm`` builds (tests/harness/megatron_lm/build_env.py; each tree's own
``megatron/core`` is used instead of the installed megatron-core).

Each probe runs Megatron's own parse_and_validate_args / validate_args with a tiny GPT
config, then calls save_checkpoint (non-persistent, and persistent with --ckpt-format
torch), load_checkpoint and the blocking maybe_finalize_async_save through the names
megatron.training.training uses. No process groups exist in the probe, so ftmem's real
functions (not mocks) are entered and stop where they first need them (parallel_state);
the traceback shows the dispatch into ftmem_megatron.checkpointing.
tests/integration/megatron/test_megatron_lm.py runs Megatron-LM's whole training loop.
"""
import json
import os
import re
import subprocess
import sys
import textwrap

from harness.common import REPO
from harness.megatron_jobs import TREES

VERSION = "0.19.2"

PROBE = textwrap.dedent('''
    import contextlib, io, json, os, re, sys, traceback

    mode, tree, ckpt_dir = sys.argv[1:4]
    import megatron.core
    from megatron.core import package_info
    import megatron.training.arguments as A
    import megatron.training.checkpointing as C
    import megatron.training.training as T

    out = {"core": megatron.core.__file__, "version": package_info.__version__,
           "native": getattr(C, "FTMEM_NATIVE", False)}
    stock = {"validate": A.validate_args, "save": C.save_checkpoint, "load": C.load_checkpoint}

    import ftmem_megatron
    out["lazy"] = "ftmem_megatron.megatron_lm" not in sys.modules
    ftmem_megatron.install()
    ftmem_megatron.install()
    out["validate_wrapped"] = A.validate_args is not stock["validate"]
    out["save_wrapped"] = C.save_checkpoint is not stock["save"]
    out["training_names_routed"] = T.save_checkpoint is C.save_checkpoint and T.load_checkpoint is C.load_checkpoint
    if mode == "installer":
        out["wrapped_once"] = (getattr(A.validate_args, "__wrapped__", None) is stock["validate"]
                               and getattr(C.save_checkpoint, "__wrapped__", None) is stock["save"]
                               and getattr(C.load_checkpoint, "__wrapped__", None) is stock["load"])

    BASE = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
            "--train-iters", "10", "--lr", "1e-4", "--save-interval", "1000",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--save", ckpt_dir, "--load", ckpt_dir]
    IN_MEMORY = ["--non-persistent-ckpt-type", "in_memory", "--non-persistent-save-interval", "1"]

    # Megatron's own entry point, as pretrain_gpt.py calls it (sets the global args).
    sys.argv = BASE + IN_MEMORY + ["--ftmem-ec-k", "1", "--ftmem-ec-m", "1", "--ftmem-ranks-per-node", "1"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        args = A.parse_and_validate_args()
    out["good"] = [args.non_persistent_ckpt_type, args.non_persistent_save_interval, args.ftmem_ec_k,
                   args.ftmem_ec_m, args.ftmem_ranks_per_node, args.data_parallel_size]
    out["leftover_attrs"] = [k for k in vars(args) if k.startswith("_ftmem")]
    out["printed_in_memory"] = bool(re.search(r"non_persistent_ckpt_type \\.+ in_memory", printed.getvalue()))

    def rejected(extra):
        sys.argv = BASE + extra
        bad = A.parse_args()
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                A.validate_args(bad, {})
        except Exception as e:
            return [type(e).__name__, str(e)]
        return None

    out["bad"] = {
        "k_without_m": rejected(IN_MEMORY + ["--ftmem-ec-k", "1"]),
        "no_interval": rejected(["--non-persistent-ckpt-type", "in_memory"]),
        "flags_without_in_memory": rejected(["--ftmem-ec-k", "1", "--ftmem-ec-m", "1"]),
        "group_too_big": rejected(IN_MEMORY + ["--ftmem-ec-k", "2", "--ftmem-ec-m", "1",
                                               "--ftmem-ranks-per-node", "1"]),
        "async_save": rejected(IN_MEMORY + ["--ftmem-ec-k", "1", "--ftmem-ec-m", "1", "--async-save",
                                            "--ckpt-format", "torch"]),
    }
    if mode == "patched":
        # Without ftmem installed, the patched Megatron-LM names the package to install.
        saved = {k: v for k, v in sys.modules.items() if k == "ftmem_megatron" or k.startswith("ftmem_megatron.")}
        sys.modules["ftmem_megatron"] = None  # find_spec() -> None, import -> ImportError
        try:
            out["without_ftmem"] = rejected(IN_MEMORY)
        finally:
            sys.modules.update(saved)

    # ftmem_megatron's own megatron-core imports resolve to the wheel's 0.19.2 core.
    import ftmem_megatron.checkpointing, ftmem_megatron.sharded_state  # noqa: E401
    out["adapter_core"] = sorted({sys.modules[m].__file__ for m in (
        "megatron.core.dist_checkpointing.mapping", "megatron.core.dist_checkpointing.dict_utils",
        "megatron.core.parallel_state", "megatron.core.tensor_parallel", "megatron.core.utils")})

    def frames(call):
        try:
            call()
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}",
                    "frames": [f"{f.filename}:{f.name}" for f in traceback.extract_tb(e.__traceback__)]}
        return {"error": None, "frames": []}

    # What train_step's save_checkpoint_and_time and setup_model_and_optimizer call.
    out["save"] = frames(lambda: T.save_checkpoint(7, [], None, None, 0.0, None, non_persistent_ckpt=True))
    out["load"] = frames(lambda: T.load_checkpoint([], None, None, checkpointing_context=None))
    out["persistent_save"] = frames(lambda: T.save_checkpoint(7, [], None, None, 0.0, None))
    # With --ckpt-format torch, ftmem writes persistent checkpoints from memory.
    args.ckpt_format = "torch"
    out["persistent_save_torch"] = frames(lambda: T.save_checkpoint(7, [], None, None, 0.0, None))
    # Megatron's blocking end of async saves (before it exits) waits for ftmem's flush:
    # the real wait_flushed, counted on its way through.
    import ftmem_megatron.checkpointing as F
    real_wait, waits = F.wait_flushed, []
    F.wait_flushed = lambda: (waits.append(1), real_wait())[1]
    T.maybe_finalize_async_save(blocking=True)
    T.maybe_finalize_async_save(blocking=False)
    out["finalize_waits"] = len(waits)
    # After ftmem found nothing newer, Megatron's disk load looks for no non-persistent checkpoint.
    try:
        out["disk_non_persistent_iteration"] = C._get_non_persistent_iteration(ckpt_dir, args)
    except Exception as e:
        out["disk_non_persistent_iteration"] = f"{type(e).__name__}: {e}"
    print("RESULT " + json.dumps(out))
''')


def _probe(mode: str, tree: str, tmp_path) -> dict:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, REPO]), WORLD_SIZE="2", RANK="0",
               PYTHONDONTWRITEBYTECODE="1")
    env.pop("LOCAL_WORLD_SIZE", None)
    out = subprocess.run([sys.executable, str(probe), mode, tree, str(tmp_path / "ckpt")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def _check_arguments(result: dict, tree: str) -> None:
    # (Megatron appends the git hash of the checkout around the tree: "0.19.2+91afaed")
    assert result["core"].startswith(tree) and result["version"].split("+")[0] == VERSION, result["core"]
    assert all(path.startswith(tree) for path in result["adapter_core"]), result["adapter_core"]
    assert result["lazy"], "import ftmem_megatron imported the Megatron-LM hooks before install()"
    assert result["good"] == ["in_memory", 1, 1, 1, 1, 2]
    assert result["leftover_attrs"] == [] and result["printed_in_memory"]
    bad = result["bad"]
    assert bad["k_without_m"][0] == "ConfigError", bad
    assert "--ftmem-ec-k and --ftmem-ec-m go together" in bad["k_without_m"][1]
    assert bad["no_interval"][0] == "ConfigError" and "needs --non-persistent-save-interval" in bad["no_interval"][1]
    assert bad["flags_without_in_memory"][0] == "ConfigError", bad
    assert "only apply to in-memory checkpoints" in bad["flags_without_in_memory"][1]
    assert bad["group_too_big"][0] == "ConfigError" and "needs groups of 3 nodes" in bad["group_too_big"][1]
    assert bad["async_save"][0] == "ConfigError", bad
    assert "--async-save does not go with --non-persistent-ckpt-type in_memory" in bad["async_save"][1]


def _check_dispatch(result: dict, dispatcher: str, tree: str) -> None:
    """``dispatcher`` (file:function) calls ftmem_megatron.checkpointing's function of the
    same name, which runs until it needs the process groups."""
    ftmem_ckpt = os.path.join(REPO, "ftmem_megatron", "checkpointing.py")
    for name, call in (("save", result["save"]), ("load", result["load"]), ("save", result["persistent_save_torch"])):
        frames = call["frames"]
        entered = f"{ftmem_ckpt}:{name}_checkpoint"
        assert entered in frames, call
        assert frames[frames.index(entered) - 1] == f"{dispatcher}:{name}_checkpoint", call
        assert frames[-1].startswith(os.path.join(tree, "megatron", "core", "parallel_state.py")), call
        assert "is not initialized" in call["error"], call
    persistent = result["persistent_save"]["frames"]
    assert persistent and not any(f.startswith(ftmem_ckpt) for f in persistent), result["persistent_save"]
    assert result["disk_non_persistent_iteration"] == -1
    assert result["finalize_waits"] == 1  # the blocking call only


def test_patch_applies_cleanly():
    """The build applied the patch (and stops where it does not apply cleanly)."""
    with open(os.path.join(os.path.dirname(TREES["patch"]), "patch.log")) as f:
        applied = f.read()
    assert applied.count("patching file") == 3 and not re.search(r"offset|fuzz|reversed|rej", applied), applied
    with open(os.path.join(TREES["patch"], "megatron", "training", "checkpointing.py")) as f:
        assert "FTMEM_NATIVE = True" in f.read()


def test_patched_megatron_lm_parses_and_dispatches_to_ftmem(tmp_path):
    tree = TREES["patch"]
    result = _probe("patched", tree, tmp_path)
    assert result["native"] is True
    # install() sees the patch and changes nothing.
    assert not result["validate_wrapped"] and not result["save_wrapped"] and result["training_names_routed"]
    _check_arguments(result, tree)
    without = result["without_ftmem"]
    assert without[0] == "RuntimeError" and 'pip install "ftmem[megatron]"' in without[1], without
    _check_dispatch(result, os.path.join(tree, "megatron", "training", "checkpointing.py"), tree)


def test_installer_on_unpatched_megatron_lm(tmp_path):
    tree = TREES["installer"]
    result = _probe("installer", tree, tmp_path)
    assert result["native"] is False
    assert result["validate_wrapped"] and result["save_wrapped"] and result["training_names_routed"]
    assert result["wrapped_once"], "a second install() wrapped the hooks again"
    _check_arguments(result, tree)
    _check_dispatch(result, os.path.join(REPO, "ftmem_megatron", "megatron_lm.py"), tree)
