"""The promises every run file relies on: whole-file writes seen whole, appends that survive a
torn line, and errors that name the file and line."""

import threading

import pytest

from areal_eval import jsonl


def _at_once(count: int, work) -> list:
    """``work(i)`` in ``count`` threads released together; their results, or what they raised."""
    barrier, results = threading.Barrier(count), [None] * count

    def run(i):
        barrier.wait()
        try:
            results[i] = work(i)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_threads_of_one_process_replacing_one_file_at_once_all_succeed(tmp_path):
    # A flow following an in-process trainer writes the run id from two threads of one process.
    target = tmp_path / "run_id"

    def write_many(i):
        for _ in range(50):
            jsonl.write_atomic(target, f"writer-{i}")

    assert _at_once(8, write_many) == [None] * 8
    assert target.read_text() in {f"writer-{i}" for i in range(8)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run_id"]  # no temporary file left


def test_create_atomic_lets_exactly_one_writer_name_the_value(tmp_path):
    target = tmp_path / "run_id"
    created = _at_once(8, lambda i: jsonl.create_atomic(target, f"writer-{i}"))
    assert created.count(True) == 1
    assert target.read_text() == f"writer-{created.index(True)}"
    assert jsonl.create_atomic(target, "late") is False and target.read_text() != "late"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run_id"]


def test_an_append_after_a_torn_line_starts_a_fresh_line(tmp_path):
    path = tmp_path / "ledger.jsonl"
    jsonl.append(path, {"step": 1})
    with path.open("ab") as fh:
        fh.write(b'{"step": 2, "va')  # a writer killed mid-line
    jsonl.append(path, {"step": 3})
    lines = jsonl.read_complete(path).lines
    assert [n for n, _ in lines] == [1, 2, 3]
    with pytest.raises(jsonl.JsonlError, match=r"ledger.jsonl:2: not valid JSON"):
        jsonl.loads(lines[1][1], path, lines[1][0])
    assert jsonl.loads(lines[2][1], path, 3) == {"step": 3}


def test_read_complete_leaves_a_line_still_being_written_for_the_next_read(tmp_path):
    path = tmp_path / "manifest.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b"')
    first = jsonl.read_complete(path)
    assert [raw for _, raw in first.lines] == [b'{"a": 1}']
    with path.open("ab") as fh:
        fh.write(b": 2}\n")
    second = jsonl.read_complete(path, first.offset, first.line)
    assert second.lines == [(2, b'{"b": 2}')] and second.line == 3
