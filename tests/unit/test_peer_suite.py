"""How `make test-peer` (tests/harness/peer_suite.py) reads the outcomes of DeepSpeed's own
tests: a test that broke a rule in its first runs is judged on all its runs, a flake that
fails stock too is not held against ftmem, and one that always passes stock is a regression."""
from harness.peer_suite import table, verdict

UNIVERSAL = "unit/checkpoint/test_universal_checkpoint.py::TestZeROUniversalCheckpointDP::test_dp_world_size_2to4[x]"
FROZEN = "unit/checkpoint/test_zero_optimizer.py::TestZeROSaveLoadEdgeCase::test_save_exclude_frozen_weights[0]"


def test_a_test_that_did_not_pass_stock_in_one_of_its_runs_is_deepspeed_s_flake_and_else_a_regression():
    assert verdict(["passed", "hang", "passed"], ["hang", "passed", "passed"], UNIVERSAL)[1]
    assert verdict(["hang", "passed", "passed"], ["failed", "hang", "passed"], UNIVERSAL)[1]
    assert "flake" in verdict(["passed", "passed", "failed"], ["hang", "hang", "passed"], UNIVERSAL)[0]
    assert verdict(["passed", "passed", "passed"], ["hang", "passed", "passed"], UNIVERSAL) == (" **regression**",
                                                                                                 False)
    assert verdict(["passed", "passed", "passed"], ["passed", "failed", "passed"], UNIVERSAL)[1] is False
    assert verdict(["passed"], ["passed"], UNIVERSAL) == ("", True)
    assert verdict(["failed"], ["failed"], UNIVERSAL) == ("", True)  # it fails as it fails stock


def test_an_exception_by_design_is_named_and_the_table_gives_every_run_and_fails_on_a_regression():
    assert verdict(["passed"], ["failed"], FROZEN) == (
        " (by design: compares the sizes of checkpoint files on disk, where ftmem writes stubs)", True)
    flaky = {"stock": {UNIVERSAL: ["passed", "hang", "passed"]}, "ftmem": {UNIVERSAL: ["hang", "passed", "passed"]}}
    text, ok = table({"oldest": flaky}, {"oldest": 10.0})
    assert ok and "| passed, hang, passed | hang, passed, passed (DeepSpeed's own flake" in text, text
    steady = {"stock": {UNIVERSAL: ["passed", "passed", "passed"]}, "ftmem": {UNIVERSAL: ["hang", "passed", "passed"]}}
    text, ok = table({"oldest": steady}, {"oldest": 10.0})
    assert not ok and "**regression**" in text
