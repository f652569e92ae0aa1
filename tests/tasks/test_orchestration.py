"""What a flow asks of a real Prefect API: its tags, whether another flow run is alive, and the
runs of its training run that died without saying so."""

from __future__ import annotations

import uuid

from tasks.orchestration import crash_orphaned_runs, flow_run_alive, holding_slot, tag_flow_run


def test_a_run_outside_prefect_has_no_flow_run_to_wait_for_and_no_limit_holds_nothing():
    assert not flow_run_alive("not-a-flow-run-id")
    assert tag_flow_run("run:x") is None and crash_orphaned_runs("f", "run:x") == []  # outside a flow run
    with holding_slot(None, wait_s=0):
        pass


def test_tags_liveness_and_orphans_as_the_api_holds_them(prefect_server):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    @flow(name="orphan-check")
    def tagged(run_tag: str) -> tuple[str, bool, list[str]]:
        from prefect.runtime import flow_run

        tag_flow_run(run_tag, "evaluator:generation")
        return flow_run.id, flow_run_alive(flow_run.id), crash_orphaned_runs("orphan-check", run_tag)

    run_tag = f"run:{uuid.uuid4().hex[:8]}"
    first_id, _, _ = tagged(run_tag)
    with get_client(sync_client=True) as client:  # a flow run of the same training run whose process died
        first = client.read_flow_run(uuid.UUID(first_id))
        dead = client.create_flow_run(tagged, tags=[run_tag], state=Running())
    second_id, alive, crashed = tagged(run_tag)
    assert alive and not flow_run_alive(first_id) and not flow_run_alive(str(uuid.uuid4()))
    assert crashed == [dead.name]
    with get_client(sync_client=True) as client:
        assert sorted(client.read_flow_run(uuid.UUID(second_id)).tags) == sorted([run_tag, "evaluator:generation"])
        assert run_tag in first.tags
        state = client.read_flow_run(dead.id).state
    assert state.is_crashed() and "resumed the training run" in state.message
