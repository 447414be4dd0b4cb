"""Text generation shared by the chat command and the server: sampling settings checked before any work, a
prompt checked against the model's context, stop strings cut out of the streamed text, OpenAI's penalties,
logit_bias and logprobs, cancellation between tokens, and prefill/decode timing."""
from __future__ import annotations

import functools
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch


class SamplingError(ValueError):
    """A sampling setting out of range; ``field`` names it, ``expected`` says what would be accepted."""

    def __init__(self, field_name: str, expected: str, value):
        super().__init__(f"{field_name}: expected {expected}, got {value!r}")
        self.field = field_name
        self.expected = expected
        self.value = value


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


SEED_LIMIT = 2 ** 64  # torch.manual_seed takes seeds below this (an unsigned 64-bit int)
PENALTY_RANGE, BIAS_RANGE = 2.0, 100.0  # OpenAI's ranges: penalties in [-2, 2], logit_bias values in [-100, 100]
MOST_LOGPROBS = 20  # OpenAI's top_logprobs limit


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens. ``temperature`` 0 is greedy; ``top_k`` 0 keeps every token; ``seed`` reseeds torch's
    generator before each answer, so that a sampled answer repeats. ``presence_penalty``, ``frequency_penalty``
    and ``logit_bias`` ((token id, bias) pairs) adjust the logits as OpenAI's parameters of those names do, before
    temperature, top-k and top-p; ``logprobs`` (None: none) asks for each answer token's log-probability and its
    ``logprobs`` likeliest alternatives."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None

    def __post_init__(self):
        checks = (
            ("max_new_tokens", _is_int(self.max_new_tokens) and self.max_new_tokens >= 1, "an int >= 1"),
            ("temperature", _is_number(self.temperature) and self.temperature >= 0, "a number >= 0 (0 = greedy)"),
            ("top_p", _is_number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", _is_int(self.top_k) and self.top_k >= 0, "an int >= 0 (0 = off)"),
            ("repetition_penalty", _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
             "a number > 0 (1 = off)"),
            ("stop", isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
             "non-empty strings"),
            ("seed", self.seed is None or (_is_int(self.seed) and 0 <= self.seed < SEED_LIMIT),
             f"an int in [0, {SEED_LIMIT - 1}]"),
            ("presence_penalty", _is_number(self.presence_penalty) and abs(self.presence_penalty) <= PENALTY_RANGE,
             "a number in [-2, 2]"),
            ("frequency_penalty", _is_number(self.frequency_penalty) and abs(self.frequency_penalty) <= PENALTY_RANGE,
             "a number in [-2, 2]"),
            ("logit_bias", isinstance(self.logit_bias, tuple) and all(
                isinstance(pair, tuple) and len(pair) == 2 and _is_int(pair[0]) and pair[0] >= 0
                and _is_number(pair[1]) and abs(pair[1]) <= BIAS_RANGE for pair in self.logit_bias),
             "token ids (ints >= 0) mapped to numbers in [-100, 100]"),
            ("logprobs", self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MOST_LOGPROBS),
             f"an int in [0, {MOST_LOGPROBS}]"),
        )
        for name, ok, expected in checks:
            if not ok:
                raise SamplingError(name, expected, getattr(self, name))

    def generate_kwargs(self) -> dict:
        """The ``model.generate`` sampling arguments; greedy passes no sampling knobs (transformers warns about
        unused ones). The repetition penalty is ``LogitAdjustments``' to apply: 1 here keeps a default of the
        checkpoint's generation config from applying it a second time."""
        picking = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        if self.temperature > 0:
            picking = dict(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        return dict(picking, repetition_penalty=1.0)


class LogitAdjustments:
    """A logits processor for one (1, S) prompt: first notes the model's own log-probabilities of the step
    (``last``, when logprobs are asked for), then applies the repetition penalty (transformers' rule, over
    prompt and answer), OpenAI's presence and frequency penalties (over the answer's tokens so far: ``logit -=
    count * frequency_penalty + (count > 0) * presence_penalty``) and logit_bias (added). transformers runs a
    custom processor before temperature, top-k and top-p, so these see the model's logits, as OpenAI's do."""

    def __init__(self, sampling: Sampling, prompt_tokens: int):
        from transformers import RepetitionPenaltyLogitsProcessor

        self.sampling, self.prompt_tokens = sampling, prompt_tokens
        self.repetition = (RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty)
                           if sampling.repetition_penalty != 1.0 else None)
        self.last: torch.Tensor | None = None  # the latest step's log-probabilities, (vocab,) fp32

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sampling = self.sampling
        if sampling.logprobs is not None:
            self.last = torch.log_softmax(scores[0].float(), dim=-1)
        if self.repetition is not None:
            scores = self.repetition(input_ids, scores)
        if sampling.presence_penalty or sampling.frequency_penalty:
            counts = torch.bincount(input_ids[0, self.prompt_tokens:], minlength=scores.shape[-1])[:scores.shape[-1]]
            scores = scores - (counts * sampling.frequency_penalty + (counts > 0) * sampling.presence_penalty).to(
                scores.dtype)
        if sampling.logit_bias:
            ids, biases = zip(*sampling.logit_bias)
            scores = scores.index_add(-1, torch.tensor(ids), torch.tensor([biases], dtype=scores.dtype))
        return scores


@dataclass(frozen=True)
class TokenLogprob:
    """One answer token: its text and UTF-8 bytes, its log-probability under the model, where its text starts in
    the answer, and the likeliest tokens of that step as (text, bytes, log-probability), best first."""

    text: str
    bytes: bytes
    logprob: float
    text_offset: int
    top: tuple[tuple[str, bytes, float], ...]


def token_bytes(tokenizer, token_id: int) -> bytes:
    """A token's own bytes: exact for byte-level BPE tokenizers (GPT-2 style, as SmolLM2's and Llama 3's), where
    a token may hold part of a character; otherwise its decoded text as UTF-8."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if _is_byte_level(tokenizer) and isinstance(piece, str):
        table = _byte_of_char()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
    return tokenizer.decode([token_id]).encode()


def _is_byte_level(tokenizer) -> bool:
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's table from the printable character standing for each byte back to the byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {ch: byte for byte, ch in bytes_to_unicode().items()}


class _TokenLog:
    """Each answer token's log-probability (``LogitAdjustments.last`` at the step that chose it) and its
    ``top`` likeliest alternatives; ``shown(length)`` hands out the entries whose text starts within the first
    ``length`` characters of the answer, each once."""

    def __init__(self, tokenizer, adjustments: LogitAdjustments, top: int):
        self.tokenizer, self.adjustments, self.top = tokenizer, adjustments, top
        self.ids: list[int] = []
        self.text_length = 0  # of the answer's tokens so far, decoded as the streamed text is
        self.entries: list[TokenLogprob] = []
        self.handed_out = 0

    def add(self, token_id: int) -> None:
        offset = self.text_length
        self.ids.append(token_id)
        self.text_length = len(self.tokenizer.decode(self.ids, skip_special_tokens=True))
        if token_id in self.tokenizer.all_special_ids:  # the end of the turn: it has no text, so no entry
            return
        row = self.adjustments.last
        best = torch.topk(row, self.top) if self.top else None
        top = () if best is None else tuple((*self._piece(i), float(lp))
                                            for lp, i in zip(best.values, best.indices.tolist()))
        self.entries.append(TokenLogprob(*self._piece(token_id), float(row[token_id]), offset, top))

    def _piece(self, token_id: int) -> tuple[str, bytes]:
        raw = token_bytes(self.tokenizer, token_id)
        return raw.decode(errors="replace"), raw

    def shown(self, length: int) -> list[TokenLogprob]:
        end = self.handed_out
        while end < len(self.entries) and self.entries[end].text_offset < length:
            end += 1
        taken, self.handed_out = self.entries[self.handed_out:end], end
        return taken


class StopText:
    """Cuts streamed text before the first stop string, holding back a tail that could still become one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of ``text`` (with what was held back) that can be shown now."""
        if self.stopped:
            return ""
        self.pending += text
        hits = [at for at in (self.pending.find(stop) for stop in self.stops) if at >= 0]
        if hits:
            shown, self.pending, self.stopped = self.pending[:min(hits)], "", True
            return shown
        held = max((n for stop in self.stops for n in range(1, len(stop)) if self.pending.endswith(stop[:n])),
                   default=0)
        shown, self.pending = self.pending[:len(self.pending) - held], self.pending[len(self.pending) - held:]
        return shown

    def flush(self) -> str:
        """What is still held back once the text has ended (no stop string completed it)."""
        shown, self.pending = ("" if self.stopped else self.pending), ""
        return shown


@dataclass
class Generation:
    """One answer: its text (stop strings cut off), token counts, why it ended and when tokens arrived."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string), "length" (max_new_tokens or the context), "cancelled"
    time_to_first_token: float | None
    seconds: float
    logprobs: list[TokenLogprob] | None = None  # the tokens of ``text``, when Sampling.logprobs asked for them
    cached_tokens: int = 0  # prompt tokens a ConversationCache already held: not prefilled again

    @property
    def prefill_tokens_per_second(self) -> float | None:
        """Tokens prefilled (the prompt's, less the cached ones) over the time to the first token."""
        prefilled = self.prompt_tokens - self.cached_tokens
        return prefilled / self.time_to_first_token if self.time_to_first_token else None

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Tokens after the first (which prefill produces) over the time after it."""
        if self.time_to_first_token is None or self.completion_tokens < 2 or self.seconds <= self.time_to_first_token:
            return None
        return (self.completion_tokens - 1) / (self.seconds - self.time_to_first_token)

    def stats_line(self) -> str:
        if self.time_to_first_token is None:
            return f"[{self.prompt_tokens} prompt tokens, no token generated in {self.seconds:.2f} s]"
        decode = self.decode_tokens_per_second
        cached = f" ({self.cached_tokens} of them cached)" if self.cached_tokens else ""
        return (f"[prefill: {self.prompt_tokens} tokens{cached}, first token after {self.time_to_first_token:.2f} s "
                f"({self.prefill_tokens_per_second:.1f} tok/s) | decode: {self.completion_tokens} tokens, "
                + (f"{decode:.1f} tok/s" if decode is not None else "no decode step") + "]")

    def as_dict(self) -> dict:
        return dict(text=self.text, finish_reason=self.finish_reason, prompt_tokens=self.prompt_tokens,
                    completion_tokens=self.completion_tokens, time_to_first_token_s=self.time_to_first_token,
                    prefill_tokens_per_s=self.prefill_tokens_per_second,
                    decode_tokens_per_s=self.decode_tokens_per_second, seconds=self.seconds)


def _streamer(tokenizer, on_text: Callable[[str], None], stop_text: StopText, clock: dict,
              on_token: Callable[[int], None]):
    from transformers import TextStreamer

    class TimedStreamer(TextStreamer):
        """Hands finished words to ``on_text`` (stop strings cut), each new token to ``on_token``, and notes when
        the first new token came."""

        def put(self, value):
            if not (self.skip_prompt and self.next_tokens_are_prompt):
                clock.setdefault("first_token", time.perf_counter())
                on_token(int(value.reshape(-1)[0]))
            super().put(value)

        def on_finalized_text(self, text: str, stream_end: bool = False):
            shown = stop_text.feed(text) + (stop_text.flush() if stream_end else "")
            if shown:
                on_text(shown)

    return TimedStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def _flag_criteria(is_set: Callable[[], bool]):
    from transformers import StoppingCriteria

    class FlagCriteria(StoppingCriteria):
        """Ends generation after the current token once ``is_set()`` (a cancel request, a stop string seen)."""

        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), is_set(), dtype=torch.bool, device=input_ids.device)

    return FlagCriteria()


class ConversationCache:
    """One conversation's KV cache across generate() calls, and the tokens whose K/V it holds. A prompt that extends
    the previous one (the next turn of a chat: the previous prompt, its answer, then the new message) reuses the
    K/V of the tokens they share, so only the rest is prefilled; the cache is cropped back to where the prompt
    departs from them (an answer the chat template tokenizes differently, say). Any other prompt, the same prompt
    again among them, starts a new cache: its answer is the one a fresh run gives. With a patched model the cache
    is its NpuKVCache (K/V in NPU buffers); an HF cache works the same way."""

    def __init__(self):
        self.cache = None
        self.tokens: torch.Tensor | None = None  # (positions,): the token at each cached position
        self.prompt_tokens = 0  # how many of them were the previous prompt

    def reusable(self, input_ids: torch.Tensor) -> int:
        """How many of ``input_ids``' (1, S) first tokens the cache holds and may serve: 0 unless the prompt
        extends the previous one (leaving at least one token to feed)."""
        if self.cache is None:
            return 0
        prompt, held = input_ids[0], self.tokens
        common = min(len(held), len(prompt) - 1)
        differs = (held[:common] != prompt[:common]).nonzero()
        common = int(differs[0]) if len(differs) else common
        return common if common >= self.prompt_tokens else 0

    def take(self, input_ids: torch.Tensor):
        """The cache to hand generate() for ``input_ids`` (cropped to the tokens it shares with them) and how many
        positions it holds; (None, 0) when there is nothing to reuse."""
        reused = self.reusable(input_ids)
        if reused == 0:
            self.drop()
            return None, 0
        extra = self.cache.get_seq_length() - reused
        if extra:
            self.cache.crop(-extra)
        return self.cache, reused

    def keep(self, cache, sequence: torch.Tensor, prompt_tokens: int) -> None:
        """After generate(): ``cache`` holds the K/V of the first positions of ``sequence`` (1-D: the prompt, whose
        first ``prompt_tokens`` it was, and the answer)."""
        if cache is None:  # generate() kept no cache (use_cache=False)
            self.drop()
        else:
            self.cache, self.tokens = cache, sequence[: cache.get_seq_length()].clone()
            self.prompt_tokens = prompt_tokens

    def drop(self) -> None:
        """Forget the cache (a generation that did not finish leaves it holding positions no sequence records)."""
        self.cache, self.tokens, self.prompt_tokens = None, None, 0


@functools.lru_cache(maxsize=None)
def _cache_keyword(model_class: type) -> str:
    """generate()'s keyword for a Cache: ``cache`` from transformers 5.24 on, ``past_key_values`` before."""
    import inspect

    forward = getattr(model_class, "forward", None)
    return "cache" if forward is not None and "cache" in inspect.signature(forward).parameters else "past_key_values"


def context_of(model) -> int | None:
    """The model's context in tokens (config.max_position_embeddings), if it states one."""
    return getattr(model.config, "max_position_embeddings", None)


def check_prompt(model, prompt_tokens: int) -> None:
    """A PromptTooLongError unless the prompt leaves room for at least one answer token in the model's context."""
    from .patch_llama import PromptTooLongError

    context = context_of(model)
    if context is not None and prompt_tokens >= context:
        raise PromptTooLongError(prompt_tokens, context, most=context - 1)


def check_request(model, sampling: Sampling, prompt_tokens: int) -> None:
    """What only the model can tell, before any work: ``check_prompt``, and a SamplingError for a logit_bias token
    outside its vocabulary."""
    check_prompt(model, prompt_tokens)
    vocab = model.config.vocab_size
    unknown = [token for token, _ in sampling.logit_bias if token >= vocab]
    if unknown:
        raise SamplingError("logit_bias", f"token ids in [0, {vocab - 1}] (the model's vocabulary)", unknown[0])


def generate(model, tokenizer, input_ids: torch.Tensor, sampling: Sampling,
             on_text: Callable[[str], None] = lambda text: None,
             cancel: threading.Event | None = None,
             on_logprobs: Callable[[list[TokenLogprob]], None] = lambda entries: None,
             conversation: ConversationCache | None = None) -> Generation:
    """Generate one answer for a (1, S) prompt, streaming its text to ``on_text`` (and, when ``sampling.logprobs``
    asks for them, the log-probabilities of the tokens behind each piece to ``on_logprobs`` just before it).
    ``conversation``: the cache of earlier turns; the prompt's tokens it holds are not prefilled again, and it
    holds this prompt and answer afterwards.
    ``check_request``'s errors come before any work, and the answer stops where the context ends (finish_reason "length"). Setting ``cancel`` ends it after the
    current token (finish_reason "cancelled"); a KeyboardInterrupt raised inside (by Ctrl-C or by ``on_text``)
    propagates to the caller."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must have shape (1, S), got {tuple(input_ids.shape)}")
    prompt_tokens = input_ids.shape[1]
    check_request(model, sampling, prompt_tokens)
    context = context_of(model)
    max_new_tokens = sampling.max_new_tokens if context is None else min(sampling.max_new_tokens,
                                                                         context - prompt_tokens)
    cancel = cancel or threading.Event()
    stop_text, clock, pieces = StopText(sampling.stop), {}, []
    adjustments = LogitAdjustments(sampling, prompt_tokens)
    tokens = _TokenLog(tokenizer, adjustments, sampling.logprobs) if sampling.logprobs is not None else None
    logprobs: list[TokenLogprob] | None = None if tokens is None else []

    def show(text: str) -> None:
        pieces.append(text)
        if tokens is not None:
            entries = tokens.shown(sum(map(len, pieces)))
            logprobs.extend(entries)
            on_logprobs(entries)
        on_text(text)

    criteria = StoppingCriteriaList([_flag_criteria(lambda: cancel.is_set() or stop_text.stopped)])
    stop_kwargs = dict(stop_strings=list(sampling.stop), tokenizer=tokenizer) if sampling.stop else {}
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    cache, cached = conversation.take(input_ids) if conversation is not None else (None, 0)
    keyword = _cache_keyword(type(model))
    cache_kwargs = {} if cache is None else {keyword: cache}
    started = time.perf_counter()
    try:
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 streamer=_streamer(tokenizer, show, stop_text, clock,
                                                    tokens.add if tokens is not None else lambda token: None),
                                 stopping_criteria=criteria, logits_processor=LogitsProcessorList([adjustments]),
                                 pad_token_id=tokenizer.pad_token_id, max_new_tokens=max_new_tokens, **stop_kwargs,
                                 return_dict_in_generate=True, **cache_kwargs, **sampling.generate_kwargs())
    except BaseException:
        if conversation is not None:
            conversation.drop()
        raise
    seconds = time.perf_counter() - started
    if conversation is not None:
        conversation.keep(getattr(out, keyword), out.sequences[0], prompt_tokens)
    out = out.sequences
    new_tokens = out[0, prompt_tokens:]
    ended_on_eos = len(new_tokens) > 0 and int(new_tokens[-1]) in _eos_ids(model, tokenizer)
    if cancel.is_set():
        reason = "cancelled"
    elif len(new_tokens) >= max_new_tokens and not ended_on_eos and not stop_text.stopped:
        reason = "length"
    else:
        reason = "stop"
    first = clock.get("first_token")
    return Generation("".join(pieces), prompt_tokens, len(new_tokens), reason,
                      None if first is None else first - started, seconds, logprobs, cached)


def _eos_ids(model, tokenizer) -> set[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def chat_input_ids(tokenizer, messages: list[dict]) -> torch.Tensor:
    """The (1, S) prompt of a conversation, through the tokenizer's chat template."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
    return encoded["input_ids"]


def text_input_ids(tokenizer, prompt: str) -> torch.Tensor:
    """The (1, S) prompt of a raw completion."""
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


__all__ = ["Generation", "LogitAdjustments", "Sampling", "SamplingError", "StopText", "TokenLogprob", "chat_input_ids",
           "check_prompt", "check_request", "context_of", "generate", "text_input_ids", "token_bytes"]
