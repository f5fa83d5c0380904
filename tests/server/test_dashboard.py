"""The live dashboard of `flare run`: the figures it draws, and that redirected output never gets it."""

from __future__ import annotations

import asyncio
import re
import io
from types import SimpleNamespace

from rich.console import Console

from flare.engine.stats import EngineStats
from flare.engine.outputs import RequestOutput
from flare.server.generation import Generation
from flare.server.metrics import ServerMetrics
from flare.ui.dashboard import Dashboard, FinishedSequence, Figures, SequenceRecorder, TokenRates, render


def text_of(renderable, width: int = 110) -> str:
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def figures(**changes) -> Figures:
    values = dict(uptime_s=3725.0, running=3, waiting=2, finished_requests=1234, aborted_requests=4,
                  rejected_requests=2,
                  prompt_tokens=56789, generated_tokens=4321, prompt_tokens_per_s=812.5,
                  generated_tokens_per_s=97.25, kv_pages_used=30, kv_pages_total=120, prefix_hit_tokens=75,
                  prefix_miss_tokens=25, preemptions=7, page_integrity="ok",
                  recent=(FinishedSequence("stop", 12, 40, 0.035), FinishedSequence("aborted", 9, 0, None)))
    values.update(changes)
    return Figures(**values)


def test_rendered_figures_show_what_an_operator_reads():
    text = text_of(render("tiny-stories", "http://127.0.0.1:8000", figures()))
    assert "tiny-stories" in text and "http://127.0.0.1:8000/v1" in text
    assert "1h02m05s" in text                                          # uptime
    assert "3 running, 2 waiting, 1,234 finished (4 aborted), 2 rejected" in text
    assert "56,789 (812.5 tok/s)" in text and "4,321 (97.2 tok/s)" in text
    assert "30 / 120 pages (25.0%)" in text                            # KV cache
    assert "75.0% of 100 prompt tokens" in text                        # prefix cache hit rate
    assert re.search(r"Preemptions\s+7\s", text)
    assert re.search(r"Page integrity\s+ok\s", text)
    recent = text.split("Recent requests", 1)[1]
    lines = [line for line in recent.splitlines() if "stop " in line or "aborted " in line]
    assert "aborted" in lines[0] and "stop" in lines[1]               # the newest request first
    assert "35 ms" in lines[1] and "40" in lines[1] and "12" in lines[1]


def test_empty_engine_shows_no_made_up_rates():
    text = text_of(render("m", "http://h:1", figures(kv_pages_total=0, kv_pages_used=0, prefix_hit_tokens=0,
                                                      prefix_miss_tokens=0, recent=())))
    assert "0 / 0 pages (-)" in text and "- of 0 prompt tokens" in text and "none yet" in text


def test_token_rates_cover_only_the_recent_window():
    rates = TokenRates(window_s=5)
    assert rates.add(0.0, 0, 0) == (0.0, 0.0)
    assert rates.add(2.0, 100, 50) == (50.0, 25.0)
    rates.add(6.0, 100, 50)
    prompt, generated = rates.add(12.0, 100, 50)                       # nothing new for over five seconds
    assert (prompt, generated) == (0.0, 0.0)


def test_recorder_counts_streamed_tokens_ttft_and_how_sequences_ended():
    class StandInEngine:
        aborted: list = []

        async def generate(self, request_id, prompt_ids, params):
            if request_id == "a":
                yield RequestOutput(request_id, (5, 6), "ab")
                yield RequestOutput(request_id, (7,), "c", finished=True, finish_reason="length",
                                    num_prompt_tokens=4)
            else:                                       # a client that leaves before any token
                yield RequestOutput(request_id, (), "")

        def abort(self, request_id):
            self.aborted.append(request_id)

    async def consume(stream, first_only=False):
        async for _ in stream:
            if first_only:
                break
        await stream.aclose()

    generation = Generation(StandInEngine(), None, None, ServerMetrics(lambda: None))
    recorder = SequenceRecorder()
    generation.observer = recorder
    asyncio.run(consume(generation.stream_one("a", [1, 2, 3, 4], None)))
    asyncio.run(consume(generation.stream_one("b", [1, 2], None), first_only=True))
    generated, finished, aborted, recent = recorder.snapshot()
    assert (generated, finished, aborted) == (3, 2, 1)
    assert (recent[0].status, recent[0].prompt_tokens, recent[0].generated_tokens) == ("length", 4, 3)
    assert recent[0].ttft_s is not None and recent[0].ttft_s >= 0
    assert (recent[1].status, recent[1].generated_tokens, recent[1].ttft_s) == ("aborted", 0, None)
    assert StandInEngine.aborted == ["b"]


def test_figures_come_from_engine_stats_and_the_app_metrics():
    engine_stats = EngineStats(num_running=2, num_waiting=1, kv_pages_used=48, kv_pages_total=64,
                               num_preemptions=3, prefix_cache_hit_tokens=30, prefix_cache_miss_tokens=90,
                               page_integrity="ok")
    metrics = ServerMetrics(lambda: engine_stats)
    metrics.requests.labels(api="completions", outcome="ok").inc(5)
    metrics.requests.labels(api="chat_completions", outcome="error").inc(2)
    metrics.prompt_tokens.inc(640)
    state = SimpleNamespace(engine=SimpleNamespace(stats=lambda: engine_stats), metrics=metrics,
                            generation=SimpleNamespace(observer=None))
    dashboard = Dashboard(io.StringIO(), "m", "http://127.0.0.1:8000")
    dashboard.attach(state)
    now = dashboard.figures(now=100.0)
    assert (now.running, now.waiting, now.preemptions) == (2, 1, 3)
    assert (now.rejected_requests, now.prompt_tokens) == (2, 640)
    assert now.kv_usage == 0.75 and now.prefix_hit_rate == 0.25 and now.page_integrity == "ok"
    metrics.prompt_tokens.inc(160)
    assert dashboard.figures(now=102.0).prompt_tokens_per_s == 80.0
    assert "75.0%" in text_of(dashboard) and "25.0%" in text_of(dashboard)


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_only_a_usable_terminal_gets_the_dashboard(monkeypatch):
    monkeypatch.setenv("TERM", "xterm-256color")
    assert Dashboard.for_stream(io.StringIO(), "m", "http://h:1") is None        # redirected: plain lines
    assert isinstance(Dashboard.for_stream(Tty(), "m", "http://h:1"), Dashboard)
    monkeypatch.setenv("TERM", "dumb")
    assert Dashboard.for_stream(Tty(), "m", "http://h:1") is None


def test_live_display_draws_and_stops_on_a_terminal(monkeypatch):
    monkeypatch.setenv("TERM", "xterm-256color")
    stream = Tty()
    dashboard = Dashboard.for_stream(stream, "tiny-stories", "http://127.0.0.1:8000")
    dashboard.start()
    dashboard.stop()                                                     # the signal
    dashboard.stop()                                                     # and the finally after the stop
    shown = stream.getvalue()
    assert "tiny-stories" in shown and "Requests" in shown

