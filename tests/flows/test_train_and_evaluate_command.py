"""The ``train-and-evaluate`` command around its flow: bad input in one line before anything
starts, the run's lock handed to the flow, and the config loaded once."""

import json
import time

import pytest

from areal_eval.runs.directory import RunBusy, RunDir, RunLock


def test_main_hands_its_run_lock_to_the_flow_so_no_owner_slips_in_between(tmp_path):
    import flows.train_and_evaluate as module

    run, other = RunDir(tmp_path / "run"), RunDir(tmp_path / "other")
    module._taken_by_main = RunLock(run).acquire()  # what main() does once the inputs check out
    with pytest.raises(RunBusy):
        RunLock(run).acquire()  # while Prefect starts
    with module.owning_run(run):
        with pytest.raises(RunBusy):
            RunLock(run).acquire()
    RunLock(run).acquire().release()  # the flow's end frees it

    module._taken_by_main = RunLock(run).acquire()
    with module.owning_run(other):  # a lock for another run is not kept
        RunLock(run).acquire().release()
        with pytest.raises(RunBusy):
            RunLock(other).acquire()


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--config", "/no/such/config.yaml"], "error: /no/such/config.yaml: no such config file"),
        (["--set", "work_dir=/proc/1"], "error: /proc/1/demo: No such file or directory"),
        (["--set", "run_name=" + "x" * 300], "error: run_name: 'x"),
        (["--set", "poll_interval_s=1e400"], "error: poll_interval_s: must be a finite number, got inf"),
        (["--set", "data.valid_path={not_utf8}"], "error: {not_utf8}:2: not UTF-8 text (byte 15: b'\\xe9')"),
    ],
)
def test_bad_input_is_one_line_naming_its_field_or_file_and_line(tmp_path, capsys, argv, line):
    from flows.train_and_evaluate import main

    not_utf8 = tmp_path / "valid.jsonl"
    not_utf8.write_bytes(b'{"chosen": "a", "rejected": "b"}\n{"chosen": "caf\xe9", "rejected": "x"}\n')
    argv = [a.format(not_utf8=not_utf8) for a in argv]
    assert main([*argv, "--set", f"work_dir={tmp_path}"] if "work_dir" not in argv[-1] else argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(line.format(not_utf8=not_utf8)), err


def test_the_command_its_flow_runs_name_and_its_body_load_the_config_once(tmp_path):
    from flows.train_and_evaluate import run_config

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"work_dir": str(tmp_path), "run_name": "once"}))
    first = run_config(None, str(config), ["train.max_steps=8"])
    assert run_config(None, str(config), ["train.max_steps=8"]) is first and first.train.max_steps == 8
    assert run_config(None, str(config), ["train.max_steps=9"]).train.max_steps == 9  # other inputs: loaded
    time.sleep(0.01)
    config.write_text(json.dumps({"work_dir": str(tmp_path), "run_name": "edited"}))
    assert run_config(None, str(config), ["train.max_steps=8"]).run_name == "edited"  # an edited file: read again
