"""Text generation shared by the chat command and the server: sampling settings checked before any work,
stop strings cut out of the streamed text, cancellation between tokens, and prefill/decode timing."""
from __future__ import annotations

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


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens. ``temperature`` 0 is greedy; ``top_k`` 0 keeps every token; ``seed`` reseeds torch's
    generator before each answer, so that a sampled answer repeats."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

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
            ("seed", self.seed is None or _is_int(self.seed), "an int"),
        )
        for name, ok, expected in checks:
            if not ok:
                raise SamplingError(name, expected, getattr(self, name))

    def generate_kwargs(self) -> dict:
        """The ``model.generate`` arguments; greedy passes no sampling knobs (transformers warns about unused ones)."""
        kwargs = dict(max_new_tokens=self.max_new_tokens)
        if self.temperature > 0:
            kwargs.update(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if self.repetition_penalty != 1.0:
            kwargs["repetition_penalty"] = self.repetition_penalty
        return kwargs


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
    finish_reason: str  # "stop" (EOS or a stop string), "length" (max_new_tokens), "cancelled"
    time_to_first_token: float | None
    seconds: float

    @property
    def prefill_tokens_per_second(self) -> float | None:
        return self.prompt_tokens / self.time_to_first_token if self.time_to_first_token else None

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
        return (f"[prefill: {self.prompt_tokens} tokens, first token after {self.time_to_first_token:.2f} s "
                f"({self.prefill_tokens_per_second:.1f} tok/s) | decode: {self.completion_tokens} tokens, "
                + (f"{decode:.1f} tok/s" if decode is not None else "no decode step") + "]")

    def as_dict(self) -> dict:
        return dict(text=self.text, finish_reason=self.finish_reason, prompt_tokens=self.prompt_tokens,
                    completion_tokens=self.completion_tokens, time_to_first_token_s=self.time_to_first_token,
                    prefill_tokens_per_s=self.prefill_tokens_per_second,
                    decode_tokens_per_s=self.decode_tokens_per_second, seconds=self.seconds)


def _streamer(tokenizer, on_text: Callable[[str], None], stop_text: StopText, clock: dict):
    from transformers import TextStreamer

    class TimedStreamer(TextStreamer):
        """Hands finished words to ``on_text`` (stop strings cut) and notes when the first new token came."""

        def put(self, value):
            if not (self.skip_prompt and self.next_tokens_are_prompt):
                clock.setdefault("first_token", time.perf_counter())
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


def generate(model, tokenizer, input_ids: torch.Tensor, sampling: Sampling,
             on_text: Callable[[str], None] = lambda text: None,
             cancel: threading.Event | None = None) -> Generation:
    """Generate one answer for a (1, S) prompt, streaming its text to ``on_text``. Setting ``cancel`` ends it
    after the current token (finish_reason "cancelled"); a KeyboardInterrupt raised inside (by Ctrl-C or by
    ``on_text``) propagates to the caller."""
    from transformers import StoppingCriteriaList

    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must have shape (1, S), got {tuple(input_ids.shape)}")
    cancel = cancel or threading.Event()
    stop_text, clock, pieces = StopText(sampling.stop), {}, []

    def show(text: str) -> None:
        pieces.append(text)
        on_text(text)

    criteria = StoppingCriteriaList([_flag_criteria(lambda: cancel.is_set() or stop_text.stopped)])
    stop_kwargs = dict(stop_strings=list(sampling.stop), tokenizer=tokenizer) if sampling.stop else {}
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             streamer=_streamer(tokenizer, show, stop_text, clock), stopping_criteria=criteria,
                             pad_token_id=tokenizer.pad_token_id, **stop_kwargs, **sampling.generate_kwargs())
    seconds = time.perf_counter() - started
    new_tokens = out[0, input_ids.shape[1]:]
    ended_on_eos = len(new_tokens) > 0 and int(new_tokens[-1]) in _eos_ids(model, tokenizer)
    if cancel.is_set():
        reason = "cancelled"
    elif len(new_tokens) >= sampling.max_new_tokens and not ended_on_eos and not stop_text.stopped:
        reason = "length"
    else:
        reason = "stop"
    first = clock.get("first_token")
    return Generation("".join(pieces), input_ids.shape[1], len(new_tokens), reason,
                      None if first is None else first - started, seconds)


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


__all__ = ["Generation", "Sampling", "SamplingError", "StopText", "chat_input_ids", "generate", "text_input_ids"]
