"""The forked-ranks agent, apart from the jobs it runs (those: tests/launchers/test_local.py and
every evaluation test)."""

from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from areal_eval.launchers.forked_ranks import cheap_rendezvous_event_names


class Handler:
    """As torch's rendezvous handlers name their events: from a method, after its caller."""

    def _record(self) -> str:
        return dynamic_rendezvous.get_method_name()

    def next_rendezvous(self) -> str:
        return self._record()


def test_rendezvous_events_keep_torchs_names_without_reading_the_stack(monkeypatch):
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", dynamic_rendezvous.get_method_name)
    named_by_torch = Handler().next_rendezvous()
    cheap_rendezvous_event_names()
    assert dynamic_rendezvous.get_method_name.__module__ != "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
    assert Handler().next_rendezvous() == named_by_torch == "next_rendezvous"
    assert dynamic_rendezvous.get_method_name(10_000) == "no_method_name"
