"""What a user's ``pip install`` gets: the library alone, and the tools that need the
source tree saying so in one line where it is absent."""
import os
import shutil
import subprocess
import sys
import zipfile

from harness.common import REPO

OWN_NAMES = {"ftmem", "ftmem_deepspeed", "ftmem_megatron", "ftmem_guard"}


def test_the_wheel_installs_no_top_level_name_but_ftmem_s_own(tmp_path):
    """Built from the project's files alone, as a fresh clone holds them (a checkout's own
    build/ folder may hold what an older build put there)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    source = tmp_path / "source"
    for name in tracked:
        if os.path.isfile(os.path.join(REPO, name)):
            os.makedirs(source / os.path.dirname(name), exist_ok=True)
            shutil.copy2(os.path.join(REPO, name), source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(tmp_path),
                    str(source)], check=True, capture_output=True, timeout=300)
    [wheel] = [f for f in os.listdir(tmp_path) if f.endswith(".whl")]
    with zipfile.ZipFile(tmp_path / wheel) as z:
        top = {name.split("/")[0] for name in z.namelist() if not name.split("/")[0].endswith(".dist-info")}
    assert top == OWN_NAMES


def test_a_tool_run_without_the_source_tree_says_so_in_one_line(tmp_path):
    """The library as a wheel installs it: no examples/ or benchmarks/ beside it."""
    shutil.copytree(os.path.join(REPO, "ftmem"), tmp_path / "ftmem")
    for command in (["bench", "save"], ["demo"]):
        out = subprocess.run([sys.executable, "-m", "ftmem.cli", *command], cwd=tmp_path, capture_output=True,
                             text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(tmp_path)))
        assert out.returncode == 2, out
        assert out.stdout == "" and len(out.stderr.splitlines()) == 1, out.stderr
        assert "run it from a checkout" in out.stderr, out.stderr
