"""N-gram speculative decoding on vs off, same model, same run, interleaved rounds.

    .venv/bin/python -m loadtest.bench_speculative [--num-drafts 4] [--ngram 3]
        [--output-len 160] [--random-len 128] [--batch 8] [--rounds 2] [--json OUT]

Two engines with the same settings but `speculative_ngram` (0 and --num-drafts), greedy.
Workloads, each run with speculation off then on, `--rounds` times (interleaved, so load
drifts hit both alike):

- quote: chat prompts that quote a passage and ask to repeat or edit it (where n-gram
  drafts should be right), one request at a time; max_tokens --output-len, EOS honoured;
- random: --random-len random token ids in, --random-len out (ignore_eos), one request at
  a time, and --batch requests at once (where drafts should rarely help; a small model
  often falls into loops there, which they do catch);
- random, sampled: the same prompts at temperature 1 (seeded), where the output rarely
  repeats and most drafts are wrong: the cost of verifying them.

--workloads picks some (default: all).

Reported per workload: output tokens/s off and on (one request at a time: decode tokens/s
after the first token; batch: output tokens over the wall time), the ratio on / off, the
speculating engine's draft acceptance rate and tokens per decode step, how many outputs
were identical on and off; plus the CPU model, flags and load average.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from loadtest.bench_engine import random_prompts
from shared.model_files import DEFAULT_MODEL_NAME
from worker.engine.config import EngineConfig
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.offline import LLM, GenerationResult

PASSAGES = [
    "The old mill stood at the bend of the river, where the water slowed and widened before "
    "the weir. For two hundred years it ground the wheat of every farm in the valley, and "
    "the miller's family kept a ledger of each sack, each price and each flood. When the "
    "railway came the mill lost its trade, but the ledger survived, and it is now the best "
    "record we have of the valley's harvests.",
    "To reset the router, unplug it from the wall and wait thirty seconds. Plug it back in "
    "and wait until the power light stops blinking. Then press and hold the reset button on "
    "the back for ten seconds, until all the lights flash together. The router restarts with "
    "its factory settings: the network name and password are printed on the label underneath.",
    "def moving_average(values, window):\n"
    "    if window <= 0:\n"
    "        raise ValueError('window must be positive')\n"
    "    averages = []\n"
    "    total = 0.0\n"
    "    for index, value in enumerate(values):\n"
    "        total += value\n"
    "        if index >= window:\n"
    "            total -= values[index - window]\n"
    "        if index >= window - 1:\n"
    "            averages.append(total / window)\n"
    "    return averages\n",
    "Dear Ms Patel, thank you for your letter of 3 March about the delayed delivery of your "
    "order. We are sorry that the parcel arrived two weeks late and that the box was damaged. "
    "We have sent a replacement lamp by express courier, and it should reach you by Friday. "
    "Please keep the damaged one; there is no need to return it. Yours sincerely, Tom Evans.",
]
INSTRUCTIONS = [
    "Repeat the following text exactly, word for word.",
    "Rewrite the following text, changing only the names and numbers.",
    "Copy the following text and fix any mistakes in it.",
]


@dataclass
class Tally:
    """Tokens and seconds of one engine over a workload's rounds."""

    tokens: int = 0
    seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def quote_prompts(llm: LLM) -> list[list[int]]:
    messages = [
        [{"role": "user", "content": f"{instruction}\n\n{passage}"}]
        for passage in PASSAGES
        for instruction in INSTRUCTIONS[:2]
    ]
    return [llm.engine.tokenize(messages=m) for m in messages]


def run_one_at_a_time(llm: LLM, prompts: list[list[int]], params: SamplingParams, tally: Tally):
    """Decode tokens/s of each request alone: tokens after the first over the time after it."""
    for prompt in prompts:
        result: GenerationResult = llm.generate([prompt], params)[0]
        tokens = result.outputs[0].token_ids
        tally.outputs.append(tokens)
        tally.tokens += len(tokens) - 1
        tally.seconds += result.finished_time - result.first_token_time


def run_batch(
    llm: LLM,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    tally: Tally,
) -> None:
    started = time.perf_counter()
    results = llm.generate(prompts, params)
    tally.seconds += time.perf_counter() - started
    for result in results:
        tally.outputs.append(result.outputs[0].token_ids)
        tally.tokens += len(result.outputs[0].token_ids)


def compare(name: str, llms: dict[str, LLM], run: Any, rounds: int) -> dict[str, Any]:
    """Run a workload off then on, `rounds` times; figures and the speculation counters."""
    tallies = {mode: Tally() for mode in llms}
    before = llms["on"].engine.stats()
    load_before = os.getloadavg()[0]
    for _ in range(rounds):
        for mode, llm in llms.items():
            run(llm, tallies[mode])
    after = llms["on"].engine.stats()
    drafted = after.num_spec_draft_tokens - before.num_spec_draft_tokens
    accepted = after.num_spec_accepted_tokens - before.num_spec_accepted_tokens
    steps = after.num_decode_steps - before.num_decode_steps
    decoded = after.num_decode_tokens - before.num_decode_tokens
    off, on = tallies["off"], tallies["on"]
    same = sum(a == b for a, b in zip(off.outputs, on.outputs, strict=True))
    figures = {
        "tokens_per_s_off": off.tokens_per_s,
        "tokens_per_s_on": on.tokens_per_s,
        "ratio_on_off": on.tokens_per_s / off.tokens_per_s,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "draft_tokens": drafted,
        "tokens_per_decode_step": decoded / steps if steps else 0.0,
        "identical_outputs": f"{same}/{len(off.outputs)}",
        "output_tokens": on.tokens,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }
    print(
        f"{name}: off {off.tokens_per_s:.1f} tok/s, on {on.tokens_per_s:.1f} tok/s, "
        f"ratio {figures['ratio_on_off']:.3f}; acceptance {figures['acceptance_rate']:.2f} "
        f"of {drafted} drafts, {figures['tokens_per_decode_step']:.2f} tokens/step; "
        f"identical {figures['identical_outputs']}; load {load_before:.1f} -> "
        f"{figures['load_after']:.1f}",
        flush=True,
    )
    return figures


def cpu_description() -> dict[str, Any]:
    """lscpu's model name and the vector flags that matter here."""
    model, flags = "unknown", set()
    with open("/proc/cpuinfo") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    present = [flag for flag in wanted if flag in flags]
    return {"model_name": model, "flags": present, "cores": os.cpu_count()}


def build(args: argparse.Namespace, num_drafts: int) -> LLM:
    return LLM(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device="cpu",
            kv_cache_size_mb=256,
            num_threads=args.threads,
            speculative_ngram=num_drafts,
            speculative_ngram_size=args.ngram,
        )
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-drafts", type=int, default=4)
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=160)
    parser.add_argument("--random-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--workloads", default="quote,random,random_batch,random_sampled")
    parser.add_argument("--json", default=None, help="write the figures here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    llms = {"off": build(args, 0), "on": build(args, args.num_drafts)}
    report: dict[str, Any] = {"args": vars(args), "cpu": cpu_description()}
    report["dtype"] = llms["on"].engine.executor.dtype
    report["threads"] = torch.get_num_threads()
    print(f"{report['cpu']} {report['dtype']} threads={report['threads']} load={os.getloadavg()}")
    vocab = llms["on"].engine.executor.vocab_size
    for llm in llms.values():  # warm-up
        llm.generate(random_prompts(2, 16, vocab, seed=9), SamplingParams(max_tokens=4))
    quote = quote_prompts(llms["on"])
    quote_params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    randoms = random_prompts(args.batch, args.random_len, vocab, seed=1)
    random_params = SamplingParams(temperature=0.0, max_tokens=args.random_len, ignore_eos=True)
    sampled_params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=args.random_len, ignore_eos=True)
        for i in range(args.batch)
    ]
    workloads = {
        "quote": lambda llm, tally: run_one_at_a_time(llm, quote, quote_params, tally),
        "random": lambda llm, tally: run_one_at_a_time(llm, randoms[:2], random_params, tally),
        "random_batch": lambda llm, tally: run_batch(llm, randoms, random_params, tally),
        "random_sampled": lambda llm, tally: run_batch(llm, randoms, sampled_params, tally),
    }
    for name in args.workloads.split(","):
        report[name] = compare(name, llms, workloads[name], args.rounds)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
