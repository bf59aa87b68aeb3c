"""What a preemption needs between the scheduler's signal and its kill, as the run records it."""

import json
import logging

from difftrain.train.health import LEAD_FILE, PreemptLead


def test_the_need_is_the_longest_step_a_checkpoint_and_a_margin_and_a_short_lead_warns_once(tmp_path, caplog):
    events = []
    lead = PreemptLead(tmp_path, configured_s=30, on_event=lambda kind, step, **kw: events.append((kind, step, kw)),
                       window=3)
    for s in (9.0, 2.0, 1.0, 1.5):           # the 9 s step has left the window of 3
        lead.step(s)
    with caplog.at_level(logging.WARNING, logger="difftrain.health"):
        rec = lead.saved(100, write_s=4.0)
        assert rec == json.loads((tmp_path / LEAD_FILE).read_text())
        assert rec["step_s"] == 2.0 and rec["save_s"] == 4.0 and rec["margin_s"] == 15.0
        assert rec["lead_needed_s"] == 21.0 and rec["shutdown_timeout_s"] == 21 and rec["configured_lead_s"] == 30
        assert not events and not caplog.records               # 30 s is enough
        lead.step(20.0)                                         # a slow step
        lead.saved(200, write_s=40.0)                           # 20 + 40 + 15 = 75 s > 30 s: warn
        lead.saved(300, write_s=40.0)                           # once per start
    assert [(k, s) for k, s, _ in events] == [("preempt_lead_short", 200)]
    assert events[0][2] == {"configured_s": 30, "needed_s": 75.0}
    assert len(caplog.records) == 1 and "health.preempt_lead_s = 30" in caplog.text and "75.0 s" in caplog.text
    assert json.loads((tmp_path / LEAD_FILE).read_text())["step"] == 300


def test_no_configured_lead_records_without_warning(tmp_path, caplog):
    lead = PreemptLead(tmp_path, configured_s=0)
    lead.step(100.0)
    with caplog.at_level(logging.WARNING, logger="difftrain.health"):
        rec = lead.saved(5, write_s=200.0)
    assert rec["lead_needed_s"] == 375.0 and rec["configured_lead_s"] is None and not caplog.records
