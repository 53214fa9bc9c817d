"""The server's per-token text work while streaming: decoding what each new token adds.

A streamed answer needs, at every token, the text the answer has so far (to cut stop
strings and send what changed). Decoding all of the answer's tokens again at every token
costs O(length) a token; ``deploy.deployment.AnswerText`` decodes only the tokens after the
text it has settled. Both run here side by side on the same random answers (a third of
them the tokenizer's byte pieces, which split characters), with the test SentencePiece
tokenizer of ``serve_load.py --shape 1b``; reported: microseconds per token of the text
work alone, and with the OpenAI chunk built around it (``deploy.openai_api.Reply``).

    python benchmarks/stream_text.py --lengths 128 1024
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from serve_load import ROOT, SP_TOKENIZER  # noqa: I001  (benchmarks/ is on the path when run)

from deploy.deployment import AnswerText, text_context
from deploy.openai_api import Reply
from deploy.openai_schema import Choice, CompletionRequest
from megalith.config import load_config
from preprocessing.tokenizer import Tokenizer, load_tokenizer
from training.inference.decode import SampledToken, SamplingConfig
from training.inference.loading import ModelInfo, ServedModel
from training.models.gpt import GPTModel


def served_model(tokenizer: Tokenizer) -> ServedModel:
    """A ServedModel of a tiny GPT (the text path uses its tokenizer and family only)."""
    model = load_config(ROOT / "configs" / "tiny-cpu.yaml").model
    model = model.model_copy(update={"vocab_size": tokenizer.padded_vocab_size})
    info = ModelInfo("bench", "bench", None, None, "0" * 64, 4096, 0.0)
    return ServedModel(GPTModel(model), tokenizer, info)


def answers(tokenizer: Tokenizer, length: int, count: int) -> list[list[int]]:
    rng = random.Random(0)
    byte_ids = [i for i in range(tokenizer.vocab_size) if len(tokenizer.token_bytes(i)) == 1]
    return [
        [
            rng.choice(byte_ids) if rng.random() < 1 / 3 else rng.randrange(tokenizer.vocab_size)
            for _ in range(length)
        ]  # fmt: skip
        for _ in range(count)
    ]


def per_token_us(run: Callable[[list[int]], None], batch: list[list[int]]) -> float:
    start = time.perf_counter()
    for answer in batch:
        run(answer)
    return 1e6 * (time.perf_counter() - start) / sum(len(a) for a in batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--tokens", type=int, default=20_000, help="tokens timed per row")
    args = parser.parse_args()
    tokenizer = load_tokenizer(str(SP_TOKENIZER))
    served = served_model(tokenizer)
    prompt = [tokenizer.eod_id, *tokenizer.encode("Once upon a time there was a little dog")]
    context = text_context(prompt)

    def redecode(answer: list[int]) -> None:
        for end in range(1, len(answer) + 1):
            served.text(context, answer[:end])

    def incremental(answer: list[int]) -> None:
        text = AnswerText(served, prompt)
        for token in answer:
            text.push(token)

    def openai_chunks(answer: list[int]) -> None:
        body = CompletionRequest(model="bench", prompt="x", max_tokens=len(answer), stream=True)
        reply = Reply(body, served, [Choice(0, 0, prompt, SamplingConfig(len(answer)))])
        for token in answer:
            reply.take(0, SampledToken(token), None)  # type: ignore[arg-type]
            reply._next_chunk(reply.choices[0])

    print("| answer tokens | re-decode the answer, us/token | AnswerText, us/token | "
          "AnswerText + OpenAI chunk, us/token |\n|---|---|---|---|")  # fmt: skip
    for length in args.lengths:
        batch = answers(tokenizer, length, max(1, args.tokens // length))
        times = [per_token_us(run, batch) for run in (redecode, incremental, openai_chunks)]
        print(f"| {length} | {times[0]:.1f} | {times[1]:.1f} | {times[2]:.1f} |")


if __name__ == "__main__":
    main()
