import json

import pytest

from areal_eval import jsonl
from areal_eval.runs.ledger import Ledger, LedgerEntry


def test_the_last_line_of_a_step_wins_and_survives_a_reopen(tmp_path):
    ledger = Ledger(tmp_path / "ledger.jsonl")
    ledger.append(LedgerEntry(5, "/c5", "scheduled", "moving"))
    ledger.append(LedgerEntry(5, "/c5", "evaluated", "moving", {"accuracy": 0.5}))
    ledger.append(LedgerEntry(10, "/c10", "skipped", "plateau"))
    again = Ledger(tmp_path / "ledger.jsonl")
    assert [(e.step, e.status) for e in again.entries()] == [(5, "evaluated"), (10, "skipped")]
    assert again.latest(5).metrics == {"accuracy": 0.5}


def test_failed_attempts_stay_on_record_until_an_entry_names_its_own(tmp_path):
    ledger = Ledger(tmp_path / "ledger.jsonl")
    ledger.append(LedgerEntry(5, "/c5", "scheduled", attempts=["transient: worker died"]))
    kept = ledger.append(LedgerEntry(5, "/c5", "evaluated", metrics={"accuracy": 0.5}))
    assert kept.attempts == ["transient: worker died"] and kept.failed_attempts == 1
    more = ledger.append(LedgerEntry(5, "/c5", "failed", attempts=["transient: worker died", "permanent: bad"]))
    assert more.failed_attempts == 2
    assert Ledger(tmp_path / "ledger.jsonl").latest(5).attempts == more.attempts


def test_a_run_without_probes_or_failures_writes_lines_without_those_fields(tmp_path):
    ledger = Ledger(tmp_path / "ledger.jsonl")
    ledger.append(LedgerEntry(0, "/c0", "evaluated", metrics={"accuracy": 0.5}))
    row = json.loads((tmp_path / "ledger.jsonl").read_text())
    assert "probe" not in row and "probe_metrics" not in row and "attempts" not in row


def test_a_torn_last_line_is_skipped_and_a_wrong_field_names_its_line(tmp_path):
    path = tmp_path / "ledger.jsonl"
    Ledger(path).append(LedgerEntry(0, "/c0", "scheduled"))
    with path.open("a") as f:
        f.write('{"step": 0, "uri": "/c0", "sta')
    torn = Ledger(path)
    assert torn.latest(0).status == "scheduled" and torn.problems
    path.write_text(json.dumps({"step": 0, "uri": "/c0", "status": "evaluated", "colour": "red"}) + "\n")
    with pytest.raises(jsonl.JsonlError, match=r"ledger.jsonl:1: bad ledger entry"):
        Ledger(path)
