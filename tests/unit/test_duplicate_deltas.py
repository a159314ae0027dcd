"""A delta written twice to a stream (the worker's publish retried after Redis took it but
the reply was lost, e.g. Redis restarting) reaches the client once: both the non-streaming
accumulator and the SSE translator drop it by its position; a restarted attempt still
replays from position 0 as before."""

from __future__ import annotations

from api.openai.formatting import Accumulator, ResponseContext
from api.openai.streaming import StreamTranslator
from shared.contracts import DeltaEvent, RestartEvent

D0 = DeltaEvent(index=0, text="a", token_ids=[5], pos=0)
D1 = DeltaEvent(index=0, text="b", token_ids=[6], pos=1)
D2 = DeltaEvent(index=0, text="c", token_ids=[7], pos=2)


def test_the_accumulator_drops_a_repeated_delta() -> None:
    acc = Accumulator()
    for event in (D0, D1, D1, D2, D2):
        acc.add(event)
    assert acc.choices[0].text == "abc" and acc.choices[0].token_ids == [5, 6, 7]
    acc.add(RestartEvent(attempt=2, reason="worker lost"))
    for event in (D0, D0, D1):
        acc.add(event)
    assert acc.choices[0].text == "ab"


def test_the_stream_sends_a_repeated_delta_once_and_replays_after_a_restart() -> None:
    ctx = ResponseContext(endpoint="completions", job_id="job-1", model="m", created=0)
    translator = StreamTranslator(ctx)
    texts = []
    for event in (D0, D1, D1, RestartEvent(attempt=2, reason="lost"), D0, D1, D1, D2):
        texts += [c["choices"][0]["text"] for c in translator.on_event(event)]
    assert texts == ["a", "b", "c"]
