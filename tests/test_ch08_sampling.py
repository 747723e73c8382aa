"""Chapter 8's sampling and stop strings, against references that do not share the code under test.

- The samplers: top-k keeps the k most likely, each filter matches its definition (top-p's graded
  tests, exercise ch08.7, are in ``test_exercises_ch08.py``), and tokens drawn at temperature 1 follow the model's softmax (a chi-square
  test at a fixed prompt and seed: deterministic, so it cannot fail by chance).
- Seeds: a seeded sequence run through the scheduler and the packed model gets the tokens of a
  reference sampler that runs the plain model alone, whether it runs alone or batched with others.
- Stop strings: the sequence ends at the first stop, the text shown never contains it, and a stream
  of deltas never sends a character a stop may still claim (hypothesis, against ``str.find``). Token
  by token, the stop check and the stream's deltas are those of decoding and searching the whole
  answer again at every token (hypothesis), while decoding only a few tokens per token.
- A stream's text deltas (``TextDelta``): token by token the deltas of decoding the whole answer
  again at every token (hypothesis, broken UTF-8 and special tokens included), while decoding only
  a few tokens per token; a token's event is the server-sent event of its fields.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sampling_oracle import model_logits, reference_distribution, reference_sampled
from scipy.stats import chisquare
from test_tokenizer import byte_ids

from chapter_flags import attention_here
from chapters.ch03_dynamic_batching.step_loop import run_until_done
from chapters.ch04_memory_pool.memory_pool import KVMemoryPool
from chapters.ch08_continuous_batching.model_runner import ModelRunner
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore
from chapters.ch08_continuous_batching.sampling import (
    GREEDY,
    SamplingParams,
    keep_top_k,
    sample_tokens,
    sampling_distribution,
)
from chapters.ch08_continuous_batching.scheduler import ContinuousScheduler, SchedulerConfig, Sequence
from chapters.ch08_continuous_batching.stop_strings import StopStrings, StopText, visible_text
from chapters.ch08_continuous_batching.openai_api import text_chunk
from chapters.ch08_continuous_batching.streaming import TextDelta, sse, token_event
from shared.tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer

PROMPT = list(b"Once upon a time, ")


# -- the samplers ---------------------------------------------------------------------------------


def test_top_k_keeps_the_k_most_likely() -> None:
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.5, 0.0]] * 3)
    kept = keep_top_k(logits, torch.tensor([[2], [0], [9]]))
    assert [i for i, v in enumerate(kept[0].tolist()) if v != float("-inf")] == [1, 3]
    assert torch.equal(kept[1:], logits[1:])  # 0: no limit; more than the vocabulary: all of it


def test_sampled_tokens_follow_the_models_distribution(default_model) -> None:
    """Chi-square goodness of fit of 6,000 draws at temperature 1 against the model's softmax."""
    logits = model_logits(default_model.model, PROMPT)
    expected = torch.softmax(logits, -1)
    params = SamplingParams(temperature=1.0, seed=1234)
    generator = params.generator()
    draws = 6000
    counts = torch.zeros_like(expected)
    for _ in range(draws // 100):  # 100 rows per call: a batch of the same distribution, one stream
        tokens, _ = sample_tokens(logits.expand(100, -1), [params] * 100, [generator] * 100)
        counts += torch.bincount(torch.tensor(tokens), minlength=expected.numel())
    # Tokens expected at least 5 times each get a cell; the rest are pooled into one.
    big = expected * draws >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    wanted = torch.cat([expected[big], expected[~big].sum()[None]]) * draws
    assert big.sum() >= 5, "the prompt's distribution is too peaked to test"
    assert chisquare(observed.numpy(), wanted.numpy() * observed.sum().item() / wanted.sum().item()).pvalue > 1e-3
    # The same counts must reject a distribution that is only slightly off (temperature 0.8).
    sharper = torch.softmax(logits / 0.8, -1)
    wrong = torch.cat([sharper[big], sharper[~big].sum()[None]]) * draws
    assert chisquare(observed.numpy(), wrong.numpy() * observed.sum().item() / wrong.sum().item()).pvalue < 1e-3


def test_temperature_top_k_and_top_p_reshape_the_distribution_as_their_definitions_say(default_model) -> None:
    logits = model_logits(default_model.model, PROMPT)
    for temperature, top_k, top_p in ((0.5, 0, 1.0), (1.0, 0, 1.0), (1.7, 0, 1.0), (1.0, 20, 1.0), (0.8, 0, 0.9), (1.2, 30, 0.7)):
        got = sampling_distribution(logits[None], [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)])[0]
        wanted = reference_distribution(logits, temperature, top_k, top_p)
        # The set of tokens that can be drawn is exact; their probabilities agree within rounding.
        assert (got > 0).nonzero().flatten().tolist() == (wanted > 0).nonzero().flatten().tolist(), (temperature, top_k, top_p)
        assert torch.allclose(got, wanted, atol=1e-6)


def test_logprobs_are_the_models_log_softmax_whatever_the_temperature(default_model) -> None:
    logits = model_logits(default_model.model, PROMPT)
    reference = torch.log_softmax(logits, -1)
    for params in (SamplingParams(logprobs=3), SamplingParams(temperature=1.5, seed=9, logprobs=5)):
        [token], [entry] = sample_tokens(logits[None], [params], [params.generator()])
        assert entry.logprob == pytest.approx(reference[token].item(), abs=1e-5)
        best = torch.topk(reference, params.logprobs)
        assert [t for t, _ in entry.top] == best.indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(best.values.tolist(), abs=1e-5)
    assert sample_tokens(logits[None], [GREEDY], [None]) == ([int(logits.argmax())], [None])


@pytest.mark.parametrize("bad", [{"temperature": -0.1}, {"temperature": 2.5}, {"top_p": 0.0}, {"top_p": 1.5},
                                 {"top_k": -1}, {"logprobs": 6}])
def test_out_of_range_sampling_parameters_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


# -- seeds through the scheduler and the packed model ---------------------------------------------


def run_sequences(default_model, seqs: list[Sequence], attention: str = "gather") -> None:
    store = PagedKVStore(KVMemoryPool(default_model.config, 4096, block_tokens=16))
    scheduler = ContinuousScheduler(store, SchedulerConfig(8, 64))
    for seq in seqs:
        scheduler.add(seq)
    run_until_done(scheduler, ModelRunner(default_model.model, store, attention_here(attention, store)))
    assert store.manager.free_blocks == store.manager.total_blocks


# flex computes the same logits as the other backends (test_ch08_scheduler.py); its compilation here runs with make test-slow
@pytest.mark.parametrize("attention", ["gather", pytest.param("flex", marks=pytest.mark.slow), "kernel"])
def test_a_seeded_request_gets_the_reference_samplers_tokens_alone_and_batched(default_model, oracle, attention: str) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=40, seed=42)
    wanted = reference_sampled(default_model.model, PROMPT, 24, seed=42, temperature=1.0, top_k=40, top_p=0.95)
    alone = Sequence(PROMPT, 24, sampling=params)
    run_sequences(default_model, [alone], attention)
    assert alone.output_ids == wanted

    rng = random.Random(5)
    others = [([rng.randrange(256) for _ in range(rng.randint(4, 90))], rng.randint(4, 30)) for _ in range(6)]
    batched = Sequence(PROMPT, 24, sampling=params)
    neighbours = [Sequence(p, n, sampling=SamplingParams(temperature=0.9, seed=i) if i % 2 else GREEDY)
                  for i, (p, n) in enumerate(others)]
    run_sequences(default_model, neighbours[:3] + [batched] + neighbours[3:], attention)
    assert batched.output_ids == wanted
    for i, (seq, (p, n)) in enumerate(zip(neighbours, others)):
        if i % 2 == 0:
            assert seq.output_ids == oracle(p, n)  # greedy neighbours still get the oracle's tokens


def test_without_a_seed_two_requests_draw_independently(default_model) -> None:
    params = SamplingParams(temperature=1.5)
    seqs = [Sequence(PROMPT, 16, sampling=params) for _ in range(2)]
    run_sequences(default_model, seqs)
    assert seqs[0].output_ids != seqs[1].output_ids


# -- stop strings ---------------------------------------------------------------------------------


def test_a_stop_string_ends_the_sequence_and_frees_its_blocks(default_model, oracle) -> None:
    tokenizer = ByteTokenizer()
    full = tokenizer.decode(oracle(PROMPT, 40))
    stop = full[10:13]  # three characters the greedy answer reaches: spans three byte tokens
    cut = full.find(stop)
    seq = Sequence(PROMPT, 40, stop=StopStrings((stop, "never appears here"), tokenizer))
    plain = Sequence(PROMPT, 40)
    run_sequences(default_model, [seq, plain])
    assert seq.finish_reason == "stop" and plain.finish_reason == "length"
    assert tokenizer.decode(seq.output_ids) == full[:cut + len(stop)]  # it stopped on the token that completed the stop
    assert visible_text(tokenizer, seq.output_ids, (stop,)) == full[:cut]
    assert plain.output_ids == oracle(PROMPT, 40)


texts = st.text(alphabet="ab\u00e9\n", max_size=30)


@given(texts, st.lists(st.text(alphabet="ab\u00e9\n", min_size=1, max_size=4), min_size=1, max_size=4))
@settings(max_examples=300, deadline=None)
def test_streamed_deltas_add_up_to_the_visible_text_and_never_send_a_stop(text: str, stops: list[str]) -> None:
    tokenizer, stops_t = ByteTokenizer(), tuple(stops)
    ids = tokenizer.encode(text)
    # Where generation ends: the first token after which the text contains a stop (the scheduler's rule).
    ends = next((i + 1 for i in range(len(ids)) if StopStrings(stops_t, tokenizer).reached(ids[: i + 1])), len(ids))
    ids = ids[:ends]
    full = tokenizer.decode(ids)
    cut = min((full.find(stop) for stop in stops_t if stop in full), default=len(full))
    shown = full[:cut]
    stream, sent = StopText(tokenizer, stops_t), ""
    for token in ids:
        sent += stream.add(token)
        assert shown.startswith(sent), "a streamed character is not in the final text"
    sent += stream.finish()
    assert sent == shown == visible_text(tokenizer, ids, stops_t)


def whole_decode_deltas(tokenizer, ids: list[int]) -> list[str]:
    """The first, readable way to stream text: decode everything so far at every token, hold a trailing U+FFFD."""
    deltas, sent = [], 0
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        if text.endswith("\ufffd"):
            deltas.append("")
            continue
        deltas.append(text[sent:])
        sent = len(text)
    return deltas




@given(byte_ids)
@settings(max_examples=400, deadline=None)
def test_text_deltas_are_the_whole_decodes_deltas_token_by_token(ids: list[int]) -> None:
    tokenizer = ByteTokenizer()
    delta = TextDelta(tokenizer)
    assert [delta.add(token) for token in ids] == whole_decode_deltas(tokenizer, ids)
    sent = "".join(whole_decode_deltas(tokenizer, ids))
    assert sent + delta.flush() == tokenizer.decode(ids)


class CountingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        self.lengths: list[int] = []

    def decode(self, ids: list[int]) -> str:
        self.lengths.append(len(ids))
        return super().decode(ids)


def test_a_text_delta_decodes_a_few_tokens_per_token_however_long_the_answer() -> None:
    tokenizer = CountingTokenizer()
    delta = TextDelta(tokenizer)
    answer = "caf\u00e9 \u20ac " * 300  # one-, two- and three-byte characters, 2,700 tokens
    assert "".join(delta.add(token) for token in tokenizer.encode(answer)) == answer
    # The window: the tokens last handed out and those of the character being completed, here 3 bytes each at most.
    assert max(tokenizer.lengths) <= 6


@given(st.integers(0, 50_000), st.text())
@settings(max_examples=300, deadline=None)
def test_a_token_event_is_the_server_sent_event_of_its_fields(token_id: int, text: str) -> None:
    assert token_event(token_id, text) == sse({"token_id": token_id, "text": text}, event="token")


@given(st.text(), st.text(), st.integers(0, 2**40))
@settings(max_examples=300, deadline=None)
def test_an_openai_text_chunk_is_the_server_sent_event_of_its_fields(text: str, model: str, created: int) -> None:
    meta = {"id": "cmpl-0123abcd", "object": "text_completion", "created": created, "model": model}
    assert text_chunk(meta)(text) == sse({**meta, "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": None}]})


# Answers and stops over the same characters, one, two and three bytes long, with broken characters
# (bytes that never complete one: U+FFFD, which a stop may hold too) and special tokens between them.
STOP_ALPHABET = "ab\u00e9\u20ac"
answer_ids = st.lists(st.one_of(st.sampled_from(STOP_ALPHABET).map(lambda c: list(c.encode())),
                                st.lists(st.sampled_from([0xE2, 0x82, 0xAC, 0xC3, 0xA9, 0xF0, 0x9F]), min_size=1, max_size=2),
                                st.integers(256, BYTE_VOCAB_SIZE - 1).map(lambda t: [t])),
                      max_size=20).map(lambda chunks: [token for chunk in chunks for token in chunk])
stop_lists = st.lists(st.text(alphabet=STOP_ALPHABET + "\ufffd", min_size=1, max_size=4), min_size=1, max_size=4).map(tuple)


def whole_decode_stop_deltas(tokenizer, ids: list[int], stops: tuple[str, ...]) -> tuple[list[str], str]:
    """The first, readable way to stream text that stops: at every token decode everything so far, search
    all of it, send up to the stop, or up to what is neither a broken character nor a stop's beginning."""
    deltas, sent = [], 0

    def take(text: str, end: int) -> str:
        nonlocal sent
        if end <= sent:
            return ""
        delta, sent = text[sent:end], end
        return delta

    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        stop = min((text.find(s) for s in stops if s in text), default=None)
        if stop is not None:
            deltas.append(take(text, stop))
            continue
        decided = text.rstrip("\ufffd")
        longest = max((n for s in stops for n in range(1, len(s)) if decided.endswith(s[:n])), default=0)
        deltas.append(take(text, len(decided) - longest))
    text = tokenizer.decode(ids)
    stop = min((text.find(s) for s in stops if s in text), default=len(text))
    return deltas, take(text, stop)


@given(answer_ids, stop_lists)
@settings(max_examples=400, deadline=None)
def test_the_stop_check_is_a_search_of_the_whole_decode_token_by_token(ids: list[int], stops: tuple[str, ...]) -> None:
    tokenizer = ByteTokenizer()
    check = StopStrings(stops, tokenizer)  # one per sequence, asked after every token, as the scheduler does
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        assert check.reached(ids[:k]) == any(stop in text for stop in stops)
        if any(stop in text for stop in stops):
            break  # the scheduler ends the sequence here


@given(answer_ids, stop_lists)
@settings(max_examples=400, deadline=None)
def test_streamed_stop_deltas_are_the_whole_decodes_token_by_token(ids: list[int], stops: tuple[str, ...]) -> None:
    tokenizer = ByteTokenizer()
    # The tokens a stream gets: the scheduler ends the sequence at the first token whose text holds a stop.
    ids = ids[:next((k for k in range(1, len(ids) + 1) if any(stop in tokenizer.decode(ids[:k]) for stop in stops)), len(ids))]
    deltas, last = whole_decode_stop_deltas(tokenizer, ids, stops)
    stream = StopText(tokenizer, stops)
    for k, (token, expected) in enumerate(zip(ids, deltas, strict=True)):
        assert stream.decoded_chars == len(tokenizer.decode(ids[:k]))  # a token's logprobs text_offset
        assert stream.add(token) == expected
    assert stream.finish() == last


def test_stop_checks_decode_a_few_tokens_per_token_however_long_the_answer() -> None:
    answer = "caf\u00e9 \u20ac " * 300  # one-, two- and three-byte characters, 2,700 tokens
    tokenizer = CountingTokenizer()
    ids = tokenizer.encode(answer)
    check, stream = StopStrings(("never", "\u20ac\u20ac"), tokenizer), StopText(tokenizer, ("never",))
    assert not any(check.reached(ids[:k]) for k in range(1, len(ids) + 1))
    assert "".join(stream.add(token) for token in ids) + stream.finish() == answer
    assert max(tokenizer.lengths) <= 6


def test_stop_strings_are_refused_when_empty_or_too_many() -> None:
    with pytest.raises(ValueError):
        StopStrings(("",), ByteTokenizer())
    with pytest.raises(ValueError):
        StopStrings(tuple("abcde"), ByteTokenizer())
