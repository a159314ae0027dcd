"""Feeds the worker's Prometheus metrics from engine stats and published tokens."""

from __future__ import annotations

from shared.metrics import WorkerMetrics
from worker.engine.engine import EngineStats, SequenceOutput
from worker.job_state import JobState


class WorkerMetricsRecorder:
    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics
        self._last = EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0)
        self.num_generation_tokens = 0  # the heartbeat's tokens/s reads this

    def observe_job_started(self, job: JobState) -> None:
        timings = job.timings
        if timings.queued_at is not None and timings.started_at is not None:
            self.metrics.queue_time.observe(max(timings.started_at - timings.queued_at, 0.0))
        endpoint = job.payload.endpoint
        self.metrics.prompt_tokens.labels(endpoint=endpoint).inc(len(job.prompt_token_ids))
        self.metrics.throughput_tokens.labels(kind="prompt").inc(len(job.prompt_token_ids))

    def observe_token(self, job: JobState, previous_token_at: float | None) -> None:
        now = job.last_token_at or 0.0
        if previous_token_at is None:
            if job.timings.queued_at is not None:
                self.metrics.time_to_first_token.observe(max(now - job.timings.queued_at, 0.0))
        else:
            self.metrics.inter_token_latency.observe(max(now - previous_token_at, 0.0))

    def observe_job_finished(self, job: JobState) -> None:
        timings = job.timings
        if timings.queued_at is not None and timings.finished_at is not None:
            self.metrics.e2e_latency.observe(max(timings.finished_at - timings.queued_at, 0.0))

    def observe_steps(self, batches: list[list[SequenceOutput]]) -> None:
        for outputs in batches:
            # an embedding step's outputs generate nothing (their inputs count as prompt)
            num_tokens = sum(len(o.new_token_ids) for o in outputs if isinstance(o, SequenceOutput))
            self.num_generation_tokens += num_tokens
            self.metrics.generation_tokens.inc(num_tokens)
            self.metrics.throughput_tokens.labels(kind="generation").inc(num_tokens)
            self.metrics.batch_size.observe(len(outputs))

    def observe_stats(self, stats: EngineStats) -> None:
        m = self.metrics
        m.kv_cache_usage_bytes.set(stats.num_blocks_used * stats.kv_bytes_per_block)
        m.kv_cache_usage_ratio.set(stats.num_blocks_used / max(stats.num_blocks_total, 1))
        m.num_running.set(stats.num_running)
        m.num_waiting.set(stats.num_waiting)
        m.preemptions.inc(max(stats.num_preemptions_total - self._last.num_preemptions_total, 0))
        m.prefix_cache_queries.inc(
            max(stats.num_prefix_query_tokens - self._last.num_prefix_query_tokens, 0)
        )
        m.prefix_cache_hits.inc(
            max(stats.num_prefix_hit_tokens - self._last.num_prefix_hit_tokens, 0)
        )
        self._observe_speculation(stats)
        for kind, threads in stats.step_threads.items():
            m.step_threads.labels(kind=kind).set(threads)
        m.step_thread_switches.inc(
            max(stats.num_thread_switches - self._last.num_thread_switches, 0)
        )
        self._last = stats

    def _observe_speculation(self, stats: EngineStats) -> None:
        m = self.metrics
        m.spec_draft_tokens.inc(
            max(stats.num_spec_draft_tokens - self._last.num_spec_draft_tokens, 0)
        )
        m.spec_accepted_tokens.inc(
            max(stats.num_spec_accepted_tokens - self._last.num_spec_accepted_tokens, 0)
        )
        m.spec_acceptance_rate.set(stats.spec_acceptance_rate)
        m.tokens_per_decode_step.set(stats.tokens_per_decode_step)
