"""The chat loop (Ctrl-C, Ctrl-D, /reset, /exit) and the generation shared by the CLI and the server."""
import io

import pytest

from torch_npu2.chat import ChatLoop, ctrl_c_sets
from torch_npu2.textgen import Sampling, SamplingError, StopText, chat_input_ids, generate


def _scripted(*lines):
    """A read_line that returns ``lines`` in order; an exception class in them is raised instead."""
    queue = list(lines)

    def read_line(prompt):
        item = queue.pop(0)
        if isinstance(item, type) and issubclass(item, BaseException):
            raise item()
        return item

    return read_line


class Replies:
    """A reply function recording the conversation it was given; ``interrupt`` lists the turns it stops."""

    def __init__(self, interrupt=()):
        self.seen, self.interrupt = [], set(interrupt)

    def __call__(self, messages):
        self.seen.append([dict(m) for m in messages])
        if len(self.seen) in self.interrupt:
            raise KeyboardInterrupt
        return f"answer {len(self.seen)}"


def test_ctrl_c_during_an_answer_drops_that_turn_and_returns_to_the_prompt():
    replies, err = Replies(interrupt={2}), io.StringIO()
    loop = ChatLoop(replies, read_line=_scripted("one", "two", "three", EOFError), err=err)
    assert loop.run() == 0
    assert replies.seen[2] == [{"role": "user", "content": "one"}, {"role": "assistant", "content": "answer 1"},
                               {"role": "user", "content": "three"}]
    assert "answer stopped" in err.getvalue()


def test_ctrl_c_at_the_prompt_once_continues_twice_quits():
    replies, err = Replies(), io.StringIO()
    assert ChatLoop(replies, read_line=_scripted(KeyboardInterrupt, "hi", KeyboardInterrupt, KeyboardInterrupt,
                                                 "never read"), err=err).run() == 0
    assert len(replies.seen) == 1 and err.getvalue().count("Ctrl-C again or Ctrl-D to quit") == 2


def test_reset_keeps_the_system_message_exit_quits_and_blank_lines_are_ignored():
    replies, err = Replies(), io.StringIO()
    loop = ChatLoop(replies, system="be brief", read_line=_scripted("a", "  ", "/reset", "b", "/nope", "/exit", "x"),
                    err=err)
    assert loop.run() == 0
    assert replies.seen == [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"}],
                            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "b"}]]
    assert "(new conversation)" in err.getvalue() and "unknown command /nope" in err.getvalue()


def test_stop_text_cuts_before_the_stop_string_across_chunks():
    stop = StopText(("END", "\n\n"))
    assert stop.feed("hello E") == "hello " and stop.pending == "E"
    assert stop.feed("N") == "" and stop.feed("D and more") == "" and stop.stopped
    assert stop.feed("later") == "" and stop.flush() == ""
    unfinished = StopText(("END",))
    assert unfinished.feed("the EN") == "the " and unfinished.flush() == "EN"
    assert StopText(()).feed("anything") == "anything"


@pytest.mark.parametrize("field, value", [("max_new_tokens", 0), ("temperature", -0.1), ("top_p", 1.5),
                                          ("top_k", -1), ("repetition_penalty", 0.0), ("stop", ("",)),
                                          ("seed", 1.5), ("temperature", float("inf"))])
def test_sampling_names_the_setting_out_of_range(field, value):
    with pytest.raises(SamplingError, match=f"^{field}: expected") as raised:
        Sampling(**{field: value})
    assert raised.value.field == field


def test_greedy_passes_no_sampling_knobs():
    assert Sampling().generate_kwargs()["do_sample"] is False
    sampled = Sampling(temperature=0.7, top_k=5, repetition_penalty=1.2).generate_kwargs()
    assert sampled == dict(max_new_tokens=256, do_sample=True, temperature=0.7, top_p=1.0, top_k=5,
                           repetition_penalty=1.2)


def test_generate_streams_times_and_matches_the_model(tiny_patched):
    model, tokenizer = tiny_patched
    ids = chat_input_ids(tokenizer, [{"role": "user", "content": "Hello"}])
    pieces = []
    result = generate(model, tokenizer, ids, Sampling(max_new_tokens=8), on_text=pieces.append)
    reference = model.generate(input_ids=ids, attention_mask=ids.new_ones(ids.shape), max_new_tokens=8,
                               do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert result.text == "".join(pieces) == tokenizer.decode(reference[0, ids.shape[1]:], skip_special_tokens=True)
    assert result.completion_tokens == 8 and result.finish_reason == "length" and result.prompt_tokens == ids.shape[1]
    assert 0 < result.time_to_first_token < result.seconds and result.decode_tokens_per_second > 0
    assert "prefill: " in result.stats_line() and " tok/s] " not in result.stats_line()


def test_generate_stops_at_a_stop_string_and_leaves_it_out(tiny_patched):
    model, tokenizer = tiny_patched
    ids = chat_input_ids(tokenizer, [{"role": "user", "content": "Hello"}])
    full = generate(model, tokenizer, ids, Sampling(max_new_tokens=12))
    stop = full.text.split()[2]  # a word from the middle of the greedy answer
    cut = generate(model, tokenizer, ids, Sampling(max_new_tokens=12, stop=(stop,)))
    assert cut.text == full.text[:full.text.index(stop)] and cut.finish_reason == "stop"
    assert cut.completion_tokens < full.completion_tokens


def test_sampling_with_a_seed_repeats(tiny_patched):
    model, tokenizer = tiny_patched
    ids = chat_input_ids(tokenizer, [{"role": "user", "content": "Hello"}])
    sampling = Sampling(max_new_tokens=6, temperature=1.5, top_p=0.95, top_k=40, seed=7)
    assert generate(model, tokenizer, ids, sampling).text == generate(model, tokenizer, ids, sampling).text


def test_ctrl_c_sets_the_event_even_inside_a_weakref_callback_and_a_second_one_raises():
    """Python drops an exception raised in a weakref callback (the runtime's buffer pool has one): there a plain
    KeyboardInterrupt would be lost. Under ctrl_c_sets the first Ctrl-C only sets the event; the second raises."""
    import os
    import signal
    import threading
    import weakref

    class Lease:
        pass

    cancel, lease = threading.Event(), Lease()
    before = signal.getsignal(signal.SIGINT)
    with ctrl_c_sets(cancel):
        ref = weakref.ref(lease, lambda _: os.kill(os.getpid(), signal.SIGINT))
        del lease
        assert cancel.is_set() and ref() is None
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
