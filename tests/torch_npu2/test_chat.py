"""The chat loop (Ctrl-C, Ctrl-D, /reset, /exit) and the generation shared by the CLI and the server."""
import io

import pytest
import torch

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
                                          ("seed", 1.5), ("temperature", float("inf")), ("seed", 2 ** 64),
                                          ("seed", -1), ("presence_penalty", 2.5), ("frequency_penalty", -3),
                                          ("frequency_penalty", True), ("logit_bias", ((5, 101.0),)),
                                          ("logit_bias", ((-1, 1.0),)), ("logprobs", 21)])
def test_sampling_names_the_setting_out_of_range(field, value):
    with pytest.raises(SamplingError, match=f"^{field}: expected") as raised:
        Sampling(**{field: value})
    assert raised.value.field == field


def test_greedy_passes_no_sampling_knobs_and_the_repetition_penalty_is_ours():
    assert Sampling().generate_kwargs()["do_sample"] is False
    sampled = Sampling(temperature=0.7, top_k=5, repetition_penalty=1.2).generate_kwargs()
    # 1 keeps a checkpoint's default from applying on top of LogitAdjustments, which applies 1.2
    assert sampled == dict(do_sample=True, temperature=0.7, top_p=1.0, top_k=5, repetition_penalty=1.0)


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


def test_logit_adjustments_follow_openais_formulas_before_temperature():
    """logit -= count * frequency_penalty + (count > 0) * presence_penalty over the answer's tokens (not the
    prompt's), logit_bias added, the repetition penalty as transformers applies it, and the model's own
    log-probabilities noted before any of them."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from torch_npu2.textgen import LogitAdjustments

    prompt = [4, 4, 1]
    answer = [2, 2, 2, 3, 4]
    input_ids = torch.tensor([prompt + answer])
    scores = torch.randn(1, 8, generator=torch.Generator().manual_seed(0))
    sampling = Sampling(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((7, 3.0), (0, -100.0)),
                        logprobs=2)
    adjustments = LogitAdjustments(sampling, prompt_tokens=len(prompt))
    out = adjustments(input_ids, scores.clone())
    counts = {2: 3, 3: 1, 4: 1}  # token 4's two prompt occurrences do not count
    expected = scores.clone()
    for token, count in counts.items():
        expected[0, token] -= count * 0.25 + 0.5
    expected[0, 7] += 3.0
    expected[0, 0] -= 100.0
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(adjustments.last, torch.log_softmax(scores[0], -1), rtol=0, atol=0)
    repeated = LogitAdjustments(Sampling(repetition_penalty=1.3), prompt_tokens=len(prompt))
    torch.testing.assert_close(repeated(input_ids, scores.clone()),
                               RepetitionPenaltyLogitsProcessor(1.3)(input_ids, scores.clone()), rtol=0, atol=0)
    assert LogitAdjustments(Sampling(), 3)(input_ids, scores) is scores  # nothing asked: nothing changed


def test_generate_reports_the_models_own_logprobs_of_each_answer_token(tiny_patched):
    """Each entry is log_softmax of the logits the model produced at that step (generate's output_logits, the
    same forward), for the token picked; its top alternatives are the likeliest, best first; the entries' texts
    make up the answer and their offsets say where each starts."""
    model, tokenizer = tiny_patched
    ids = chat_input_ids(tokenizer, [{"role": "user", "content": "Hello"}])
    result = generate(model, tokenizer, ids, Sampling(max_new_tokens=8, logprobs=3))
    out = model.generate(input_ids=ids, attention_mask=ids.new_ones(ids.shape), max_new_tokens=8, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    assert "".join(e.text for e in result.logprobs) == result.text and len(result.logprobs) == 8
    offset = 0
    for entry, token, logits in zip(result.logprobs, tokens, out.logits):
        expected = torch.log_softmax(logits[0].float(), -1)
        assert entry.logprob == pytest.approx(float(expected[token]), abs=1e-6)
        assert [lp for _, _, lp in entry.top] == pytest.approx(torch.topk(expected, 3).values.tolist(), abs=1e-6)
        assert entry.top[0][2] == entry.logprob  # greedy picks the likeliest
        assert entry.text_offset == offset and entry.bytes.decode() == entry.text
        offset += len(entry.text)
    assert generate(model, tokenizer, ids, Sampling(max_new_tokens=2)).logprobs is None


def test_penalties_and_logit_bias_steer_generation_as_openai_describes(tiny_patched):
    """Greedy decoding with the penalties equals greedy decoding under an independent processor that applies
    OpenAI's formula; a +100 bias makes one token the whole answer."""
    from collections import Counter

    model, tokenizer = tiny_patched
    ids = chat_input_ids(tokenizer, [{"role": "user", "content": "Hello"}])
    prompt = ids.shape[1]

    def openai_penalties(input_ids, scores):
        scores = scores.clone()
        for token, count in Counter(input_ids[0, prompt:].tolist()).items():
            scores[0, token] -= count * 1.5 + 1.0
        return scores

    penalized = generate(model, tokenizer, ids, Sampling(max_new_tokens=12, presence_penalty=1.0,
                                                         frequency_penalty=1.5))
    plain = generate(model, tokenizer, ids, Sampling(max_new_tokens=12))
    from transformers import LogitsProcessorList

    expected = model.generate(input_ids=ids, attention_mask=ids.new_ones(ids.shape), max_new_tokens=12,
                              do_sample=False, pad_token_id=tokenizer.pad_token_id,
                              logits_processor=LogitsProcessorList([openai_penalties]))
    assert penalized.text == tokenizer.decode(expected[0, prompt:], skip_special_tokens=True)
    assert penalized.text != plain.text  # the tiny model repeats itself: the penalties change its answer
    token = tokenizer.convert_tokens_to_ids("Ġblue")
    forced = generate(model, tokenizer, ids, Sampling(max_new_tokens=4, logit_bias=((token, 100.0),)))
    assert forced.text == " blue" * 4


def test_a_prompt_that_fills_the_context_is_refused_before_any_work_and_answers_stop_at_its_end(tiny_patched):
    from torch_npu2.patch_llama import PromptTooLongError

    model, tokenizer = tiny_patched
    context = model.config.max_position_embeddings

    class Untouchable:
        config = model.config

        def generate(self, **kwargs):
            raise AssertionError("generation started")

    with pytest.raises(PromptTooLongError) as refused:
        generate(Untouchable(), tokenizer, torch.full((1, context), 5), Sampling())
    assert str(refused.value) == (f"the prompt has {context} tokens, more than the {context - 1} that leave room for "
                                  f"an answer in the model's context of {context} tokens "
                                  "(config.max_position_embeddings)")
    result = generate(model, tokenizer, torch.full((1, context - 3), 5), Sampling(max_new_tokens=10))
    assert result.completion_tokens == 3 and result.finish_reason == "length"


def test_the_end_of_piped_input_ends_the_prompts_line_where_the_prompt_went():
    out, err = io.StringIO(), io.StringIO()
    assert ChatLoop(Replies(), read_line=_scripted(EOFError), err=err, out=out).run() == 0
    assert out.getvalue() == "\n"


class CountPrefilledTokens:
    """Counts the tokens each prefill forward of the patched decoder layers is handed (layer 0's calls)."""

    def __init__(self, monkeypatch):
        from torch_npu2.patch_llama.layer import NpuDecoderLayer

        self.tokens = []
        prefill = NpuDecoderLayer._prefill

        def counted(layer, hidden, *args):
            if layer.layer_idx == 0:
                self.tokens.append(hidden.shape[1])
            return prefill(layer, hidden, *args)

        monkeypatch.setattr(NpuDecoderLayer, "_prefill", counted)


def test_a_conversation_cache_prefills_only_the_new_turn_and_answers_as_a_fresh_run(tiny_patched, monkeypatch):
    from torch_npu2.patch_llama.kv_cache import NpuKVCache
    from torch_npu2.textgen import ConversationCache

    model, tokenizer = tiny_patched
    conversation, prefilled = ConversationCache(), CountPrefilledTokens(monkeypatch)
    messages = [{"role": "user", "content": "Hello"}]
    first_ids = chat_input_ids(tokenizer, messages)
    first = generate(model, tokenizer, first_ids, Sampling(max_new_tokens=6), conversation=conversation)
    assert first.cached_tokens == 0 and prefilled.tokens == [first_ids.shape[1]]
    assert type(conversation.cache) is NpuKVCache
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Tell me more"}]
    ids = chat_input_ids(tokenizer, messages)
    cached = conversation.reusable(ids)
    assert cached > first_ids.shape[1]  # the first prompt and (some of) its answer
    second = generate(model, tokenizer, ids, Sampling(max_new_tokens=6), conversation=conversation)
    assert second.cached_tokens == cached and prefilled.tokens[1:] == [ids.shape[1] - cached]
    assert f"({cached} of them cached)" in second.stats_line()
    fresh = generate(model, tokenizer, ids, Sampling(max_new_tokens=6))
    assert second.text == fresh.text and prefilled.tokens[2:] == [ids.shape[1]]


def test_a_conversation_cache_serves_only_prompts_that_extend_the_previous_one(tiny_patched):
    from torch_npu2.textgen import ConversationCache

    model, tokenizer = tiny_patched
    conversation = ConversationCache()
    ids = chat_input_ids(tokenizer, [{"role": "user", "content": "Hello"}])
    generate(model, tokenizer, ids, Sampling(max_new_tokens=3), conversation=conversation)
    assert conversation.reusable(ids) == 0  # the same prompt again: a fresh run
    other = chat_input_ids(tokenizer, [{"role": "user", "content": "Goodbye"}])
    assert conversation.reusable(other) == 0
    longer = torch.cat([conversation.tokens[None], torch.tensor([[5, 6]])], dim=1)
    assert conversation.reusable(longer) == len(conversation.tokens)
    departs = longer.clone()
    departs[0, ids.shape[1] + 1] += 1  # the second answer token differs: the cache is cropped to the first
    assert conversation.reusable(departs) == ids.shape[1] + 1
    cache, held = conversation.take(departs)
    assert held == cache.get_seq_length() == ids.shape[1] + 1


def test_an_interrupted_generation_drops_the_conversation_cache(tiny_patched):
    from torch_npu2.textgen import ConversationCache

    model, tokenizer = tiny_patched
    conversation = ConversationCache()
    ids = chat_input_ids(tokenizer, [{"role": "user", "content": "Hello"}])

    def interrupt(text):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate(model, tokenizer, ids, Sampling(max_new_tokens=6), on_text=interrupt, conversation=conversation)
    assert conversation.cache is None and conversation.reusable(ids) == 0
