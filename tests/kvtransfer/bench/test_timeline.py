"""The cross-process time line of a transfer: events split by transfer, medians per step."""

from __future__ import annotations

from kvtransfer.bench import timeline


def test_events_of_both_ends_are_split_by_transfer_and_medians_taken_per_step() -> None:
    us = 1000  # ns
    sender = [(0, "submit>"), (50 * us, "send:Header"), (400 * us, "recv:Ack"),
              (1000 * us, "submit>"), (1070 * us, "send:Header"), (1500 * us, "recv:Ack"),
              (2000 * us, "submit>"), (2060 * us, "send:Header"), (2060 * us, "send:Header"),
              (2300 * us, "recv:Ack")]  # fmt: skip
    receiver = [
        (90 * us, "recv:Header"),
        (1110 * us, "recv:Header"),
        (2080 * us, "recv:Header"),
        (-5 * us, "recv:Header"),
    ]  # fmt: skip  (before any transfer: dropped)
    rows = timeline.breakdown(sender, receiver)
    assert [r["step"] for r in rows] == ["tx submit>", "tx send:Header", "rx recv:Header",
                                         "tx recv:Ack"]  # fmt: skip
    by = {r["step"]: r for r in rows}
    assert by["tx send:Header"] == {"step": "tx send:Header", "median_us": 60.0, "count": 3}
    assert by["rx recv:Header"]["median_us"] == 90.0 and by["tx recv:Ack"]["median_us"] == 400.0
    # the first transfer skipped (a warm-up), and a window that cuts the ack off
    late = timeline.breakdown(sender, receiver, skip=1, window_ms=0.2)
    assert {r["step"]: r["count"] for r in late} == {"tx submit>": 2, "tx send:Header": 2,
                                                      "rx recv:Header": 2}  # fmt: skip


def test_install_records_the_control_messages_of_this_process() -> None:
    from kvtransfer.control import ControlConn

    original = ControlConn.send
    try:
        timeline.install("receiver")
        assert ControlConn.send is not original
        timeline.mark("here")
        assert [label for _, label in timeline.take()] == ["here"] and timeline.take() == []
    finally:
        ControlConn.send = original  # type: ignore[method-assign]
        from kvtransfer.control import ControlConn as C
        from kvtransfer.expectations import ExpectationRegistry
        from kvtransfer.staging import DeviceIds

        for cls, name in ((C, "recv"), (DeviceIds, "upload"), (ExpectationRegistry, "claim"),
                          (ExpectationRegistry, "complete")):  # fmt: skip
            setattr(cls, name, getattr(cls, name).__wrapped__)
