"""Batched sampling: logit processors, filters, seeded draws and logprobs, one call per step.

Per-request parameters become batch tensors once per call. Order, as in vLLM: grammar
bitmasks (constrained rows only, see `structured.py`), logit bias and
min_tokens masks, penalties, then greedy argmax for temperature-0 rows; for the others
temperature, min_p, top_k, top_p and an exponential race (argmax of probs / Exp(1) noise),
done in log space as argmax(logits - log(noise)). A seeded request draws its noise from its
own generator, so its tokens do not depend on the rest of the batch. Logprobs come from the
raw logits, before any processing.

Speculative decoding passes a request once per position it verifies (rows in position
order). Each row is sampled from that position's own distribution with fresh noise, and a
draft stands only where it equals the token drawn there; this is rejection sampling for a
point-mass draft (draft d kept with probability p(d); otherwise a token from p with d
removed, renormalised), so the distribution is exactly that of plain decoding. A seeded
request's draws for rows that were not used are undone (`rewind`), so its tokens are the
same with speculation on or off.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future

import torch

from worker.engine.core.outputs import SampledToken, TopToken
from worker.engine.core.request import Request
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.grammar_matcher import apply_bitmask, fill_bitmask, start_bitmask
from worker.layers import native

_NEG_INF = float("-inf")
_MIN_UNIFORM = 1e-20
# Tokens examined before a full sort when top_p is set without top_k.
_TOP_P_CANDIDATES = 1024


class Sampler:
    """Samples one token per row of a [S, V] logits tensor; keeps per-request generators."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._masks: tuple[Sequence[Request], Future[torch.Tensor]] | None = None
        # Generator states before each seeded draw of the latest `sample` call, per request.
        self._states_before_draws: dict[str, list[torch.Tensor]] = {}

    def release(self, request_ids: Iterable[str]) -> None:
        """Drop per-request state (seeded generators) of finished or aborted requests."""
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def begin(self, requests: Sequence[Request]) -> None:
        """Start filling the grammar masks of this step's rows (called before the forward;
        `sample` with the same rows waits for them)."""
        matchers = [r.grammar for r in requests if r.grammar is not None]
        self._masks = (requests, start_bitmask(matchers)) if matchers else None

    def _apply_grammars(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Constrained rows keep only the tokens their grammar allows; other rows untouched."""
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        pending, self._masks = self._masks, None
        if not rows:
            return
        if pending is not None and pending[0] is requests:
            bitmask = pending[1].result()
        else:
            bitmask = fill_bitmask([requests[i].grammar for i in rows])  # type: ignore[misc]
        apply_bitmask(logits, rows, bitmask)

    def rewind(self, request_id: str, num_rows: int) -> None:
        """Undo the random draws of the request's last `num_rows` rows in the latest call."""
        states = self._states_before_draws.get(request_id)
        generator = self._generators.get(request_id)
        if states and generator is not None and num_rows > 0:
            generator.set_state(states[-num_rows])

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[SampledToken]:
        """Pick a token for each row; row i of `logits` (float32, or the model's dtype: widened
        here where anything but the argmax reads them) belongs to `requests[i]`.

        A request may own several rows (consecutive positions, in order): each is sampled as
        its own decode step would be.
        """
        if len(requests) != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logits rows for {len(requests)} requests")
        self._states_before_draws.clear()
        if _is_plain_greedy(requests):
            return [SampledToken(token_id) for token_id in first_max(logits).tolist()]
        raw_logits = logits.float()
        processed = raw_logits.clone()
        self._apply_grammars(processed, requests)
        _apply_logit_bias(processed, requests)
        _apply_min_tokens(processed, requests)
        _apply_penalties(processed, requests)
        token_ids = self._choose(processed, requests)
        return _with_logprobs(raw_logits, token_ids, requests)

    def _choose(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        token_ids = first_max(logits)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            subset = [requests[i] for i in random_rows]
            if all(_is_cut_only(r.sampling_params) for r in subset):
                token_ids[rows] = self._race_among_candidates(logits.index_select(0, rows), subset)
            else:
                filtered = _filter(logits.index_select(0, rows), subset)
                noise = self._noise(filtered, subset)
                token_ids[rows] = first_max(filtered - noise.log())
        return token_ids

    def _race_among_candidates(
        self, logits: torch.Tensor, requests: Sequence[Request]
    ) -> torch.Tensor:
        """The exponential race restricted to each row's top-k/top-p survivors.

        Same winner as the full-vocabulary race (the other tokens are -inf there), but noise,
        log and argmax touch [S, n] candidates instead of [S, V]: for 64 rows x 49k tokens
        with top_p this is most of the sampler's time. Seeded rows still draw their full
        vocabulary noise and read it at the candidates, so their tokens do not change.
        """
        params = [r.sampling_params for r in requests]
        logits = logits / _column([p.temperature for p in params], logits)
        values, indices, num_kept = _top_candidates(logits, params)
        keep = values >= values.gather(1, num_kept - 1)  # ties with the cut-off are kept
        uniform = torch.rand(values.shape, device=logits.device)
        for row, request in enumerate(requests):
            if request.sampling_params.seed is not None:
                uniform[row] = self._seeded_uniform(request, logits)[indices[row]]
        noise = uniform.clamp_(min=_MIN_UNIFORM).log_().neg_()
        race = (values - noise.log()).masked_fill_(~keep, _NEG_INF)
        return indices.gather(1, first_max(race).unsqueeze(1)).squeeze(1)

    def _noise(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """Exp(1) noise per row (-log U): seeded rows from their own generator, others shared."""
        uniform = torch.rand_like(logits)
        for row, request in enumerate(requests):
            if request.sampling_params.seed is not None:
                uniform[row] = self._seeded_uniform(request, logits)
        return uniform.clamp_(min=_MIN_UNIFORM).log_().neg_()

    def _seeded_uniform(self, request: Request, logits: torch.Tensor) -> torch.Tensor:
        """One row of uniforms over the vocabulary from the request's own generator."""
        generator = self._generator(request, logits.device)
        states = self._states_before_draws.setdefault(request.request_id, [])
        states.append(generator.get_state())
        return torch.rand(logits.shape[1], generator=generator, device=logits.device)

    def _generator(self, request: Request, device: torch.device) -> torch.Generator:
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(request.sampling_params.seed)
            self._generators[request.request_id] = generator
        return generator


def first_max(values: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: its first largest value (a NaN counts as largest), as
    `argmax(dim=-1)` gives it, from `max`'s kernel, the faster one on CPU; bf16 logits on the
    native kernels as they are, with no float32 copy (docs/benchmarks.md)."""
    if values.dtype == torch.bfloat16 and values.dim() == 2 and native.serves(values):
        return torch.ops.ladle_native.first_max_bf16(values)
    return values.max(dim=-1).indices


def _is_plain_greedy(requests: Sequence[Request]) -> bool:
    """True when argmax of the raw logits is the whole answer for every row."""
    for request in requests:
        params = request.sampling_params
        if (
            not params.is_greedy
            or request.grammar is not None
            or params.logit_bias
            or params.logprobs is not None
            or _needs_min_tokens_mask(request)
            or _has_penalties(request)
        ):
            return False
    return True


def _has_penalties(request: Request) -> bool:
    params = request.sampling_params
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def _needs_min_tokens_mask(request: Request) -> bool:
    return len(request.output_token_ids) < request.sampling_params.min_tokens


def _apply_logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    rows, cols, values = [], [], []
    vocab_size = logits.shape[1]
    for row, request in enumerate(requests):
        for token_id, bias in request.sampling_params.logit_bias.items():
            if 0 <= int(token_id) < vocab_size:
                rows.append(row)
                cols.append(int(token_id))
                values.append(float(bias))
    if rows:
        index = (_long(rows, logits), _long(cols, logits))
        logits.index_put_(index, torch.tensor(values, device=logits.device), accumulate=True)


def _apply_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Ban eos and stop token ids until a request has produced min_tokens tokens."""
    rows, cols = [], []
    vocab_size = logits.shape[1]
    for row, request in enumerate(requests):
        if not _needs_min_tokens_mask(request):
            continue
        params = request.sampling_params
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:
            banned |= set(request.eos_token_ids)
        for token_id in banned:
            if 0 <= token_id < vocab_size:
                rows.append(row)
                cols.append(token_id)
    if rows:
        logits[_long(rows, logits), _long(cols, logits)] = _NEG_INF


def _apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Repetition (HF, prompt + output) then presence/frequency (OpenAI, output only)."""
    params = [r.sampling_params for r in requests]
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        seen = _token_counts(logits, [requests[i].all_token_ids for i in rep_rows]) > 0
        penalty = _column([params[i].repetition_penalty for i in rep_rows], logits)
        rows = _long(rep_rows, logits)
        subset = logits[rows]
        scaled = torch.where(subset > 0, subset / penalty, subset * penalty)
        logits[rows] = torch.where(seen, scaled, subset)
    pf_rows = [
        i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    ]
    if pf_rows:
        counts = _token_counts(logits, [requests[i].output_token_ids for i in pf_rows])
        presence = _column([params[i].presence_penalty for i in pf_rows], logits)
        frequency = _column([params[i].frequency_penalty for i in pf_rows], logits)
        rows = _long(pf_rows, logits)
        logits[rows] -= presence * (counts > 0) + frequency * counts


def _token_counts(logits: torch.Tensor, token_lists: list[list[int]]) -> torch.Tensor:
    """[len(token_lists), V] float counts of each token id in each list."""
    vocab_size = logits.shape[1]
    width = max((len(tokens) for tokens in token_lists), default=0)
    padded = torch.full((len(token_lists), max(width, 1)), vocab_size, dtype=torch.long)
    for row, tokens in enumerate(token_lists):
        if tokens:
            padded[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    padded = padded.clamp_(max=vocab_size).to(logits.device)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=logits.device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab_size]


def _filter(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Temperature, then min_p, top_k and top_p (on the top-k renormalised distribution)."""
    params = [r.sampling_params for r in requests]
    logits = logits / _column([p.temperature for p in params], logits)
    if any(p.min_p > 0.0 for p in params):
        probs = logits.softmax(dim=-1)
        threshold = _column([p.min_p for p in params], logits) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, _NEG_INF)
    cut_rows = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    if cut_rows:
        rows = _long(cut_rows, logits)
        cut = _top_k_top_p(logits.index_select(0, rows), [params[i] for i in cut_rows])
        logits = logits.index_copy(0, rows, cut)
    return logits


def _is_cut_only(params: SamplingParams) -> bool:
    """Sampling limited by top_k or top_p, without min_p (the candidate fast path)."""
    return (params.top_k > 0 or params.top_p < 1.0) and params.min_p == 0.0


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask tokens below each row's cut-off logit (ties with the cut-off are kept)."""
    values, _indices, num_kept = _top_candidates(logits, params)
    return logits.masked_fill(logits < values.gather(1, num_kept - 1), _NEG_INF)


def _top_candidates(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorted top logits [S, n], their token ids [S, n], and [S, 1] how many survive.

    A partial top-n selection replaces the full vocabulary sort whenever the top n tokens
    already hold every row's top-k set and top-p mass; otherwise it falls back to n = V.
    """
    vocab_size = logits.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    limited = [k for k in top_k if k < vocab_size]
    wide = len(limited) < len(top_k)
    num_candidates = min(vocab_size, max(limited + ([_TOP_P_CANDIDATES] if wide else [])))
    top_k_tensor = _long(top_k, logits)
    values, indices, num_kept = _cut(logits, params, top_k_tensor, num_candidates)
    if wide and num_candidates < vocab_size and bool((num_kept == num_candidates).any()):
        values, indices, num_kept = _cut(logits, params, top_k_tensor, vocab_size)
    return values, indices, num_kept


def _cut(
    logits: torch.Tensor, params: list[SamplingParams], top_k: torch.Tensor, num_candidates: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top logits [S, n] sorted, their ids, and [S, 1] how many survive top_k then top_p."""
    values, indices = logits.topk(num_candidates, dim=-1)
    positions = torch.arange(num_candidates, device=logits.device).unsqueeze(0)
    kept = positions < top_k.unsqueeze(1)
    top_k_mass = values.masked_fill(~kept, _NEG_INF).logsumexp(dim=-1)
    is_limited = (top_k < logits.shape[1]).to(values.dtype)
    log_mass = is_limited * top_k_mass + (1 - is_limited) * logits.logsumexp(dim=-1)
    probs = (values - log_mass.unsqueeze(1)).exp().masked_fill(~kept, 0.0)
    before = probs.cumsum(dim=-1) - probs  # probability mass strictly above each token
    top_p = _column([p.top_p for p in params], logits)
    kept &= (before < top_p) | (top_p >= 1.0) | (positions == 0)
    return values, indices, kept.sum(dim=-1, keepdim=True)


def _with_logprobs(
    raw_logits: torch.Tensor, token_ids: torch.Tensor, requests: Sequence[Request]
) -> list[SampledToken]:
    ids = token_ids.tolist()
    wanted = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    if not wanted:
        return [SampledToken(token_id) for token_id in ids]
    rows = _long(wanted, raw_logits)
    logprobs = raw_logits.index_select(0, rows).log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[rows].unsqueeze(1)).squeeze(1).tolist()
    num_top = max(requests[i].sampling_params.logprobs for i in wanted)
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    results = [SampledToken(token_id) for token_id in ids]
    for j, row in enumerate(wanted):
        num_row_top = requests[row].sampling_params.logprobs
        top = [TopToken(top_ids[j][t], top_values[j][t]) for t in range(num_row_top)]
        results[row] = SampledToken(ids[row], chosen[j], top)
    return results


def _long(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)
